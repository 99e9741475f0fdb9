"""What the security layer costs, and what it saves, on real daemons (loopback).

1. ``s1``: scenario S1 (12 nodes, the 1-D CNN) run twice on identical partitions and seeds, with
   mTLS (the default) and with ``security.insecure = true``: median round time over every node's
   rounds, and the ratio.
2. ``flood``: one node running its own rounds (local strategy, S1's CNN and data) while one
   authenticated peer asks for full-split cross-gradients as fast as it can, 6 calls at a time
   (issue 8: 1,809 such requests in 60 s took a node's median round from 0.05 s to 3.4 s). The
   attacker runs at nice 19, standing in for a remote one whose CPU is not the victim's.
   Median round time before and during the flood, with the default per-peer budget and with the
   budget lifted (so the defence is measured against its absence in the same run).

   ``--insiders 1,4`` floods with one, then four certified identities at once (issue 22's goal:
   the victim's round rate falls by at most 25 % and 50 %).

    python bench/security_bench.py [--only s1|flood] [--rounds 15] [--strategy fedfomo] [--window-s 10 --reps 4]
                                   [--insiders 1,4] [--no-unlimited]

Writes bench/results/security.json (figures and the full configuration).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from nodeproc import NodeProc, wait_for  # noqa: E402
from test_security_limits import Mallory  # noqa: E402

from coterie.lab.launcher import run_scenario  # noqa: E402
from coterie.lab.scenario import parse_scenario  # noqa: E402
from coterie.node.config import read_toml  # noqa: E402
from coterie.node.peering.errors import PeerCallError  # noqa: E402
from coterie.node.peering.messages import CROSS_GRADIENT, ComputeRequest  # noqa: E402

S1 = ROOT / "scenarios" / "s1_label_permuted.toml"
UNLIMITED = {
    "requests_per_s": 1e6,
    "request_burst": 1e6,
    "compute_share": 1e3,
    "compute_burst_s": 1e3,
    "max_concurrent": 64,
}


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
        runs[mode] = {
            "median_round_s": statistics.median(durations),
            "rounds_measured": len(durations),
            "wall_s": round(time.monotonic() - t0, 1),
        }
        print(
            f"S1 {strategy} {mode}: median round {runs[mode]['median_round_s'] * 1000:.0f} ms "
            f"over {len(durations)} node-rounds",
            flush=True,
        )
    runs["ratio_mtls_over_plaintext"] = runs["mtls"]["median_round_s"] / runs["plaintext"]["median_round_s"]
    return runs


def s1_learner(seed: int) -> dict:
    learner = dict(read_toml(S1)["learner"])
    learner.update({"num_nodes": 12, "node_index": 0, "data_seed": seed, "init_seed": seed})
    return learner


def _flood_process(root: str, victim_info: dict, offsets: list[tuple[float, float]], q, insiders: int = 1) -> None:
    """The attacker, in a process of its own at the lowest CPU priority: as from another machine,
    its own CPU use should not be what slows the victim down (they share this one). It floods
    during each (start, end) window, in seconds after it is ready (it reports that moment first:
    on a loaded box its imports and handshakes take a while), and idles in between; ``insiders``:
    certified identities flooding at once (each its own certificate, connection and budget)."""
    os.nice(19)

    class Victim:  # what Mallory needs of a NodeProc
        node_id, address = "victim", victim_info["address"]

        @staticmethod
        def status():
            return {"fingerprint": victim_info["fingerprint"]}

    async def go():
        ms = [Mallory(Path(root), Victim, "mallory" if i == 0 else f"mallory{i}") for i in range(insiders)]
        codes: dict[str, int] = {}
        params = None
        for m in ms:
            await m.join()
            _, params = await m.params()
        t0 = time.time() + 1.0
        q.put(t0)
        windows = [(t0 + a, t0 + b) for a, b in offsets]

        async def loop(m, stop: float):
            while time.time() < stop:
                try:
                    await m.client.compute(
                        Victim.address,
                        ComputeRequest(
                            CROSS_GRADIENT,
                            m.node_id,
                            groups={"params": params},
                            max_samples=0,
                            purpose="scool-gradient",
                        ),
                        peer="victim",
                    )
                    codes["ok"] = codes.get("ok", 0) + 1
                except PeerCallError as e:
                    codes[e.kind] = codes.get(e.kind, 0) + 1

        for start, stop in windows:
            await asyncio.sleep(max(0.0, start - time.time()))  # the schedule: idle until the window
            await asyncio.gather(*(loop(m, stop) for m in ms for _ in range(6)))
        for m in ms:
            await m.close()
        return codes

    q.put(asyncio.run(go()))


def flood_once(root: Path, limits: dict, window_s: float, reps: int, seed: int, insiders: int = 1) -> dict:
    """Alternate ``reps`` quiet and flooded windows of ``window_s`` (load on a shared machine
    drifts; interleaving compares like with like) and compare the victim's rounds in each."""
    # it answers cross-gradients, exactly (as tests/test_security_limits.py's flood): without a
    # purpose and the victim serving it, every call was refused as invalid before any compute
    victim = NodeProc(
        root,
        "victim",
        {
            "strategy": "local",
            "learner": s1_learner(seed),
            "round_interval_s": 0.0,
            "seed": seed,
            "log_level": "WARNING",
            "privacy": {"enabled": False, "serve_purposes": ["scool-gradient"]},
            **({"limits": limits} if limits else {}),
        },
    )
    victim.start(timeout=300)  # a loaded shared box can take minutes to import torch
    try:
        wait_for(lambda: victim.status()["round"] >= 20, 300, "warm-up rounds")
        quiet = [(2 * k * window_s, (2 * k + 1) * window_s) for k in range(reps)]
        loud = [((2 * k + 1) * window_s, (2 * k + 2) * window_s) for k in range(reps)]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        attacker = ctx.Process(
            target=_flood_process,
            args=(
                str(root),
                {"address": victim.address, "fingerprint": victim.status()["fingerprint"]},
                loud,
                q,
                insiders,
            ),
        )
        attacker.start()
        t0 = q.get(timeout=300)  # the attacker is ready: windows count from here
        quiet = [(t0 + a, t0 + b) for a, b in quiet]
        loud = [(t0 + a, t0 + b) for a, b in loud]
        codes = q.get(timeout=2 * reps * window_s + 300)
        attacker.join(30)
        hist = victim.get("/history")
        adm = victim.status()["admission"]
        billed = round(sum(v.get("compute_s", 0.0) for k, v in adm.items() if k.startswith("mallory")), 2)
    finally:
        victim.stop()

    def rounds_in(windows):  # rounds that started and ended inside a window
        return [h["duration_s"] for h in hist if any(a <= h["t"] - h["duration_s"] and h["t"] <= b for a, b in windows)]

    before, during = rounds_in(quiet), rounds_in(loud)
    out = {
        "median_round_quiet_s": statistics.median(before),
        "median_round_flood_s": statistics.median(during),
        "rounds_quiet": len(before),
        "rounds_flood": len(during),
        "calls": codes,
        "billed_compute_s": billed,
        "flooded_s": reps * window_s,
        "window_s": window_s,
        "insiders": insiders,
        # round rate: rounds that started and ended inside the windows, per second of window
        "rate_quiet_per_s": len(before) / (reps * window_s),
        "rate_flood_per_s": len(during) / (reps * window_s),
    }
    out["ratio"] = out["median_round_flood_s"] / out["median_round_quiet_s"]
    out["rate_loss"] = 1 - out["rate_flood_per_s"] / out["rate_quiet_per_s"]
    return out


