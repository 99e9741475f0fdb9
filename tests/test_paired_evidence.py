"""The back-off's paired evidence (issue 33; node/collaboration_check.py): both models are scored
on the same validation samples, so the per-sample loss differences decide, against their own
standard error, where the unpaired rule compared two accuracies (or two MSEs with a fixed 10 %
margin). Each decision test below is one the unpaired rule gets wrong; the evaluations are a
real learner's; a checkpoint from before the paired rule resumes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from coterie.node.collaboration_check import CollaborationCheck, Paired, Score, paired
from coterie.node.config import ReferenceConfig
from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.torch_learner import build_learner
from coterie.node.local_reference import LocalReference


def regression_outlier() -> tuple[Score, Score, Paired]:
    """12 validation samples: collaboration better on 11 (0.9 vs 1.0), one sample far off, so its
    MSE is 12 % above local's."""
    local = np.ones(12)
    collab = np.full(12, 0.9)
    collab[5] = 12 * 1.12 - 0.9 * 11
    evidence = paired(collab, local)
    assert evidence is not None
    return Score(float(collab.mean()), None, 12), Score(1.0, None, 12), evidence


def test_a_regression_node_worse_by_one_outlier_but_better_on_the_rest_is_not_backed_off():
    collab, local, evidence = regression_outlier()
    assert collab.loss == pytest.approx(1.12)
    old = CollaborationCheck(patience=1, rule="unpaired")
    assert not old.observe(collab, local, evidence)  # 12 % > the fixed 10 % margin: the old rule backs off
    new = CollaborationCheck(patience=1, rule="paired")
    for _ in range(5):
        assert new.observe(collab, local, evidence)
    assert new.worse_run == 0 and "paired loss difference +0.12 ± 0.22 SE on 12 samples" in new.reason()


def classification_clearly_worse() -> tuple[Score, Score, Paired]:
    """20 samples: collaboration's cross-entropy is higher on every one (0.6-0.7 vs 0.3), its
    accuracy one sample lower (0.70 vs 0.75)."""
    rng = np.random.default_rng(0)
    local_loss, collab_loss = np.full(20, 0.3), 0.6 + 0.1 * rng.random(20)
    local_ok, collab_ok = np.r_[np.ones(15), np.zeros(5)], np.r_[np.ones(14), np.zeros(6)]
    evidence = paired(collab_loss, local_loss, collab_ok, local_ok)
    assert evidence is not None and evidence.err == pytest.approx(0.05)
    collab = Score(float(collab_loss.mean()), 0.70, 20)
    return collab, Score(0.3, 0.75, 20), evidence


def test_a_classification_node_whose_loss_is_worse_on_every_sample_is_backed_off():
    collab, local, evidence = classification_clearly_worse()
    old = CollaborationCheck(patience=2, rule="unpaired")
    new = CollaborationCheck(patience=2, rule="paired", paired_on="loss")
    on_errors = CollaborationCheck(patience=2, rule="paired", paired_on="accuracy")
    for _ in range(4):
        old.observe(collab, local, evidence)
        new.observe(collab, local, evidence)
        on_errors.observe(collab, local, evidence)
    assert old.helping and on_errors.helping  # one sample's accuracy: within noise for both
    assert not new.helping and new.switches == 1
    reason = new.reason()
    assert (
        reason.startswith("collaboration is not helping this node: val loss") and "val acc 0.7 vs local 0.75" in reason
    )
    either = CollaborationCheck(patience=1, rule="paired", paired_on="either")
    assert not either.observe(collab, local, evidence)


