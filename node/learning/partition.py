"""Deterministic partitions: every node computes every node's shard alone, no coordinator.

``partition(pool, cfg)`` is a pure function of the pool, ``cfg.partition``,
``cfg.partition_params``, ``cfg.num_nodes``, ``cfg.data_seed`` and the val/test fractions, so
node ``i`` takes ``partition(pool, cfg)[i]`` and all nodes agree on who holds what. Shards are
disjoint across nodes; when the pool cannot supply the requested sizes a ``ValueError`` says so.

Common ``partition_params``:

- ``samples_per_node``: samples per node (train+val+test): an int, or ``[lo, hi]`` so each
  node draws its size uniformly from that inclusive range. Default: the largest equal size the
  pool can supply for the partition (``len(pool) // num_nodes`` where classes don't matter).
- val/test: ``cfg.val_fraction`` / ``cfg.test_fraction`` of each node's own samples (rounded),
  the rest is train.

Partitions (``true_clusters`` gives each node's ground-truth cluster: nodes whose data come
from the same distribution share a cluster id):

- ``iid``: uniform random disjoint samples. All nodes cluster 0.
- ``dirichlet``: ``alpha`` (default 0.5): each node's class proportions ~ Dir(alpha·1). When a
  class runs out, the shortfall is taken from the node's other classes in proportion to its
  weights. Every node is its own cluster (cluster = node index).
- ``pathological``: ``k`` (default 2) classes per node, chosen so class usage stays balanced
  (McMahan et al.'s shards); a node's samples split evenly over its classes. Nodes with the same
  class set share a cluster (ids in order of first appearance).
- ``random_pairs``: each node draws ``k`` (default 2) distinct classes uniformly at random
  (SCool's non-IID); clusters as for ``pathological``.
- ``label_permutation``: ``num_clusters`` (default ``min(4, num_nodes)``). Contiguous blocks of nodes form the
  clusters: node ``i`` is in cluster ``i * num_clusters // num_nodes``. Samples are iid; cluster
  0 keeps the labels, every other cluster relabels with its own seeded random permutation
  (never the identity, distinct between clusters where possible). ``Shard.label_map[c]`` is the
  label a node trains and tests on for class ``c``.
- ``class_groups``: SCool's non-IID SBM. ``num_groups`` (default ``num_classes //
  classes_per_group``), ``classes_per_group`` (default 2). Contiguous blocks of nodes form the
  groups (as for ``label_permutation``); each group gets its own disjoint, seeded random set of
  classes. Cluster = group.
- ``sine_intervals`` (regression pools): ``num_intervals`` (default ``num_nodes``). The pool's
  x range is cut into equal-width intervals; node ``i`` draws from interval
  ``i * num_intervals // num_nodes``. Cluster = interval.
- ``mixture``: ``num_components`` K (default 4), ``alpha`` (default 0.5). K label-permutation
  components (component 0 keeps the labels, the others relabel as ``label_permutation``'s
  clusters do); node ``i`` draws its mixture weights π_i ~ Dir(alpha·1_K) and each of its splits
  holds the components in those proportions (largest-remainder rounding), samples iid from the
  pool — the mixture-of-distributions setting of FedeRiCo §2.1 (after FedEM). ``true_mixture``
  gives every π_i without loading data (results.json carries it); cluster = argmax_k π_ik.

Label noise (``cfg.label_noise``) is per node, so it is applied in ``node_data`` to the
node's own train labels only: that share of them (rounded) is replaced by labels drawn
uniformly from all classes (which may coincide with the true label).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .config import LearnerConfig
from .datasets import Pool, dataset_num_classes

PARTITIONS = (
    "iid",
    "dirichlet",
    "pathological",
    "label_permutation",
    "class_groups",
    "random_pairs",
    "sine_intervals",
    "mixture",
)
_PARAMS = {
    "iid": set(),
    "dirichlet": {"alpha"},
    "pathological": {"k"},
    "random_pairs": {"k"},
    "label_permutation": {"num_clusters"},
    "class_groups": {"num_groups", "classes_per_group"},
    "sine_intervals": {"num_intervals"},
    "mixture": {"num_components", "alpha"},
}
_REGRESSION_OK = {"iid", "sine_intervals"}

# salts separating the independent random streams derived from data_seed
_S_SIZES, _S_CLASSES, _S_SAMPLES, _S_PERM, _S_DIR, _S_NOISE, _S_MIX = 11, 12, 13, 14, 15, 16, 17


@dataclass
class Shard:
    train: np.ndarray  # int64 indices into the pool
    val: np.ndarray
    test: np.ndarray
    cluster: int
    label_map: np.ndarray | None = None  # class -> label this node sees (label_permutation)
    classes: tuple[int, ...] | None = None  # classes this node was given, if restricted
    mixture: np.ndarray | None = None  # true mixture weights π_i over the components (mixture)
    component_maps: np.ndarray | None = None  # (K, C): class -> label under component k (mixture)
    components: dict[str, np.ndarray] | None = None  # split -> component of each sample (mixture)

    def indices(self, split: str) -> np.ndarray:
        return {"train": self.train, "val": self.val, "test": self.test}[split]

    def __len__(self) -> int:
        return len(self.train) + len(self.val) + len(self.test)


@dataclass
class Splits:
    """A node's samples as the learner takes them: inputs and labels of its three splits."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass
