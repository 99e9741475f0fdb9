"""Utility under privacy: the strategies that compute on peers' data, at several noise levels.

For S1 (label-permuted clusters) and S3 (IID + two random-label nodes) this runs, on real daemons
(``coterie run``), the strategies that release something computed on a node's private data —
FedeRiCo (pushed gradients), COBO (alignment gradients), SCool-SBM and SCool-attention
(cross-losses) — with

  off        privacy.enabled = false: exact answers (the non-private anchor), plus ``local``
  σ=0        clipping only (ε = ∞), no budget
  σ=0.5/1/2  Gaussian noise multiplier σ, no budget: the ε 30 rounds cost
  default    the node defaults (σ and budget as shipped): what a deployment gets

and reports per strategy and setting: mean test accuracy (clean nodes), in-cluster weight mass,
the share of the non-private gain over local that is kept, and ε (median / max over nodes, at
the configured δ) read from each node's privacy ledger after the run.

    python bench/privacy_bench.py                        # everything (hours on a busy 2-core box)
    python bench/privacy_bench.py --scenarios s1 --settings off,sigma1 --strategies federico
    python bench/privacy_bench.py --report-only          # recompute the table from what is there

Every setting runs from its own scenario file, written next to its results
(bench/results/privacy/<scenario>/<setting>/scenario.toml + results.json); finished settings are
skipped on a rerun (delete the directory to redo one). Writes bench/results/privacy.md and
bench/results/privacy.json. DP noise is drawn from OS entropy on purpose (a seeded noise stream
could be subtracted), so reruns agree only statistically; partitions and θ⁰ follow --seed.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import tomli_w
import tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from strategy_bench import SCENARIOS, mean_ci, metrics  # noqa: E402

from coterie.node.config import PrivacyConfig  # noqa: E402
from coterie.node.privacy import accountant  # noqa: E402
from coterie.node.privacy.ledger import FILE as LEDGER_FILE  # noqa: E402

PRIVATE_STRATEGIES = ["federico", "cobo", "scool-sbm", "scool-attention"]
INF = math.inf
SETTINGS: dict[str, dict] = {
    "off": {"enabled": False},
    # the issue's grid, over the 32-sample batches the strategies ask for, no budget: what 30 rounds cost
    "sigma0": {"noise_multiplier": 0.0, "budget_epsilon": INF, "min_batch": 32},
    "sigma0.5": {"noise_multiplier": 0.5, "budget_epsilon": INF, "min_batch": 32},
    "sigma1": {"noise_multiplier": 1.0, "budget_epsilon": INF, "min_batch": 32},
    "sigma2": {"noise_multiplier": 2.0, "budget_epsilon": INF, "min_batch": 32},
    "default": {},  # as shipped (PrivacyConfig defaults), budget included
}
LABELS = {
    "off": "off (exact)",
    "sigma0": "σ=0 (clip only)",
    "sigma0.5": "σ=0.5",
    "sigma1": "σ=1",
    "sigma2": "σ=2",
    "default": "defaults",
}


def scenario_for(sc: str, setting: str, rounds: int | None, seed: int) -> dict:
    data = tomllib.loads((ROOT / "scenarios" / SCENARIOS[sc]).read_text())
    data.setdefault("node", {})["privacy"] = dict(SETTINGS[setting])
    # 12 daemons start at once; on a loaded 2-core box a node can take minutes to come up, and
    # its successor's --bootstrap-from wait (start_timeout_s, 120 s by default) would give up
    data["node"]["start_timeout_s"] = 600
    data["seed"] = seed
    if rounds is not None:
        data["rounds"] = rounds
    data["name"] = f"{data.get('name', sc)}-privacy-{setting}"
    return data


def nodes_dir(run_dir: Path, strategy: str) -> Path:
    """Where a strategy's node state dirs are: run_dir/<s>/<s>/nodes (one ``coterie run`` per
    strategy, the current layout) or run_dir/<s>/nodes (one run for the whole setting)."""
    per_strategy = run_dir / strategy / strategy / "nodes"
    return per_strategy if per_strategy.exists() else run_dir / strategy / "nodes"


EPSILONS = "epsilons.json"  # per setting: each strategy's per-node ε, kept (node state dirs are not)


def ledger_epsilons(run_dir: Path, strategy: str, delta: float) -> list[float] | None:
    """Total ε of every node, from the ledger each one kept in its state dir; from the setting's
    ``epsilons.json`` when the state dirs are gone (a fresh checkout); None if neither exists."""
    nodes = nodes_dir(run_dir, strategy)
    cache = run_dir / EPSILONS
    kept = json.loads(cache.read_text()) if cache.exists() else {}
    if not nodes.exists():
        return kept.get(strategy)
    out = []
    for d in sorted(nodes.iterdir()):
        path = d / LEDGER_FILE
        steps = json.loads(path.read_text())["total"]["steps"] if path.exists() else []
        out.append(accountant.epsilon(steps, delta))
    if kept.get(strategy) != out:
        kept[strategy] = out
        cache.write_text(json.dumps(kept))
    return out


def run_setting(sc: str, setting: str, strategies: list[str], args, seed: int = 0) -> Path:
    """One ``coterie run`` per strategy (a failed start on a loaded machine is retried, and the
    strategies that finished are kept); their results are merged into run_dir/results.json."""
    run_dir = seed_dir(args.out, seed) / sc / setting
    merged = run_dir / "results.json"
    run_dir.mkdir(parents=True, exist_ok=True)
    results = json.loads(merged.read_text()) if merged.exists() else None
    if args.force and results is not None:  # rerun only the strategies asked for: the others' results stay
        for strat in strategies:
            results["strategies"].pop(strat, None)
    scen = scenario_for(sc, setting, args.rounds, seed)
    path = run_dir / "scenario.toml"
    path.write_text(tomli_w.dumps(scen))
    for strat in strategies:
        if results is not None and strat in results["strategies"]:
            print(f"# {sc}/{setting}/{strat}: done before, kept", flush=True)
            continue
        out = run_dir / strat
        cmd = [sys.executable, "-m", "coterie.cli.main", "run", str(path), "--out", str(out), "--strategy", strat]
        for attempt in range(1, args.attempts + 1):
            if out.exists():
                shutil.rmtree(out)
            print("$", " ".join(cmd), flush=True)
            t0 = time.time()
            rc = subprocess.run(cmd, stdout=subprocess.DEVNULL if args.quiet else None).returncode
            print(f"# {sc}/{setting}/{strat}: exit {rc} after {time.time() - t0:.0f}s (attempt {attempt})", flush=True)
            if rc == 0:
                break
        else:
            print(f"# {sc}/{setting}/{strat}: gave up after {args.attempts} attempts", flush=True)
            continue
        one = json.loads((out / "results.json").read_text())
        if results is None:
            results = one
        else:
            results["strategies"].update(one["strategies"])
        merged.write_text(json.dumps(results))
    return run_dir


def seed_dir(out: Path, seed: int) -> Path:
    """Seed 0's runs sit in out/<scenario>/<setting> (where they always were); seed k's in out/seed<k>/."""
    return out if seed == 0 else out / f"seed{seed}"


def collect(args, seed: int = 0) -> dict:
    table: dict = {}
    before_path = args.report.with_suffix(".json")  # ε of runs whose ledgers are no longer on disk
    before = json.loads(before_path.read_text()) if before_path.exists() else {}
    before = before.get("per_seed", {}).get(str(seed), {}) if "per_seed" in before else (before if seed == 0 else {})
    for sc in args.scenarios:
        rows: dict = {}
        for setting in SETTINGS:
            run_dir = seed_dir(args.out, seed) / sc / setting
            if not (run_dir / "results.json").exists():
                continue
            res = json.loads((run_dir / "results.json").read_text())
            m = metrics(res)
            priv = PrivacyConfig(**tomllib.loads((run_dir / "scenario.toml").read_text())["node"]["privacy"])
            for strat, r in m.items():
                eps = ledger_epsilons(run_dir, strat, priv.delta) if strat != "local" and priv.enabled else []
                old = before.get(sc, {}).get(strat, {}).get(setting, {})
                rows.setdefault(strat, {})[setting] = {
                    "mean_acc": r["mean_acc"],
                    "in_cluster_mass": r["in_cluster_mass"],
                    "in_cluster_chance": r["in_cluster_chance"],
                    "eps_median": float(np.median(eps)) if eps else old.get("eps_median"),
                    "eps_max": float(np.max(eps)) if eps else old.get("eps_max"),
                    "delta": priv.delta,
                    "noise_multiplier": priv.noise_multiplier if priv.enabled else None,
                    "budget_epsilon": priv.budget_epsilon if priv.enabled else None,
                    "wall_time_s": r["wall_time_s"],
                    "created": res.get("created"),
                }
        table[sc] = rows
    return table


def _pct(v):
    return "–" if v is None else f"{100 * v:.1f}"


def _eps(v):
    return "–" if v is None else ("∞" if not math.isfinite(v) else f"{v:.2f}")


def kept_share(rows: dict, strat: str, setting: str) -> float | None:
    """(acc − local) / (acc_off − local) within one seed's table; None without a positive exact gain."""
    local = rows.get("local", {}).get("off", {}).get("mean_acc")
    off = rows.get(strat, {}).get("off", {}).get("mean_acc")
    r = rows.get(strat, {}).get(setting)
    if r is None or local is None or off is None or off - local <= 1e-9:
        return None
    return (r["mean_acc"] - local) / (off - local)


