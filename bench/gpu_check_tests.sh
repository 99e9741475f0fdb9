#!/bin/bash
# Second GPU pass: the privacy unit tests (fixed to compare on the learner's device) and every
# strategy that computes on a peer's data, served under the default DP release, on CUDA daemons.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg/coterie && for d in node cli proto; do ln -sfn "$PWD/$d" /tmp/pkg/coterie/$d; done
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1
python3 -c "import torch; print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
timeout 420 python3 -m pytest -q -p no:cacheprovider -rA tests/test_learner.py tests/test_privacy.py tests/test_privacy_attack.py \
  "tests/test_strategies_daemon.py" -k "not dashboard and (learner or privacy or attack or federico or scool or cobo or fedfomo or dpsgd)" 2>&1 \
  | tee "$OUT/unit2.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -45
grep -rh "device cuda" /tmp/pytest-of-*/ -r --include=*.log 2>/dev/null | head -2
