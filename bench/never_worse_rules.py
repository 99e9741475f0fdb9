"""The back-off's evidence, rule against rule (issue 33): on the same runs, what each decision
rule of ``node/collaboration_check.py`` would have done, judged on every node's audit set.

A rule decides only what a node *reports and exports* (its collaborative model or its twin); the
node trains, exchanges and publishes the same either way. So one run of ``bench/never_worse.py``
serves every rule: in the run's child process every node's check is shadowed by one check per
rule below, fed the very same validation figures and paired evidence at every check; at the end
each rule's last decision per node is stored beside the node's audit figures. A rule's gain on a
node is then its collaborative model's audit gain over the twin if that rule still collaborates,
0 if it backed off (it reports the twin). Runs are appended to ``never_worse_rules_runs.jsonl``.

    python bench/never_worse_rules.py sweep --networks sine-sgd,sine-adam,gaussian-perm --seeds 0,1
    python bench/never_worse_rules.py report
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import never_worse as nw  # noqa: E402

RUNS = nw.RESULTS / "never_worse_rules_runs.jsonl"
# name -> CollaborationCheck arguments besides patience (z = 1 unless said)
RULES: dict[str, dict[str, Any]] = {
    "unpaired": {"rule": "unpaired"},
    "paired-loss": {"rule": "paired", "paired_on": "loss"},
    "paired-acc": {"rule": "paired", "paired_on": "accuracy"},
    "paired-either": {"rule": "paired", "paired_on": "either"},
    "paired-loss-pool3": {"rule": "paired", "paired_on": "loss", "pool": 3},
    "paired-loss-z2": {"rule": "paired", "paired_on": "loss", "z": 2.0},
}
# Rules that pick one of RULES by the node's task (classification, regression): their decisions
# are those very checks', so they need no shadow of their own and apply to runs already stored.
BY_TASK: dict[str, dict[str, str]] = {"auto": {"acc": "paired-acc", "mse": "unpaired"}}
COLUMNS = [*RULES, *BY_TASK]


def _shadow_every_check() -> None:
    """Every CollaborationCheck in this process also feeds one check per rule (``_rules``)."""
    from coterie.node.collaboration_check import CollaborationCheck

    observe = CollaborationCheck.observe

    def observe_all(self: Any, collab: Any, local: Any, evidence: Any = None) -> bool:
        if not hasattr(self, "_rules"):
            self._rules = {name: CollaborationCheck(self.patience, **{"z": 1.0, **kw}) for name, kw in RULES.items()}
        for check in self._rules.values():
            observe(check, collab, local, evidence)
        return observe(self, collab, local, evidence)

    CollaborationCheck.observe = observe_all  # type: ignore[method-assign]

    audit_figures = nw.audit_figures

    def with_rules(nodes: list[Any], sets: list[Any]) -> dict[str, dict[str, Any]]:
        out = audit_figures(nodes, sets)
        for node in nodes:
            rules = getattr(node.reference.check, "_rules", {})
            out[node.node_id]["rules"] = {
                name: {"helping": c.helping, "switches": c.switches} for name, c in rules.items()
            }
        return out

    nw.audit_figures = with_rules


def rule_gain(n: dict[str, Any], rule: str) -> tuple[float, float, bool] | None:
    """(audit gain, its SE, backed off) of what ``rule`` would report on node ``n``."""
    rule = BY_TASK[rule][n["metric"]] if rule in BY_TASK else rule
    r = (n.get("rules") or {}).get(rule)
    if r is None or n.get("audit_collab_gain") is None:
        return None
    if r["helping"]:
        return n["audit_collab_gain"], n["audit_collab_se"], False
    return 0.0, 0.0, True  # the twin: its gain over itself


def table(rows: list[dict[str, Any]], network: str) -> list[str]:
    goal = nw.GOAL["mse" if network.startswith("sine") else "acc"]
    runs = [r for r in rows if r["network"] == network and "failed" not in r]
    if not runs:
        return []
    seeds = sorted({r["seed"] for r in runs})
    unit = "% MSE" if network.startswith("sine") else "points"
    out = [
        f"### `{network}` (seeds {','.join(map(str, seeds))}; gains in {unit}, goal ≥ {goal:+g})",
        "",
        "Worst node's audit gain per strategy (min over seeds), then per rule: real misses (gain + 2 SE "
        "below the goal) / wrong back-offs (backed off, collaborative model better by > 2 SE) / mean gain "
        "over all node runs; then the misses and wrong back-offs of each seed (seeds in order).",
        "",
        "| strategy | collab (no back-off) | " + " | ".join(COLUMNS) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    # per rule, per seed: [misses, wrong back-offs]; per rule: the gains of all node runs
    counts = {rule: {seed: [0, 0] for seed in seeds} for rule in COLUMNS}
    gains: dict[str, list[float]] = {rule: [] for rule in COLUMNS}
    for s in nw.ALL:
        rs = [r for r in runs if r["strategy"] == s]
        if not rs:
            continue
        cells = []
        cw = [
            min(n["audit_collab_gain"] for n in r["nodes"].values() if n.get("audit_collab_gain") is not None)
            for r in rs
        ]
        for rule in COLUMNS:
            worst = []
            for r in rs:
                gs = [g for g in (rule_gain(n, rule) for n in r["nodes"].values()) if g is not None]
                if not gs:
                    continue
                worst.append(min(g for g, _, _ in gs))
                c = counts[rule][r["seed"]]
                c[0] += sum(1 for g, se, _ in gs if g + 2 * se < goal)
                gains[rule] += [g for g, _, _ in gs]
                c[1] += sum(
                    1
                    for n in r["nodes"].values()
                    if (rg := rule_gain(n, rule)) is not None
                    and rg[2]
                    and n["audit_collab_gain"] - 2 * n["audit_collab_se"] > 0
                )
            cells.append(f"{min(worst):+.1f}" if worst else "—")
        out.append(f"| {s} | {min(cw):+.1f} | " + " | ".join(cells) + " |")

    def total(rule: str) -> str:
        per = counts[rule].values()
        return f"**{sum(m for m, _ in per)} / {sum(w for _, w in per)} / {statistics.mean(gains[rule]):+.2f}**"

    def spread(rule: str) -> str:
        per = counts[rule].values()
        return ",".join(str(m) for m, _ in per) + " / " + ",".join(str(w) for _, w in per)

    out.append("| **misses / wrong off / mean** | | " + " | ".join(total(r) for r in COLUMNS) + " |")
    out.append("| per seed: misses / wrong off | | " + " | ".join(spread(r) for r in COLUMNS) + " |")
    return out + [""]


def report() -> None:
    first: dict[tuple[str, str, int], dict[str, Any]] = {}  # two sweeps may meet on a run: its first success counts
    for r in (json.loads(x) for x in RUNS.read_text().splitlines() if x.strip()):
        key = (r["network"], r["strategy"], r["seed"])
        if key not in first or ("failed" in first[key] and "failed" not in r):
            first[key] = r
    rows = list(first.values())
    lines: list[str] = []
    for w in nw.NETWORKS:
        lines += table(rows, w)
    failed = [r for r in rows if "failed" in r]
    lines += [f"- failed: {r['network']} {r['strategy']} seed {r['seed']}: {r['failed']}" for r in failed]
    print("\n".join(lines))


def main() -> None:
    nw.hooked_main(
        __doc__,
        __file__,
        _shadow_every_check,
        RUNS,
        report,
        seeds="0,1",
        networks="sine-sgd,sine-adam,gaussian-perm",
        jobs=2,
        out="/tmp/never_worse_rules",
    )


if __name__ == "__main__":
    main()
