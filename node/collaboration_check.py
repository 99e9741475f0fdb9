"""Is collaboration helping this node? The decision alone (no model, no I/O), so it can be tested
on numbers: each check compares what the node predicts by collaborating with its local-only
reference on the *validation* split (``local_reference.py`` measures both).

Worse means beyond the split's noise. Three rules (``reference.rule``):

- ``paired`` (the two models are scored on the same samples, so their per-sample differences
  d_i = loss_collab,i − loss_local,i carry the evidence): worse when mean(d) > z · sd(d)/√n. The
  loss is the learner's (cross-entropy, squared error): far more information per sample than 0/1
  accuracy, and for regression a noise-based margin instead of a fixed share. ``paired_on``
  picks, for classification, the loss, the paired 0/1 errors (never less than one sample, 1/n)
  or either. ``pool`` > 1 averages mean(d) over the last checks: the same validation samples
  are reused, so that averages out training noise between rounds, not the split's sampling noise
  (the SE is not divided by it). Without per-sample figures (a learner that gives none) a check
  falls back to the unpaired rule;
- ``unpaired`` (the rule before): accuracy below the local one by more than ``z`` standard errors
  of the difference of two accuracies measured on ``n`` samples (at least one sample's worth:
  1/n); a loss (regression) above the local one by more than ``mse_margin`` of it;
- ``auto``: chosen by task: ``paired`` on the 0/1 errors for classification, ``unpaired`` for
  regression (the paired loss test, noisy on 9-11 validation samples, lets more of the sine
  networks' real losses through than the fixed margin). Not the default: on gaussian-perm over 3
  seeds it has fewer real misses but as many more wrong back-offs (bench/results/never_worse_rules.md).

Hysteresis: ``patience`` worse checks in a row back off; ``patience`` checks in a row where
collaboration is at least as good as local come back. Between the two (worse, but within noise)
the node stays where it is, so it does not flip on every check."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

Rule = Literal["paired", "unpaired", "auto"]
PairedOn = Literal["loss", "accuracy", "either"]


@dataclass(frozen=True)
class Score:
    """One model's score on the validation split."""

    loss: float
    accuracy: float | None  # None: regression
    n: int


@dataclass(frozen=True)
class Paired:
    """How much worse collaboration is than local on the same validation samples: the mean and
    standard error of the per-sample loss differences (collab − local) and of the 0/1 error
    differences (local correct − collab correct; None for regression)."""

    loss: float
    loss_se: float
    err: float | None
    err_se: float | None
    n: int


def _mean_se(d: np.ndarray) -> tuple[float, float]:
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.inf


def paired(
    collab_losses: np.ndarray,
    local_losses: np.ndarray,
    collab_correct: np.ndarray | None = None,
    local_correct: np.ndarray | None = None,
) -> Paired | None:
    """The paired evidence of two models scored on the same samples; None where there is none
    (no samples, different lengths, a non-finite loss: the check then uses the unpaired rule)."""
    c, lo = np.asarray(collab_losses, dtype=np.float64), np.asarray(local_losses, dtype=np.float64)
    if len(c) == 0 or c.shape != lo.shape or not (np.isfinite(c).all() and np.isfinite(lo).all()):
        return None
    loss, loss_se = _mean_se(c - lo)
    err = err_se = None
    if collab_correct is not None and local_correct is not None and len(collab_correct) == len(c):
        err, err_se = _mean_se(np.asarray(local_correct, np.float64) - np.asarray(collab_correct, np.float64))
    return Paired(loss, loss_se, err, err_se, len(c))


def accuracy_margin(collab: float, local: float, n: int, z: float) -> float:
    """z standard errors of (collab - local), each a binomial proportion on n samples; never
    less than one sample (1/n), so a split of n samples cannot call one sample's difference real."""
    se = math.sqrt(max(collab * (1 - collab) + local * (1 - local), 0.0) / max(n, 1))
    return max(z * se, 1.0 / max(n, 1))


