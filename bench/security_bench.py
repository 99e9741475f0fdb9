"""What the security layer costs, and what it saves, on real daemons (loopback).

1. ``s1``: scenario S1 (12 nodes, the 1-D CNN) run twice on identical partitions and seeds, with
   mTLS (the default) and with ``security.insecure = true``: median round time over every node's
   rounds, and the ratio.
2. ``flood``: one node running its own rounds (local strategy, S1's CNN and data) while one
   authenticated peer asks for full-split cross-gradients as fast as it can, 6 calls at a time
   (issue 8: 1,809 such requests in 60 s took a node's median round from 0.05 s to 3.4 s).
   Median round time before and during the flood, with the default per-peer budget and with the
   budget lifted (so the defence is measured against its absence in the same run).

    python bench/security_bench.py [--only s1|flood] [--rounds 15] [--flood-s 30] [--strategy fedfomo]

Writes bench/results/security.json (figures and the full configuration).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from coterie.node.config import read_toml  # noqa: E402
from coterie.node.launcher import run_scenario  # noqa: E402
from coterie.node.peering.errors import PeerCallError  # noqa: E402
from coterie.node.peering.messages import CROSS_GRADIENT, ComputeRequest  # noqa: E402
from coterie.node.scenario import parse_scenario  # noqa: E402
from nodeproc import NodeProc, wait_for  # noqa: E402
from test_security_limits import Mallory  # noqa: E402

S1 = ROOT / "scenarios" / "s1_label_permuted.toml"
UNLIMITED = {"requests_per_s": 1e6, "request_burst": 1e6, "compute_share": 1e3, "compute_burst_s": 1e3,
             "max_concurrent": 64}


def s1_round_times(strategy: str, rounds: int, seed: int, out: Path) -> dict:
    data = read_toml(S1)
    runs = {}
    for mode, security in (("mtls", {}), ("plaintext", {"insecure": True})):
        d = dict(data)
        d["node"] = {**data.get("node", {}), **({"security": security} if security else {})}
        sc = parse_scenario(d, strategies=[strategy], rounds=rounds, seed=seed)
        t0 = time.monotonic()
        run_scenario(sc, out / mode)
        durations = []
        for f in (out / mode / strategy / "nodes").glob("*/history.jsonl"):  # every node's own rounds
            durations += [json.loads(line)["duration_s"] for line in f.read_text().splitlines() if line.strip()]
        runs[mode] = {"median_round_s": statistics.median(durations), "rounds_measured": len(durations),
                      "wall_s": round(time.monotonic() - t0, 1)}
        print(f"S1 {strategy} {mode}: median round {runs[mode]['median_round_s'] * 1000:.0f} ms "
              f"over {len(durations)} node-rounds", flush=True)
    runs["ratio_mtls_over_plaintext"] = runs["mtls"]["median_round_s"] / runs["plaintext"]["median_round_s"]
    return runs


def s1_learner(seed: int) -> dict:
    learner = dict(read_toml(S1)["learner"])
    learner.update({"num_nodes": 12, "node_index": 0, "data_seed": seed, "init_seed": seed})
    return learner


def flood_once(root: Path, limits: dict, seconds: float, seed: int) -> dict:
    victim = NodeProc(root, "victim", {"strategy": "local", "learner": s1_learner(seed), "round_interval_s": 0.0,
                                       "seed": seed, "log_level": "WARNING", **({"limits": limits} if limits else {})})
    victim.start()
    try:
        wait_for(lambda: victim.status()["round"] >= 20, 300, "warm-up rounds")
        r0 = victim.status()["round"]
        time.sleep(seconds / 2)  # baseline: the same node, alone  # noqa: sleep measures, it waits for nothing
        r1 = victim.status()["round"]

        async def go():
            m = Mallory(root, victim)
            await m.join()
            _, params = await m.params()
            codes: dict[str, int] = {}
            stop = time.monotonic() + seconds

            async def loop():
                while time.monotonic() < stop:
                    try:
                        await m.client.compute(victim.address, ComputeRequest(
                            CROSS_GRADIENT, "mallory", groups={"params": params}, max_samples=0), peer="victim")
                        codes["ok"] = codes.get("ok", 0) + 1
                    except PeerCallError as e:
                        codes[e.kind] = codes.get(e.kind, 0) + 1
            start = victim.status()["round"]
            await asyncio.gather(*(loop() for _ in range(6)))
            end = victim.status()["round"]
            await m.close()
            return codes, start, end

        codes, f0, f1 = asyncio.run(go())
        hist = victim.get("/history")
        before = [h["duration_s"] for h in hist if r0 < h["round"] <= r1]
        during = [h["duration_s"] for h in hist if f0 < h["round"] <= f1]
        billed = victim.status()["admission"].get("mallory", {}).get("compute_s")
    finally:
        victim.stop()
    out = {"median_round_before_s": statistics.median(before), "median_round_during_s": statistics.median(during),
           "rounds_before": len(before), "rounds_during": len(during), "calls": codes,
           "billed_compute_s": billed, "flood_s": seconds}
    out["ratio"] = out["median_round_during_s"] / out["median_round_before_s"]
    return out


def flood(seconds: float, seed: int) -> dict:
    res = {}
    for name, limits in (("default budget", None), ("no budget", UNLIMITED)):
        with tempfile.TemporaryDirectory(prefix="coterie-flood-") as d:
            r = flood_once(Path(d), limits or {}, seconds, seed)
        res[name] = r
        print(f"flood, {name}: median round {r['median_round_before_s'] * 1000:.0f} ms -> "
              f"{r['median_round_during_s'] * 1000:.0f} ms (x{r['ratio']:.2f}); calls {r['calls']}, "
              f"billed {r['billed_compute_s']} s in {seconds:.0f} s", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["s1", "flood"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--strategy", default="fedfomo")
    ap.add_argument("--flood-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "security"))
    args = ap.parse_args()
    report: dict = {"config": vars(args), "machine_note": "loopback; all processes share one machine"}
    if args.only in (None, "s1"):
        report["s1"] = s1_round_times(args.strategy, args.rounds, args.seed, Path(args.out))
    if args.only in (None, "flood"):
        report["flood"] = flood(args.flood_s, args.seed)
    path = ROOT / "bench" / "results" / "security.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
