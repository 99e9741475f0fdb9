"""Blend instead of choose (issue 33): on the same runs as ``bench/never_worse.py``, what a node
would get on its audit set if it predicted with a *blend* of its collaborative model and its
local-only twin, with the blend's weight α (on the collaborative model) set from its validation
split, instead of the binary collaborate-or-back-off decision.

Two blends, each on a grid α ∈ {0, 0.1, ..., 1} (α = 1: the collaborative model, α = 0: the twin):

- ``pred``: prediction space, α·p(y|x; collab) + (1−α)·p(y|x; twin) — softmax probabilities, or
  outputs for regression (``MixtureModel``'s rule; a mixture's members keep their weights × α);
- ``weight``: weight space, one model α·θ_collab + (1−α)·θ_twin (both start from the same θ⁰;
  a strategy that predicts with a mixture blends each member with the twin, weights kept).

At the end of each run (the node's last state, what it would export), for every node and every α
of both grids: the blend's loss on the node's validation split (the learner's loss, what the
node could use to choose α) and its gain over the twin on the node's audit set with the paired SE
(``lab/audit.py``), plus the paired t of collab − twin on validation. The α rules are then
applied in ``report`` from those stored figures (no rerun per rule; ``ALPHA_RULES``), so every
rule is judged on the *same* runs. The run itself is the plain ``never_worse.py`` run (the node's
own decision, ``reported``, is today's default back-off).

    nice -n 5 python bench/never_worse_blend.py sweep --networks sine-sgd,sine-adam --seeds 0,1,2 --jobs 1
    python bench/never_worse_blend.py report   # never_worse_blend.md (tables), never_worse_blend.json
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import never_worse as nw  # noqa: E402

RUNS = nw.RESULTS / "never_worse_blend_runs.jsonl"
CONFIG = nw.RESULTS / "never_worse_blend.json"
REPORT = nw.RESULTS / "never_worse_blend.md"
GRID = [round(0.1 * k, 1) for k in range(11)]  # α on the collaborative model
KINDS = ("pred", "weight")
SHRINK_T = 2.0  # |t| (paired, collab − twin on validation) at which the chosen α is no longer shrunk

Members = list[tuple[str, float, dict[str, Any]]]


def blend_members(kind: str, collab: Members, twin: Members, alpha: float) -> Members:
    """The blend as a member list (``lab/audit._model`` and ``evaluate_mixture`` take it)."""
    (tid, _, tp) = twin[0]
    if kind == "pred":
        return [(i, alpha * w, p) for i, w, p in collab] + [(tid, 1.0 - alpha, tp)]
    return [(i, w, {k: alpha * v + (1.0 - alpha) * tp[k] for k, v in p.items()}) for i, w, p in collab]


def node_blends(node: Any, audit: Any) -> dict[str, Any]:
    """One live node's blends on its validation split and its audit set, every α of GRID."""
    from coterie.lab.audit import _model, node_models, paired_gain, per_sample

    ms = node_models(node)
    if "twin" not in ms:
        return {}
    card = {"format": "coterie-model/1", **node.model_card}
    task = card.get("task", "classification")
    twin_audit = per_sample(_model(card, ms["twin"]), audit, task)
    out: dict[str, Any] = {}
    val_c = node.learner.evaluate_mixture([(w, p) for _, w, p in ms["collab"]], "val")
    val_t = node.learner.evaluate_mixture([(1.0, ms["twin"][0][2])], "val")
    if val_c.losses is not None and val_t.losses is not None and len(val_c.losses) > 1:
        d = np.asarray(val_c.losses) - np.asarray(val_t.losses)
        se = float(d.std(ddof=1) / math.sqrt(len(d)))
        out["val_t"] = float(d.mean() / se) if se > 0 else 0.0
        out["val_n"] = len(d)
    for kind in KINDS:
        vl, ag, ase = [], [], []
        for a in GRID:
            members = blend_members(kind, ms["collab"], ms["twin"], a)
            vl.append(float(node.learner.evaluate_mixture([(w, p) for _, w, p in members if w > 0], "val").loss))
            g, se = paired_gain(
                per_sample(_model(card, [m for m in members if m[1] > 0]), audit, task), twin_audit, task
            )
            ag.append(g)
            ase.append(se)
        out[kind] = {"val_loss": vl, "audit_gain": ag, "audit_se": ase}
    return out


