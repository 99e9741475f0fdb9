"""What a `local` round holds at its peak, call by call (issue 34 item 2): one fresh interpreter
builds node 0 of bench/memory.py's network (the ~21 MB MLP, 40-2280-2280-10, Adam, 10 steps),
trains a round to warm up (Adam's moments exist), then runs a round's calls
in the order the daemon makes them at full rate, with the checkpoint of the previous round staged
(its copies alive while the next round trains, as the writer thread holds them). For each call:
the RSS before it and the peak RSS during it (``VmHWM``, reset through ``/proc/self/clear_refs``
before each call), in MB and in model sizes, with glibc's mmap threshold pinned at 64 KiB so that
RSS is what is alive (the daemon's own allocator settings differ: this dissects, it does not
measure the daemon's RSS). Runs under each ``--python`` given (another
checkout's venv) and this one, alternating ``--repeats`` times; writes its full config and every
reading to ``--out``.

    python bench/roundpeaks.py --python main=/work/wt-x-main/.venv/bin/python --repeats 3 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netlab import load, mnist1d_mlp  # noqa: E402

_PROBE = textwrap.dedent(
    r"""
    import asyncio, inspect, json, re, shutil, sys, tempfile, time, types
    import torch
    from coterie.node import publishing
    from coterie.node.learning.config import LearnerConfig
    from coterie.node.learning.torch_learner import build_learner
    from coterie.node.learning.guard import RoundGuard
    from coterie.node.memory_release import release_free_memory
    from coterie.node.persistence import StateStore, make_snapshot
    from coterie.node.config import ReferenceConfig
    from coterie.node.local_reference import LocalReference

    cfg = json.loads(sys.argv[1])
    blend = cfg.pop("_blend")
    torch.manual_seed(cfg.pop("_seed"))
    torch.set_num_threads(1)
    learner = build_learner(LearnerConfig(**cfg))
    model_mb = sum(p.numel() for p in learner.model.parameters()) * 4 / 2**20

    class Alone:  # the local strategy as the guard and publishing see it: nothing shared besides the model
        def shared_params(self):
            return None
        def published_extras(self):
            return {}
        def on_published(self, params):
            pass

    guard = RoundGuard(learner, Alone(), lambda where, msg: None)
    store = StateStore(tempfile.mkdtemp(prefix="roundpeaks-"))
    store.open()

    def status():
        s = open("/proc/self/status").read()
        return [int(re.search(k + r":\s+(\d+) kB", s).group(1)) / 1024 for k in ("VmRSS", "VmHWM")]

    rows = []
    def call(name, fn):
        open("/proc/self/clear_refs", "w").write("5")  # the peak RSS starts again from here
        rss, _ = status()
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
        after, peak = status()
        rows.append({"call": name, "rss_before_mb": round(rss, 1), "peak_over_mb": round(peak - rss, 1),
                     "peak_over_models": round((peak - rss) / model_mb, 2), "rss_after_mb": round(after, 1),
                     "seconds": round(seconds, 3)})
        return out

    def snapshot(rnd):
        return make_snapshot(round=rnd, version=rnd, node_id="n0", learner_state=learner.export_state(),
                             strategy_state={}, peers=[], meta={}, record={"round": rnd})

    class Board:
        current = None
        def publish(self, snap):
            self.current = snap

    node = types.SimpleNamespace(learner=learner, strategy=Alone(), guard=guard, board=Board(), node_id="n0",
                                 version=0, round=0)

    def publish(rnd):  # the daemon's own publishing (the guard drops its round-start copy here)
        node.round = rnd
        asyncio.run(publishing.publish_round(node))
        return node.board.current

    # a collaborating node's local-only reference (issue 33), predicting with the blend (the default)
    reference = LocalReference(ReferenceConfig(), learner, "dpsgd") if blend else None
    if reference is not None:
        reference.twin.train()  # the twin differs from the model: the blend's α has something to choose
        reference.twin.drop_optimizer_state()  # as the reference leaves a large model's twin between trainings

    learner.train()  # round 1: Adam's moments exist from here on
    published = publish(1)
    store.commit(snapshot(1), [{"round": 1}])
    release_free_memory()
    rest, _ = status()
    for rnd in (2, 3):  # round 2 warms the heap up; round 3 is the one reported
        rows.clear()
        staged = call("checkpoint staged (the previous round's copies)", lambda: snapshot(rnd - 1))
        call("guard: round-start copy", guard.before_round)
        call("train: 10 Adam steps", learner.train)
        call("guard: check after the round", guard.after_round)
        call("evaluate", learner.evaluate)
        if reference is not None:
            call("reference: judge (the blend's α on val, its test figures)", lambda: reference.judge(rnd, {}, None))
            # as the daemon asks for it: the live tensors where the checkout can give them (a large model)
            live = {"live": True} if "live" in inspect.signature(reference.prediction_members).parameters else {}
            call("reference: the checkpoint's mixture", lambda: reference.prediction_members("n0", None, **live))
        call("checkpoint written (the writer thread)", lambda: store.commit(staged, [{"round": rnd - 1}]))
        del staged
        published = call("publish: copy and encode", lambda: publish(rnd))
        release_free_memory()
    shutil.rmtree(store.dir, ignore_errors=True)  # its checkpoint: three model-sized tensors on disk
    alpha = None if reference is None else reference.alpha
    print(json.dumps({"model_mb": round(model_mb, 2), "rest_rss_mb": round(rest, 1), "alpha": alpha, "calls": rows}))
    """
)


def probe(python: str, cfg: dict) -> dict:
    # the mmap threshold pinned: every buffer of 64 KiB or more is mapped when allocated and unmapped
    # when freed, so RSS follows what is alive (glibc's moving threshold would otherwise serve
    # model-sized buffers from a heap whose freed pages stay resident, and the peak over a call
    # would count pages a trim had handed back and the call touched again)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    r = subprocess.run([python, "-c", _PROBE, json.dumps(cfg)], capture_output=True, text=True, timeout=900, env=env)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", action="append", default=[], help="LABEL=INTERPRETER (another checkout's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blend", action="store_true", help="also a local-only reference predicting with the blend")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "roundpeaks.json")
    args = ap.parse_args()
    pythons = dict(p.split("=", 1) for p in args.python)
    pythons["this"] = sys.executable
    cfg = {**mnist1d_mlp(8, 0, hidden=[2280, 2280], steps=10), "_seed": args.seed, "_blend": args.blend}
    runs: dict[str, list[dict]] = {label: [] for label in pythons}
    for i in range(args.repeats):
        order = list(pythons.items()) if i % 2 == 0 else list(reversed(pythons.items()))
        for label, py in order:
            runs[label].append(probe(py, cfg))
            print(f"run {i + 1} {label}: load {load()}", flush=True)
    for label, rs in runs.items():
        if args.blend:
            print(f"\n{label}: blend α {[r.get('alpha') for r in rs]}")
        print(
            f"\n{label}: rest RSS {statistics.median(r['rest_rss_mb'] for r in rs):.0f} MB, model {rs[0]['model_mb']} MB"
        )
        for j, row in enumerate(rs[0]["calls"]):
            over = [r["calls"][j]["peak_over_mb"] for r in rs]
            before = [r["calls"][j]["rss_before_mb"] for r in rs]
            secs = [r["calls"][j]["seconds"] for r in rs]
            print(
                f"  {row['call']:<50} before {statistics.median(before):6.0f} MB, peak +{statistics.median(over):5.1f} MB "
                f"[{min(over):.1f}-{max(over):.1f}] ({statistics.median(over) / rs[0]['model_mb']:.2f} models), "
                f"{statistics.median(secs):.3f} s"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"config": {**config, "learner": cfg, "pythons": pythons}, "runs": runs}, indent=1))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    t = time.time()
    rc = main()
    print(f"{time.time() - t:.0f} s")
    sys.exit(rc)
