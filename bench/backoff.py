"""The back-off's effect on S1 or the demo network (issue 33 item 1): every strategy run twice
on identical data and seeds, the local-only reference on (the default) and off, side by side:
both networks at the same time, each in its own process (inproc backend), so both see the same
load. Per strategy: the mean and worst node's final test accuracy, the mean gain over each node's
own local-only reference (the twin's test accuracy, reported beside the node's), how many nodes
ended backed off, and the median round time on / off (the reference's cost).

    python bench/backoff.py --seeds 0 --strategies fedfomo,dpsgd --rounds 30

Writes bench/results/backoff_<scenario>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from coterie.lab.launch import run_scenario

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {"s1": "s1_label_permuted.toml", "demo": "demo.toml"}
ALL = ["dpsgd", "oracle", "fedfomo", "federico", "cobo", "l2c", "meta-l2c", "scool-sbm", "scool-attention"]


def run(scenario: str, strategies: list[str], seed: int, rounds: int | None, enabled: bool, out: Path) -> dict:
    from coterie.lab.scenario import parse_scenario
    from coterie.node.config import read_toml

    data = read_toml(ROOT / "scenarios" / SCENARIOS[scenario], "scenario")
    data["node"] = {**data.get("node", {}), "reference": {"enabled": enabled}}
    sc = parse_scenario(data, strategies=strategies, seed=seed, rounds=rounds)
    return run_scenario(sc, out, backend="inproc", check=False)


def figures(res: dict, strategy: str) -> dict:
    nodes = res["strategies"][strategy]["nodes"].values()
    finals = [n["final_test_acc"] for n in nodes]
    local = [n["eval"][-1].get("local_test_acc") for n in nodes]
    gains = [f - lo for f, lo in zip(finals, local, strict=True) if lo is not None]
    return {
        "mean": statistics.mean(finals),
        "worst": min(finals),
        "gain_over_reference": statistics.mean(gains) if gains else None,
        "worst_gain": min(gains) if gains else None,
        "backed_off": sum(1 for n in nodes if (n["collaboration"] or {}).get("helping") is False),
        "round_s": statistics.median(
            [b - a for n in nodes for a, b in zip(n["t"], n["t"][1:], strict=False) if a and b]
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="s1", choices=sorted(SCENARIOS))
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--strategies", default=",".join(ALL))
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--out", default="/tmp/backoff")
    ap.add_argument("--one", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    strategies = a.strategies.split(",")
    if a.one:  # a child: one network, its figures as JSON on the last line
        enabled = a.one == "on"
        res = run(a.scenario, strategies, int(a.seeds), a.rounds, enabled, Path(a.out))
        print(json.dumps(figures(res, strategies[0])))
        return
    rows: dict[str, dict] = {}
    t0 = time.time()
    for seed in map(int, a.seeds.split(",")):
        for s in strategies:  # on and off at the same time, in two processes: the same load on both
            base = [sys.executable, __file__, "--scenario", a.scenario, "--seeds", str(seed), "--strategies", s]
            base += ["--rounds", str(a.rounds)] if a.rounds else []
            procs = {
                mode: subprocess.Popen(
                    [*base, "--one", mode, "--out", str(Path(a.out) / f"seed{seed}-{s}-{mode}")],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for mode in ("on", "off")
            }
            for mode, proc in procs.items():
                stdout, _ = proc.communicate()
                if proc.returncode:
                    raise SystemExit(f"{s} seed {seed} reference {mode}: exit {proc.returncode}")
                rows.setdefault(s, {}).setdefault(mode, []).append(json.loads(stdout.strip().splitlines()[-1]))
                print(s, seed, mode, rows[s][mode][-1], flush=True)
    out = {"seeds": a.seeds, "rounds": a.rounds, "wall_s": time.time() - t0, "rows": rows}
    (ROOT / "bench/results" / f"backoff_{a.scenario}.json").write_text(json.dumps(out, indent=1))
    med = statistics.median
    lines = [
        f"# Back-off on {a.scenario}: the local-only reference on (default) vs off",
        "",
        f"`python bench/backoff.py --scenario {a.scenario} --seeds {a.seeds} --strategies {a.strategies}` "
        f"(inproc backend, scenarios/{SCENARIOS[a.scenario]} as shipped"
        + (f", {a.rounds} rounds" if a.rounds else "")
        + "); per strategy the median over seeds of: mean and worst node's final test accuracy, mean "
        "gain over each node's own local-only twin, nodes backed off at the end (of all), and the "
        "median round time (on/off: the twin's cost).",
        "",
        "| strategy | mean on | mean off | worst on | worst off | gain over twin on | off | backed off | round s on/off |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s, r in rows.items():
        on, off = r["on"], r["off"]

        def m(rs: list[dict], k: str) -> float:
            return med([x[k] for x in rs if x[k] is not None])

        lines.append(
            f"| {s} | {m(on, 'mean'):.3f} | {m(off, 'mean'):.3f} | {m(on, 'worst'):.3f} | {m(off, 'worst'):.3f} "
            f"| {m(on, 'gain_over_reference'):+.3f} | {m(off, 'mean') - m(on, 'mean') + m(on, 'gain_over_reference'):+.3f} "
            f"| {m(on, 'backed_off'):.0f} | {m(on, 'round_s') / m(off, 'round_s'):.2f} |"
        )
    (ROOT / "bench/results" / f"backoff_{a.scenario}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