class CollaborationCheck:
    def __init__(
        self,
        patience: int = 3,
        z: float = 1.0,
        mse_margin: float = 0.1,
        rule: Rule = "unpaired",
        paired_on: PairedOn = "loss",
        pool: int = 1,
    ):
        if patience < 1:
            raise ValueError(f"patience must be at least 1, not {patience}")
        if rule not in ("paired", "unpaired", "auto") or paired_on not in ("loss", "accuracy", "either") or pool < 1:
            raise ValueError(f"no such decision: rule {rule!r}, paired_on {paired_on!r}, pool {pool}")
        self.patience, self.z, self.mse_margin = patience, z, mse_margin
        self.rule = rule
        self.paired_on: PairedOn = "accuracy" if rule == "auto" else paired_on
        self.helping = True  # False: backed off, the node predicts with its local model
        self.streak = 0  # consecutive checks that argue for leaving the current state
        self.worse_run = 0  # consecutive checks where collaboration was worse beyond noise
        self.checks = 0
        self.switches = 0
        self.last: tuple[Score, Score] | None = None
        self.last_paired: Paired | None = None
        self.recent: deque[Paired] = deque(maxlen=pool)  # the last checks' paired evidence (pooled)

    def _pooled(self) -> Paired | None:
        """The last ``pool`` checks' paired evidence: means averaged; the SE averaged, not shrunk
        (the same samples each time: pooling removes training noise, not sampling noise)."""
        if self.rule == "unpaired" or self.last_paired is None:
            return None
        if self.rule == "auto" and self.last_paired.err is None:
            return None  # regression (no 0/1 errors): auto decides on the fixed MSE margin
        ps = list(self.recent)
        errs = [(p.err, p.err_se) for p in ps if p.err is not None and p.err_se is not None]
        err, err_se = (
            (float(np.mean([e for e, _ in errs])), float(np.mean([s for _, s in errs]))) if errs else (None, None)
        )
        return Paired(
            float(np.mean([p.loss for p in ps])),
            float(np.mean([p.loss_se for p in ps])),
            err if len(errs) == len(ps) else None,
            err_se if len(errs) == len(ps) else None,
            ps[-1].n,
        )

    def _paired_tests(self, p: Paired) -> list[tuple[float, float]]:
        """(mean, margin) of each test this check applies: the loss's, the 0/1 errors', or both."""
        loss = (p.loss, self.z * p.loss_se)
        if p.err is None or p.err_se is None or self.paired_on == "loss":
            return [loss]
        err = (p.err, max(self.z * p.err_se, 1.0 / max(p.n, 1)))
        return [err] if self.paired_on == "accuracy" else [loss, err]

    def worse(self, collab: Score, local: Score) -> bool:
        """Collaboration is worse than local beyond the noise of the split (this check's
        evidence: ``observe`` records the paired one before asking)."""
        if not math.isfinite(local.loss) and collab.accuracy is None:
            return False  # nothing to compare with
        pooled = self._pooled()
        if pooled is not None:
            return any(mean > margin for mean, margin in self._paired_tests(pooled))
        if collab.accuracy is not None and local.accuracy is not None:
            n = min(collab.n, local.n)
            return collab.accuracy < local.accuracy - accuracy_margin(collab.accuracy, local.accuracy, n, self.z)
        if not math.isfinite(collab.loss):
            return True
        return collab.loss > local.loss * (1 + self.mse_margin)

    def at_least_as_good(self, collab: Score, local: Score) -> bool:
        pooled = self._pooled()
        if pooled is not None:
            return all(mean <= 0 for mean, _ in self._paired_tests(pooled))
        if collab.accuracy is not None and local.accuracy is not None:
            return collab.accuracy >= local.accuracy
        return math.isfinite(collab.loss) and (not math.isfinite(local.loss) or collab.loss <= local.loss)

    def observe(self, collab: Score, local: Score, evidence: Paired | None = None) -> bool:
        """One check; returns whether collaboration is (still, or again) the node's prediction.
        ``evidence``: the two models' paired per-sample evidence (``paired``), if there is some."""
        self.checks += 1
        self.last = (collab, local)
        if not math.isfinite(collab.loss):
            evidence = None  # a diverged model: the unpaired rule calls it worse
        self.last_paired = evidence
        if evidence is None:
            self.recent.clear()  # pooled evidence is of consecutive checks only
        else:
            self.recent.append(evidence)
        worse = self.worse(collab, local)
        self.worse_run = self.worse_run + 1 if worse else 0
        argues_to_switch = worse if self.helping else self.at_least_as_good(collab, local)
        self.streak = self.streak + 1 if argues_to_switch else 0
        if self.streak >= self.patience:
            self.helping, self.streak = not self.helping, 0
            self.switches += 1
        return self.helping

    def figures(self) -> str:
        """The last check's figures: the two validation scores and, paired, their difference."""
        assert self.last is not None
        collab, local = self.last
        acc = collab.accuracy is not None and local.accuracy is not None
        pooled = self._pooled()
        if pooled is None:
            what, c, lo = ("val acc", collab.accuracy, local.accuracy) if acc else ("val loss", collab.loss, local.loss)
            return f"{what} {c:.4g} vs local {lo:.4g}"
        pool = f", mean of {len(self.recent)} checks" if len(self.recent) > 1 else ""
        if acc and self.paired_on == "accuracy" and pooled.err is not None and pooled.err_se is not None:
            # decided on the 0/1 errors: their figures, not the loss's
            return (
                f"val acc {collab.accuracy:.4g} vs local {local.accuracy:.4g} (paired error difference "
                f"{pooled.err:+.3g} ± {pooled.err_se:.2g} SE on {pooled.n} samples{pool})"
            )
        out = f"val loss {collab.loss:.4g} vs local {local.loss:.4g}"
        if acc:
            out += f", val acc {collab.accuracy:.4g} vs local {local.accuracy:.4g}"
        return (
            out + f" (paired loss difference {pooled.loss:+.3g} ± {pooled.loss_se:.2g} SE on {pooled.n} samples{pool})"
        )

    def reason(self) -> str | None:
        """What /status says; None before the first check."""
        if self.last is None:
            return None
        figures = self.figures()
        if not self.helping:
            run = f" over {self.worse_run} checks" if self.worse_run else " (recovering: not yet better long enough)"
            return f"collaboration is not helping this node: {figures}{run}; predicting with the local model"
        if self.worse_run:
            return f"collaboration is worse than local on {self.worse_run} check(s) in a row: {figures}"
        return f"collaboration helps or is within noise: {figures}"

    def to_json(self) -> dict[str, Any]:
        return {
            "helping": self.helping,
            "streak": self.streak,
            "worse_run": self.worse_run,
            "checks": self.checks,
            "switches": self.switches,
            "last": [asdict(s) for s in self.last] if self.last else None,
            "rule": self.rule,
            "paired": [asdict(p) for p in self.recent],  # oldest first; the last is last_paired
        }

    def load_json(self, state: dict[str, Any]) -> None:
        """Resume a checkpointed decision (one saved before the paired rule resumes without
        paired evidence: the next check brings it); ValueError naming what is malformed."""
        try:
            helping, streak, worse_run = bool(state["helping"]), int(state["streak"]), int(state["worse_run"])
            checks, switches = int(state["checks"]), int(state["switches"])
            last = [Score(float(s["loss"]), s["accuracy"], int(s["n"])) for s in state.get("last") or []]
            recent = [
                Paired(float(p["loss"]), float(p["loss_se"]), p["err"], p["err_se"], int(p["n"]))
                for p in state.get("paired") or []
            ]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"the collaboration check's saved state is malformed ({type(e).__name__}: {e})") from None
        self.helping, self.streak, self.worse_run = helping, streak, worse_run
        self.checks, self.switches = checks, switches
        self.last = (last[0], last[1]) if len(last) == 2 else None
        self.recent.clear()
        self.recent.extend(recent)
        self.last_paired = self.recent[-1] if self.recent else None
