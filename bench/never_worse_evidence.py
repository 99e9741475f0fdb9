"""More evidence than one small validation split for the blend's α (issue 33), replayed offline on
the runs ``never_worse_alpha.py`` recorded (``never_worse_alpha_runs.jsonl.xz``).

The shipped rule (``accfirst``, node/blend.py) picks α on the current check's validation split
alone. Each check scores the blends of the current models on the *same* samples, so evidence
pooled over checks cannot undo a split that misleads (it is the same split), but it does average
out the models' round-to-round noise. Rules (the check's own back-off still decides: a check that
backs off puts α at 0 and the pooling starts afresh from the next collaborating check):

- ``pool<λ>``: every grid α's validation loss (and accuracy) averaged over the checks since the
  last back-off, check t−k weighted λ^k (recent checks count more: the models move), then the
  shipped choice on the averages (classification: the most accurate, then the lowest loss);
- ``poolsig<λ>``: as ``pool<λ>``, and on a split of at most ``SMALL`` samples α leaves the twin only
  if the pooled per-sample loss difference twin − blend clears ``Z`` paired SE (needs the per-sample
  losses, recorded since this script's runs: older runs are left out of its comparison).

Per network and rule against ``accfirst`` on the same runs: real misses (audit gain + 2 SE below
the goal) and the mean audit gain per seed.

    python bench/never_worse_evidence.py     # never_worse_evidence.md, never_worse_evidence.json
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
import never_worse_alpha as nwa  # noqa: E402

RERUNS = nw.RESULTS / "never_worse_alpha_rerun_runs.jsonl.xz"  # cells rerun to record per-sample losses
REPORT = nw.RESULTS / "never_worse_evidence.md"
CONFIG = nw.RESULTS / "never_worse_evidence.json"
SMALL = 30  # the splits the significance bar applies to (the brief's "small": < 30 samples, and digits' 30)
Z = 1.0  # paired SEs the pooled difference must clear
RULES = {  # name: (λ, significance bar on small splits)
    "pool0.5": (0.5, False),
    "pool0.8": (0.8, False),
    "poolsig0.5": (0.5, True),
}
BASE = "accfirst"


def _pick(loss: np.ndarray, acc: np.ndarray | None) -> int:
    """The shipped choice on (pooled) figures: of the most accurate α, the lowest loss; ties to the twin."""
    ks = range(len(loss))
    if acc is not None:
        top = acc.max()
        ks = [k for k in ks if acc[k] >= top - 1e-12]
    return min((loss[k], k) for k in ks)[1]


def replay_pooled(log: list[dict[str, Any]], lam: float, bar: bool) -> int | None:
    """The grid index of α a pooled rule holds after the last check; -1 if the rule needs
    per-sample losses the run did not record."""
    held: int | None = None
    s_loss = s_acc = s_each = None
    w = 0.0
    for rec in log:
        if not rec["check_helping"]:  # the check backed off: the twin, and pooling starts afresh
            held, s_loss, s_acc, s_each, w = 0, None, None, None, 0.0
            continue
        if "val_loss" not in rec:
            continue
        loss = np.array([x if math.isfinite(x) else math.inf for x in rec["val_loss"]])
        acc = np.array(rec["val_acc"]) if rec.get("val_acc") else None
        s_loss = loss if s_loss is None else lam * s_loss + loss
        if acc is not None:
            s_acc = acc if s_acc is None else lam * s_acc + acc
        w = lam * w + 1.0
        k = _pick(s_loss / w, None if s_acc is None else s_acc / w)
        if bar:  # a small split: the pooled per-sample difference must clear Z paired SE
            if "val_losses" not in rec:
                return -1
            each = np.array(rec["val_losses"])
            s_each = each if s_each is None else lam * s_each + each
            if k > 0:
                d = (s_each[0] - s_each[k]) / w  # + : the blend's pooled loss is below the twin's
                n = d.size
                se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else math.inf
                if not float(d.mean()) > Z * se:
                    k = 0
        held = k
    return held


def gain(n: dict[str, Any], rule: str, large: bool) -> tuple[float, float] | None | str:
    """(audit gain, SE) a rule ends on; None: no blend recorded; "n/a": needs unrecorded data."""
    b, log = n.get("blend") or {}, n.get("alpha_log") or []
    if not b or not log:
        return None
    if rule == BASE:
        return nwa.rule_gain(n, rule)
    lam, bar = RULES[rule]
    if bar and large:
        bar = False  # the bar is for small splits only
    k = replay_pooled(log, lam, bar)
    if k == -1:
        return "n/a"
    if k is None:
        return n["audit_collab_gain"], n["audit_collab_se"]
    return b["pred"]["audit_gain"][k], b["pred"]["audit_se"][k]


def _misses(gains: list[tuple[float, float]], goal: float) -> int:
    """Real misses: audit gain + 2 SE below the goal."""
    return sum(g + 2 * se < goal for g, se in gains)


def compare(ok: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """Per network and rule: the runs the rule applies to, and on them real misses and mean gain
    per seed, the rule against ``accfirst``."""
    out = [
        "| network | rule | runs | seeds | real misses: accfirst → rule | mean gain per seed: accfirst | "
        "mean gain per seed: rule | change per seed | accfirst's spread over seeds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary: dict[str, Any] = {}
    for w in nw.NETWORKS:
        runs = [r for r in ok if r["network"] == w]
        if not runs:
            continue
        goal = nwa._goal(w)
        large = w in ("s1", "s3")
        for rule in RULES:
            per: dict[int, dict[str, list[Any]]] = {}
            napp = 0
            for r in runs:
                pairs = []
                for n in r["nodes"].values():
                    g0, g1 = gain(n, BASE, large), gain(n, rule, large)
                    if g0 is None or g1 is None:
                        continue
                    if g1 == "n/a":
                        pairs = None
                        break
                    pairs.append((g0, g1))
                if not pairs:
                    continue
                napp += 1
                d = per.setdefault(r["seed"], {"base": [], "rule": []})
                d["base"] += [p[0] for p in pairs]
                d["rule"] += [p[1] for p in pairs]
            if not per:
                out.append(f"| {w} | {rule} | 0 | — | — | — | — | — | — |")
                continue
            seeds = sorted(per)

            m0 = [_misses(per[s]["base"], goal) for s in seeds]
            m1 = [_misses(per[s]["rule"], goal) for s in seeds]
            g0 = [statistics.mean(g for g, _ in per[s]["base"]) for s in seeds]
            g1 = [statistics.mean(g for g, _ in per[s]["rule"]) for s in seeds]
            delta = [b - a for a, b in zip(g0, g1, strict=True)]
            spread = max(g0) - min(g0)
            out.append(
                f"| {w} | {rule} | {napp} | {','.join(map(str, seeds))} | {sum(m0)} → {sum(m1)} "
                f"({','.join(map(str, m0))} → {','.join(map(str, m1))}) | "
                + " | ".join(", ".join(f"{x:+.2f}" for x in xs) for xs in (g0, g1, delta))
                + f" | {spread:.2f} |"
            )
            summary.setdefault(w, {})[rule] = {
                "runs": napp,
                "seeds": seeds,
                "misses_accfirst": m0,
                "misses_rule": m1,
                "mean_gain_accfirst": g0,
                "mean_gain_rule": g1,
                "spread_accfirst": spread,
            }
    return out + [""], summary


def _key(r: dict[str, Any]) -> tuple[str, str, int]:
    return r["network"], r["strategy"], r["seed"]


def reruns(first: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The cells rerun to record per-sample losses (``RERUNS``), and how far a rerun's nodes ended
    from the first recording's (runs are not bit-for-bit repeatable if peers' messages arrive in
    another order)."""
    if not RERUNS.exists():
        return [], []
    again = [r for r in nw.run_lines(RERUNS) if "failed" not in r]
    by_key = {_key(r): r for r in first}
    diffs = []
    for r in again:
        if _key(r) not in by_key:
            continue
        for nid, n in r["nodes"].items():
            a, b = nwa.rule_gain(by_key[_key(r)]["nodes"].get(nid, {}), BASE), nwa.rule_gain(n, BASE)
            if a is not None and b is not None:
                diffs.append(abs(a[0] - b[0]))
    note = []
    if diffs:
        same = sum(d < 1e-9 for d in diffs)
        note = [
            f"{len(again)} cells rerun (`{RERUNS.name}`): `{BASE}`'s audit gain per node, rerun against "
            f"the first recording: {same} of {len(diffs)} identical, |difference| median "
            f"{statistics.median(diffs):.2f}, max {max(diffs):.2f}.",
            "",
        ]
    return again, note