def _hook() -> None:
    """Add every node's blends to the audit figures ``never_worse.child`` stores."""
    audit_figures = nw.audit_figures

    def with_blends(nodes: list[Any], sets: list[Any]) -> dict[str, dict[str, Any]]:
        out = audit_figures(nodes, sets)
        for i, node in enumerate(nodes):
            out[node.node_id]["blend"] = node_blends(node, sets[i])
        return out

    nw.audit_figures = with_blends


# ----------------------------------------------------------------------------- rules on stored figures


def _argmin(xs: list[float]) -> int:
    finite = [(x, i) for i, x in enumerate(xs) if math.isfinite(x)]
    return min(finite)[1] if finite else 0


def _on_grid(alpha: float) -> int:
    return int(round(alpha * 10))


def alpha_valopt(b: dict[str, Any], kind: str) -> int:
    """The α of GRID with the lowest validation loss (ties: the smaller α, the twin's side)."""
    return _argmin(b[kind]["val_loss"])


def alpha_shrunk(b: dict[str, Any], kind: str) -> int:
    """valopt's α shrunk toward 0.5 by how little validation can tell the two models apart:
    α = 0.5 + s·(α* − 0.5), s = min(1, |t| / SHRINK_T), t the paired t of the per-sample
    validation loss differences collab − twin; rounded to GRID."""
    a = GRID[alpha_valopt(b, kind)]
    s = min(1.0, abs(b.get("val_t", 0.0)) / SHRINK_T)
    return _on_grid(0.5 + s * (a - 0.5))


def alpha_doubt(b: dict[str, Any], kind: str) -> int:
    """0.5 when validation cannot tell (|t| ≤ 1), else the side it points to (t > 1: the twin)."""
    t = b.get("val_t", 0.0)
    return 5 if abs(t) <= 1 else (0 if t > 0 else 10)


# name -> (how it picks, from a node's stored figures: ("kind", α index) or a fixed gain source)
ALPHA_RULES = {
    "valopt": alpha_valopt,
    "shrunk": alpha_shrunk,
    "doubt": alpha_doubt,
    "0.5": lambda b, kind: 5,
}


def rule_gain(n: dict[str, Any], rule: str) -> tuple[float, float] | None:
    """(audit gain over the twin, its SE) of what ``rule`` predicts with on node ``n``.
    Rules: ``reported`` (today: the node's own back-off), ``collab``, ``twin``,
    ``<kind>-<alpha rule>``, and three on top of today's decision: ``backoff-<kind>-0.5`` (backed
    off to the 0.5 blend instead of the twin), ``on-<kind>-valopt`` (collaborating: the valopt
    blend; backed off: the twin) and ``off-<kind>-valopt`` (collaborating: the collaborative model;
    backed off: the valopt blend)."""
    b = n.get("blend") or {}
    if n.get("audit_collab_gain") is None or not b:
        return None
    if rule == "reported":
        return n["audit_reported_gain"], n["audit_reported_se"]
    if rule == "collab":
        return n["audit_collab_gain"], n["audit_collab_se"]
    if rule == "twin":
        return 0.0, 0.0
    if rule.startswith(("on-", "off-")):
        side, kind, _ = rule.split("-")
        if (n.get("helping") is not False) == (side == "on"):  # the side the blend replaces
            k = alpha_valopt(b, kind)
            return b[kind]["audit_gain"][k], b[kind]["audit_se"][k]
        if side == "on":
            return 0.0, 0.0
        return n["audit_collab_gain"], n["audit_collab_se"]
    if rule.startswith("backoff-"):
        kind = rule.split("-")[1]
        if n.get("helping") is not False:
            return n["audit_collab_gain"], n["audit_collab_se"]
        return b[kind]["audit_gain"][5], b[kind]["audit_se"][5]
    kind, how = rule.split("-", 1)
    k = ALPHA_RULES[how](b, kind)
    return b[kind]["audit_gain"][k], b[kind]["audit_se"][k]