class NodeData(Splits):
    """One node's arrays, labels already mapped (and train labels noised) as the node sees them."""

    shard: Shard
    noisy: np.ndarray  # indices into the train split whose label was replaced


def _rng(cfg: LearnerConfig, salt: int, *more: int) -> np.random.Generator:
    return np.random.default_rng([int(cfg.data_seed) & 0xFFFFFFFF, salt, *more])


def _params(cfg: LearnerConfig) -> dict:
    p = dict(cfg.partition_params)
    allowed = _PARAMS[cfg.partition] | {"samples_per_node"}
    unknown = set(p) - allowed
    if unknown:
        raise ValueError(
            f"partition {cfg.partition!r}: unknown partition_params {sorted(unknown)}; allowed: {sorted(allowed)}"
        )
    return p


def _blocks(n: int, groups: int) -> list[int]:
    """Contiguous blocks: node i belongs to block i * groups // n."""
    return [i * groups // n for i in range(n)]


def _num_classes(cfg: LearnerConfig) -> int:
    return dataset_num_classes(cfg.dataset, cfg.dataset_params)


def _class_sets(cfg: LearnerConfig, num_classes: int) -> list[tuple[int, ...]]:
    """Per-node class sets for the class-restricted partitions (independent of the samples)."""
    p, n = _params(cfg), cfg.num_nodes
    if cfg.partition in ("pathological", "random_pairs"):
        k = int(p.get("k", 2))
        if not 1 <= k <= num_classes:
            raise ValueError(f"{cfg.partition}: k={k} must be in [1, {num_classes}]")
        rng = _rng(cfg, _S_CLASSES)
        sets = []
        if cfg.partition == "random_pairs":
            for _ in range(n):
                sets.append(tuple(sorted(int(c) for c in rng.choice(num_classes, k, replace=False))))
        else:  # balanced: the k least-used classes, ties broken at random
            used = np.zeros(num_classes)
            for _ in range(n):
                order = np.lexsort((rng.random(num_classes), used))
                chosen = order[:k]
                used[chosen] += 1
                sets.append(tuple(sorted(int(c) for c in chosen)))
        return sets
    if cfg.partition == "class_groups":
        cpg = int(p.get("classes_per_group", 2))
        groups = int(p.get("num_groups", num_classes // max(cpg, 1)))
        if cpg < 1 or groups < 1 or groups * cpg > num_classes:
            raise ValueError(
                f"class_groups: num_groups={groups} x classes_per_group={cpg} "
                f"needs that many distinct classes; the dataset has {num_classes}"
            )
        if groups > n:
            raise ValueError(f"class_groups: num_groups={groups} > num_nodes={n}")
        perm = _rng(cfg, _S_CLASSES).permutation(num_classes)
        group_classes = [tuple(sorted(int(c) for c in perm[g * cpg : (g + 1) * cpg])) for g in range(groups)]
        return [group_classes[g] for g in _blocks(n, groups)]
    raise AssertionError(cfg.partition)


def true_mixture(cfg: LearnerConfig) -> np.ndarray | None:
    """(num_nodes, K) true mixture weights of the ``mixture`` partition (row i = π_i), else None.
    Loads no data."""
    return _mixture(cfg) if cfg.partition == "mixture" else None


def _mixture(cfg: LearnerConfig) -> np.ndarray:
    p = _params(cfg)
    k, alpha = int(p.get("num_components", 4)), float(p.get("alpha", 0.5))
    if k < 1:
        raise ValueError(f"mixture: num_components={k} must be >= 1")
    if alpha <= 0:
        raise ValueError(f"mixture: alpha must be > 0, got {alpha}")
    return _rng(cfg, _S_MIX).dirichlet(np.full(k, alpha), size=cfg.num_nodes)


def _component_counts(m: int, weights: np.ndarray) -> np.ndarray:
    """m samples split in proportion to ``weights`` (largest remainder: sums to m exactly)."""
    raw = weights * m
    counts = np.floor(raw).astype(np.int64)
    rest = m - int(counts.sum())
    counts[np.argsort(-(raw - counts), kind="stable")[:rest]] += 1
    return counts


def true_clusters(cfg: LearnerConfig) -> list[int]:
    """Ground-truth cluster of every node (index = node index). Loads no data."""
    p, n = _params(cfg), cfg.num_nodes
    part = cfg.partition
    if part == "iid":
        return [0] * n
    if part == "mixture":
        return [int(k) for k in np.argmax(_mixture(cfg), axis=1)]
    if part == "dirichlet":
        return list(range(n))
    if part == "label_permutation":
        # default 4, or fewer for a smaller network (a hand-started node has num_nodes = 1)
        c = int(p.get("num_clusters", min(4, n)))
        if not 1 <= c <= n:
            raise ValueError(f"label_permutation: num_clusters={c} must be in [1, num_nodes={n}]")
        return _blocks(n, c)
    if part == "sine_intervals":
        m = int(p.get("num_intervals", n))
        if not 1 <= m <= n:
            raise ValueError(f"sine_intervals: num_intervals={m} must be in [1, num_nodes={n}]")
        return _blocks(n, m)
    if part == "class_groups":
        cpg = int(p.get("classes_per_group", 2))
        groups = int(p.get("num_groups", _num_classes(cfg) // max(cpg, 1)))
        _class_sets(cfg, _num_classes(cfg))  # validates
        return _blocks(n, groups)
    # pathological / random_pairs: nodes with identical class sets share a cluster
    ids: dict[tuple[int, ...], int] = {}
    return [ids.setdefault(s, len(ids)) for s in _class_sets(cfg, _num_classes(cfg))]


def _sizes(cfg: LearnerConfig, default: int) -> list[int]:
    spn = _params(cfg).get("samples_per_node")
    n = cfg.num_nodes
    if spn is None:
        if default < 1:
            raise ValueError(f"partition {cfg.partition!r}: the pool is too small to give {n} nodes any samples")
        return [default] * n
    if isinstance(spn, (list, tuple)):
        if len(spn) != 2 or not 1 <= int(spn[0]) <= int(spn[1]):
            raise ValueError(f"samples_per_node range must be [lo, hi] with 1 <= lo <= hi, got {spn}")
        return [int(v) for v in _rng(cfg, _S_SIZES).integers(int(spn[0]), int(spn[1]) + 1, n)]
    if int(spn) < 1:
        raise ValueError(f"samples_per_node must be >= 1, got {spn}")
    return [int(spn)] * n


def _split(cfg: LearnerConfig, idx: np.ndarray, node: int) -> tuple[np.ndarray, ...]:
    """idx is already in random order: test first, then val, then train."""
    s = len(idx)
    n_test = int(round(cfg.test_fraction * s))
    n_val = int(round(cfg.val_fraction * s))
    if s - n_test - n_val < 1:
        raise ValueError(
            f"node {node}: {s} samples leave no training data after "
            f"val_fraction={cfg.val_fraction}, test_fraction={cfg.test_fraction}"
        )
    test, val, train = idx[:n_test], idx[n_test : n_test + n_val], idx[n_test + n_val :]
    return np.sort(train), np.sort(val), np.sort(test)


def _short(cfg: LearnerConfig, what: str, need: int, have: int) -> ValueError:
    return ValueError(
        f"partition {cfg.partition!r} with {cfg.num_nodes} nodes needs {need} "
        f"samples {what} but the pool has only {have}; lower "
        f"partition_params.samples_per_node or enlarge the dataset"
    )


def partition(pool: Pool, cfg: LearnerConfig) -> list[Shard]:
    """Every node's shard (index = node index)."""
    part, n = cfg.partition, cfg.num_nodes
    p = _params(cfg)
    if pool.task == "regression" and part not in _REGRESSION_OK:
        raise ValueError(f"partition {part!r} needs class labels; regression pools take {sorted(_REGRESSION_OK)}")
    if part == "sine_intervals" and pool.task != "regression":
        raise ValueError("partition 'sine_intervals' is for regression pools (dataset 'sine')")
    clusters = true_clusters(cfg)
    sample_rng = _rng(cfg, _S_SAMPLES)
    node_idx: list[np.ndarray] = []
    label_maps: list[np.ndarray | None] = [None] * n
    classes: list[tuple[int, ...] | None] = [None] * n

    if part in ("iid", "label_permutation", "mixture"):
        sizes = _sizes(cfg, len(pool) // n)
        if sum(sizes) > len(pool):
            raise _short(cfg, "in all", sum(sizes), len(pool))
        perm = sample_rng.permutation(len(pool))
        offs = np.cumsum([0] + sizes)
        node_idx = [perm[offs[i] : offs[i + 1]] for i in range(n)]
        if part == "label_permutation":
            label_maps = list(_label_maps(cfg, pool.num_classes, clusters))
        if part == "mixture":
            mix = _mixture(cfg)
            comp_maps = np.stack(_label_maps(cfg, pool.num_classes, list(range(mix.shape[1]))))

    elif part == "sine_intervals":
        lo, hi = pool.meta.get("x_range", (float(pool.x.min()), float(pool.x.max())))
        m = int(p.get("num_intervals", n))
        x = pool.x.reshape(len(pool), -1)[:, 0]
        bucket = np.clip(((x - lo) / (hi - lo) * m).astype(np.int64), 0, m - 1)
        avail = [sample_rng.permutation(np.flatnonzero(bucket == b)) for b in range(m)]
        members = [clusters.count(b) for b in range(m)]
        sizes = _sizes(cfg, min(len(avail[b]) // members[b] for b in range(m)))
        taken = [0] * m
        for i in range(n):
            b = clusters[i]
            if taken[b] + sizes[i] > len(avail[b]):
                raise _short(
                    cfg, f"in x-interval {b}", sum(s for j, s in enumerate(sizes) if clusters[j] == b), len(avail[b])
                )
            node_idx.append(avail[b][taken[b] : taken[b] + sizes[i]])
            taken[b] += sizes[i]

    else:  # class-based: per-class queues of shuffled indices, taken in node order
        C = pool.num_classes
        queues = [sample_rng.permutation(np.flatnonzero(pool.y == c)) for c in range(C)]
        class_avail = np.array([len(q) for q in queues])
        if part == "dirichlet":
            alpha = float(p.get("alpha", 0.5))
            if alpha <= 0:
                raise ValueError(f"dirichlet: alpha must be > 0, got {alpha}")
            sizes = _sizes(cfg, len(pool) // n)
            if sum(sizes) > len(pool):
                raise _short(cfg, "in all", sum(sizes), len(pool))
            drng = _rng(cfg, _S_DIR)
            weights = [drng.dirichlet(np.full(C, alpha)) for _ in range(n)]
            counts = [_capped_counts(drng, sizes[i], weights[i], class_avail) for i in range(n)]
        else:
            sets = _class_sets(cfg, C)
            users = np.zeros(C)
            for s in sets:
                for c in s:
                    users[c] += 1.0 / len(s)  # a node's samples split evenly over its classes
            used = users > 0
            k = len(sets[0])  # the same for every node; default size: a multiple of k that fits
            sizes = _sizes(cfg, k * int(np.floor(np.min(class_avail[used] / users[used]) / k + 1e-9)))
            counts = []
            crng = _rng(cfg, _S_CLASSES, 1)
            for i, s in enumerate(sets):
                per = np.zeros(C, dtype=np.int64)
                k = len(s)
                base, rem = divmod(sizes[i], k)
                extra = set(crng.permutation(list(s))[:rem].tolist())
                for c in s:
                    per[c] = base + (1 if c in extra else 0)
                counts.append(per)
                classes[i] = s
            need = np.sum(counts, axis=0)
            for c in range(C):
                if need[c] > class_avail[c]:
                    raise _short(cfg, f"of class {c}", int(need[c]), int(class_avail[c]))
        class_taken = np.zeros(C, dtype=np.int64)
        for i in range(n):
            parts = []
            for c in np.flatnonzero(counts[i]).tolist():
                parts.append(queues[c][class_taken[c] : class_taken[c] + counts[i][c]])
                class_taken[c] += counts[i][c]
            idx = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            node_idx.append(sample_rng.permutation(idx))  # mix classes before the split

    shards = []
    for i in range(n):
        tr, va, te = _split(cfg, np.asarray(node_idx[i], dtype=np.int64), i)
        shard = Shard(tr, va, te, clusters[i], label_maps[i], classes[i])
        if part == "mixture":  # every split holds the components in proportion π_i
            crng = _rng(cfg, _S_MIX, 1, i)
            shard.mixture, shard.component_maps = mix[i], comp_maps
            shard.components = {
                name: crng.permutation(np.repeat(np.arange(len(mix[i])), _component_counts(len(idx), mix[i])))
                for name, idx in (("train", tr), ("val", va), ("test", te))
            }
        shards.append(shard)
    return shards


def _capped_counts(rng: np.random.Generator, size: int, w: np.ndarray, avail: np.ndarray) -> np.ndarray:
    """Multinomial(size, w) counts that never exceed avail; decrements avail."""
    counts = np.minimum(rng.multinomial(size, w), avail)
    short = size - int(counts.sum())
    while short > 0:
        room = avail - counts
        ww = np.where(room > 0, w + 1e-12, 0.0)  # tiny floor: a class with w=0 can still help
        if ww.sum() <= 0:
            raise AssertionError("pool exhausted despite the size check")
        add = np.minimum(rng.multinomial(short, ww / ww.sum()), room)
        counts += add
        short -= int(add.sum())
    avail -= counts
    return counts


def _label_maps(cfg: LearnerConfig, C: int, clusters: list[int]) -> list[np.ndarray]:
    rng = _rng(cfg, _S_PERM)
    k = max(clusters) + 1
    maps = [np.arange(C, dtype=np.int64)]
    seen = {tuple(maps[0])}
    for _ in range(1, k):
        for _attempt in range(1000):
            perm = rng.permutation(C).astype(np.int64)
            if tuple(perm) not in seen:  # small C may run out of fresh ones: then reuse
                break
        seen.add(tuple(perm))
        maps.append(perm)
    return [maps[c] for c in clusters]


_SHARDS: OrderedDict[tuple, tuple[weakref.ref, list[Shard]]] = OrderedDict()
_SHARDS_LOCK = threading.Lock()


def shared_partition(pool: Pool, cfg: LearnerConfig) -> list[Shard]:
    """``partition(pool, cfg)``, computed once per pool and partition in this process: the nodes
    of an in-process network would otherwise each recompute every node's shard (O(N²)). The
    shards' index arrays are read-only, as they are shared."""
    key = (
        id(pool),
        cfg.dataset,
        json.dumps(cfg.dataset_params, sort_keys=True, default=str),
        cfg.partition,
        json.dumps(cfg.partition_params, sort_keys=True, default=str),
        cfg.num_nodes,
        cfg.data_seed,
        cfg.val_fraction,
        cfg.test_fraction,
    )
    with _SHARDS_LOCK:
        hit = _SHARDS.get(key)
        if hit is not None and hit[0]() is pool:
            _SHARDS.move_to_end(key)
            return hit[1]
        shards = partition(pool, cfg)
        for sh in shards:
            for a in (sh.train, sh.val, sh.test):
                a.setflags(write=False)
        _SHARDS[key] = (weakref.ref(pool), shards)
        while len(_SHARDS) > 8:
            _SHARDS.popitem(last=False)
        return shards


def node_data(pool: Pool, cfg: LearnerConfig, shards: list[Shard] | None = None) -> NodeData:
    """This node's (cfg.node_index) arrays as it sees them: mapped labels, noisy train labels.
    Only the node's own samples are copied out of the pool (which may be a memory map)."""
    if cfg.node_index >= cfg.num_nodes:
        raise ValueError(f"node_index {cfg.node_index} >= num_nodes {cfg.num_nodes}")
    shard = (shards or shared_partition(pool, cfg))[cfg.node_index]

    def labels(idx: np.ndarray, split: str) -> np.ndarray:
        y = np.array(pool.y[idx])
        if shard.components is not None:
            assert shard.component_maps is not None  # set together with the components
            return shard.component_maps[shard.components[split], y]
        return shard.label_map[y] if shard.label_map is not None else y

    y_train = labels(shard.train, "train")
    noisy = np.zeros(0, dtype=np.int64)
    if cfg.label_noise > 0:
        if pool.task != "classification":
            raise ValueError("label_noise applies to classification datasets only")
        rng = _rng(cfg, _S_NOISE, cfg.node_index)
        m = int(round(cfg.label_noise * len(y_train)))
        noisy = np.sort(rng.choice(len(y_train), m, replace=False))
        y_train[noisy] = rng.integers(0, pool.num_classes, m)
    return NodeData(
        np.array(pool.x[shard.train]),
        y_train,
        np.array(pool.x[shard.val]),
        labels(shard.val, "val"),
        np.array(pool.x[shard.test]),
        labels(shard.test, "test"),
        shard,
        noisy,
    )
