import json
import subprocess
import sys

import numpy as np
import pytest

from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.datasets import load_pool
from coterie.node.learning.partition import node_data, partition, true_clusters


def cfg(**kw):
    base = dict(dataset="digits", num_nodes=10, data_seed=7, model="mlp")
    base.update(kw)
    return LearnerConfig(**base)


@pytest.fixture(scope="module")
def digits():
    return load_pool("digits", {}, 7)


def _all(shard):
    return np.concatenate([shard.train, shard.val, shard.test])


def assert_disjoint(shards):
    allidx = np.concatenate([_all(s) for s in shards])
    assert len(np.unique(allidx)) == len(allidx)


def labels_of(pool, s):
    return set(pool.y[_all(s)].tolist())


def test_iid_sizes_splits_and_disjoint(digits):
    c = cfg(partition="iid", partition_params={"samples_per_node": 100}, val_fraction=0.1, test_fraction=0.2)
    shards = partition(digits, c)
    assert len(shards) == 10
    assert_disjoint(shards)
    for s in shards:
        assert (len(s.train), len(s.val), len(s.test)) == (70, 10, 20)
        assert len(set(s.train) & set(s.test)) == 0
        assert len(labels_of(digits, s)) >= 8
    assert true_clusters(c) == [0] * 10


def test_default_size_uses_pool_and_too_large_raises(digits):
    shards = partition(digits, cfg(partition="iid"))
    assert sum(len(s) for s in shards) == (len(digits) // 10) * 10
    with pytest.raises(ValueError, match="samples_per_node"):
        partition(digits, cfg(partition="iid", partition_params={"samples_per_node": 200}))


def test_size_range(digits):
    c = cfg(partition="iid", partition_params={"samples_per_node": [20, 60]})
    sizes = [len(s) for s in partition(digits, c)]
    assert all(20 <= n <= 60 for n in sizes) and len(set(sizes)) > 1
    assert sizes == [len(s) for s in partition(digits, c)]


def test_dirichlet_skew(digits):
    few = partition(digits, cfg(partition="dirichlet", partition_params={"alpha": 0.05, "samples_per_node": 60}))
    many = partition(digits, cfg(partition="dirichlet", partition_params={"alpha": 100.0, "samples_per_node": 60}))
    assert_disjoint(few)
    assert all(len(s) == 60 for s in few)

    def top_share(shards):
        return np.mean([np.bincount(digits.y[_all(s)], minlength=10).max() / len(s) for s in shards])

    assert top_share(few) > 0.6 > 0.3 > top_share(many)
    assert true_clusters(cfg(partition="dirichlet")) == list(range(10))


def test_pathological_k_classes_balanced(digits):
    c = cfg(partition="pathological", partition_params={"k": 2})
    shards = partition(digits, c)
    assert_disjoint(shards)
    for s in shards:
        assert labels_of(digits, s) == set(s.classes) and len(s.classes) == 2
    usage = np.bincount([c_ for s in shards for c_ in s.classes], minlength=10)
    assert usage.max() - usage.min() <= 1
    tc = true_clusters(c)
    for i in range(10):
        for j in range(10):
            assert (tc[i] == tc[j]) == (shards[i].classes == shards[j].classes)


def test_random_pairs(digits):
    c = cfg(partition="random_pairs", num_nodes=20, partition_params={"samples_per_node": 30})
    shards = partition(digits, c)
    assert_disjoint(shards)
    pairs = {s.classes for s in shards}
    assert all(len(labels_of(digits, s)) == 2 for s in shards) and len(pairs) > 5


def test_label_permutation_blocks_and_maps(digits):
    c = cfg(partition="label_permutation", partition_params={"num_clusters": 3, "samples_per_node": 100})
    shards = partition(digits, c)
    assert_disjoint(shards)
    assert true_clusters(c) == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [s.cluster for s in shards] == true_clusters(c)
    maps = {s.cluster: tuple(s.label_map) for s in shards}
    assert maps[0] == tuple(range(10))
    assert len(set(maps.values())) == 3
    for m in maps.values():
        assert sorted(m) == list(range(10))
    for s in shards:  # same cluster, same map
        assert tuple(s.label_map) == maps[s.cluster]
    d = node_data(digits, c.model_copy(update={"node_index": 5}))
    np.testing.assert_array_equal(d.y_test, np.asarray(maps[1])[digits.y[d.shard.test]])
    assert not np.array_equal(d.y_test, digits.y[d.shard.test])


def test_class_groups(digits):
    c = cfg(partition="class_groups", partition_params={"num_groups": 5, "classes_per_group": 2})
    shards = partition(digits, c)
    assert_disjoint(shards)
    assert true_clusters(c) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    groups = {}
    for s in shards:
        groups.setdefault(s.cluster, set()).add(s.classes)
        assert labels_of(digits, s) == set(s.classes)
    assert all(len(v) == 1 for v in groups.values())  # a group shares one class set
    sets = [next(iter(v)) for v in groups.values()]
    assert len(set().union(*sets)) == 10  # groups never share classes
    with pytest.raises(ValueError, match="distinct classes"):
        partition(digits, cfg(partition="class_groups", partition_params={"num_groups": 6}))


def test_sine_intervals():
    pool = load_pool("sine", {"num_samples": 1000}, 7)
    c = LearnerConfig(dataset="sine", partition="sine_intervals", num_nodes=4, data_seed=7, model="linear")
    shards = partition(pool, c)
    assert_disjoint(shards)
    lo, hi = pool.meta["x_range"]
    w = (hi - lo) / 4
    for i, s in enumerate(shards):
        x = pool.x[_all(s), 0]
        assert lo + i * w <= x.min() and x.max() <= lo + (i + 1) * w
        assert s.cluster == i
    with pytest.raises(ValueError, match="regression"):
        partition(pool, c.model_copy(update={"partition": "dirichlet"}))


def test_label_noise_only_train_and_only_this_node(digits):
    c = cfg(partition="iid", partition_params={"samples_per_node": 150}, node_index=2)
    clean = node_data(digits, c)
    noisy = node_data(digits, c.model_copy(update={"label_noise": 0.5}))
    assert len(noisy.noisy) == round(0.5 * len(clean.y_train))
    changed = np.flatnonzero(noisy.y_train != clean.y_train)
    assert set(changed) <= set(noisy.noisy) and len(changed) > 0.3 * len(noisy.noisy)
    np.testing.assert_array_equal(noisy.y_test, clean.y_test)
    np.testing.assert_array_equal(noisy.y_val, clean.y_val)
    np.testing.assert_array_equal(noisy.shard.train, clean.shard.train)


def test_unknown_param_rejected(digits):
    with pytest.raises(ValueError, match="alpah"):
        partition(digits, cfg(partition="dirichlet", partition_params={"alpah": 1}))


def test_seed_changes_shards(digits):
    a = partition(digits, cfg(partition="pathological"))
    b = partition(digits, cfg(partition="pathological", data_seed=8))
    assert [s.classes for s in a] != [s.classes for s in b] or not np.array_equal(a[0].train, b[0].train)


_CHILD = """
import json, sys
from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.datasets import load_pool
from coterie.node.learning.partition import node_data
out = []
for js in json.loads(sys.argv[1]):
    c = LearnerConfig.model_validate_json(js)
    d = node_data(load_pool(c.dataset, c.dataset_params, c.data_seed), c)
    out.append({"train": d.shard.train.tolist(), "test": d.shard.test.tolist(),
                "y": d.y_train.tolist(), "cluster": d.shard.cluster})
print(json.dumps(out))
"""


def test_same_shards_in_another_process():
    """Every node computes its shard alone: a fresh interpreter must agree bit for bit."""
    gauss = {"num_samples": 2000, "dim": 4, "num_classes": 6}
    cfgs = [
        cfg(
            dataset="gaussian", dataset_params=gauss, partition=part, partition_params=pp, node_index=6, label_noise=0.2
        )
        for part, pp in [
            ("dirichlet", {"alpha": 0.3, "samples_per_node": [40, 80]}),
            ("label_permutation", {"num_clusters": 2}),
            ("random_pairs", {"samples_per_node": 50}),
            ("class_groups", {"num_groups": 3}),
        ]
    ]
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([c.model_dump_json() for c in cfgs])],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    children = json.loads(out.stdout)
    for c, child in zip(cfgs, children, strict=True):
        mine = node_data(load_pool(c.dataset, c.dataset_params, c.data_seed), c)
        assert child["train"] == mine.shard.train.tolist()
        assert child["test"] == mine.shard.test.tolist()
        assert child["y"] == mine.y_train.tolist()
        assert child["cluster"] == mine.shard.cluster


