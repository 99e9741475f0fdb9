"""What a node learns: dataset, partition, model, optimiser. Validated by pydantic."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class LearnerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset: Literal["mnist1d", "digits", "sine", "gaussian", "cifar10", "cifar100"] = "mnist1d"
    dataset_params: dict[str, Any] = Field(default_factory=dict)  # e.g. num_samples, data_dir
    # own data: the node learns from exactly the samples at this path (npz, csv, parquet, an image
    # folder, or what the entry point `data_format` names); dataset/partition are then not used
    data: str | None = None
    data_format: str = "auto"  # auto (from the path), npz, csv, parquet, images, or a coterie.datasets entry point
    data_label: str = "label"  # the label column of a table
    data_params: dict[str, Any] = Field(default_factory=dict)  # passed to an entry-point loader
    # the class names the network agrees on (a list, or N meaning "0".."N-1"); None: regression
    # or the built-in dataset's own classes
    classes: list[str] | int | None = None
    # hooks (learning/hooks.py): the loss — auto (cross_entropy for classes, mse for regression),
    # cross_entropy, mse, or an entry point in group coterie.losses, (output, target, reduction) -> Tensor;
    # and an input transform — an entry point in group coterie.transforms, x -> x on every batch
    loss: str = "auto"
    input_transform: str | None = None
    partition: Literal[
        "iid",
        "dirichlet",
        "pathological",
        "label_permutation",
        "class_groups",
        "random_pairs",
        "sine_intervals",
        "mixture",
    ] = "label_permutation"
    partition_params: dict[str, Any] = Field(default_factory=dict)  # alpha, k, num_clusters, ...
    num_nodes: int = Field(1, ge=1)
    node_index: int = Field(0, ge=0)
    model: str = "mlp"  # stock: mlp, cnn, cnn2, linear; or an entry point in group coterie.models
    model_params: dict[str, Any] = Field(default_factory=dict)
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    batch_size: int = Field(32, ge=1)
    local_steps: int = Field(10, ge=0)  # SGD steps per round (local_epochs overrides when > 0)
    local_epochs: int = Field(0, ge=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    init_seed: int = 0  # every node derives the same θ⁰ from this + architecture
    data_seed: int = 0  # the scenario seed: every node computes its own shard from it
    val_fraction: float = Field(0.2, ge=0, lt=1)
    test_fraction: float = Field(0.2, ge=0, lt=1)
    label_noise: float = Field(0.0, ge=0, le=1)  # share of this node's train labels replaced at random
    # the divergence guard (guard.py): clip each step's gradient to this L2 norm (None: no clip);
    # a step loss above divergence_factor × the running median counts as diverged (0: only non-finite)
    grad_clip: float | None = Field(None, gt=0)
    divergence_factor: float = Field(1e3, ge=0)
    torch_threads: int = Field(1, ge=1)  # many daemons share a machine: one intra-op thread each
    # a model with a tensor of 16 MiB or more (or of this many MiB, if fewer) pins glibc's mmap
    # threshold here and its heap trim threshold at 128 KiB, instead of glibc's moving threshold that
    # kept a round's freed gradients resident (memory_release.map_large_buffers). 16: a 21 MB model's
    # gradient is mapped afresh each step and unmapped when freed, the lowest peak, for rounds ~10-20 %
    # slower at full rate; 32 (glibc's most): buffers that large stay in the heap, no slower, a smaller
    # cut (bench/results/memory.md, branch localpeak); 0: glibc's own moving threshold
    mmap_threshold_mb: float = Field(16.0, ge=0, le=32)
