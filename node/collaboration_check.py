"""Is collaboration helping this node? The decision alone (no model, no I/O), so it can be tested
on numbers: each check compares what the node predicts by collaborating with its local-only
reference on the *validation* split (``local_reference.py`` measures both).

Worse means beyond the split's noise: for accuracy, lower than the local one by more than ``z``
standard errors of the difference of two accuracies measured on ``n`` samples (at least one
sample's worth: 1/n); for a loss (regression), above the local one by more than ``mse_margin`` of
it. Hysteresis: ``patience`` worse checks in a row back off; ``patience`` checks in a row where
collaboration is at least as good as local come back. Between the two (worse, but within noise)
the node stays where it is, so it does not flip on every check."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Score:
    """One model's score on the validation split."""

    loss: float
    accuracy: float | None  # None: regression
    n: int


def accuracy_margin(collab: float, local: float, n: int, z: float) -> float:
    """z standard errors of (collab - local), each a binomial proportion on n samples; never
    less than one sample (1/n), so a split of n samples cannot call one sample's difference real."""
    se = math.sqrt(max(collab * (1 - collab) + local * (1 - local), 0.0) / max(n, 1))
    return max(z * se, 1.0 / max(n, 1))


class CollaborationCheck:
    def __init__(self, patience: int = 3, z: float = 1.0, mse_margin: float = 0.1):
        if patience < 1:
            raise ValueError(f"patience must be at least 1, not {patience}")
        self.patience, self.z, self.mse_margin = patience, z, mse_margin
        self.helping = True  # False: backed off, the node predicts with its local model
        self.streak = 0  # consecutive checks that argue for leaving the current state
        self.worse_run = 0  # consecutive checks where collaboration was worse beyond noise
        self.checks = 0
        self.switches = 0
        self.last: tuple[Score, Score] | None = None

    def worse(self, collab: Score, local: Score) -> bool:
        """Collaboration is worse than local beyond the noise of the split."""
        if collab.accuracy is not None and local.accuracy is not None:
            n = min(collab.n, local.n)
            return collab.accuracy < local.accuracy - accuracy_margin(collab.accuracy, local.accuracy, n, self.z)
        if not math.isfinite(local.loss):
            return False  # nothing to compare with
        if not math.isfinite(collab.loss):
            return True
        return collab.loss > local.loss * (1 + self.mse_margin)

    @staticmethod
    def at_least_as_good(collab: Score, local: Score) -> bool:
        if collab.accuracy is not None and local.accuracy is not None:
            return collab.accuracy >= local.accuracy
        return math.isfinite(collab.loss) and (not math.isfinite(local.loss) or collab.loss <= local.loss)

    def observe(self, collab: Score, local: Score) -> bool:
        """One check; returns whether collaboration is (still, or again) the node's prediction."""
        self.checks += 1
        self.last = (collab, local)
        worse = self.worse(collab, local)
        self.worse_run = self.worse_run + 1 if worse else 0
        argues_to_switch = worse if self.helping else self.at_least_as_good(collab, local)
        self.streak = self.streak + 1 if argues_to_switch else 0
        if self.streak >= self.patience:
            self.helping, self.streak = not self.helping, 0
            self.switches += 1
        return self.helping

    def reason(self) -> str | None:
        """What /status says; None before the first check."""
        if self.last is None:
            return None
        collab, local = self.last
        what, c, lo = (
            ("val acc", collab.accuracy, local.accuracy)
            if collab.accuracy is not None and local.accuracy is not None
            else ("val loss", collab.loss, local.loss)
        )
        figures = f"{what} {c:.4g} vs local {lo:.4g}"
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
        }

    def load_json(self, state: dict[str, Any]) -> None:
        """Resume a checkpointed decision; ValueError naming what is malformed."""
        try:
            helping, streak, worse_run = bool(state["helping"]), int(state["streak"]), int(state["worse_run"])
            checks, switches = int(state["checks"]), int(state["switches"])
            last = [Score(float(s["loss"]), s["accuracy"], int(s["n"])) for s in state.get("last") or []]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"the collaboration check's saved state is malformed ({type(e).__name__}: {e})") from None
        self.helping, self.streak, self.worse_run = helping, streak, worse_run
        self.checks, self.switches = checks, switches
        self.last = (last[0], last[1]) if len(last) == 2 else None
