"""The blend's α over a run (issue 33): how often the default ``reference.predict = "blend"``
changes α between checks and by how much, and whether a hysteresis rule on α would do better,
judged on every node's audit set.

α (the blend's weight on the collaborative model, ``node/blend.py``) only decides what a node
predicts with; it never touches training or the exchange. So one plain ``never_worse.py`` run
(the default: blend in prediction space, chosen afresh at every check) serves every α rule:
in the run's child process every check's validation evidence is recorded per node — the check's
decision, the α it chose, every grid α's validation loss, and the paired standard error of the
per-sample loss difference between the best grid α and every other (``alpha_log``) — and at the end the blends
of the node's last models are scored on its audit set for every grid α (never_worse_blend's
``node_blends``). A rule replays the recorded checks, picks its last α, and gets that α's
audit gain over the twin. Rules (``RULES``):

- ``valopt``: the shipped rule, the lowest validation loss at every check (ties: the smaller α);
  it must reproduce the node's own α (checked: ``report`` counts mismatches);
- ``hyst``: keep the previous check's α unless the new best is lower by more than ``HYST_Z`` paired
  SE of the two α's per-sample validation losses; the first check after the start or after a
  back-off chooses freely (the check's back-off puts α at 0, as the node does);
- ``accfirst`` (classification): of the grid α with the highest validation accuracy, the lowest
  validation loss (the goal is in accuracy; the loss favours a flat collaborative model over an
  overconfident twin);
- ``sig``: the lowest validation loss only if it beats the twin's (α = 0) by more than ``HYST_Z``
  paired SE, else the twin (a difference the split cannot tell goes to the node's own model).

Per node, one diagnostic of the split's size (``val_misleads``): the share of random draws, as
many samples as its validation split, from its audit set on which collaboration and the twin
rank the other way round than on the whole audit set.

    nice -n 5 python bench/never_worse_alpha.py sweep --networks sine-sgd,sine-adam --seeds 0,1,2 --jobs 1
    python bench/never_worse_alpha.py report   # never_worse_alpha.md, never_worse_alpha.json
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
import never_worse_blend as nwb  # noqa: E402

RUNS = nw.RESULTS / "never_worse_alpha_runs.jsonl.xz"  # 25 MB as text, 6.7 MB gzipped
REPORT = nw.RESULTS / "never_worse_alpha.md"
CONFIG = nw.RESULTS / "never_worse_alpha.json"
HYST_Z = 1.0  # paired SEs by which a new α must beat the kept one
SMALL_SPLIT = 30  # validation splits up to this size record every check's per-sample losses


def _sig(x: float) -> float:
    return float(f"{x:.5g}") if math.isfinite(x) else x


def _se_from(best: int, losses: list[np.ndarray]) -> list[float]:
    """Paired SE of the per-sample loss difference between grid α ``best`` and every grid α
    (all a hysteresis rule needs: the new best against the α it holds)."""
    out = []
    for ls in losses:
        d = losses[best] - ls
        out.append(_sig(float(d.std(ddof=1) / math.sqrt(len(d)))) if len(d) > 1 else float("nan"))
    return out


def _hook() -> None:
    """Record every check's α evidence per node, then add it and the end-of-run blends
    (never_worse_blend) to the audit figures ``never_worse.child`` stores."""
    from coterie.node.local_reference import LocalReference

    judge = LocalReference.judge

    def recording_judge(self: Any, rnd: int, evaluation: Any, members: Any) -> Any:
        log = self.__dict__.setdefault("_alpha_log", [])
        captured: list[Any] = []
        if self.twin is None or rnd % self.cfg.check_every:
            return judge(self, rnd, evaluation, members)
        blends = self.learner.evaluate_blends

        def capture(*a: Any, **k: Any) -> Any:
            r = blends(*a, **k)
            captured.append(r)
            return r

        self.learner.evaluate_blends = capture  # this call only: the instance attribute goes after
        try:
            out = judge(self, rnd, evaluation, members)
        finally:
            del self.learner.evaluate_blends
        rec: dict[str, Any] = {"round": rnd, "check_helping": self.check.helping, "alpha": self.alpha}
        rec["rule"] = "accfirst" if getattr(self, "_accuracy_first", False) else "valopt"  # what the node ran
        if captured and all(r.losses is not None for r in captured[-1]):
            ls = [np.asarray(r.losses, dtype=np.float64) for r in captured[-1]]
            rec["val_loss"] = [_sig(float(r.loss)) for r in captured[-1]]
            if captured[-1][0].accuracy is not None:
                rec["val_acc"] = [_sig(float(r.accuracy)) for r in captured[-1]]
            rec["best"] = _argmin([float(r.loss) for r in captured[-1]])  # before rounding: the node's argmin
            rec["se_best"] = _se_from(rec["best"], ls)
            rec["se_twin"] = _se_from(0, ls)  # every α against the twin: a significance bar on any α
            if len(ls[0]) <= SMALL_SPLIT:  # per-sample losses: pooling across checks needs them (small splits)
                rec["val_losses"] = [[float(f"{x:.4g}") for x in a] for a in ls]
        log.append(rec)
        return out

    LocalReference.judge = recording_judge  # type: ignore[method-assign]
    nwb._hook()
    with_blends = nw.audit_figures

    def with_alpha(nodes: list[Any], sets: list[Any]) -> dict[str, dict[str, Any]]:
        from coterie.lab.audit import score_node

        out = with_blends(nodes, sets)
        for i, node in enumerate(nodes):
            out[node.node_id]["alpha_log"] = node.reference.__dict__.get("_alpha_log", [])
            log = out[node.node_id]["alpha_log"]
            n_val = node.learner.num_samples("val")
            sc = score_node(node, sets[i])
            if "twin" in sc and n_val > 0:
                out[node.node_id]["val_misleads"] = misleads(sc["collab"], sc["twin"], n_val, log, node)
        return out

    nw.audit_figures = with_alpha


MISLEAD_DRAWS = 2000


def misleads(collab: np.ndarray, twin: np.ndarray, n_val: int, log: Any, node: Any) -> float:
    """A diagnostic of the validation split's size: the share of random draws of ``n_val`` audit
    samples (the node's own distribution) on which the collaborative model looks at least as good
    as the twin although on the whole audit set it is not, or worse although it is better
    (per-sample squared error, or 1/0 correct; seeded by the node's id)."""
    task = node.model_card.get("task", "classification")
    d = (collab - twin) if task == "classification" else (twin - collab)  # + : collaboration better
    truth = float(d.mean()) >= 0
    rng = np.random.default_rng([sum(map(ord, node.node_id)), len(d)])
    idx = rng.integers(0, len(d), size=(MISLEAD_DRAWS, n_val))
    return float(np.mean((d[idx].mean(axis=1) >= 0) != truth))


# ----------------------------------------------------------------------------- rules on the log


def _argmin(xs: list[float]) -> int:
    finite = [(x, i) for i, x in enumerate(xs) if math.isfinite(x)]
    return min(finite)[1] if finite else 0


def _accfirst(rec: dict[str, Any]) -> int:
    """Classification: of the grid α with the highest validation accuracy, the lowest loss."""
    acc = rec.get("val_acc")
    if not acc:
        return rec["best"]
    top = max(acc)
    return min((rec["val_loss"][k], k) for k, a in enumerate(acc) if a == top)[1]


def replay(log: list[dict[str, Any]], rule: str, z: float = HYST_Z) -> list[int | None]:
    """The grid index of α a rule holds after each check (None: none chosen yet)."""
    held: int | None = None
    fresh = True  # the next check chooses freely (start, or just back from a back-off)
    out: list[int | None] = []
    for rec in log:
        if not rec["check_helping"]:
            held, fresh = 0, True
        elif "val_loss" in rec:
            best = rec["best"]
            if rule == "accfirst":
                held = _accfirst(rec)
            elif rule == "sig":
                held = best if rec["val_loss"][0] - rec["val_loss"][best] > z * rec["se_best"][0] else 0
            elif rule == "valopt" or fresh or held is None:
                held = best
            elif rec["val_loss"][best] < rec["val_loss"][held] - z * rec["se_best"][held]:
                held = best
            fresh = False
        out.append(held)
    return out


RULES = ("valopt", "hyst", "accfirst", "sig")


def rule_gain(n: dict[str, Any], rule: str) -> tuple[float, float] | None:
    """(audit gain over the twin, its SE) of the blend a rule ends on."""
    b, log = n.get("blend") or {}, n.get("alpha_log") or []
    if not b or not log:
        return None
    k = replay(log, rule)[-1]
    if k is None:  # never chose: the node predicts with its collaborative model
        return n["audit_collab_gain"], n["audit_collab_se"]
    return b["pred"]["audit_gain"][k], b["pred"]["audit_se"][k]


def changes(log: list[dict[str, Any]], held: list[int | None]) -> tuple[int, int, list[float]]:
    """(consecutive check pairs both collaborating, of them with α changed, |Δα| of each change)."""
    checks, moved, steps = 0, 0, []
    for i in range(1, len(log)):
        if not (log[i]["check_helping"] and log[i - 1]["check_helping"]):
            continue
        a, b = held[i - 1], held[i]
        if a is None or b is None:
            continue
        checks += 1
        if a != b:
            moved += 1
            steps.append(abs(a - b) / 10)
    return checks, moved, steps


def _q(xs: list[float]) -> str:
    if not xs:
        return "—"
    xs = sorted(xs)
    return f"{statistics.median(xs):.2g} [{xs[0]:.2g}, {xs[-1]:.2g}]"


def _goal(network: str) -> float:
    return nw.GOAL["mse" if network.startswith("sine") else "acc"]


def stability(runs: list[dict[str, Any]], w: str) -> tuple[list[str], dict[str, Any]]:
    """Per strategy: how often and how far α moves under each rule, the worst node per rule;
    per rule: real misses and mean gain per seed."""
    goal, seeds = _goal(w), sorted({r["seed"] for r in runs})
    head = (
        "| strategy | seeds | check pairs | "
        + " | ".join(f"moved ({r}) | size of Δα ({r})" for r in RULES)
        + " | "
        + " | ".join(f"worst ({r})" for r in RULES)
        + " |"
    )
    out = [
        f"### `{w}` (seeds {','.join(map(str, seeds))}; {len(runs)} runs)",
        "",
        head,
        "|---|---|---|" + "---|" * (3 * len(RULES)),
    ]
    tot = {rule: {"misses": {s: 0 for s in seeds}, "gains": {s: [] for s in seeds}} for rule in RULES}
    mismatch = 0
    all_moves: dict[str, list[Any]] = {rule: [0, 0, []] for rule in RULES}
    for s in nw.ALL:
        rs = [r for r in runs if r["strategy"] == s]
        if not rs:
            continue
        cnt = {rule: [0, 0, []] for rule in RULES}
        worst: dict[str, list[float]] = {rule: [] for rule in RULES}
        for r in rs:
            gs: dict[str, list[float]] = {rule: [] for rule in RULES}
            for n in r["nodes"].values():
                log = n.get("alpha_log") or []
                held = {rule: replay(log, rule) for rule in RULES}
                ran = ran_rule(log)
                if log and held[ran][-1] is not None and log[-1]["alpha"] is not None:
                    mismatch += abs(held[ran][-1] / 10 - log[-1]["alpha"]) > 1e-9
                for rule in RULES:
                    c, m, st = changes(log, held[rule])
                    cnt[rule][0] += c
                    cnt[rule][1] += m
                    cnt[rule][2] += st
                    g = rule_gain(n, rule)
                    if g is None:
                        continue
                    gs[rule].append(g[0])
                    tot[rule]["gains"][r["seed"]].append(g[0])
                    tot[rule]["misses"][r["seed"]] += g[0] + 2 * g[1] < goal
            for rule in RULES:
                if gs[rule]:
                    worst[rule].append(min(gs[rule]))
        for rule in RULES:
            for k in range(3):
                all_moves[rule][k] += cnt[rule][k]
        cells = [f"{cnt[r][1]} | {_q(cnt[r][2])}" for r in RULES]
        ws = [f"{min(worst[r]):+.1f}" if worst[r] else "—" for r in RULES]
        out.append(
            f"| {s} | {','.join(str(r['seed']) for r in rs)} | {cnt['valopt'][0]} | " + " | ".join(cells + ws) + " |"
        )
    out.append("")
    for rule in ("valopt", "hyst"):
        pairs, moved, sizes = all_moves[rule]
        if pairs:
            big = sum(x >= 0.5 for x in sizes)
            out.append(
                f"- α under `{rule}` moved between {moved} of {pairs} consecutive checks ({100 * moved / pairs:.0f} %); "
                f"size median {statistics.median(sizes) if sizes else 0:.2g}, ≥ 0.5 in {big} ({100 * big / pairs:.0f} % of pairs)"
            )
    for rule in RULES:
        t = tot[rule]
        per = [statistics.mean(t["gains"][s]) if t["gains"][s] else float("nan") for s in seeds]
        allg = [x for s in seeds for x in t["gains"][s]]
        out.append(
            f"- `{rule}`: real misses **{sum(t['misses'].values())}** "
            f"({','.join(str(t['misses'][s]) for s in seeds)}), mean gain "
            f"**{statistics.mean(allg) if allg else float('nan'):+.2f}** ({','.join(f'{x:+.2f}' for x in per)})"
        )
    summary = {
        rule: {
            "misses_per_seed": tot[rule]["misses"],
            "mean_gain_per_seed": {s: statistics.mean(v) if v else None for s, v in tot[rule]["gains"].items()},
        }
        for rule in RULES
    }
    summary["valopt_mismatches"] = mismatch
    return out + [""], summary


def _spread(xs: list[float]) -> str:
    if not xs:
        return "—"
    m = statistics.median(xs)
    return f"{m:+.1f}" if len(xs) == 1 else f"{m:+.1f} [{min(xs):+.1f}, {max(xs):+.1f}]"


SHIPPED = ("valopt", "accfirst")  # the rule the runs' nodes ran, and the one this change ships


def goal_table(ok: list[dict[str, Any]]) -> list[str]:
    """Per network and strategy, what a default node reports on its audit set under the rule the
    runs before 2026-11-29 ran (``valopt``) and the one shipped now (``accfirst``), both replayed on the same checks:
    worst node (min over seeds, with its SE), mean gain per seed (median [min, max]), real misses."""
    head = " | ".join(f"worst node (SE): {r} | mean per seed: {r} | real misses: {r}" for r in SHIPPED)
    out = [
        f"| network | strategy | seeds | {head} | goal ({SHIPPED[-1]}) |",
        "|---|---|---|" + "---|" * (3 * len(SHIPPED) + 1),
    ]
    for w in nw.NETWORKS:
        goal = _goal(w)
        for s in nw.ALL:
            rs = sorted((r for r in ok if r["network"] == w and r["strategy"] == s), key=lambda r: r["seed"])
            if not rs:
                continue
            cells, verdict = [], ""
            for rule in SHIPPED:
                means, real, floor = [], 0, (math.inf, 0.0)
                for r in rs:
                    gs = [g for g in (rule_gain(n, rule) for n in r["nodes"].values()) if g is not None]
                    if not gs:
                        continue
                    means.append(statistics.mean(g for g, _ in gs))
                    floor = min(floor, min(gs))
                    real += sum(g + 2 * se < goal for g, se in gs)
                cells.append(f"{floor[0]:+.1f} ({floor[1]:.1f}) | {_spread(means)} | {real}")
                verdict = "met" if floor[0] >= goal else ("within 2 SE" if real == 0 else f"**missed ({real})**")
            out.append(
                f"| {w} | {s} | {','.join(str(r['seed']) for r in rs)} | " + " | ".join(cells) + f" | {verdict} |"
            )
    return out + [""]


def ran_rule(log: list[dict[str, Any]]) -> str:
    """The α rule the node itself ran: recorded since the runs of 2026-11-29 (helper blendseeds);
    before, the runs that record ``se_twin`` ran main's ``accfirst``, the older ones ``valopt``."""
    for rec in reversed(log):
        if "rule" in rec:
            return str(rec["rule"])
        if "se_twin" in rec:
            return "accfirst"
    return "valopt"


def reported_mismatches(ok: list[dict[str, Any]]) -> int:
    """Nodes whose replayed audit gain under the rule they ran is not what the node itself
    reported (a check of the replay)."""
    bad = 0
    for r in ok:
        for n in r["nodes"].values():
            g = rule_gain(n, ran_rule(n.get("alpha_log") or []))
            if g is not None and n.get("audit_reported_gain") is not None:
                bad += abs(g[0] - n["audit_reported_gain"]) > 1e-6
    return bad


def miss_lines(ok: list[dict[str, Any]]) -> list[str]:
    """Every real miss under ``valopt`` (what the first runs ran) or ``accfirst`` (shipped now), with the evidence the
    node's validation split had at its last check."""
    out = []
    for r in sorted(ok, key=lambda r: (list(nw.NETWORKS).index(r["network"]), nw.ALL.index(r["strategy"]), r["seed"])):
        goal = _goal(r["network"])
        for nid, n in r["nodes"].items():
            gs = {rule: rule_gain(n, rule) for rule in SHIPPED}
            missed = [rule for rule, g in gs.items() if g is not None and g[0] + 2 * g[1] < goal]
            if not missed:
                continue
            log, b = n.get("alpha_log") or [], n.get("blend") or {}
            last = log[-1] if log else {}
            aud = b.get("pred", {}).get("audit_gain") or []
            fig = f"`{r['network']}` {r['strategy']} seed {r['seed']} {nid} (missed under {', '.join(missed)}): "
            fig += "; ".join(
                f"{rule} α {replay(log, rule)[-1] / 10:.1f}, {g[0]:+.1f} ± {g[1]:.1f}"
                for rule, g in gs.items()
                if g is not None and replay(log, rule)[-1] is not None
            )
            fig += f"; collab {n['audit_collab_gain']:+.1f}; run's in-cluster w {100 * (r.get('in_cluster_weight') or 0):.0f} %"
            if aud:
                best_a = max(range(len(aud)), key=aud.__getitem__)
                fig += f"; audit's best α {best_a / 10:.1f} ({aud[best_a]:+.1f})"
            if "val_loss" in last:
                vl = last["val_loss"]
                fig += (
                    f"; val (n={b.get('val_n')}) loss α=0 {vl[0]:.3g}, valopt's α {vl[last['best']]:.3g}"
                    f" (paired SE {last['se_best'][0]:.2g}), α=1 {vl[-1]:.3g}"
                )
                if last.get("val_acc"):
                    va = last["val_acc"]
                    fig += f"; val acc α=0 {va[0]:.2f}, valopt's α {va[last['best']]:.2f}, α=1 {va[-1]:.2f}"
                    fig += f" (audit acc: twin {n['audit_twin']:.2f}, collab {n['audit_collab']:.2f})"
            if n.get("val_misleads") is not None:
                fig += f"; a draw of its val size misleads {100 * n['val_misleads']:.0f} %"
            out.append("- " + fig)
    return out or ["- none"]


def report() -> None:
    rows = nw.run_lines(RUNS)
    ok = [r for r in rows if "failed" not in r]
    lines = [
        "# The blend's α over a run: how often it moves, and two other α rules (issue 33)",
        "",
        "`nice -n 5 python bench/never_worse_alpha.py sweep --networks … --seeds … --jobs 1` then "
        "`python bench/never_worse_alpha.py report` (method: the script's docstring). Every run is the "
        f'default node (`reference.predict = "blend"`, prediction space), {nw.ROUNDS} rounds, a check every '
        "round. Rules replayed on the recorded checks: `valopt` (shipped: lowest validation loss every "
        f"check), `hyst` (keep α unless the new best is lower by > {HYST_Z:g} paired SE), `accfirst` "
        "(classification: highest validation accuracy, then lowest loss), `sig` (the lowest validation "
        f"loss only if it beats the twin's by > {HYST_Z:g} paired SE, else the twin). `check pairs`: consecutive "
        "checks both collaborating; `moved`: of them, α changed; `size of Δα`: median [min, max] of the "
        "changes; `worst`: the worst node's audit gain (min over seeds). Real misses: audit gain + 2 SE "
        "below the goal (−1 point / −5 % MSE), per seed; mean gain over all node runs, per seed. Raw "
        "lines (every check's grid losses and paired SEs, the end's audit grid): "
        "`never_worse_alpha_runs.jsonl.xz`; config: `never_worse_alpha.json`.",
        "",
        "## What a default node reports, per network and strategy (audit set, gain over the twin)",
        "",
    ]
    lines += goal_table(ok)
    lines += ["## α between checks, and the rules", ""]
    summary: dict[str, Any] = {}
    for w in nw.NETWORKS:
        runs = [r for r in ok if r["network"] == w]
        if runs:
            t, summary[w] = stability(runs, w)
            lines += t
    mism = sum(v["valopt_mismatches"] for v in summary.values())
    lines.append(
        f"Replayed the rule each node ran (`valopt` before 2026-11-29's runs, `accfirst` since) against the α "
        f"it held at its last check: {mism} mismatches; its audit gain against what the node reported: "
        f"{reported_mismatches(ok)} mismatches."
    )
    lines += ["", "## Every real miss (`valopt` or `accfirst`), with its validation evidence at the last check", ""]
    lines += miss_lines(ok)
    lines += [
        f"- failed: {r['network']} {r['strategy']} seed {r['seed']}: {r['failed']}" for r in rows if "failed" in r
    ]
    REPORT.write_text("\n".join(lines) + "\n")
    cfg = {"rounds": nw.ROUNDS, "hyst_z": HYST_Z, "grid": nwb.GRID, "audit_size": nw.AUDIT_SIZE}
    cfg["mislead_draws"] = MISLEAD_DRAWS
    cfg["networks"] = {w: nw.NETWORKS[w][0]() for w in summary}
    CONFIG.write_text(json.dumps({**cfg, "summary": summary}, indent=1, default=str) + "\n")
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
        out="/tmp/never_worse_alpha",
    )


if __name__ == "__main__":
    main()
