"""Predicting with a blend of the collaborative model and the local-only twin (issue 33;
node/blend.py, node/local_reference.py with ``reference.predict = "blend"``): the blend itself, α
chosen on the validation split, and a node that reports, checkpoints and shows in /status the
blend it predicts with."""

from __future__ import annotations

import math

import pytest
import torch

from coterie.node.blend import alphas, blend, choose
from coterie.node.config import ReferenceConfig
from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.torch_learner import build_learner
from coterie.node.local_reference import LocalReference
from coterie.node.modelfile import MixtureModel, _build


def test_the_blend_is_the_twin_at_0_the_collaborative_members_at_1_and_their_average_between():
    twin = {"w": torch.zeros(3), "b": torch.ones(1)}
    collab = [("a", 0.25, {"w": torch.full((3,), 4.0), "b": torch.full((1,), 3.0)}), ("b", 0.75, twin)]
    assert blend(collab, twin, 0.0, "me") == [("me", 1.0, twin)]
    assert blend(collab, twin, 1.0, "me") is collab
    half = blend(collab, twin, 0.5, "me")
    assert [(i, w) for i, w, _ in half] == [("a", 0.25), ("b", 0.75)]  # a mixture's weights are kept
    assert torch.equal(half[0][2]["w"], torch.full((3,), 2.0)) and torch.equal(half[0][2]["b"], torch.full((1,), 2.0))
    assert torch.equal(half[1][2]["w"], twin["w"])
    # in prediction space: the collaborative members at α times their weights, and the twin
    mix = blend(collab, twin, 0.25, "me", "prediction")
    assert [(i, w) for i, w, _ in mix] == [("a", 0.0625), ("b", 0.1875), ("me", 0.75)] and mix[2][2] is twin
    # a diverged collaborative model does not leak into α = 0 through a zero weight
    nan = [("a", 1.0, {"w": torch.full((3,), math.nan), "b": torch.ones(1)})]
    assert torch.equal(blend(nan, twin, 0.0, "me")[0][2]["w"], twin["w"])
    with pytest.raises(ValueError, match=r"α must be in \[0, 1\], not 1.5"):
        blend(collab, twin, 1.5, "me")
    with pytest.raises(ValueError, match=r"member 'a'.*\['extra'\] differ"):
        blend([("a", 1.0, {**twin, "extra": torch.zeros(1)})], twin, 0.5, "me")
    with pytest.raises(ValueError, match="no such blend space 'logits'"):
        blend(collab, twin, 0.5, "me", "logits")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one step"):
        alphas(0)


def test_alpha_is_the_lowest_validation_loss_ties_and_non_finite_to_the_twins_side():
    grid = alphas(4)
    assert grid == [0.0, 0.25, 0.5, 0.75, 1.0]
    alpha, losses = choose(grid, lambda a: (a - 0.7) ** 2)
    assert alpha == 0.75 and losses == pytest.approx([0.49, 0.2025, 0.04, 0.0025, 0.09])
    assert choose(grid, lambda a: 1.0)[0] == 0.0  # cannot tell: the twin
    assert choose(grid, lambda a: math.nan if a < 1 else 2.0)[0] == 1.0
    assert choose(grid, lambda a: math.inf)[0] == 0.0


def test_classification_alpha_is_the_lowest_loss_among_the_most_accurate_blends():
    grid = alphas(4)
    # the loss falls towards collaboration (a flat collaborative model against an overconfident
    # twin), the accuracy says the twin's side is right: only the most accurate α compete
    loss = {0.0: 3.0, 0.25: 1.6, 0.5: 1.4, 0.75: 1.3, 1.0: 1.25}
    acc = {0.0: 0.6, 0.25: 0.65, 0.5: 0.65, 0.75: 0.55, 1.0: 0.5}
    alpha, losses = choose(grid, loss.__getitem__, acc.__getitem__)
    assert alpha == 0.5 and losses == [loss[a] for a in grid]
    assert choose(grid, loss.__getitem__)[0] == 1.0  # no accuracy (regression): the loss alone
    # a most accurate α without a finite loss does not compete; none finite at all: the twin
    assert choose(grid, lambda a: math.nan if a == 0.5 else loss[a], acc.__getitem__)[0] == 0.25
    assert choose(grid, lambda a: math.nan, acc.__getitem__)[0] == 0.0


