"""The learner interface: everything the daemon and the strategies may ask of local learning.

The daemon and the strategies only see this interface; the torch implementation, datasets and
partitions live beside it. Parameters travel as ``Params``: an ordered ``dict[name, Tensor]`` of
CPU float tensors (detached copies; mutating them never touches the live model). Parameters given
to an evaluation (``loss``, ``evaluate``, ``gradient``, the mixtures) are read in place, not
copied: the caller does not change them until the call returns; ``None`` there means the live
model, which the learner reads consistently while it may be training (issue 34).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch

Params = dict[str, torch.Tensor]
Split = Literal["train", "val", "test"]


def add_into(dst: torch.Tensor, src: Any) -> None:
    """``dst += src``; ``src`` a tensor, or one a payload still holds encoded, which decodes itself
    into ``dst`` a chunk at a time (``wire/folding.py``: no decoded copy of a pulled model)."""
    if isinstance(src, torch.Tensor):
        dst.add_(src.to(dst.device, dst.dtype))
    else:
        src.add_to(dst)


@dataclass
class EvalResult:
    loss: float  # mean (or summed, if reduction="sum") loss
    n: int  # samples it was computed on
    accuracy: float | None = None  # None for regression
    # per sample, in the split's order, where the learner gives them (evaluations of a split):
    # the loss (cross-entropy, squared error, ...) and 1/0 correct (classification); the
    # collaboration check pairs them across two models on the same samples (collaboration_check.py)
    losses: np.ndarray | None = field(default=None, compare=False, repr=False)
    correct: np.ndarray | None = field(default=None, compare=False, repr=False)


@dataclass
class TrainResult:
    loss: float  # mean training loss over the steps taken
    steps: int
    samples: int


@runtime_checkable
class MakesTwin(Protocol):
    """A learner that can make its local-only reference (``node/local_reference.py``)."""

    def local_twin(self) -> Learner:
        """A second learner on this node's samples from the same θ⁰, in the same batch order,
        trained apart from this one."""
        ...


class Learner(ABC):
    """Local learning on one node's private data. Methods that take ``params`` evaluate *that*
    model (a peer's, or a candidate) without touching the live one, so they are safe to call from
    a request-serving thread while training runs in another."""

    device: str  # "cpu" or "cuda:0"
    true_cluster: int | None  # ground truth from the partitioner; evaluation/oracle only
    class_names: list[str] | None = None  # output i's class name, agreed by the network; None: regression
    input_shape: tuple[int, ...] = ()  # one sample's shape
    own_data: bool = False  # True: the node's own files (real data: privacy allows no concession)

    def task_spec(self) -> str:
        """What this model learns (input shape, class names or regression) as peers compare it in
        the handshake (``task.py``)."""
        from .task import describe_task

        return describe_task(self.input_shape, self.class_names)

    def data_info(self) -> dict:
        """Where this node's samples come from and how many each split holds (for /status)."""
        return {}

    @abstractmethod
    def get_params(self) -> Params: ...

    def live_params(self) -> Params:
        """The live parameters themselves where the learner can give them (CPU tensors, not
        copies), for a caller that reads them at once while nothing changes the model (publishing
        encodes them into its buffer); by default a copy."""
        return self.get_params()

    @abstractmethod
    def set_params(self, params: Params) -> None: ...

    def add_to_params(self, params: Params) -> None:
        """θ += ``params`` (stream-averaging adds each peer's model into the live one). A value
        may be a pulled tensor still encoded (``PeerNetwork.pull(lazy=True)``): ``add_into``."""
        mine = self.get_params()
        for k, v in mine.items():
            add_into(v, params[k])
        self.set_params(mine)

    def scale_params(self, w: float) -> None:
        """θ *= ``w``."""
        self.set_params({k: v * w for k, v in self.get_params().items()})

    @abstractmethod
    def param_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, dtype name) of every parameter, in order; used to validate peer models."""

    @abstractmethod
    def fingerprint(self) -> str:
        """Architecture fingerprint (sha256 hex of model name + param_spec); peers must match."""

    @abstractmethod
    def train(self, steps: int | None = None) -> TrainResult:
        """Local training of the live model from its current params (optimizer state persists).
        ``steps`` overrides the configured local steps/epochs."""

    def steps_per_round(self) -> int:
        """The optimizer steps one round of local training takes (``train()`` without ``steps``):
        strategies that take their own gradient steps match the node's configured budget."""
        return 1

    @abstractmethod
    def loss(
        self,
        params: Params | None = None,
        split: Split = "train",
        max_samples: int | None = None,
        reduction: Literal["mean", "sum"] = "mean",
    ) -> EvalResult:
        """Loss of ``params`` (live model if None) on this node's data. ``max_samples`` draws a
        fresh random minibatch of that size instead of the whole split."""

    @abstractmethod
    def gradient(
        self,
        params: Params | None = None,
        split: Split = "train",
        max_samples: int | None = None,
        reduction: Literal["mean", "sum"] = "mean",
    ) -> tuple[Params, EvalResult]:
        """Gradient of the loss of ``params`` on this node's data, with that loss."""

    # --- per-sample bounded sums: what a differentially private release adds noise to. The caller
    # (node/privacy/mechanisms.py) picks the samples, so a peer never chooses them. ---
    def clipped_loss_sum(
        self, params: Params | None, split: Split, indices: Sequence[int] | np.ndarray, clip: float
    ) -> float:
        """Σ over the samples ``indices`` of ``split`` of the per-sample loss clipped into
        [0, clip] (a non-finite loss counts as ``clip``): one sample moves it by at most ``clip``."""
        raise NotImplementedError(f"{type(self).__name__} cannot compute per-sample clipped losses")

    def clipped_gradient_sum(
        self, params: Params | None, split: Split, indices: Sequence[int] | np.ndarray, clip: float
    ) -> Params:
        """Σ_i g_i · min(1, clip / ‖g_i‖) over the samples ``indices`` of ``split``, g_i the
        gradient of sample i's loss (the full parameter vector's L2 norm; a non-finite g_i counts
        as zero): one sample moves it by at most ``clip`` in L2."""
        raise NotImplementedError(f"{type(self).__name__} cannot compute per-sample clipped gradients")

    @abstractmethod
    def apply_gradient(self, grad: Params) -> None:
        """One optimizer step on the live model using ``grad`` instead of a local gradient."""

    @abstractmethod
    def evaluate(self, split: Split = "test", params: Params | None = None) -> EvalResult: ...

    @abstractmethod
    def evaluate_mixture(self, members: list[tuple[float, Params | None]], split: Split = "test") -> EvalResult:
        """Accuracy/loss of the mixture prediction Σ_j w_j p(y|x; θ_j) (FedeRiCo); a member's
        θ_j None is the live model."""

    def evaluate_blends(
        self, members: list[tuple[float, Params | None]], other: Params, alphas: list[float], split: Split = "val"
    ) -> list[EvalResult]:
        """``evaluate_mixture`` of ``[(a·w_j, θ_j)…, (1 − a, other)]`` for every ``a`` in ``alphas``
        (the prediction-space blends of node/blend.py; a = 0 is ``other`` alone, a = 1 the members
        alone). A learner that can should compute each model's outputs once for all of them."""
        out = []
        for a in alphas:
            ms: list[tuple[float, Params | None]] = (
                [(1.0, other)] if a == 0 else members if a == 1 else [(a * w, p) for w, p in members] + [(1 - a, other)]
            )
            out.append(self.evaluate_mixture(ms, split))
        return out

    @abstractmethod
    def num_samples(self, split: Split = "train") -> int: ...

    @abstractmethod
    def export_state(
        self, reuse: dict[str, torch.Tensor] | None = None, live: bool = False
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """Copies of everything a resume needs: tensors (model, optimizer state, ...) that
        nothing else mutates, and a JSON-able dict. Cheap (a memcpy); the caller writes them.
        ``reuse``: the tensors of an earlier export the caller is done with, to copy into
        instead of allocating (and page-faulting) fresh memory every round. ``live``: the model's
        and optimizer's own tensors, not copies, for a caller that writes them before anything
        changes the model again (a large model's checkpoint: no model-sized staging copies)."""

    @abstractmethod
    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore what ``export_state`` returned; raise ValueError saying what does not fit."""