def test_the_accuracy_test_needs_more_than_one_sample_and_either_takes_the_first_that_fires():
    ok = np.ones(20)
    wrong = ok.copy()
    wrong[:3] = 0  # collaboration wrong on 3 samples local gets right, the losses equal
    evidence = paired(np.ones(20), np.ones(20), wrong, ok)
    assert evidence is not None and evidence.loss == 0
    collab, local = Score(1.0, 0.85, 20), Score(1.0, 1.0, 20)
    assert not CollaborationCheck(patience=1, rule="paired", paired_on="accuracy").observe(collab, local, evidence)
    assert not CollaborationCheck(patience=1, rule="paired", paired_on="either").observe(collab, local, evidence)
    assert CollaborationCheck(patience=1, rule="paired", paired_on="loss").observe(collab, local, evidence)
    one = ok.copy()
    one[0] = 0  # one sample's difference is never evidence
    single = paired(np.ones(20), np.ones(20), one, ok)
    assert CollaborationCheck(patience=1, rule="paired", paired_on="accuracy").observe(collab, local, single)


def test_comes_back_after_patience_checks_where_the_mean_difference_is_not_worse():
    collab, local, worse = classification_clearly_worse()
    check = CollaborationCheck(patience=2, rule="paired")
    check.observe(collab, local, worse)
    assert not check.observe(collab, local, worse)
    better = Paired(loss=-0.01, loss_se=0.05, err=0.0, err_se=0.0, n=20)
    tie_worse = Paired(loss=0.02, loss_se=0.05, err=0.0, err_se=0.0, n=20)  # within noise: holds
    assert not check.observe(collab, local, better)
    assert not check.observe(collab, local, tie_worse)  # restarts the count
    assert not check.observe(collab, local, better)
    assert check.observe(collab, local, better) and check.switches == 2


def test_pooling_averages_the_last_checks_means_not_their_noise():
    collab, local = Score(1.0, None, 10), Score(1.0, None, 10)
    spike = Paired(loss=0.3, loss_se=0.1, err=None, err_se=None, n=10)
    calm = Paired(loss=-0.05, loss_se=0.1, err=None, err_se=None, n=10)
    single, pooled = (
        CollaborationCheck(patience=1, rule="paired"),
        CollaborationCheck(patience=1, rule="paired", pool=3),
    )
    for check in (single, pooled):
        check.observe(collab, local, calm)
        check.observe(collab, local, calm)
    assert not single.observe(collab, local, spike)  # one round's training noise backs it off
    assert pooled.observe(collab, local, spike)  # (0.3 - 0.1) / 3 = 0.067 < 0.1: the SE is not shrunk
    steady = Paired(loss=0.11, loss_se=0.1, err=None, err_se=None, n=10)
    for _ in range(3):
        pooled.observe(collab, local, steady)
    assert not pooled.helping and "mean of 3 checks" in pooled.reason()


def test_without_paired_evidence_the_paired_rule_falls_back_to_the_unpaired_one():
    check = CollaborationCheck(patience=1, rule="paired")
    assert not check.observe(Score(1.2, None, 30), Score(1.0, None, 30))  # 20 % > mse_margin
    assert check.reason().startswith("collaboration is not helping this node: val loss 1.2 vs local 1 over")
    assert paired(np.ones(3), np.ones(4)) is None and paired(np.array([np.nan]), np.ones(1)) is None
    assert paired(np.array([]), np.array([])) is None
    nan = CollaborationCheck(patience=1, rule="paired")  # a diverged model is worse, whatever its evidence says
    assert not nan.observe(Score(float("nan"), None, 3), Score(1.0, None, 3), Paired(-1.0, 0.1, None, None, 3))


def test_the_paired_state_resumes_and_a_checkpoint_from_before_it_loads():
    collab, local, evidence = classification_clearly_worse()
    check = CollaborationCheck(patience=3, rule="paired", pool=2)
    for _ in range(2):
        check.observe(collab, local, evidence)
    saved = json.loads(json.dumps(check.to_json()))
    again = CollaborationCheck(patience=3, rule="paired", pool=2)
    again.load_json(saved)
    assert again.to_json() == check.to_json() and again.reason() == check.reason()
    assert not again.observe(collab, local, evidence)  # the third worse check in a row
    old = {k: v for k, v in saved.items() if k not in ("paired", "rule")}  # as saved before the paired rule
    resumed = CollaborationCheck(patience=3, rule="paired", pool=2)
    resumed.load_json(old)
    assert resumed.worse_run == 2 and resumed.last_paired is None and not resumed.observe(collab, local, evidence)
    with pytest.raises(ValueError, match="saved state is malformed.*loss_se"):
        resumed.load_json({**saved, "paired": [{"loss": 1.0}]})


