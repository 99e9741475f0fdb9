"""Collect the paper reproductions (bench/results/papers_*.json) into bench/results/papers.md.

    python bench/papers/collect.py

Each reproduction is a script in bench/papers/ with a ``--seed``; it writes its full config and
results to bench/results/papers_<name>.json and prints "paper says / we get". This renders them
in one page, with each script's own description of the setting.
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parents[1] / "bench" / "results"
sys.path.insert(0, str(HERE.parent))
from strategy_bench import mean_ci  # noqa: E402  (bench/ is not a package)

ORDER = ["federico_fig1", "cobo_fig3", "l2c_fig4", "scool_fig6a", "fedfomo_fig2"]
# seed files written before Run.write named them papers_<name>_s<k>.json (same script and config)
ALIASES = {"federico_fig1": "fidelity_federico_fig1_s{seed}.json"}


def _last(d: dict[str, Any]) -> Any:
    return d[max(d, key=int)]


def _at(d: dict[str, Any], rnd: int) -> Any:
    return d.get(str(rnd), d.get(rnd))  # type: ignore[call-overload]


# The figures each claim rests on, per seed: (label, value from the run's summary). Accuracies in %.
FIGURES: dict[str, list[tuple[str, Callable[[dict[str, Any]], Any]]]] = {
    "federico_fig1": [
        ("weight on self + adjacent intervals (uniform 0.34)", lambda s: s["weight_on_self_and_adjacent"]),
        ("top peer is an adjacent interval (share of clients)", lambda s: s["top_peer_is_adjacent"]),
        ("test MSE federico", lambda s: s["test_mse"]["federico"]),
        ("test MSE local", lambda s: s["test_mse"]["local"]),
        ("test MSE D-PSGD (one consensus model)", lambda s: s["test_mse"]["dpsgd"]),
        ("clients where federico's MSE is below local's", lambda s: s["federico_beats_local_share"]),
    ],
    "cobo_fig3": [
        ("steps run", lambda s: s["steps_run"]),
        ("first step in-cluster W − cross W > 0.1", lambda s: s["steps_first_separating"]),
        ("first step mean cross-cluster W < 0.5", lambda s: s["steps_cross_below_half"]),
        ("first step every node ranks its mates first", lambda s: s["steps_first_ranked"]),
        ("first step W matches the oracle matrix", lambda s: s["steps_first_oracle_match"]),
        ("mean cross-cluster W at 600 steps (S1's budget)", lambda s: s["at_600_steps"]["W_cross"]),
        ("accuracy % at 600 steps", lambda s: 100 * s["at_600_steps"]["acc"]),
        ("mean cross-cluster W at the end", lambda s: s["final"]["W_cross"]),
        ("accuracy % at the end", lambda s: 100 * s["final"]["acc"]),
    ],
    "l2c_fig4": [
        *[
            (
                f"{m}: in-cluster share at round {r}" + (" (before pruning)" if r <= 10 else ""),
                (lambda s, m=m, r=r: _at(s[m]["in_cluster_mass"], r)),
            )
            for m in ("l2c", "meta-l2c")
            for r in (2, 10)
        ],
        *[
            (f"{m}: kept neighbours of the same task", (lambda s, m=m: s[m]["kept_correct"]))
            for m in ("l2c", "meta-l2c")
        ],
        *[(f"{m}: final accuracy %", (lambda s, m=m: 100 * s[m]["final_acc"])) for m in ("l2c", "meta-l2c", "local")],
    ],
    "scool_fig6a": [
        *[
            (f"{m}: L1 to the true graph at round {r}", (lambda s, m=m, r=r: _at(s[m]["l1"], r)))
            for m in ("scool-sbm", "scool-attention")
            for r in (5, 10)
        ],
        *[(f"{m}: L1 at the end", (lambda s, m=m: _last(s[m]["l1"]))) for m in ("scool-sbm", "scool-attention")],
        ("L1 of uniform weights (reference)", lambda s: s["l1_uniform_weights"]),
        *[
            (f"{m}: final accuracy %", (lambda s, m=m: 100 * s[m]["final_acc"]))
            for m in ("scool-sbm", "scool-attention")
        ],
    ],
    "fedfomo_fig2": [
        ("affinity AUROC (same cluster vs other) at round 5", lambda s: _at(s["affinity_auroc"], 5)),
        ("affinity AUROC at the end", lambda s: _last(s["affinity_auroc"])),
        ("in-cluster share of the weights used, at the end", lambda s: _last(s["in_cluster_used_weights"])),
        ("fedfomo final accuracy %", lambda s: 100 * s["final_acc"]),
        ("local final accuracy %", lambda s: 100 * s["local_acc"]),
        ("clients where fedfomo beats local", lambda s: s["beats_local_share"]),
    ],
}


def seed_runs(name: str) -> dict[int, dict[str, Any]]:
    """Every stored seed of one reproduction: papers_<name>.json (its own seed) and papers_<name>_s<k>.json."""
    runs: dict[int, dict[str, Any]] = {}
    paths = [RESULTS / f"papers_{name}.json", *sorted(RESULTS.glob(f"papers_{name}_s*.json"))]
    if name in ALIASES:
        paths += sorted(RESULTS.glob(ALIASES[name].format(seed="*")))
    for path in paths:
        if path.exists():
            r = json.loads(path.read_text())
            runs.setdefault(int(r["config"].get("seed", 0)), r)
    return dict(sorted(runs.items()))


def fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1 else f"{v:.1f}"
    return str(v)


def seeds_table(name: str, runs: dict[int, dict[str, Any]]) -> list[str]:
    seeds = list(runs)
    lines = [
        f"Across seeds {seeds} (mean ± 95% CI, Student t over the seeds; `–`: never within the run):",
        "",
        "| figure | " + " | ".join(f"seed {k}" for k in seeds) + " | mean ± 95% CI |",
        "|---|" + "---|" * len(seeds) + "---|",
    ]
    for label, get in FIGURES.get(name, []):
        vals = []
        for r in runs.values():
            try:
                vals.append(get(r["summary"]))
            except (KeyError, TypeError):
                vals.append(None)
        nums = [float(v) for v in vals if v is not None]
        if len(nums) >= 2:
            m, h = mean_ci(nums)
            agg = f"{fmt(m)} ± {fmt(h)}" + ("" if len(nums) == len(vals) else f" ({len(nums)} of {len(vals)})")
        else:
            agg = "–" if not nums else "(one seed)"
        lines.append(f"| {label} | " + " | ".join(fmt(v) for v in vals) + f" | {agg} |")
    return lines + [""]


def doc(name: str) -> str:
    src = (HERE / f"{name}.py").read_text()
    text = ast.get_docstring(ast.parse(src)) or ""
    return text.split("\n\n    python")[0].strip()


def main() -> None:
    lines = [
        "# The papers' claims, reproduced",
        "",
        "One script per paper in `bench/papers/` (scaled to a 2-core CPU box; every script takes "
        "`--seed` and writes its config and results to `bench/results/papers_<name>.json`). All run "
        "in-process: real `TorchLearner`s on real partitions with the strategies' code, peer calls "
        "through the strategy test harness's network (`tests/strategy_harness.py`), not gRPC. "
        "Regenerate this page with `python bench/papers/collect.py`. Each section shows seed 0's "
        "run in words, then the figures behind its claims for every seed run, with their spread.",
        "",
    ]
    for name in ORDER:
        path = RESULTS / f"papers_{name}.json"
        if not path.exists():
            lines += [f"## {name}", "", "_not run yet_", ""]
            continue
        r = json.loads(path.read_text())
        cfg = r["config"]
        lines += [
            f"## {name}",
            "",
            doc(name),
            "",
            f"Run: `python bench/papers/{name}.py --seed {cfg.get('seed')}` — {r['wall_s']:.0f} s wall "
            f"({cfg.get('harness', 'in-process')}).",
            "",
            "| paper says | we get |",
            "|---|---|",
        ]
        for c in r["claims"]:
            lines.append(f"| {c['paper']} | {c['we']} |")
        lines.append("")
        lines += seeds_table(name, seed_runs(name))
    (RESULTS / "papers.md").write_text("\n".join(lines))
    print("wrote", RESULTS / "papers.md")


if __name__ == "__main__":
    main()