def _overconfident_twin_case(space: str) -> tuple[LocalReference, list[float]]:
    """A reference whose validation scores are set per α: the loss falls towards collaboration,
    the accuracy is highest at α = 0.3 and 0.4 (the learner's scoring stubbed, all else real)."""
    from coterie.node.learning.learner import EvalResult

    cfg = LearnerConfig(dataset="digits", model="mlp", model_params={"hidden": [8]}, optimizer="adam", lr=0.01)
    learner = build_learner(cfg)
    ref = LocalReference(ReferenceConfig(predict="blend", blend_space=space), learner, "dpsgd")
    losses = [3.0 - 0.15 * k for k in range(11)]  # α = 1 the lowest
    accs = [0.6, 0.6, 0.6, 0.7, 0.7, 0.6, 0.6, 0.55, 0.5, 0.5, 0.5]
    scores = [EvalResult(loss=x, n=20, accuracy=a) for x, a in zip(losses, accs, strict=True)]
    learner.evaluate_blends = lambda members, other, grid, split="val": scores  # type: ignore[method-assign]
    queue = iter(scores)
    learner.evaluate_mixture = lambda members, split="val": next(queue)  # type: ignore[method-assign]
    return ref, losses


@pytest.mark.parametrize("space", ["prediction", "weight"])
def test_a_node_blends_with_the_most_accurate_alpha_not_the_flattest(space):
    ref, losses = _overconfident_twin_case(space)
    ref._choose_alpha([("n1", 1.0, ref.learner.get_params())])
    assert ref.alpha == 0.4 and ref.alpha_losses == losses  # of 0.3 and 0.4 (acc 0.7), the lower loss


CFG_SMALL = LearnerConfig(dataset="digits", model="mlp", model_params={"hidden": [16]}, optimizer="adam", lr=0.01)


def _trained(cfg: LearnerConfig, rounds: int) -> dict[str, torch.Tensor]:
    learner = build_learner(cfg)
    for _ in range(rounds):
        learner.train()
    return learner.get_params()


def test_a_node_predicts_reports_exports_and_shows_the_blend_with_the_lowest_validation_loss():
    cfg = LearnerConfig(dataset="digits", model="mlp", model_params={"hidden": [16]}, optimizer="adam", lr=0.01)
    learner = build_learner(cfg)
    ref = LocalReference(ReferenceConfig(predict="blend", blend_space="weight"), learner, "dpsgd")
    assert ref.twin is not None and ref.blending and ref.alpha is None and ref.prediction_members("n0") is None
    theta0 = ref.twin.get_params()  # the twin has not trained: θ⁰
    good = _trained(cfg, 5)
    # a collaborative model that overshoots a good one: θ⁰ + 4(θ_good − θ⁰), so the blend at α = 0.25
    # *is* the good model, and neither end is
    learner.set_params({k: theta0[k] + 4 * (good[k] - theta0[k]) for k in good})
    collab_params = learner.get_params()
    ev = ref.judge(1, {"test_acc": 0.1, "test_loss": 9.0}, None)

    def at(a: float) -> dict[str, torch.Tensor]:
        return {k: a * collab_params[k] + (1 - a) * theta0[k] for k in good}

    # scored as the node scores any blend (the mixture evaluation: probabilities, clamped NLL)
    by_alpha = {a: learner.evaluate_mixture([(1.0, at(a))], "val") for a in ref.grid}
    best = min(ref.grid, key=lambda a: (by_alpha[a].loss, a))
    assert 0 < best < 1 and ref.alpha == best  # chosen on validation, strictly between the two
    assert ref.alpha_losses == pytest.approx([by_alpha[a].loss for a in ref.grid], rel=1e-5)
    blended = at(best)
    test = learner.evaluate_mixture([(1.0, blended)], "test")
    # it reports the blend, keeps the collaborative figures beside it, and says α
    assert ev["test_acc"] == pytest.approx(test.accuracy) and ev["test_loss"] == pytest.approx(test.loss, rel=1e-5)
    assert ev["collab_test_acc"] == 0.1 and ev["blend_alpha"] == best and ev["helping"] == 1.0
    # what it checkpoints for the export is that one blended model
    [(node_id, w, exported)] = ref.prediction_members("n0")
    assert node_id == "n0" and w == 1.0 and all(torch.allclose(exported[k], blended[k]) for k in good)
    view = ref.view()
    assert view["predicting_with"]["model"] == "blend" and view["predicting_with"]["alpha"] == best
    assert view["reason"].startswith("predicting with a blend of the collaborative and the local model's weights, α = ")
    # α survives a restart
    again = LocalReference(ReferenceConfig(predict="blend", blend_space="weight"), build_learner(cfg), "dpsgd")
    again.import_state(ref.export_state(), 1)
    assert again.alpha == best and again.alpha_losses == ref.alpha_losses


