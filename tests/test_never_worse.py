"""Collaboration never leaves a node worse than alone (issue 33 item 1): the local-only reference
(node/local_reference.py) and the back-off decision (node/collaboration_check.py).

The decision is tested on numbers (noise margin, hysteresis); the reference on a real in-process
network (lab's inproc launcher: real nodes, state dirs, checkpoints) where one node's labels are
permuted relative to all its peers: D-PSGD drags it far below what it learns alone, which the
same run with the reference off shows; with the reference on (the default) it ends within noise
of its local-only accuracy under D-PSGD, FedFomo and FedeRiCo."""

from __future__ import annotations

import json
import math

import pytest
import torch

from coterie.lab.launch import run_scenario
from coterie.lab.scenario import parse_scenario
from coterie.node.collaboration_check import CollaborationCheck, Score, accuracy_margin
from coterie.node.config import NodeConfig, ReferenceConfig
from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.torch_learner import build_learner
from coterie.node.local_reference import LocalReference
from coterie.node.modelfile import export_state_dir
from coterie.node.persistence import read_latest


def acc(a: float, n: int = 100) -> Score:
    return Score(loss=1.0, accuracy=a, n=n)


# ----------------------------------------------------------------------------------- decision
def test_the_margin_is_the_standard_error_of_a_difference_of_two_accuracies():
    # two accuracies of 0.5 on 100 samples: sd of the difference sqrt(0.25 + 0.25) / 10
    assert accuracy_margin(0.5, 0.5, 100, 1.0) == pytest.approx(math.sqrt(0.5) / 10)
    assert accuracy_margin(0.5, 0.5, 100, 2.0) == pytest.approx(2 * math.sqrt(0.5) / 10)
    # never below one sample's worth: 1.0 vs 1.0 on 50 samples is no evidence of anything
    assert accuracy_margin(1.0, 1.0, 50, 1.0) == pytest.approx(1 / 50)


def test_a_difference_within_the_noise_never_backs_off():
    check = CollaborationCheck(patience=3, z=1.0)
    for _ in range(20):  # 0.05 below on 100 samples: within one standard error (0.065)
        assert check.observe(acc(0.65), acc(0.70))
    assert check.helping and check.worse_run == 0
    assert check.reason().startswith("collaboration helps or is within noise: val acc 0.65 vs local 0.7")


def test_backs_off_after_patience_worse_checks_in_a_row_and_says_why():
    check = CollaborationCheck(patience=3, z=1.0)
    assert check.observe(acc(0.50), acc(0.80)) and check.observe(acc(0.50), acc(0.80))
    assert check.observe(acc(0.78), acc(0.80))  # one check within noise: the run starts again
    assert check.observe(acc(0.50), acc(0.80)) and check.observe(acc(0.55), acc(0.80))
    assert "worse than local on 2 check(s) in a row" in check.reason()
    assert not check.observe(acc(0.61), acc(0.74))
    assert check.reason() == (
        "collaboration is not helping this node: val acc 0.61 vs local 0.74 over 3 checks; "
        "predicting with the local model"
    )
    assert check.switches == 1


def test_returns_only_after_patience_checks_at_least_as_good_and_holds_in_between():
    check = CollaborationCheck(patience=2, z=1.0)
    check.observe(acc(0.3), acc(0.8))
    check.observe(acc(0.3), acc(0.8))
    assert not check.helping
    for _ in range(10):  # worse, but within noise: the hysteresis band keeps it backed off
        assert not check.observe(acc(0.76), acc(0.80))
    assert "recovering" in check.reason()
    assert not check.observe(acc(0.81), acc(0.80))  # one better check is not enough
    assert not check.observe(acc(0.79), acc(0.80))  # ... and a worse one restarts the count
    assert not check.observe(acc(0.80), acc(0.80))
    assert check.observe(acc(0.82), acc(0.80))  # two in a row: collaboration is back
    assert check.switches == 2


def test_regression_uses_a_relative_margin_on_the_loss():
    check = CollaborationCheck(patience=1, mse_margin=0.1)
    assert check.observe(Score(1.09, None, 30), Score(1.0, None, 30))  # within 10 %
    assert not check.observe(Score(1.2, None, 30), Score(1.0, None, 30))
    assert check.reason().startswith("collaboration is not helping this node: val loss 1.2 vs local 1")
    check = CollaborationCheck(patience=1)
    assert not check.observe(Score(float("nan"), None, 30), Score(1.0, None, 30))  # a NaN model is worse