# --------------------------------------------------------------------------- on a real learner
def digits_learner(**kw):
    cfg = LearnerConfig(dataset="digits", model="mlp", model_params={"hidden": [16]}, optimizer="adam", lr=0.01, **kw)
    return cfg, build_learner(cfg)


def test_evaluations_carry_per_sample_losses_that_average_to_the_loss():
    _, learner = digits_learner()
    learner.train()
    ev = learner.evaluate("val")
    assert ev.losses is not None and ev.correct is not None and len(ev.losses) == ev.n > 0
    assert float(ev.losses.mean()) == pytest.approx(ev.loss, rel=1e-5)
    assert float(ev.correct.mean()) == pytest.approx(ev.accuracy)
    other = {k: v + 0.05 * torch.randn_like(v) for k, v in learner.get_params().items()}
    mix = learner.evaluate_mixture([(0.5, learner.get_params()), (0.5, other)], "val")
    assert mix.losses is not None and float(mix.losses.mean()) == pytest.approx(mix.loss, rel=1e-5)
    assert float(mix.correct.mean()) == pytest.approx(mix.accuracy)
    sine = build_learner(LearnerConfig(dataset="sine", partition="sine_intervals", model="mlp"))
    ev = sine.evaluate("val")
    assert ev.correct is None and float(ev.losses.mean()) == pytest.approx(ev.loss, rel=1e-5)


def test_the_reference_decides_on_paired_evidence_and_resumes_an_old_checkpoint():
    cfg, learner = digits_learner()
    ref = LocalReference(ReferenceConfig(patience=1, rule="paired"), learner, "dpsgd")
    for rnd in (1, 2, 3):
        ref.train(rnd)
    # the live model: the twin's, slightly blurred towards uniform (every sample's loss a bit worse)
    learner.set_params({k: 0.7 * v for k, v in ref.twin.get_params().items()})
    ev = ref.judge(3, {"test_acc": 0.0, "test_loss": 9.0}, None)
    assert ref.check.last_paired is not None and ref.check.last_paired.loss > 0
    assert ev["helping"] == 0.0 and "paired loss difference" in ref.view()["reason"]
    tensors, meta = ref.export_state()
    meta["check"] = {k: v for k, v in meta["check"].items() if k not in ("paired", "rule")}  # pre-paired
    again = LocalReference(ReferenceConfig(patience=1, rule="paired"), build_learner(cfg), "dpsgd")
    again.import_state((tensors, meta), 3)
    assert again.backed_off and again.note is None and again.check.checks == 1


# --------------------------------------------------------------------------- auto: the rule by task
def classification_four_errors_in_a_hundred() -> tuple[Score, Score, Paired]:
    """100 samples: collaboration wrong on 4 that local gets right, the same on the rest (0.76 vs
    0.80): within two unpaired accuracies' noise (5.9 points), beyond the paired errors' (2 points)."""
    local_ok = np.r_[np.ones(80), np.zeros(20)]
    collab_ok = local_ok.copy()
    collab_ok[:4] = 0
    evidence = paired(np.ones(100), np.ones(100), collab_ok, local_ok)
    assert evidence is not None
    return Score(1.0, 0.76, 100), Score(1.0, 0.80, 100), evidence


def decisions(rule: str, paired_on: str, cases: list[tuple[Score, Score, Paired]]) -> list[bool]:
    check = CollaborationCheck(patience=1, rule=rule, paired_on=paired_on)  # type: ignore[arg-type]
    return [check.observe(*case) for case in cases]


