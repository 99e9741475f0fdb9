"""The offline α rules of bench/never_worse_evidence.py (evidence pooled over checks) and the rule
bench/never_worse_alpha.py says a recorded node ran: small hand-made check logs whose right answer
is known."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import never_worse_alpha as nwa  # noqa: E402
import never_worse_evidence as nwe  # noqa: E402

GRID = 11


def _check(loss: list[float], helping: bool = True, **extra: object) -> dict[str, object]:
    rec: dict[str, object] = {"check_helping": helping, "val_loss": loss, "best": nwa._argmin(loss)}
    rec.update(extra)
    return rec


def _slope(at_twin: float, at_collab: float) -> list[float]:
    return [at_twin + (at_collab - at_twin) * k / (GRID - 1) for k in range(GRID)]


def test_pooling_keeps_an_earlier_check_that_a_single_check_would_forget():
    # check 1: collaboration much better; check 2: the twin slightly better
    log = [_check(_slope(1.0, 0.5)), _check(_slope(0.5, 0.52))]
    assert nwa.replay(log, "valopt")[-1] == 0  # the last check alone: the twin
    assert nwe.replay_pooled(log, 0.5, bar=False) == GRID - 1  # pooled (0.5·check 1 + check 2): collaboration
    assert nwe.replay_pooled(log, 0.0, bar=False) == 0  # λ = 0: the last check alone again


def test_a_back_off_starts_the_pooling_afresh():
    log = [_check(_slope(1.0, 0.5)), {"check_helping": False}, _check(_slope(0.5, 0.52))]
    assert nwe.replay_pooled(log, 0.5, bar=False) == 0
    assert nwe.replay_pooled(log[:2], 0.5, bar=False) == 0  # backed off: the twin


def test_classification_pools_accuracy_first():
    # the loss favours collaboration, the pooled accuracy the twin's side
    log = [
        _check(_slope(1.0, 0.6), val_acc=[0.7] * 5 + [0.6] * 6),
        _check(_slope(1.0, 0.6), val_acc=[0.6] * 5 + [0.6] * 6),
    ]
    assert nwe.replay_pooled(log, 0.5, bar=False) == 4  # the most accurate (0-4), then the lowest loss


def _per_sample(twin: list[float], collab: list[float]) -> list[list[float]]:
    """Every α's per-sample loss, linear from the twin's to collaboration's (a real blend's is
    not, but the rule reads only the recorded numbers)."""
    return [[t + (c - t) * k / (GRID - 1) for t, c in zip(twin, collab, strict=True)] for k in range(GRID)]


def test_the_bar_keeps_the_twin_when_the_pooled_difference_is_within_its_noise():
    twin = [1.0, 1.0, 1.0, 1.0]
    noisy = [0.1, 1.9, 0.2, 1.6]  # mean 0.95: better than the twin by 0.05, SE about 0.45
    ls = _per_sample(twin, noisy)
    log = [_check([sum(x) / 4 for x in ls], val_losses=ls)]
    assert nwe.replay_pooled(log, 0.5, bar=False) == GRID - 1
    assert nwe.replay_pooled(log, 0.5, bar=True) == 0
    clear = [0.5, 0.6, 0.5, 0.6]
    ls = _per_sample(twin, clear)
    log = [_check([sum(x) / 4 for x in ls], val_losses=ls)]
    assert nwe.replay_pooled(log, 0.5, bar=True) == GRID - 1


def test_the_bar_says_so_when_the_run_did_not_record_per_sample_losses():
    assert nwe.replay_pooled([_check(_slope(1.0, 0.5))], 0.5, bar=True) == -1


@pytest.mark.parametrize(
    ("log", "rule"),
    [
        ([{"rule": "accfirst"}], "accfirst"),
        ([{"rule": "valopt"}], "valopt"),
        ([{"se_twin": [0.0]}], "accfirst"),  # recorded after main adopted accfirst, before the rule was
        ([{"se_best": [0.0]}], "valopt"),  # the first 152 runs
        ([], "valopt"),
    ],
)
def test_the_rule_a_recorded_node_ran(log, rule):
    assert nwa.ran_rule(log) == rule