def test_the_decision_resumes_from_its_json_and_refuses_a_malformed_one():
    check = CollaborationCheck(patience=2)
    for _ in range(3):
        check.observe(acc(0.2), acc(0.9))
    again = CollaborationCheck(patience=2)
    again.load_json(json.loads(json.dumps(check.to_json())))
    assert again.to_json() == check.to_json() and again.reason() == check.reason()
    with pytest.raises(ValueError, match="collaboration check's saved state is malformed.*helping"):
        again.load_json({"streak": 1})
    assert again.to_json() == check.to_json()  # untouched by the refused state


# ------------------------------------------------------------------------------ the reference
def test_the_reference_is_on_by_default_and_covers_the_built_in_small_models():
    assert NodeConfig().reference.enabled
    limit = ReferenceConfig().shadow_max_params
    s1_cnn = LearnerConfig(
        dataset="mnist1d",
        dataset_params={"num_samples": 400},
        model="cnn",
        model_params={"channels": [16, 32], "fc": 64},
    )
    for cfg in (s1_cnn, LearnerConfig(dataset="mnist1d", dataset_params={"num_samples": 400})):
        learner = build_learner(cfg)
        ref = LocalReference(ReferenceConfig(), learner, "fedfomo")
        assert ref.active and ref.every == 1 and sum(p.numel() for p in learner.model.parameters()) <= limit
    assert not LocalReference(ReferenceConfig(), learner, "local").active  # local *is* the reference
    big = LocalReference(ReferenceConfig(shadow_max_params=100, large_every=4), learner, "fedfomo")
    assert big.active and big.every == 4 and "trains one round in 4" in big.note


def test_the_twin_learns_alone_and_resumes_from_its_checkpointed_state():
    cfg = LearnerConfig(dataset="digits", model="mlp", model_params={"hidden": [16]}, optimizer="adam", lr=0.01)
    learner = build_learner(cfg)
    ref = LocalReference(ReferenceConfig(patience=1), learner, "dpsgd")
    assert ref.twin is not None
    start = ref.twin.get_params()
    assert all(torch.equal(start[k], v) for k, v in learner.get_params().items())  # the same θ⁰
    for rnd in (1, 2, 2, 3):  # a retried round (2) does not train the twin twice
        ref.train(rnd)
    alone = build_learner(cfg)
    for _ in range(3):
        alone.train()
    assert all(torch.equal(ref.twin.get_params()[k], v) for k, v in alone.get_params().items())
    learner.set_params({k: torch.zeros_like(v) for k, v in learner.get_params().items()})  # a ruined live model
    ev = ref.judge(3, {"test_acc": 0.0, "test_loss": 9.0}, None)
    assert ev["helping"] == 0.0 and ev["collab_test_acc"] == 0.0 and ev["test_acc"] == ev["local_test_acc"] > 0
    state = ref.export_state()
    again = LocalReference(ReferenceConfig(patience=1), build_learner(cfg), "dpsgd")
    again.import_state(state, 3)
    assert again.backed_off and again.trained_round == 3
    assert all(torch.equal(again.twin.get_params()[k], v) for k, v in ref.twin.get_params().items())
    assert again.settled_at is None
    fresh = LocalReference(ReferenceConfig(), build_learner(cfg), "dpsgd")
    fresh.import_state(None, 7)  # a checkpoint from before the reference: restarts, says so
    assert fresh.trained_round == 7 and "restarted from the initial model at round 7" in fresh.note


# ------------------------------------------------------------------------- on a real network
ROUNDS = 15