def flood(window_s: float, reps: int, seed: int, insiders: list[int], unlimited: bool = True) -> dict:
    res = {}
    runs = [(f"{n} insider{'s' if n > 1 else ''}, default budget", None, n) for n in insiders]
    if unlimited:
        runs.append(("1 insider, no budget", UNLIMITED, 1))
    for name, limits, n in runs:
        with tempfile.TemporaryDirectory(prefix="coterie-flood-") as d:
            r = flood_once(Path(d), limits or {}, window_s, reps, seed, n)
        res[name] = r
        print(
            f"flood, {name}: {r['rate_quiet_per_s']:.2f} rounds/s quiet, {r['rate_flood_per_s']:.2f} flooded "
            f"(loss {r['rate_loss']:.0%}); median round {r['median_round_quiet_s'] * 1000:.0f} ms quiet, "
            f"{r['median_round_flood_s'] * 1000:.0f} ms flooded (x{r['ratio']:.2f}); calls {r['calls']}, "
            f"billed {r['billed_compute_s']} s of compute in {r['flooded_s']:.0f} s of flood",
            flush=True,
        )
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["s1", "flood"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--strategy", default="fedfomo")
    ap.add_argument("--window-s", type=float, default=10.0, help="length of each quiet / flooded window")
    ap.add_argument("--reps", type=int, default=4, help="quiet+flooded window pairs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--insiders", default="1,4", help="flood: how many certified insiders flood at once (a list)")
    ap.add_argument("--no-unlimited", action="store_true", help="flood: skip the run with the budget lifted")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "security"), help="run directories")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "security.json"))
    args = ap.parse_args()
    import platform

    report: dict = {
        "config": vars(args),
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, load "
        f"{os.getloadavg()[0]:.1f} at start; loopback, all processes on this machine",
    }
    if args.only in (None, "s1"):
        report["s1"] = s1_round_times(args.strategy, args.rounds, args.seed, Path(args.out))
    if args.only in (None, "flood"):
        report["flood"] = flood(
            args.window_s, args.reps, args.seed, [int(n) for n in args.insiders.split(",")], not args.no_unlimited
        )
    path = Path(args.json)
    path.write_text(json.dumps(report, indent=2))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
