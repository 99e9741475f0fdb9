"""Audit sets: for every node of a lab network, a large extra sample from *that node's own
distribution* (its cluster's label permutation, class set or x-interval), disjoint from every
node's train/val/test split and never given to any node. A node's own test split holds 8-30
samples on small networks, so one sample moves its accuracy 3-7 points; an audit set of
thousands tells a real loss from split noise (issue 33, bench/never_worse.py).

Where the samples come from:

- ``sine``, ``mnist1d``: the generator again with another seed (``AUDIT_SEED_OFFSET``): their
  distribution does not depend on the seed (sine: ``x_range``/``noise``; mnist1d: its fixed
  templates; its per-dataset standardisation moves with the sample, by ~1/sqrt(N));
- ``gaussian``: its class means depend on the seed, so they are redrawn as the generator draws
  them and fresh points are drawn around them from an independent stream;
- ``digits`` (1,797 bundled samples, no generator): what the nodes' shards leave over.

Then each node's share, as ``partition`` defines its distribution: ``label_permutation`` maps the
labels with the node's permutation; ``class_groups``/``pathological``/``random_pairs`` keep its
classes (balanced where generated); ``sine_intervals`` keeps its interval; ``iid`` keeps all.
Label noise is never applied (a node's val/test labels are clean too).

``AuditScorer`` scores what a live node (lab inproc backend) predicts with, its collaborative
model and its local-only twin on its audit set, per sample, so a gain comes with the standard
error of the paired difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.datasets import Pool, load_pool
from coterie.node.learning.partition import Shard, partition

AUDIT_SEED_OFFSET = 1_000_003  # far from any scenario seed: the audit pool never is the nodes' pool
_GAUSSIAN_SALT = 0xA0D17
_SUPPORTED = ("iid", "label_permutation", "class_groups", "pathological", "random_pairs", "sine_intervals")


@dataclass
class AuditSet:
    x: np.ndarray
    y: np.ndarray  # labels as the node sees them (its permutation applied), or regression targets

    def __len__(self) -> int:
        return len(self.y)


def _fresh_pool(cfg: LearnerConfig, n: int) -> Pool:
    """n fresh samples of the dataset's distribution, independent of the nodes' pool."""
    params = dict(cfg.dataset_params)
    if cfg.dataset in ("sine", "mnist1d"):
        return load_pool(cfg.dataset, {**params, "num_samples": n}, cfg.data_seed + AUDIT_SEED_OFFSET)
    if cfg.dataset == "gaussian":
        # the class means exactly as datasets._gaussian draws them (first draw of its stream)
        c, dim = int(params.get("num_classes", 4)), int(params.get("dim", 10))
        means = np.random.default_rng([cfg.data_seed, 0x6A055]).standard_normal((c, dim)) * float(
            params.get("separation", 3.0)
        )
        rng = np.random.default_rng([cfg.data_seed, 0x6A055, _GAUSSIAN_SALT])
        y = np.arange(n) % c
        rng.shuffle(y)
        x = means[y] + float(params.get("cluster_std", 1.0)) * rng.standard_normal((n, dim))
        return Pool(x.astype(np.float32), y.astype(np.int64), c, (dim,), "classification")
    raise ValueError(f"audit set: no generator for dataset {cfg.dataset!r} (sine, mnist1d, gaussian, digits)")


def _leftover(pool: Pool, shards: list[Shard]) -> np.ndarray:
    used = np.zeros(len(pool), dtype=bool)
    for sh in shards:
        for split in (sh.train, sh.val, sh.test):
            used[split] = True
    return np.flatnonzero(~used)


def _classes(cfg: LearnerConfig, shard: Shard, num_classes: int) -> tuple[int, ...]:
    return shard.classes if shard.classes is not None else tuple(range(num_classes))


def audit_sets(cfg: LearnerConfig, size: int = 2000) -> list[AuditSet]:
    """Every node's audit set (index = node index) for the network ``cfg`` describes (any node's
    learner config: num_nodes and data_seed are the network's). ``size`` samples each where the
    dataset is generated; for ``digits``, every sample no node holds (of the node's classes)."""
    if cfg.partition not in _SUPPORTED:
        raise ValueError(f"audit set: partition {cfg.partition!r} not supported; supported: {', '.join(_SUPPORTED)}")
    pool = load_pool(cfg.dataset, cfg.dataset_params, cfg.data_seed)
    shards = partition(pool, cfg)
    if cfg.dataset == "digits":
        src, idx_all = pool, _leftover(pool, shards)
    else:
        if cfg.partition == "sine_intervals":
            m = int(cfg.partition_params.get("num_intervals", cfg.num_nodes))
            n = int(size * m * 1.3)  # uniform x: each interval gets ~n/m, 1.3 covers the spread
        else:
            k = min(len(_classes(cfg, sh, pool.num_classes)) for sh in shards)
            n = math.ceil(size / k) * max(pool.num_classes, 1)  # balanced classes: size/k of each
        src = _fresh_pool(cfg, n)
        idx_all = np.arange(len(src))
    out = []
    for i, sh in enumerate(shards):
        y_all = np.asarray(src.y[idx_all])
        if cfg.partition == "sine_intervals":
            lo, hi = src.meta.get("x_range", pool.meta["x_range"])
            m = int(cfg.partition_params.get("num_intervals", cfg.num_nodes))
            x0 = np.asarray(src.x[idx_all]).reshape(len(idx_all), -1)[:, 0]
            bucket = np.clip(((x0 - lo) / (hi - lo) * m).astype(np.int64), 0, m - 1)
            idx = idx_all[bucket == sh.cluster]
        else:
            classes = _classes(cfg, sh, pool.num_classes)
            if cfg.dataset == "digits":
                idx = idx_all[np.isin(y_all, classes)]
            else:
                per = math.ceil(size / len(classes))
                idx = np.concatenate([idx_all[y_all == c][:per] for c in classes])
        if cfg.dataset != "digits":
            if len(idx) < size:
                raise ValueError(f"audit set: node {i} got {len(idx)} samples, fewer than {size}")
            idx = np.sort(idx[:size])
        y = np.array(src.y[idx])
        if sh.label_map is not None:
            y = sh.label_map[y]
        out.append(AuditSet(np.array(src.x[idx]), y))
    return out


# ----------------------------------------------------------------------------- scoring live nodes


def _model(card: dict[str, Any], members: list[tuple[str, float, dict[str, torch.Tensor]]]) -> torch.nn.Module:
    """The module an export of ``members`` loads into (``modelfile``): one model, or their mixture."""
    from coterie.node.modelfile import MixtureModel, _build

    built = [_build(card, dict(p), "audit", f" (member {k})") for k, (_, _, p) in enumerate(members)]
    if len(built) == 1:
        return built[0].eval()
    return MixtureModel(built, [w for _, w, _ in members], card.get("task", "classification")).eval()


def per_sample(model: torch.nn.Module, audit: AuditSet, task: str) -> np.ndarray:
    """1/0 correct per sample (classification) or squared error (regression)."""
    with torch.no_grad():
        out = model(torch.as_tensor(audit.x))
    if task == "classification":
        return (out.argmax(1).numpy() == audit.y).astype(np.float64)
    return ((out.reshape(len(audit), -1)[:, 0].numpy().astype(np.float64) - audit.y) ** 2).astype(np.float64)


def node_models(node: Any) -> dict[str, list[tuple[str, float, dict[str, torch.Tensor]]]]:
    """A live node's three models as member lists: ``reported`` (what it predicts with, reports
    and checkpoints for export: daemon._snapshot's choice), ``collab`` (the strategy's model or
    mixture, the back-off aside) and ``twin`` (its local-only reference, absent without one)."""
    own = [(node.node_id, 1.0, node.learner.get_params())]
    collab = node.strategy.prediction_members() or own
    reported = node.reference.prediction_members(node.node_id, node.strategy.prediction_members())
    out = {"reported": reported or collab, "collab": collab}
    if node.reference.twin is not None:
        out["twin"] = [(node.node_id, 1.0, node.reference.twin.get_params())]
    return out


def score_node(node: Any, audit: AuditSet) -> dict[str, np.ndarray]:
    """Per-sample scores of the node's models (``node_models``) on its audit set."""
    card = {"format": "coterie-model/1", **node.model_card}
    task = card.get("task", "classification")
    return {k: per_sample(_model(card, ms), audit, task) for k, ms in node_models(node).items()}


def paired_gain(node: np.ndarray, twin: np.ndarray, task: str) -> tuple[float, float]:
    """(gain, its standard error) of a model over its twin from per-sample scores on one set:
    accuracy points, or relative MSE in % ((twin - node) / twin, the twin's MSE held fixed)."""
    d = node - twin if task == "classification" else twin - node
    scale = 100.0 if task == "classification" else 100.0 / float(np.mean(twin))
    se = float(np.std(d, ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    return scale * float(np.mean(d)), scale * se