def outlier_network(strategies: list[str], reference: bool) -> dict:
    """4 nodes on digits: n0-n2 share the identity labelling, n3's labels are permuted."""
    return parse_scenario(
        {
            "name": "outlier",
            "seed": 1,
            "nodes": 4,
            "rounds": ROUNDS,
            "strategy": strategies,
            "bootstrap": "star",
            "timeout_s": 240,
            "learner": {
                "dataset": "digits",
                "partition": "label_permutation",
                "partition_params": {"num_clusters": 1, "samples_per_node": 440},
                "model": "mlp",
                "model_params": {"hidden": [64]},
                "optimizer": "adam",
                "lr": 0.003,
                "local_steps": 10,
                "device": "cpu",
            },
            "node": {
                "heartbeat_interval_s": 0.3,
                "start_timeout_s": 60,
                "round_interval_s": 0,
                "log_level": "WARNING",
                "privacy": {"enabled": False},
                **({} if reference else {"reference": {"enabled": False}}),
            },
            "overrides": [
                {"nodes": [3], "learner": {"partition_params": {"num_clusters": 4, "samples_per_node": 440}}}
            ],
        }
    )


@pytest.mark.timeout(600)
def test_a_node_among_peers_of_another_task_ends_within_noise_of_alone(tmp_path):
    res = run_scenario(
        outlier_network(["local", "dpsgd", "fedfomo", "federico"], True), tmp_path / "on", backend="inproc", check=False
    )
    off = run_scenario(outlier_network(["dpsgd"], False), tmp_path / "off", backend="inproc", check=False)
    local = res["strategies"]["local"]["nodes"]["n3"]
    alone, n_test = local["final_test_acc"], 88  # digits: 440 samples, 20 % test
    noise = accuracy_margin(alone, alone, n_test, 2.0)
    # without the reference, D-PSGD's average leaves the outlier far below what it learns alone
    assert off["strategies"]["dpsgd"]["nodes"]["n3"]["final_test_acc"] < alone - noise
    for s in ("dpsgd", "fedfomo", "federico"):
        node = res["strategies"][s]["nodes"]["n3"]
        last = node["eval"][-1]
        # the twin is what the node learns alone (it may have settled a few rounds before the end)
        assert abs(last["local_test_acc"] - alone) <= noise
        assert node["final_test_acc"] >= alone - noise, (s, node["final_test_acc"], alone)
        collab = node["collaboration"]
        assert collab["helping"] == (last["helping"] == 1.0) and collab["reference"]["active"]
        if not collab["helping"]:  # backed off: it reports (and predicts with) the local model
            assert node["final_test_acc"] == last["local_test_acc"] and "collab_test_acc" in last
            assert collab["reason"].startswith("collaboration is not helping this node: val acc")
    dpsgd = res["strategies"]["dpsgd"]["nodes"]["n3"]
    assert not dpsgd["collaboration"]["helping"]  # D-PSGD's outlier is the one that must back off
    assert dpsgd["eval"][-1]["collab_test_acc"] < alone - noise
    # the export is the model it predicts with: the twin's parameters, not the live model's
    state_dir = tmp_path / "on" / "dpsgd" / "nodes" / "n3"
    data, card = export_state_dir(state_dir)
    from safetensors.torch import load as st_load

    exported, ckpt = st_load(data), read_latest(state_dir)
    twin = {k[len("reference/model/") :]: v for k, v in ckpt.tensors.items() if k.startswith("reference/model/")}
    assert twin and set(exported) == set(twin) and all(torch.equal(exported[k], twin[k]) for k in twin)
    assert "mixture" not in card and card["eval"]["test_acc"] == dpsgd["final_test_acc"]


def test_the_twin_stops_training_once_its_validation_score_stops_improving():
    cfg = LearnerConfig(dataset="digits", model="mlp", model_params={"hidden": [16]})
    ref = LocalReference(ReferenceConfig(settle_after=2), build_learner(cfg), "fedfomo")
    assert ref.twin is not None
    for rnd, val in enumerate((0.5, 0.6, 0.6, 0.7, 0.65, 0.7), start=1):
        ref._settle(rnd, acc(val))
    assert ref.settled_at == 6  # two checks without beating 0.7
    before = ref.twin.get_params()
    ref.train(7)
    assert ref.trained_round == 7 and all(torch.equal(ref.twin.get_params()[k], v) for k, v in before.items())
    restored = LocalReference(ReferenceConfig(settle_after=2), build_learner(cfg), "fedfomo")
    restored.import_state(ref.export_state(), 7)
    assert restored.settled_at == 6
    never = LocalReference(ReferenceConfig(settle_after=0), build_learner(cfg), "fedfomo")
    for rnd in range(1, 20):
        never._settle(rnd, acc(0.5))
    assert never.settled_at is None