def test_a_prediction_space_blend_is_the_mixture_of_the_two_models_it_reports_and_exports():
    cfg = LearnerConfig(dataset="digits", model="mlp", model_params={"hidden": [16]}, optimizer="adam", lr=0.01)
    learner = build_learner(cfg)
    ref = LocalReference(ReferenceConfig(predict="blend", blend_space="prediction"), learner, "dpsgd")
    assert ref.twin is not None
    theta0 = ref.twin.get_params()
    good = _trained(cfg, 5)
    # an overconfident collaborative model (as in the weight-space test): mixing in the untrained
    # twin's near-uniform probabilities lowers its cross-entropy, so α lands strictly inside
    learner.set_params({k: theta0[k] + 4 * (good[k] - theta0[k]) for k in good})
    collab = learner.get_params()
    ev = ref.judge(1, {"test_acc": 0.3, "test_loss": 2.0}, None)

    def mix(a: float, split: str):
        members = [(w, p) for w, p in ((a, collab), (1 - a, theta0)) if w > 0]
        return learner.evaluate_mixture(members, split)

    top = max(mix(a, "val").accuracy for a in ref.grid)  # of the most accurate blends, the lowest loss
    best = min((a for a in ref.grid if mix(a, "val").accuracy == top), key=lambda a: (mix(a, "val").loss, a))
    assert ref.alpha == best and ref.alpha_losses == pytest.approx([mix(a, "val").loss for a in ref.grid], rel=1e-5)
    assert 0 < best < 1
    assert ev["test_acc"] == pytest.approx(mix(best, "test").accuracy) and ev["collab_test_acc"] == 0.3
    members = ref.prediction_members("n0")  # what the checkpoint carries for the export: both models
    assert [(i, w) for i, w, _ in members] == [("n0", best), ("n0", 1 - best)]
    assert all(torch.equal(members[0][2][k], collab[k]) and torch.equal(members[1][2][k], theta0[k]) for k in collab)
    # the export of those members (modelfile's mixture module) predicts as the node reported
    card = {"architecture": "mlp", "input_shape": list(learner.input_shape), "num_classes": 10}
    built = [_build({**card, "model_params": {"hidden": [16]}}, p, "test", "") for _, _, p in members]
    exported = MixtureModel(built, [w for _, w, _ in members], "classification").eval()
    x, y = learner._data["test"]
    with torch.no_grad():
        assert float((exported(x).argmax(1) == y).float().mean()) == pytest.approx(ev["test_acc"], abs=1e-6)
    assert ref.view()["predicting_with"] | {"val_loss_by_alpha": None} == {
        "model": "blend",
        "rule": "blend",
        "alpha": best,
        "space": "prediction",
        "val_loss_by_alpha": None,
    }


def test_a_ruined_collaborative_model_blends_to_the_twin_alone():
    cfg = LearnerConfig(dataset="digits", model="mlp", model_params={"hidden": [16]}, optimizer="adam", lr=0.01)
    learner = build_learner(cfg)
    ref = LocalReference(ReferenceConfig(predict="blend"), learner, "dpsgd")
    assert ref.twin is not None
    for rnd in (1, 2, 3):
        ref.train(rnd)
    learner.set_params({k: torch.full_like(v, math.nan) for k, v in learner.get_params().items()})  # diverged
    ev = ref.judge(3, {"test_acc": 0.0, "test_loss": math.nan}, None)
    assert ref.alpha == 0.0 and ev["helping"] == 0.0 and ev["test_acc"] == ev["local_test_acc"] > 0
    [(_, _, exported)] = ref.prediction_members("n0")
    assert all(torch.equal(exported[k], v) for k, v in ref.twin.get_params().items())
    assert ref.view()["reason"].startswith("collaboration is not helping this node: val acc")
    assert ref.view()["predicting_with"]["model"] == "local"
    # once the check backs off (patience 1 here), the twin alone, without scoring blends
    off = LocalReference(ReferenceConfig(predict="blend", patience=1), learner, "dpsgd")
    off.train(1)
    ev = off.judge(1, {"test_acc": 0.0, "test_loss": math.nan}, None)
    assert not off.check.helping and off.alpha == 0.0 and off.alpha_losses == [] and ev["helping"] == 0.0
    assert off.view()["reason"].endswith("; predicting with the local model") and off.backed_off


def test_blending_in_prediction_space_is_the_default():
    cfg = ReferenceConfig()
    assert (cfg.predict, cfg.blend_space, cfg.blend_steps) == ("blend", "prediction", 10)
    learner = build_learner(LearnerConfig(dataset="digits", model="mlp", model_params={"hidden": [16]}))
    ref = LocalReference(cfg, learner, "fedfomo")
    assert ref.blending and ref.grid == [k / 10 for k in range(11)]