def test_mixture_components_follow_the_true_weights(digits):
    """Every node's splits hold the K label-permutation components in its Dir(α) proportions; the
    labels are the component's relabelling of the class; weights need no data and are seeded."""
    from coterie.node.learning.partition import true_mixture

    c = cfg(
        partition="mixture",
        partition_params={"num_components": 3, "alpha": 0.5, "samples_per_node": 150},
        val_fraction=0.2,
        test_fraction=0.2,
    )
    mix = true_mixture(c)
    assert mix.shape == (10, 3) and np.allclose(mix.sum(1), 1)
    assert np.array_equal(
        mix,
        true_mixture(
            cfg(partition="mixture", partition_params={"num_components": 3, "alpha": 0.5, "samples_per_node": 150})
        ),
    )  # sizes don't change π
    assert not np.allclose(
        mix, true_mixture(cfg(partition="mixture", data_seed=8, partition_params={"num_components": 3, "alpha": 0.5}))
    )
    shards = partition(digits, c)
    assert_disjoint(shards)
    assert true_clusters(c) == [int(np.argmax(m)) for m in mix]
    maps = shards[0].component_maps
    assert maps.shape == (3, 10) and np.array_equal(maps[0], np.arange(10))
    assert len({tuple(m) for m in maps}) == 3
    for i, s in enumerate(shards):
        assert np.array_equal(s.mixture, mix[i]) and np.array_equal(s.component_maps, maps)
        for split in ("train", "val", "test"):
            comp = s.components[split]
            assert len(comp) == len(s.indices(split))
            share = np.bincount(comp, minlength=3) / len(comp)
            assert np.abs(share - mix[i]).max() <= 1 / len(comp) + 1e-9  # exact up to rounding
        d = node_data(digits, c.model_copy(update={"node_index": i}), shards)
        assert np.array_equal(d.y_test, maps[s.components["test"], digits.y[s.test]])
        assert np.array_equal(d.y_train, maps[s.components["train"], digits.y[s.train]])
    # smaller α: more nodes dominated by one component
    peaked = true_mixture(cfg(partition="mixture", num_nodes=200, partition_params={"alpha": 0.1}))
    flat = true_mixture(cfg(partition="mixture", num_nodes=200, partition_params={"alpha": 10.0}))
    assert peaked.max(1).mean() > 0.8 > 0.5 > flat.max(1).mean()


def test_mixture_rejects_bad_params(digits):
    with pytest.raises(ValueError, match="alpha"):
        partition(digits, cfg(partition="mixture", partition_params={"alpha": 0}))
    with pytest.raises(ValueError, match="num_components"):
        true_clusters(cfg(partition="mixture", partition_params={"num_components": 0}))
    with pytest.raises(ValueError, match="unknown partition_params"):
        partition(digits, cfg(partition="mixture", partition_params={"k": 2}))
    with pytest.raises(ValueError, match="needs class labels"):
        partition(load_pool("sine", {}, 0), cfg(dataset="sine", partition="mixture"))