def test_auto_decides_on_the_paired_errors_for_classification_and_the_mse_margin_for_regression():
    four = classification_four_errors_in_a_hundred()
    assert CollaborationCheck(patience=1, rule="unpaired").observe(*four)  # the unpaired margin misses it
    auto = CollaborationCheck(patience=1, rule="auto", paired_on="loss")  # paired_on does not apply to auto
    assert not auto.observe(*four) and auto.paired_on == "accuracy"
    clear = classification_clearly_worse()  # every loss worse, one error more: not evidence on the errors
    assert CollaborationCheck(patience=1, rule="auto").observe(*clear)
    outlier = regression_outlier()  # 12 % MSE over local: paired says noise, the margin backs off
    assert CollaborationCheck(patience=1, rule="paired").observe(*outlier)
    regression = CollaborationCheck(patience=1, rule="auto")
    assert not regression.observe(*outlier) and regression.reason().startswith(
        "collaboration is not helping this node: val loss 1.12 vs local 1 over"
    )
    # decision for decision what the rules sweep's "auto" column takes from the shadowed checks
    calm = Paired(loss=-0.01, loss_se=0.05, err=-0.01, err_se=0.01, n=100)
    cls = [four, four, (four[0], four[1], calm), clear, (four[0], four[1], calm)]
    assert decisions("auto", "loss", cls) == decisions("paired", "accuracy", cls)
    reg_calm = (Score(0.9, None, 12), Score(1.0, None, 12), Paired(-0.1, 0.05, None, None, 12))
    reg = [outlier, reg_calm, outlier, outlier, reg_calm]
    assert decisions("auto", "loss", reg) == decisions("unpaired", "loss", reg) != decisions("paired", "loss", reg)


def test_auto_decides_on_a_real_learners_paired_errors_and_its_state_resumes():
    cfg, learner = digits_learner()
    ref = LocalReference(ReferenceConfig(patience=1, rule="auto"), learner, "dpsgd")
    for rnd in (1, 2, 3):
        ref.train(rnd)
    learner.set_params({k: 0.0 * v for k, v in ref.twin.get_params().items()})  # predicts one class
    ev = ref.judge(3, {"test_acc": 0.0, "test_loss": 9.0}, None)
    assert ref.check.last_paired is not None and ref.check.last_paired.err is not None
    assert ev["helping"] == 0.0 and "paired error difference" in ref.view()["reason"]
    again = LocalReference(ReferenceConfig(patience=1, rule="auto"), build_learner(cfg), "dpsgd")
    again.import_state(ref.export_state(), 3)
    assert again.backed_off and again.check.to_json() == ref.check.to_json()


def sine_learner():
    cfg = LearnerConfig(dataset="sine", partition="sine_intervals", model="mlp", optimizer="adam", lr=0.01)
    return cfg, build_learner(cfg)


def test_under_auto_a_classifier_decides_on_paired_errors_and_a_regressor_on_the_mse_margin():
    assert ReferenceConfig().rule == "unpaired" and CollaborationCheck().rule == "unpaired"  # the default stays
    for make, paired_figures in ((digits_learner, True), (sine_learner, False)):
        cfg, learner = make()
        ref = LocalReference(ReferenceConfig(patience=1, rule="auto"), learner, "dpsgd")
        for rnd in (1, 2, 3):
            ref.train(rnd)
        learner.set_params({k: 0.0 * v for k, v in ref.twin.get_params().items()})  # a constant prediction
        assert ref.judge(3, {"test_acc": 0.0, "test_loss": 9.0}, None)["helping"] == 0.0
        reason = ref.view()["reason"]
        assert ("paired error difference" in reason) == paired_figures, reason
        assert reason.startswith("collaboration is not helping this node: val " + ("acc" if paired_figures else "loss"))
        # a checkpoint saved before the rule existed (no "rule", no "paired") resumes under auto
        tensors, meta = ref.export_state()
        meta["check"] = {k: v for k, v in meta["check"].items() if k not in ("paired", "rule")}
        again = LocalReference(ReferenceConfig(patience=1, rule="auto"), build_learner(cfg), "dpsgd")
        again.import_state((tensors, meta), 3)
        assert again.backed_off and again.check.checks == 1
