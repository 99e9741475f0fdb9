"""Soak: a small network of real daemons at full round rate for a long time, sampling what each
process holds — resident memory, open fds, OS threads, asyncio tasks (``/status`` ``process``) and
gRPC channels (``/status`` ``membership.channels``) — to show that nothing grows once warmed up
(issue 34 item 3: RSS slope < 1 MB/hour, fds and tasks constant).

    python bench/soak.py                                   # 3 FedFomo nodes, 1 hour, a sample every 10 s
    python bench/soak.py --duration-s 120 --warmup-s 30    # a short one (tests/test_soak.py runs ~1 min)

Writes ``config.json`` (every knob, the seed), ``samples.jsonl`` (one line per node and sample) and
``summary.json`` into ``--out`` (default ``bench/results/soak/<UTC stamp>``) and prints, per node and
after the warm-up: the RSS slope (least squares, MB/hour), RSS first/last, and the range and the
medians of the first and second half for fds, tasks, threads and channels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netlab import Lab, load, mnist1d_mlp, wait_for  # noqa: E402

COUNTS = ("open_fds", "asyncio_tasks", "threads", "channels")


def sample(lab: Lab, t0: float) -> list[dict[str, Any]]:
    out = []
    for d, s in zip(lab.nodes, lab.statuses(timeout=10.0), strict=True):
        if not s:
            continue
        p = s.get("process") or {}
        out.append(
            {
                "t": round(time.monotonic() - t0, 2),
                "node": d.node_id,
                "round": s["round"],
                "rss_bytes": p.get("rss_bytes"),
                "open_fds": p.get("open_fds"),
                "asyncio_tasks": p.get("asyncio_tasks"),
                "threads": p.get("threads"),
                "channels": (s.get("membership") or {}).get("channels"),
                "asyncio_task_kinds": p.get("asyncio_task_kinds") or {},
            }
        )
    return out


def summarise(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """Per node, over the samples after the warm-up: RSS slope (MB/hour) and first/last, and for
    each count its min/max and the medians of the first and second half (a leak shows as a second
    half above the first)."""
    out: dict[str, Any] = {}
    for node in sorted({s["node"] for s in samples}):
        rows = [s for s in samples if s["node"] == node and s["t"] >= warmup_s and s["rss_bytes"] is not None]
        if len(rows) < 4:
            out[node] = {"error": f"{len(rows)} samples after the warm-up (need 4)"}
            continue
        ts = [r["t"] / 3600 for r in rows]
        mb = [r["rss_bytes"] / 1e6 for r in rows]
        slope = statistics.linear_regression(ts, mb).slope
        half = len(rows) // 2
        counts = {}
        for k in COUNTS:
            v = [r[k] for r in rows if r[k] is not None]
            if v:
                first, second = v[: len(v) // 2], v[len(v) // 2 :]
                counts[k] = {
                    "min": min(v),
                    "max": max(v),
                    "median_first_half": statistics.median(first),
                    "median_second_half": statistics.median(second),
                }
        kinds_first, kinds_last = rows[0].get("asyncio_task_kinds") or {}, rows[-1].get("asyncio_task_kinds") or {}
        out[node] = {
            # which coroutines there were more of at the end than after the warm-up (a leak's name)
            "task_kinds_grown": {
                k: [kinds_first.get(k, 0), n] for k, n in kinds_last.items() if n > kinds_first.get(k, 0)
            },
            "samples": len(rows),
            "window_s": round(rows[-1]["t"] - rows[0]["t"], 1),
            "rounds": rows[-1]["round"] - rows[0]["round"],
            "rss_slope_mb_per_hour": round(slope, 3),
            "rss_mb_first": round(mb[0], 1),
            "rss_mb_last": round(mb[-1], 1),
            "rss_mb_median_first_half": round(statistics.median(mb[:half]), 1),
            "rss_mb_median_second_half": round(statistics.median(mb[half:]), 1),
            **counts,
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    n = args.nodes
    node_cfg = {
        "strategy": args.strategy,
        "round_interval_s": args.round_interval,
        "seed": args.seed,
        "log_level": "WARNING",
        "heartbeat_interval_s": 0.5,
    }
    if args.history_max_bytes:  # a small cap rotates every few hundred rounds: rotations inside the soak
        node_cfg["history"] = {"max_bytes": args.history_max_bytes}
    configs = [{**node_cfg, "learner": mnist1d_mlp(n, i, steps=args.local_steps)} for i in range(n)]
    root = Path(args.dir or tempfile.mkdtemp(prefix="coterie-soak-"))
    samples: list[dict[str, Any]] = []
    wraps = None
    if args.memprobe:  # n0 under tracemalloc: what grew after the warm-up, by allocation site
        probe = [sys.executable, str(Path(__file__).parent / "memprobe.py"), str(Path(args.memprobe).resolve())]
        wraps = [probe + ["--start-s", "60", "--base-s", str(args.warmup_s), "--every-s", "60"]] + [[]] * (n - 1)
    with Lab(root, configs, wraps=wraps) as lab:
        lab.start(seeds=1)
        wait_for(
            lambda: all(s and s["peers_alive"] == n - 1 and s["round"] >= 1 for s in lab.statuses()),
            300,
            f"{n} nodes to meet and run a round",
        )
        t0 = time.monotonic()
        next_at = t0
        while time.monotonic() - t0 < args.duration_s:
            samples.extend(sample(lab, t0))
            next_at += args.sample_s
            time.sleep(max(0.0, next_at - time.monotonic()))
        samples.extend(sample(lab, t0))
        dead = [d.node_id for d in lab.nodes if d.proc is None or d.proc.poll() is not None]
    return {"samples": samples, "summary": summarise(samples, args.warmup_s), "exited": dead, "load": load()}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--strategy", default="fedfomo")
    ap.add_argument("--duration-s", type=float, default=3600.0)
    ap.add_argument("--warmup-s", type=float, default=300.0, help="samples before this are not judged")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--round-interval", type=float, default=0.0, help="0: full round rate")
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--history-max-bytes", type=int, help="history.max_bytes of every node (default: the node's)")
    ap.add_argument("--dir", help="state dirs and logs (default: a temporary directory)")
    ap.add_argument("--memprobe", help="run n0 under bench/memprobe.py (tracemalloc), its report to this file")
    ap.add_argument("--out", help="results directory (default: bench/results/soak/<UTC stamp>)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out or Path(__file__).parent / "results" / "soak" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(vars(args), indent=1))
    res = run(args)
    with open(out / "samples.jsonl", "w") as f:
        for s in res["samples"]:
            f.write(json.dumps(s) + "\n")
    (out / "summary.json").write_text(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    print(
        f"soak: {args.nodes} x {args.strategy}, {args.duration_s:.0f} s, warm-up {args.warmup_s:.0f} s; load {res['load']}"
    )
    for node, s in res["summary"].items():
        if "error" in s:
            print(f"  {node}: {s['error']}")
            continue
        counts = "  ".join(
            f"{k} {s[k]['min']}..{s[k]['max']} (median {s[k]['median_first_half']}->{s[k]['median_second_half']})"
            for k in COUNTS
            if k in s
        )
        print(
            f"  {node}: {s['rounds']} rounds in {s['window_s']} s; RSS {s['rss_mb_first']}->{s['rss_mb_last']} MB, "
            f"slope {s['rss_slope_mb_per_hour']:+.2f} MB/h; {counts}"
        )
    if res["exited"]:
        print(f"  exited during the soak: {res['exited']}")
    print(f"results: {out}")
    return 1 if res["exited"] else 0


if __name__ == "__main__":
    sys.exit(main())