def test_choose_keeps_the_binary_back_off():
    cfg = LearnerConfig(dataset="digits", model="mlp", model_params={"hidden": [16]})
    learner = build_learner(cfg)
    ref = LocalReference(ReferenceConfig(predict="choose", patience=1), learner, "dpsgd")
    ref.train(1)
    ev = ref.judge(1, {"test_acc": 0.5, "test_loss": 1.0}, None)
    assert "blend_alpha" not in ev and ref.alpha is None
    assert ref.view()["predicting_with"]["rule"] == "choose"


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_every_prediction_space_blend_scored_in_one_pass_is_the_mixture_scored_afresh_bit_for_bit(task):
    # the check scores 11 blends a check from one pass of each model (TorchLearner.evaluate_blends);
    # each must be exactly what the mixture evaluation gives that blend on its own
    if task == "classification":
        cfg = LearnerConfig(dataset="digits", model="mlp", model_params={"hidden": [16]}, optimizer="adam", lr=0.01)
    else:
        cfg = LearnerConfig(
            dataset="sine",
            dataset_params={"num_samples": 400, "noise": 0.1},
            partition="sine_intervals",
            partition_params={"num_intervals": 2, "samples_per_node": 50},
            num_nodes=2,
            model="mlp",
            model_params={"hidden": [8]},
        )
    learner = build_learner(cfg)
    twin = learner.get_params()
    a, b = _trained(cfg, 3), _trained(cfg.model_copy(update={"init_seed": 1}), 2)
    for members in ([(1.0, a)], [(0.3, a), (0.5, b), (0.2, twin)]):
        grid = alphas(10)
        scored = learner.evaluate_blends(members, twin, grid, "val")
        for alpha, got in zip(grid, scored, strict=True):
            ms = blend([(str(i), w, p) for i, (w, p) in enumerate(members)], twin, alpha, "twin", "prediction")
            want = learner.evaluate_mixture([(w, p) for _, w, p in ms], "val")
            assert got.loss == want.loss and got.n == want.n and got.accuracy == want.accuracy
            assert (got.losses == want.losses).all()
            assert (got.correct is None) == (want.correct is None)
            if want.correct is not None:
                assert (got.correct == want.correct).all()


@pytest.mark.parametrize("backed_off", [False, True])
def test_a_live_checkpoint_carries_the_blend_as_the_model_and_twin_it_already_holds(tmp_path, backed_off):
    """A large model's checkpoint holds the model's and twin's own tensors (``live``): the blend's
    members are those tensors, named once in the file, not copies made to write them (issue 34)."""
    from coterie.node.persistence import StateStore, make_snapshot, read_checkpoint

    learner = build_learner(CFG_SMALL)
    ref = LocalReference(ReferenceConfig(predict="blend", blend_space="prediction"), learner, "dpsgd")
    assert ref.twin is not None
    theta0 = ref.twin.get_params()
    good = _trained(CFG_SMALL, 5)
    learner.set_params({k: theta0[k] + 4 * (good[k] - theta0[k]) for k in good})  # α strictly inside (above)
    ref.judge(1, {"test_acc": 0.3, "test_loss": 2.0}, None)
    assert 0 < ref.alpha < 1
    if backed_off:
        ref.check.helping = False
    members = ref.prediction_members("n0", None, live=True)
    own = {t.untyped_storage().data_ptr() for t in learner.model.parameters()}
    own |= {t.untyped_storage().data_ptr() for t in ref.twin.model.parameters()}
    assert all(t.untyped_storage().data_ptr() in own for _, _, p in members for t in p.values())  # main: copies
    snap = make_snapshot(
        round=1,
        version=1,
        node_id="n0",
        learner_state=learner.export_state(live=True),
        strategy_state={},
        peers=[],
        meta={},
        record={"round": 1},
        mixture=members,
        reference=ref.export_state(live=True),
        live=True,
    )
    assert not [k for k in snap.tensors if k.startswith("mixture/")]  # nothing stored twice
    store = StateStore(tmp_path / "state")
    store.open("n0")
    store.commit(snap, [{"round": 1}])
    written = read_checkpoint(store.checkpoints()[-1]).mixture()
    expected = [(1.0, theta0)] if backed_off else [(ref.alpha, learner.get_params()), (1 - ref.alpha, theta0)]
    assert [m["weight"] for m in written] == [w for w, _ in expected]
    assert all(torch.equal(m["params"][k], p[k]) for m, (_, p) in zip(written, expected, strict=True) for k in p)