def across_seeds(tables: dict[int, dict]) -> dict:
    """Per scenario, strategy and setting run in every seed: the seeds' values and mean ± 95% CI."""
    seeds = sorted(tables)
    out: dict = {}
    for sc in tables[seeds[0]]:
        for strat, settings in tables[seeds[0]][sc].items():
            for setting in settings:
                per = [tables[k].get(sc, {}).get(strat, {}).get(setting) for k in seeds]
                if any(r is None for r in per):
                    continue
                acc = [r["mean_acc"] for r in per]
                kept = [kept_share(tables[k][sc], strat, setting) for k in seeds]
                gain = [
                    r["mean_acc"] - tables[k][sc]["local"]["off"]["mean_acc"]
                    for k, r in zip(seeds, per, strict=True)
                    if "local" in tables[k][sc]
                ]
                out.setdefault(sc, {}).setdefault(strat, {})[setting] = {
                    "seeds": seeds,
                    "mean_acc": acc,
                    "mean_acc_ci": mean_ci(acc),
                    "gain_over_local": gain,
                    "gain_ci": mean_ci(gain) if len(gain) == len(seeds) else None,
                    "kept": kept,
                    "kept_of_mean_gains": None,
                    "in_cluster_mass": [r["in_cluster_mass"] for r in per],
                    "eps_max": max((r["eps_max"] for r in per if r.get("eps_max") is not None), default=None),
                }
        for settings in out.get(sc, {}).values():  # kept from the seeds' mean gains (a ratio of means)
            off = settings.get("off")
            for r in settings.values():
                if off and r["gain_ci"] and off["gain_ci"] and off["gain_ci"][0] > 1e-9:
                    r["kept_of_mean_gains"] = r["gain_ci"][0] / off["gain_ci"][0]
    return out


