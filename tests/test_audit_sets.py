"""lab/audit.py: every node's audit set comes from its own distribution, holds none of any node's
samples, and the inproc backend hands the finished nodes, live, to a caller that scores them."""

from __future__ import annotations

import numpy as np
import pytest

from coterie.lab.audit import audit_sets, paired_gain, score_node
from coterie.lab.launch import run_scenario
from coterie.lab.scenario import parse_scenario
from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.datasets import load_pool
from coterie.node.learning.partition import node_data, partition


def learner(**kw) -> LearnerConfig:
    base = {"dataset": "gaussian", "num_nodes": 4, "node_index": 0, "data_seed": 5, "model": "mlp"}
    return LearnerConfig(**{**base, **kw})


def test_gaussian_audit_follows_each_nodes_own_label_permutation():
    cfg = learner(
        dataset_params={"num_samples": 2000, "separation": 2.0},
        partition="label_permutation",
        partition_params={"num_clusters": 2, "samples_per_node": 300},
    )
    sets = audit_sets(cfg, 400)
    assert [len(a) for a in sets] == [400] * 4
    for i, a in enumerate(sets):
        own = node_data(
            load_pool(cfg.dataset, cfg.dataset_params, cfg.data_seed), cfg.model_copy(update={"node_index": i})
        )
        for label in range(4):  # the class the node calls `label` sits where its own samples of it sit
            gap = np.linalg.norm(a.x[a.y == label].mean(0) - own.x_train[own.y_train == label].mean(0))
            assert gap < 1.5, (i, label, gap)  # sampling error ~0.6; two classes sit ~2*sqrt(20) apart
    assert not np.array_equal(sets[0].y, sets[2].y)  # the two clusters label the same points differently
    pool = load_pool(cfg.dataset, cfg.dataset_params, cfg.data_seed)
    assert not (set(map(bytes, sets[0].x)) & set(map(bytes, np.asarray(pool.x))))  # fresh points


def test_sine_audit_stays_in_the_nodes_interval_and_on_the_curve():
    cfg = learner(
        dataset="sine",
        dataset_params={"num_samples": 400, "noise": 0.1},
        partition="sine_intervals",
        partition_params={"num_intervals": 2, "samples_per_node": 50},
    )
    left, _, right, _ = audit_sets(cfg, 300)
    assert left.x.max() <= 0 <= right.x.min() and left.x.min() < -2.5 and right.x.max() > 2.5
    resid = left.y - np.sin(left.x[:, 0])
    assert 0.08 < resid.std() < 0.12  # the scenario's noise, not another curve


def test_class_groups_audit_holds_the_nodes_classes_only_balanced():
    cfg = learner(
        dataset="mnist1d",
        dataset_params={"num_samples": 1000},
        partition="class_groups",
        partition_params={"num_groups": 2, "classes_per_group": 2, "samples_per_node": 40},
    )
    shards = partition(load_pool(cfg.dataset, cfg.dataset_params, cfg.data_seed), cfg)
    for sh, a in zip(shards, audit_sets(cfg, 100), strict=True):
        labels, counts = np.unique(a.y, return_counts=True)
        assert tuple(labels) == sh.classes and list(counts) == [50, 50]


def test_digits_audit_is_every_sample_no_shard_holds():
    cfg = learner(
        dataset="digits", partition="label_permutation", partition_params={"num_clusters": 2, "samples_per_node": 150}
    )
    pool = load_pool("digits")
    sets = audit_sets(cfg)
    assert [len(a) for a in sets] == [1797 - 4 * 150] * 4
    held = {bytes(np.asarray(pool.x[j])) for sh in partition(pool, cfg) for s in (sh.train, sh.val, sh.test) for j in s}
    assert not held & {bytes(x) for x in sets[0].x}  # the bundled digits hold no duplicate images


def test_an_unsupported_partition_is_named():
    with pytest.raises(ValueError, match="partition 'dirichlet' not supported"):
        audit_sets(learner(partition="dirichlet"))


def test_paired_gain_and_its_standard_error():
    node, twin = np.array([1.0, 1, 0, 1]), np.array([0.0, 1, 0, 0])
    g, se = paired_gain(node, twin, "classification")
    assert g == pytest.approx(50.0) and se == pytest.approx(100 * np.std([1, 0, 0, 1], ddof=1) / 2)
    g, _ = paired_gain(np.array([1.0, 1.0]), np.array([2.0, 2.0]), "regression")  # half the twin's MSE
    assert g == pytest.approx(50.0)


def test_inproc_hands_the_finished_nodes_live_to_on_done(tmp_path):
    sc = parse_scenario(
        {
            "name": "t",
            "seed": 3,
            "nodes": 4,
            "rounds": 3,
            "strategy": ["fedfomo"],
            "learner": {
                "dataset": "gaussian",
                "dataset_params": {"num_samples": 800, "separation": 1.0},
                "partition": "label_permutation",
                "partition_params": {"num_clusters": 2, "samples_per_node": 100},
                "model": "mlp",
                "model_params": {"hidden": [16]},
                "local_steps": 3,
                "device": "cpu",
            },
            "node": {"heartbeat_interval_s": 0.3, "start_timeout_s": 60},
        }
    )
    sets = audit_sets(LearnerConfig(**{**sc.learner, "num_nodes": 4, "node_index": 0, "data_seed": 3}), 200)
    seen = {}

    def audit(nodes):
        for i, n in enumerate(nodes):
            seen[n.node_id] = (n.done, n.round, score_node(n, sets[i]))

    run_scenario(sc, tmp_path, backend="inproc", on_done=audit)
    assert sorted(seen) == ["n0", "n1", "n2", "n3"]
    for done, rnd, scores in seen.values():
        assert done and rnd == 3
        assert set(scores) == {"reported", "collab", "twin"} and all(len(v) == 200 for v in scores.values())
