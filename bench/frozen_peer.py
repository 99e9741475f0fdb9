"""A frozen peer must not stall its neighbours (issue 10.1), measured on real daemons.

N nodes (fedfomo by default) paced at one round a second; once every node knows every other one
and has run a few rounds, one node is stopped with SIGSTOP for ``--pause`` seconds, then resumed
with SIGCONT. Reported per other node: its round rate in the window before the pause and during
it (and the ratio: the target is >= 0.9), healthy peers it marked dead (target: none), and whether
the paused node was sampled again after it resumed.

    python bench/frozen_peer.py --nodes 8 --pause 20 --json bench/results/frozen_peer.json
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netlab import Lab, load, mnist1d_mlp, wait_for  # noqa: E402


def rate(history: list[dict], t0: float, t1: float) -> float:
    return sum(1 for h in history if t0 < h["t"] <= t1) / (t1 - t0)


def run(args: argparse.Namespace) -> dict:
    n = args.nodes
    node_cfg = {
        "strategy": args.strategy,
        "round_interval_s": args.round_interval,
        "seed": args.seed,
        "log_level": "INFO",
        **json.loads(args.node_config),
    }
    configs = [{**node_cfg, "learner": mnist1d_mlp(n, i)} for i in range(n)]
    root = Path(args.dir or tempfile.mkdtemp(prefix="coterie-frozen-"))
    victim_i = n // 2
    with Lab(root, configs, python=args.python) as lab:
        lab.start(seeds=1)
        victim = lab.nodes[victim_i]
        others = [d for d in lab.nodes if d is not victim]

        def settled():
            sts = lab.statuses()
            return all(s and s["peers_alive"] == n - 1 and s["round"] >= args.warm_rounds for s in sts)

        wait_for(settled, 300, f"{n} nodes to meet and run {args.warm_rounds} rounds")
        time.sleep(args.before)  # the "before" window: steady state, nothing happens
        before_dead = {d.node_id: len(d.transitions()) for d in lab.nodes}
        t_stop = time.time()
        victim.signal(signal.SIGSTOP)
        time.sleep(args.pause)
        t_cont = time.time()
        victim.signal(signal.SIGCONT)
        time.sleep(args.after)
        t_end = time.time()
        rows = []
        for d in others:
            h = d.history()
            rb, rd, ra = (rate(h, t_stop - args.before, t_stop), rate(h, t_stop, t_cont), rate(h, t_cont, t_end))
            trans = d.transitions()[before_dead[d.node_id] :]
            false_dead = sorted({p for p, _, new in trans if new == "dead" and p != victim.node_id})
            sampled_after = any(victim.node_id in r.get("contacted", []) for r in h if r["t"] > t_cont)
            rows.append(
                {
                    "node": d.node_id,
                    "rate_before": rb,
                    "rate_during": rd,
                    "rate_after": ra,
                    "ratio_during": rd / rb if rb else float("nan"),
                    "false_dead": false_dead,
                    "victim_states": [(o, nw) for p, o, nw in trans if p == victim.node_id],
                    "sampled_victim_after": sampled_after,
                }
            )
        vh = victim.history()
        out = {
            "python": args.python,
            "nodes": n,
            "strategy": args.strategy,
            "pause_s": args.pause,
            "victim": victim.node_id,
            "load_before": args._load0,
            "load_after": load(),
            "node_config": node_cfg,
            "per_node": rows,
            "median_ratio_during": statistics.median(r["ratio_during"] for r in rows),
            "min_ratio_during": min(r["ratio_during"] for r in rows),
            "false_dead_total": sum(len(r["false_dead"]) for r in rows),
            "victim_sampled_again_by": sum(r["sampled_victim_after"] for r in rows),
            "victim_rounds_after": sum(1 for r in vh if r["t"] > t_cont),
            "dir": str(root),
        }
    return out


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # leave through the lab's cleanup
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--strategy", default="fedfomo")
    ap.add_argument("--pause", type=float, default=20.0)
    ap.add_argument("--before", type=float, default=20.0)
    ap.add_argument("--after", type=float, default=20.0)
    ap.add_argument("--warm-rounds", type=int, default=5)
    ap.add_argument("--round-interval", type=float, default=1.0)
    ap.add_argument("--node-config", default="{}", help="extra node config as JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir")
    ap.add_argument(
        "--python", default=sys.executable, help="interpreter of the daemons (e.g. python3 = the /work/main baseline)"
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    args._load0 = load()
    out = run(args)
    for r in out["per_node"]:
        print(
            f"{r['node']}: {r['rate_before']:.2f} -> {r['rate_during']:.2f} rounds/s "
            f"(x{r['ratio_during']:.2f}), after {r['rate_after']:.2f}; false dead {r['false_dead']}; "
            f"victim {r['victim_states']}; sampled victim again: {r['sampled_victim_after']}"
        )
    print(
        f"median ratio during pause {out['median_ratio_during']:.3f} (min {out['min_ratio_during']:.3f}); "
        f"false dead {out['false_dead_total']}; victim sampled again by {out['victim_sampled_again_by']}"
        f"/{len(out['per_node'])}; victim rounds after {out['victim_rounds_after']}; "
        f"load {out['load_before']} -> {out['load_after']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