def seeds_markdown(agg: dict, seeds: list[int]) -> list[str]:
    if not agg:
        return []
    lines = [
        f"## Across seeds {seeds}",
        "",
        "The settings run with every seed. Accuracy and gain over local (paired: the same seed's "
        "local run) as mean ± 95% CI (Student t over the seeds); kept = mean gain under privacy / "
        "mean exact gain (a ratio of the seeds' means), then each seed's own kept in brackets; ε max: "
        "the largest total ε any node reached in any seed.",
        "",
    ]
    for sc, rows in agg.items():
        lines += [
            f"### {sc.upper()}",
            "",
            "| strategy | setting | mean acc % | gain over local (points) | kept (per seed) | in-cluster mass (per seed) | ε max |",
            "|---|---|---|---|---|---|---|",
        ]
        for strat, settings in rows.items():
            for setting in SETTINGS:
                r = settings.get(setting)
                if r is None:
                    continue
                m, h = r["mean_acc_ci"]
                gain = (
                    "–"
                    if r["gain_ci"] is None or strat == "local"
                    else f"{100 * r['gain_ci'][0]:+.1f} ± {100 * r['gain_ci'][1]:.1f}"
                )
                kept = (
                    "–"
                    if setting == "off" or r["kept_of_mean_gains"] is None
                    else f"{100 * r['kept_of_mean_gains']:.0f}% ("
                    + ", ".join("–" if k is None else f"{100 * k:.0f}%" for k in r["kept"])
                    + ")"
                )
                mass = ", ".join("–" if v is None else f"{v:.2f}" for v in r["in_cluster_mass"])
                eps = "–" if setting == "off" or strat == "local" else _eps(r["eps_max"])
                lines.append(
                    f"| {strat} | {LABELS[setting]} | {100 * m:.1f} ± {100 * h:.1f} | {gain} | {kept} | {mass} | {eps} |"
                )
        lines.append("")
    return lines


