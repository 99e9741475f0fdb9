"""Where a node's samples come from, as ``TorchLearner`` needs it: the node's own files
(``learner.data``, ``own_data.py``: no pool, no partition, no ground-truth cluster) or its shard
of a built-in pool (``datasets.py`` + ``partition.py``), with what output i means on both."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .config import LearnerConfig
from .datasets import Pool, load_pool
from .own_data import OwnData, load_own_data
from .own_data import class_names as agreed_names
from .partition import NodeData, Shard, node_data


@dataclass
class Source:
    arrays: NodeData | OwnData  # x_/y_ train, val, test
    task: str  # "classification" or "regression"
    class_names: list[str] | None  # output i's class name, agreed by the network; None: regression
    input_shape: tuple[int, ...]
    own_data: bool
    info: dict[str, Any]  # for /status: where the samples come from, the task, samples per split
    true_cluster: int | None = None  # ground truth from the partitioner (built-in pools only)
    shard: Shard | None = None
    noisy_train: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def num_classes(self) -> int:
        return len(self.class_names) if self.class_names is not None else 0


def node_source(cfg: LearnerConfig, pool: Pool | None = None, data: NodeData | OwnData | None = None) -> Source:
    if data is None and cfg.data is not None:
        data = load_own_data(cfg)  # the node's own files: no pool, no partition
    if isinstance(data, OwnData):
        if cfg.label_noise > 0:
            raise ValueError("learner.label_noise is for the built-in datasets, not learner.data")
        return Source(data, data.task, data.class_names, tuple(data.input_shape), True, data.summary())
    if pool is None:
        pool = load_pool(cfg.dataset, cfg.dataset_params, cfg.data_seed)
    if data is None:
        data = node_data(pool, cfg)
    names = builtin_names(cfg, pool)
    info = {
        "source": f"built-in: {cfg.dataset}, partition {cfg.partition} (node {cfg.node_index} of {cfg.num_nodes})",
        "task": pool.task,
        "input_shape": list(pool.input_shape),
        "classes": names,
        "samples": {s: int(len(getattr(data, f"y_{s}"))) for s in ("train", "val", "test")},
    }
    return Source(
        data, pool.task, names, tuple(pool.input_shape), False, info, int(data.shard.cluster), data.shard, data.noisy
    )


def builtin_names(cfg: LearnerConfig, pool: Pool) -> list[str] | None:
    """The built-in dataset's classes "0".."C-1", or ``learner.classes`` naming them."""
    if pool.task != "classification":
        if cfg.classes is not None:
            raise ValueError(f"learner.classes given, but dataset {cfg.dataset!r} is regression")
        return None
    names = agreed_names(cfg.classes)
    if names is None:
        return [str(i) for i in range(pool.num_classes)]
    if len(names) != pool.num_classes:
        raise ValueError(f"learner.classes names {len(names)} classes; dataset {cfg.dataset!r} has {pool.num_classes}")
    return names