COLUMNS = [
    "reported",
    "collab",
    *(f"{kind}-{how}" for kind in KINDS for how in ALPHA_RULES),
    *(f"backoff-{kind}-0.5" for kind in KINDS),
    *(f"{side}-{kind}-valopt" for side in ("on", "off") for kind in KINDS),
]


def table(rows: list[dict[str, Any]], network: str) -> tuple[list[str], dict[str, Any]]:
    goal = nw.GOAL["mse" if network.startswith("sine") else "acc"]
    runs = [r for r in rows if r["network"] == network and "failed" not in r]
    if not runs:
        return [], {}
    seeds = sorted({r["seed"] for r in runs})
    unit = "% MSE" if network.startswith("sine") else "points"
    per_strategy = sorted({r["strategy"] for r in runs}, key=nw.ALL.index)
    counted = {s: sorted(r["seed"] for r in runs if r["strategy"] == s) for s in per_strategy}
    out = [
        f"### `{network}` (seeds {','.join(map(str, seeds))}; gains in {unit}, goal ≥ {goal:+g}; "
        f"{len(runs)} runs, {sum(len(r['nodes']) for r in runs)} node runs)",
        "",
        "Runs per strategy (seeds): " + "; ".join(f"{s} {','.join(map(str, v))}" for s, v in counted.items()),
        "",
        "| strategy | " + " | ".join(COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    stats: dict[str, Any] = {c: {"misses": {sd: 0 for sd in seeds}, "gains": [], "thrown": 0.0} for c in COLUMNS}
    kept_base = 0.0
    for s in per_strategy:
        cells = []
        rs = [r for r in runs if r["strategy"] == s]
        for c in COLUMNS:
            worst = []
            for r in rs:
                gs = [(n, rule_gain(n, c)) for n in r["nodes"].values()]
                gs = [(n, g) for n, g in gs if g is not None]
                if not gs:
                    continue
                worst.append(min(g for _, (g, _) in gs))
                st = stats[c]
                st["misses"][r["seed"]] += sum(1 for _, (g, se) in gs if g + 2 * se < goal)
                st["gains"] += [g for _, (g, _) in gs]
                # gain thrown away: of node runs where collaboration is really better (> 2 SE)
                st["thrown"] += sum(
                    max(0.0, n["audit_collab_gain"] - g)
                    for n, (g, _) in gs
                    if n["audit_collab_gain"] - 2 * n["audit_collab_se"] > 0
                )
            cells.append(f"{min(worst):+.1f}" if worst else "—")
        out.append(f"| {s} | " + " | ".join(cells) + " |")
    for r in runs:
        kept_base += sum(
            n["audit_collab_gain"]
            for n in r["nodes"].values()
            if n.get("blend") and n["audit_collab_gain"] - 2 * n["audit_collab_se"] > 0
        )

    def cell(c: str, what: str) -> str:
        st = stats[c]
        if what == "misses":
            return f"**{sum(st['misses'].values())}** ({','.join(str(st['misses'][sd]) for sd in seeds)})"
        if what == "mean":
            per_seed = []
            for sd in seeds:
                g = [
                    rule_gain(n, c)[0]  # type: ignore[index]
                    for r in runs
                    if r["seed"] == sd
                    for n in r["nodes"].values()
                    if rule_gain(n, c) is not None
                ]
                per_seed.append(statistics.mean(g) if g else float("nan"))
            return f"**{statistics.mean(st['gains']):+.2f}** (" + ",".join(f"{x:+.1f}" for x in per_seed) + ")"
        share = 100 * st["thrown"] / kept_base if kept_base > 0 else float("nan")
        return f"{st['thrown']:.0f} ({share:.0f} %)"

    out.append("| **real misses** (per seed) | " + " | ".join(cell(c, "misses") for c in COLUMNS) + " |")
    out.append("| **mean gain** (per seed) | " + " | ".join(cell(c, "mean") for c in COLUMNS) + " |")
    out.append("| gain thrown away (share) | " + " | ".join(cell(c, "thrown") for c in COLUMNS) + " |")
    summary = {
        c: {
            "misses_per_seed": stats[c]["misses"],
            "mean_gain": statistics.mean(stats[c]["gains"]),
            "thrown": stats[c]["thrown"],
            "collab_gain_available": kept_base,
        }
        for c in COLUMNS
    }
    return out + [""], summary


def report() -> None:
    rows = [json.loads(x) for x in RUNS.read_text().splitlines() if x.strip()]
    lines: list[str] = []
    summary: dict[str, Any] = {}
    for w in nw.NETWORKS:
        t, s = table(rows, w)
        lines += t
        if s:
            summary[w] = s
    lines += [
        f"- failed: {r['network']} {r['strategy']} seed {r['seed']}: {r['failed']}" for r in rows if "failed" in r
    ]
    config = {
        "rounds": nw.ROUNDS,
        "grid": GRID,
        "shrink_t": SHRINK_T,
        "audit_size": nw.AUDIT_SIZE,
        "columns": COLUMNS,
        "networks": {w: nw.NETWORKS[w][0]() for w in summary},
        "summary": summary,
    }
    CONFIG.write_text(json.dumps(config, indent=1, default=str) + "\n")
    head = [
        "# Blend instead of choose: every α rule on the audit set, same runs (issue 33)",
        "",
        "`nice -n 5 python bench/never_worse_blend.py sweep --seeds 0,1,2 --jobs 1` then "
        "`python bench/never_worse_blend.py report` (method: the script's docstring; the reading and "
        "the decision: `never_worse.md`, section *Blend instead of choose*). Per network: the worst "
        "node's audit gain over its twin per strategy (min over seeds), then per rule the real misses "
        "(gain + 2 SE below the goal; per seed), the mean gain over all node runs (per seed), and the "
        "gain thrown away: the sum over node runs whose collaborative model is better than the twin by "
        "> 2 SE of how much less than that model the rule gets (its share of those runs' gain; over "
        "100 % where the rule ends below the twin there). Rules: `reported` today's back-off (what the "
        "node reported in the run); `collab` no back-off; `<space>-<α>` a blend in prediction (`pred`) "
        "or weight space, α: `valopt` the grid point (0, 0.1, ..., 1) of lowest validation loss, "
        f"`shrunk` valopt's α shrunk toward 0.5 by min(1, |t|/{SHRINK_T:g}) (t: paired t of the "
        "validation loss differences collab − twin), `doubt` 0.5 if |t| ≤ 1 else the side t points "
        "to, `0.5`; on top of today's decision: `backoff-<space>-0.5` backed off to the 0.5 blend, "
        "`on-<space>-valopt` collaborating with the valopt blend (backed off: the twin), "
        "`off-<space>-valopt` backed off to the valopt blend. Raw lines: `never_worse_blend_runs.jsonl`; "
        "config and summary: `never_worse_blend.json`.",
        "",
    ]
    REPORT.write_text("\n".join(head + lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    nw.hooked_main(
        __doc__,
        __file__,
        _hook,
        RUNS,
        report,
        seeds="0,1,2",
        networks="sine-sgd,sine-adam,gaussian-perm,digits-perm,s2",
        jobs=1,
        out="/tmp/never_worse_blend",
    )


if __name__ == "__main__":
    main()