def markdown(table: dict, args, agg: dict | None = None, seeds: list[int] | None = None) -> str:
    d = PrivacyConfig()
    lines = [
        "# Utility under privacy",
        "",
        f"Real daemons on loopback (`coterie run`), {args.rounds or 30} rounds, "
        "12 nodes, S1/S3 on the 1-D CNN (scenarios/). Mean test accuracy % over the clean nodes; "
        "in-cluster weight mass over the last half of the rounds (chance in brackets); "
        "kept = (acc − local) / (acc_off − local), the share of the non-private gain over local "
        "that survives; ε = total ε of a node's data (all peers composed, RDP accountant, "
        f"δ = {d.delta:g}), median / max over the 12 nodes, from their ledgers. "
        f"Clip bounds: gradient {d.grad_clip:g}, loss {d.loss_clip:g}. The σ rows answer over the "
        "32-sample batches the strategies ask for, with no budget (the ε that 30 rounds cost); "
        f"`defaults` = as shipped: σ = {d.noise_multiplier:g} over ≥ {d.min_batch} samples, budget "
        f"ε = {d.budget_epsilon:g} (a node refuses once it is spent; the strategy then goes on "
        "without those answers).",
        "",
        "Generated by `python bench/privacy_bench.py --seeds 0,1,2` (then `--seeds 3` and `--seeds 4` "
        "with `--settings off,default --strategies federico,scool-sbm`); the across-seeds tables keep "
        "the strategies run in every seed. Each run's scenario file and "
        "results.json are in bench/results/privacy/<scenario>/<setting>/ (seed 0) and "
        "bench/results/privacy/seed<k>/<scenario>/<setting>/ (seed k). The first tables are seed 0's "
        "full grid; the spread over the seeds follows them.",
        "",
        'FedeRiCo runs its default `peer_term = "auto"`: with privacy off (`off`) it pushes '
        "gradients as Alg. 1 does; under DP noise (every other setting) a push is ~98% noise "
        "(bench/push_snr.py), so its M-step takes the peer terms from the sampled peers' published "
        "models and it releases nothing (ε 0). Its rows that pushed under DP (4% / 5% of the gain "
        "kept at ε 5.6): `git show 187a7f8:bench/results/privacy.md`.",
        "",
    ]
    ran = {setting for rows in table.values() for r in rows.values() for setting in r}
    if not ran & {"sigma0", "sigma0.5", "sigma1", "sigma2"}:
        lines += [
            "The σ sweep (`--settings sigma1,sigma2`) is not in this version: it last ran on "
            "2026-11-26's code (`git show 5715be6:bench/results/privacy.md`), before FedeRiCo's and "
            "COBO's fixes, and was dropped rather than mixed with rows of the current code.",
            "",
        ]
    lines += ["## Seed 0, every setting run", ""]
    for sc, rows in table.items():
        local = rows.get("local", {}).get("off", {}).get("mean_acc")
        lines += [
            f"### {sc.upper()}" + (f" (local {_pct(local)})" if local is not None else ""),
            "",
            "| strategy | setting | mean acc % | kept | in-cluster mass | ε median / max |",
            "|---|---|---|---|---|---|",
        ]
        for strat in [s for s in rows if s != "local"]:
            for setting in SETTINGS:
                r = rows[strat].get(setting)
                if r is None:
                    continue
                kept = kept_share(rows, strat, setting)
                mass = (
                    "–"
                    if r["in_cluster_mass"] is None
                    else f"{r['in_cluster_mass']:.2f} ({r['in_cluster_chance']:.2f})"
                )
                eps = "–" if setting == "off" else f"{_eps(r['eps_median'])} / {_eps(r['eps_max'])}"
                kept_s = "–" if kept is None or setting == "off" else f"{100 * kept:.0f}%"
                lines.append(f"| {strat} | {LABELS[setting]} | {_pct(r['mean_acc'])} | {kept_s} | {mass} | {eps} |")
        lines.append("")
    return "\n".join(lines + seeds_markdown(agg or {}, seeds or []))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="s1,s3")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--strategies", default=",".join(PRIVATE_STRATEGIES))
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", default=None, help="comma list of seeds (overrides --seed); seed 0's runs stay in --out")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "privacy")
    ap.add_argument("--report", type=Path, default=ROOT / "bench" / "results" / "privacy.md")
    ap.add_argument(
        "--force",
        action="store_true",
        help="rerun --strategies where they already have results (other strategies' results are kept)",
    )
    ap.add_argument("--attempts", type=int, default=3, help="tries per strategy run (a start can time out)")
    ap.add_argument("--quiet", action="store_true", help="no live progress from coterie run")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    args.scenarios = args.scenarios.split(",")
    strategies = args.strategies.split(",")
    unknown = set(args.settings.split(",")) - set(SETTINGS)
    if unknown:
        ap.error(f"unknown setting(s) {sorted(unknown)}; known: {list(SETTINGS)}")
    seeds = [int(k) for k in args.seeds.split(",")] if args.seeds else [args.seed]
    accountant.warm()

    def report() -> str:  # every seed with results on disk (not only this invocation's)
        have = sorted({0, *seeds, *(int(p.name[4:]) for p in args.out.glob("seed*") if p.name[4:].isdigit())})
        tables = {k: t for k in have if (t := collect(args, k)) and any(rows for rows in t.values())}
        agg = across_seeds(tables) if len(tables) > 1 else {}
        md = markdown(tables.get(0, {}), args, agg, sorted(tables))
        args.report.write_text(md)
        args.report.with_suffix(".json").write_text(
            json.dumps({"per_seed": {str(k): t for k, t in tables.items()}, "across_seeds": agg}, indent=1, default=str)
        )
        return md

    if not args.report_only:
        for seed in seeds:
            for setting in args.settings.split(","):
                for sc in args.scenarios:
                    strats = (["local"] + strategies) if setting == "off" else strategies
                    run_setting(sc, setting, strats, args, seed)
                    report()  # after every run: a long job reports as it goes
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