def main() -> None:
    ok = [r for r in nw.run_lines(nwa.RUNS) if "failed" not in r]
    table, summary = compare(ok)
    again, note = reruns(ok)
    table2, summary2 = compare(again) if again else ([], {})
    lines = [
        "# More evidence than one validation split: α pooled over checks (issue 33)",
        "",
        "`python bench/never_worse_evidence.py` (method: the script's docstring), replayed on "
        "`never_worse_alpha_runs.jsonl.xz`. Against the shipped rule (`accfirst`) on the same runs: "
        "real misses (audit gain + 2 SE below −1 point / −5 % MSE) per seed, mean audit gain over the "
        f"node runs of each seed. `poolsig` applies its bar (> {Z:g} pooled paired SE) on splits of at most "
        f"{SMALL} samples and needs their per-sample losses: only runs that recorded them count.",
        "",
    ]
    lines += ["## On the alpha runs (`never_worse_alpha_runs.jsonl.xz`)", ""] + table
    if again:
        lines += ["## On the cells rerun with per-sample losses (sine-sgd, sine-adam, gaussian-perm seeds 0-2)", ""]
        lines += note + table2
    REPORT.write_text("\n".join(lines) + "\n")
    cfg = {
        "rules": RULES,
        "base": BASE,
        "small": SMALL,
        "z": Z,
        "runs": str(nwa.RUNS.name),
        "summary": summary,
        "summary_reruns": summary2,
    }
    CONFIG.write_text(json.dumps(cfg, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
