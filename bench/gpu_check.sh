#!/bin/bash
# GPU proof for Coterie: the learner picks CUDA by itself (device auto), the DP release's
# per-sample gradients run there, and a small network of real daemons (gRPC + mTLS) trains on it.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg/coterie && for d in node cli proto; do ln -sfn "$PWD/$d" /tmp/pkg/coterie/$d; done
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, grpc, google.protobuf as p, coterie.node.daemon; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0), '| grpc', grpc.__version__, '| protobuf', p.__version__)" || exit 1
echo "=== unit: learner device + DP release on the GPU"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_learner.py tests/test_privacy.py 2>&1 | tee "$OUT/unit.log" | tail -6
echo "=== network: 8 daemons, demo scenario, device auto"
sed -e 's/^device = "cpu"/device = "auto"/' -e 's/^rounds = 30/rounds = 10/' scenarios/demo.toml > /tmp/gpu_demo.toml
t0=$(date +%s)
timeout 280 python3 -m coterie.cli.main run /tmp/gpu_demo.toml --out /tmp/gpurun 2>&1 | tail -25
echo "run took $(( $(date +%s) - t0 )) s"
cp /tmp/gpurun/results.json "$OUT/results.json" 2>/dev/null
python3 - <<'PY'
import json, glob
r = json.load(open("/tmp/gpurun/results.json"))
print("strategies:", list(r.get("strategies", r).keys())[:5] if isinstance(r, dict) else type(r))
devs = set()
for f in glob.glob("/tmp/gpurun/**/*.json", recursive=True) + glob.glob("/tmp/gpurun/**/*.log", recursive=True):
    s = open(f, errors="replace").read()
    for d in ("cuda:0", "device cpu"):
        if d in s: devs.add(d)
print("device strings seen in run outputs:", sorted(devs))
PY
grep -rh "device" /tmp/gpurun --include=*.log 2>/dev/null | grep -m3 "up:"
