"""The checkpoint's share of a round, before and after checkpoints moved off the critical path.

A solo node daemon (a real process, strategy local: a round is train + evaluate, no network)
runs R rounds per variant; from its history, per round i:

    interval_i = t_i - t_(i-1)        (end of one round's work to the end of the next's)
    overhead_i = interval_i - duration_i   (everything between the two rounds' work: the
                                            checkpoint, when it is on the critical path)

and the checkpoint share is median(overhead_i / interval_i). Variants, run interleaved in one
invocation on the same machine and disk:

    before   the code at --baseline-ref (default c41716b: 6 files, ~17 fsyncs, awaited per round)
    sync     this code with checkpoint_max_unsaved_rounds = 0 (one file, 3 fsyncs, awaited)
    async    this code with the default of 1 (written by a thread while the next round trains)

for a small MLP (40-64-64-10, ~8k parameters) and a ~21 MB MLP (40-2280-2280-10, 5.3 M), both
with Adam (the checkpoint holds the model and two moment buffers).

    python bench/checkpoint_overhead.py --reps 2      # writes bench/results/checkpoint_overhead.{json,md}
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import tomli_w

from coterie.node.admin_token import bearer, token_for_state_dir

REPO = Path(__file__).resolve().parent.parent
MODELS = {
    "small MLP (8k params)": {"model_params": {"hidden": [64, 64]}, "local_steps": 40, "rounds": 40},
    "21 MB MLP (5.3M params)": {"model_params": {"hidden": [2280, 2280]}, "local_steps": 10, "rounds": 12},
}
VARIANTS = {"before": None, "sync": 0, "async": 1}


def baseline_tree(ref: str, root: Path) -> Path:
    """The package at ``ref`` importable as ``coterie`` via PYTHONPATH (git archive, no checkout)."""
    src, pkg = root / "src", root / "pkg" / "coterie"
    src.mkdir(parents=True)
    pkg.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "node", "cli", "proto"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    for d in ("node", "cli", "proto"):
        (pkg / d).symlink_to(src / d)
    return root / "pkg"


def run_node(
    workdir: Path, name: str, model: dict[str, Any], unsaved: int | None, pythonpath: Path | None, seed: int
) -> dict[str, Any]:
    state = workdir / name
    shutil.rmtree(state, ignore_errors=True)
    cfg = {
        "node_id": "bench",
        "state_dir": str(state),
        "strategy": "local",
        "rounds": model["rounds"],
        "security": {"insecure": True},
        "min_peers": 0,
        "round_interval_s": 0.0,
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "seed": seed,
        "log_level": "WARNING",
        "learner": {
            "dataset": "mnist1d",
            "partition": "iid",
            "num_nodes": 1,
            "model": "mlp",
            "model_params": model["model_params"],
            "optimizer": "adam",
            "lr": 0.001,
            "batch_size": 32,
            "local_steps": model["local_steps"],
            "init_seed": seed,
            "data_seed": seed,
        },
    }
    if unsaved is not None:
        cfg["checkpoint_max_unsaved_rounds"] = unsaved
    path = workdir / f"{name}.toml"
    path.write_text(tomli_w.dumps(cfg))
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    log = open(workdir / f"{name}.log", "wb")
    p = subprocess.Popen(
        [sys.executable, "-m", "coterie.cli.main", "node", "start", "--config", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    metrics = ""
    try:
        deadline = time.monotonic() + 900
        while True:
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} exited or timed out; see {workdir / (name + '.log')}")
            try:
                info = json.loads((state / "node.json").read_text())
                auth = bearer(token_for_state_dir(state))  # the admin API wants the node's token
                with urllib.request.urlopen(
                    urllib.request.Request(info["admin_url"] + "/status", headers=auth), timeout=5
                ) as r:
                    if json.loads(r.read()).get("done") and info.get("pid") == p.pid:
                        with urllib.request.urlopen(
                            urllib.request.Request(info["admin_url"] + "/metrics", headers=auth), timeout=5
                        ) as m:
                            metrics = m.read().decode()
                        break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
    finally:
        p.terminate()
        p.wait(timeout=120)
    rows = [json.loads(x) for x in (state / "history.jsonl").read_text().splitlines()]
    by_round = {r["round"]: r for r in rows}
    rounds = sorted(by_round)
    out = {"duration_s": [], "interval_s": [], "overhead_share": []}
    for a, b in itertools.pairwise(rounds):
        interval = by_round[b]["t"] - by_round[a]["t"]
        out["duration_s"].append(by_round[b]["duration_s"])
        out["interval_s"].append(interval)
        out["overhead_share"].append(max(interval - by_round[b]["duration_s"], 0.0) / interval)
    for name_, key in (("write_s", "coterie_checkpoint_write_seconds"), ("wait_s", "coterie_checkpoint_wait_seconds")):
        s = [float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(key + "_sum")]
        c = [float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(key + "_count")]
        if s and c and c[0]:
            out[name_] = s[0] / c[0]  # mean per checkpoint
    ckpts = sorted(state.glob("ckpt-*"))
    out["checkpoint_bytes"] = sum(f.stat().st_size for c in ckpts[-1:] for f in ([c] if c.is_file() else c.iterdir()))
    shutil.rmtree(state, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions of every variant")
    ap.add_argument("--baseline-ref", default="c41716b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "checkpoint_overhead.json")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="coterie-ckpt-bench-"))
    try:
        base = baseline_tree(args.baseline_ref, workdir / "baseline")
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {m: {v: [] for v in VARIANTS} for m in MODELS}
        for rep in range(args.reps):
            for mname, model in MODELS.items():
                for vname, unsaved in VARIANTS.items():
                    r = run_node(
                        workdir, f"{vname}-{rep}", model, unsaved, base if vname == "before" else None, args.seed
                    )
                    runs[mname][vname].append(r)
                    print(
                        f"rep {rep} {mname:24s} {vname:6s}: round {statistics.median(r['interval_s']):.4f}s, "
                        f"compute {statistics.median(r['duration_s']):.4f}s, checkpoint share "
                        f"{statistics.median(r['overhead_share']):.1%}",
                        flush=True,
                    )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    summary = []
    for mname in MODELS:
        for vname in VARIANTS:
            rs = runs[mname][vname]
            pool = {k: [x for r in rs for x in r[k]] for k in ("duration_s", "interval_s", "overhead_share")}
            row = {
                "model": mname,
                "variant": vname,
                "round_s": statistics.median(pool["interval_s"]),
                "compute_s": statistics.median(pool["duration_s"]),
                "checkpoint_share": statistics.median(pool["overhead_share"]),
                "checkpoint_bytes": rs[-1]["checkpoint_bytes"],
            }
            for k in ("write_s", "wait_s"):
                if all(k in r for r in rs):
                    row[f"checkpoint_{k}"] = statistics.median(r[k] for r in rs)
            row["round_over_compute"] = row["round_s"] / row["compute_s"]
            summary.append(row)
    result = {
        "summary": summary,
        "runs": runs,
        "config": {
            "reps": args.reps,
            "seed": args.seed,
            "baseline_ref": args.baseline_ref,
            "models": MODELS,
            "variants": VARIANTS,
            "python": sys.version.split()[0],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    lines = [
        "| model | variant | round (median) | compute | round ÷ compute | checkpoint share of the round "
        "| background write | loop waits on checkpoint |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['round_s'] * 1000:.1f} ms | {r['compute_s'] * 1000:.1f} ms "
            f"| {r['round_over_compute']:.2f} | {r['checkpoint_share']:.1%} "
            f"| {r.get('checkpoint_write_s', float('nan')) * 1000:.1f} ms "
            f"| {r.get('checkpoint_wait_s', float('nan')) * 1000:.1f} ms |"
        )
    table = "\n".join(lines).replace("nan ms", "–")
    args.out.with_suffix(".md").write_text(
        f"# Checkpoint share of a round (bench/checkpoint_overhead.py, {args.reps} interleaved reps, "
        f"seed {args.seed}; before = {args.baseline_ref})\n\n{table}\n"
    )
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
