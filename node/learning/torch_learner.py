"""TorchLearner: the ``Learner`` interface on a torch model and this node's shard — or, with
``learner.data`` set, exactly the samples of the node's own files (``own_data.py``; no pool, no
partition, ``true_cluster`` None). Output i means ``class_names[i]`` (``learner.classes``, the
same on every node); the loss and an input transform are hooks (``hooks.py``).

Threading: the live model and optimizer are guarded by ``_lock`` (train, set_params,
apply_gradient, save/load, snapshots). Methods taking ``params`` never touch the live model:
they run ``torch.func.functional_call`` on a private *shadow* copy of the architecture under
its own ``_eval_lock``, so a request thread can evaluate a peer's model while training runs.
With ``params=None`` they read the live parameters in place, without ``_lock``: every change to
the model runs inside ``live_reads.writing()``, and an evaluation that a change overlapped runs
again on a copy taken under ``_lock`` (``live_reads.py``; no model-sized copy otherwise).

Persistence: ``export_state()`` returns copies of the parameters (``model/*``), optimizer
state (``optim/*``) and the sampler permutation, plus a JSON-able dict (optimizer
hyper-parameters and step count, RNG states, fingerprint); ``import_state`` restores them. The
state directory (``node/persistence.py``) writes and verifies them. On import the
hyper-parameters come from the config (a restart may change lr).

Parts, objects given only the pieces they use (no shared ``self``), to which the public methods
delegate: ``ShadowEval`` (loss, evaluate, gradient), ``PerSampleTerms`` (clipped sums for DP)
and ``MixtureEval`` share one ``torch_shadow.Shadow``; ``TorchState`` does export/import.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from typing import Literal

import numpy as np
import torch

from ..memory_release import map_large_buffers
from .config import LearnerConfig
from .datasets import Pool
from .guard import StepGuard
from .hooks import resolve_loss, resolve_transform
from .learner import EvalResult, Learner, Params, Split, TrainResult, add_into
from .live_reads import LiveReads
from .local_optim import LocalOptimizer, _Sampler
from .models import build_model
from .own_data import OwnData
from .partition import NodeData
from .sources import Source, node_source
from .torch_mixture import MixtureEval
from .torch_private import PerSampleTerms
from .torch_shadow import DeviceParams, Shadow, ShadowEval, without_weights
from .torch_state import TorchState
from .torch_training import LocalTraining, Rollback


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return "cuda:0"
    return device


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


def _device_splits(data: NodeData | OwnData, task: str, device: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each split's (x, y) as tensors on ``device`` (labels int64 for classification)."""
    ydt = torch.int64 if task == "classification" else torch.float32
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for split in ("train", "val", "test"):
        x = torch.as_tensor(getattr(data, f"x_{split}"), dtype=torch.float32)
        y = torch.as_tensor(getattr(data, f"y_{split}"), dtype=ydt)
        out[split] = (x.to(device), y.to(device))
    return out


LARGE_TENSOR_BYTES = 16 * 2**20  # a model with a tensor this large pins glibc's thresholds


def _map_buffers_of(model: torch.nn.Module, threshold_mb: float) -> None:
    """A model with a tensor of 16 MiB or more (or of ``threshold_mb``, if less) pins glibc's mmap
    threshold at ``threshold_mb``: a step's gradient of that tensor is no longer left resident in a
    different hole of the heap each step. Smaller models leave glibc's allocator as it is
    (process-wide: every learner of a node has the same setting)."""
    threshold = int(threshold_mb * 2**20)
    largest = max((p.numel() * p.element_size() for p in model.parameters()), default=0)
    if threshold and largest >= min(threshold, LARGE_TENSOR_BYTES):
        map_large_buffers(threshold)


def _initial_model(cfg: LearnerConfig, input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    """θ⁰, the same on every node: seeded right before construction, leaving global RNG as is."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        return build_model(cfg.model, input_shape, num_classes, **cfg.model_params)


class TorchLearner(Learner):
    def __init__(self, cfg: LearnerConfig, pool: Pool | None = None, data: NodeData | OwnData | Source | None = None):
        self.cfg = cfg
        torch.set_num_threads(cfg.torch_threads)
        self.device = resolve_device(cfg.device)
        self._source = src = data if isinstance(data, Source) else node_source(cfg, pool, data)  # Source: a twin
        data = src.arrays
        self.own_data, self._data_info = src.own_data, src.info
        self.task, self.class_names, self.num_classes = src.task, src.class_names, src.num_classes
        self.input_shape = src.input_shape
        self.true_cluster, self.shard, self.noisy_train = src.true_cluster, src.shard, src.noisy_train
        self._loss_hook = resolve_loss(cfg.loss, self.task, self.num_classes)
        self._transform = resolve_transform(cfg.input_transform)
        self._data = _device_splits(data, self.task, self.device)
        self.model = _initial_model(cfg, self.input_shape, self.num_classes)
        self._shadow = without_weights(_initial_model(cfg, self.input_shape, self.num_classes).to(self.device).eval())
        self.model.to(self.device)
        _map_buffers_of(self.model, cfg.mmap_threshold_mb)
        self._names = [n for n, _ in self.model.named_parameters()]
        self._spec = {
            n: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in self.model.named_parameters()
        }
        self.optimizer = self._make_optimizer()
        self._sampler = _Sampler(len(self._data["train"][1]), _seed(cfg.data_seed, cfg.node_index))
        self._eval_rng = np.random.default_rng(_seed(cfg.data_seed, cfg.node_index, 0xE7A1))
        self._lock = threading.RLock()
        self._eval_lock = threading.Lock()
        self.live_reads = LiveReads()  # every change to the model inside its writing()
        # changes to the live model, and the round guard's copy that train may roll back to (issue 34)
        self.rollback = Rollback()
        # a diverged step is rolled back and backs off the step size (guard.py)
        self.step_guard = StepGuard(factor=cfg.divergence_factor)
        # its parts, each given the few pieces it uses
        shadow = Shadow(
            self._shadow,
            self._data,
            self._eval_lock,
            self._names,
            self.device,
            self.task,
            inputs=self._x,
            loss_fn=self._loss_fn,
            device_params=DeviceParams(self.model, self._lock, self._check, self.device),
            live_reads=self.live_reads,
        )
        self._evals, self._private, self._mixture = (
            ShadowEval(shadow, self._eval_rng),
            PerSampleTerms(shadow),
            MixtureEval(shadow),
        )
        self._state = TorchState(
            cfg,
            self.model,
            self._sampler,
            self._eval_rng,
            self._lock,
            optimizer=lambda: self.optimizer,
            install_optimizer=self._install_optimizer,
            make_optimizer=self._make_optimizer,
            check=self._check,
            set_params=self.set_params,
            fingerprint=self.fingerprint,
        )
        self._training = LocalTraining(
            cfg,
            self.model,
            self._data,
            self._sampler,
            self.device,
            self._lock,
            inputs=self._x,
            loss_fn=self._loss_fn,
            optimizer=lambda: self.optimizer,
            step_guard=self.step_guard,
            rollback=self.rollback,
            reset=self.reset_after_divergence,
            live_reads=self.live_reads,
        )

    def data_info(self) -> dict:
        return dict(self._data_info)

    def local_twin(self) -> TorchLearner:  # the same Source: arrays shared, no pool loaded again
        return TorchLearner(self.cfg, data=self._source)

    def _x(self, x: torch.Tensor) -> torch.Tensor:
        """A batch as the model sees it: after ``learner.input_transform``, if any."""
        return x if self._transform is None else self._transform(x)

    # ------------------------------------------------------------------ params
    def _make_optimizer(self) -> LocalOptimizer:
        c = self.cfg
        return LocalOptimizer(
            c.optimizer,
            list(self.model.named_parameters()),
            lr=c.lr,
            momentum=c.momentum if c.optimizer == "sgd" else 0.0,
            weight_decay=c.weight_decay,
        )

    def get_params(self) -> Params:
        with self._lock:
            return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    def live_params(self) -> Params:
        if self.device != "cpu":
            return self.get_params()
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def _check(self, params: Params, what: str = "params") -> None:
        if list(params) != self._names and set(params) != set(self._names):
            missing, extra = set(self._names) - set(params), set(params) - set(self._names)
            raise ValueError(f"{what} do not match the model: missing {sorted(missing)}, unexpected {sorted(extra)}")
        for n in self._names:
            if tuple(params[n].shape) != self._spec[n][0]:
                raise ValueError(f"{what}[{n!r}] has shape {tuple(params[n].shape)}, expected {self._spec[n][0]}")

    def set_params(self, params: Params) -> None:
        self._check(params)
        with self._lock, self.live_reads.writing(), torch.no_grad():
            self.rollback.changed()
            for n, p in self.model.named_parameters():
                p.copy_(params[n].to(p.device, p.dtype))

    def add_to_params(self, params: Params) -> None:
        self._check(params)
        with self._lock, self.live_reads.writing(), torch.no_grad():  # in place: no model-sized temporary
            self.rollback.changed()
            for n, p in self.model.named_parameters():
                add_into(p, params[n])

    def scale_params(self, w: float) -> None:
        with self._lock, self.live_reads.writing(), torch.no_grad():
            self.rollback.changed()
            for p in self.model.parameters():
                p.mul_(w)

    def param_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return dict(self._spec)

    def fingerprint(self) -> str:
        spec = [[n, list(s), d] for n, (s, d) in self._spec.items()]
        return hashlib.sha256(json.dumps([self.cfg.model, spec]).encode()).hexdigest()

    # ------------------------------------------------------------------ core
    def _loss_fn(self, out: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
        return self._loss_hook(out, y, reduction)  # learner.loss (hooks.py)

    def num_samples(self, split: Split = "train") -> int:
        return len(self._data[split][1])

    def steps_per_round(self) -> int:
        n, bs = self.num_samples("train"), self.cfg.batch_size
        return self.cfg.local_epochs * math.ceil(n / bs) if self.cfg.local_epochs > 0 else self.cfg.local_steps

    def train(self, steps: int | None = None) -> TrainResult:
        return self._training.run(self.steps_per_round() if steps is None else steps)

    @property
    def changes(self) -> int:
        """How many times the live model has changed (a copy taken after reading it is current while
        it stays the same)."""
        return self.rollback.changes

    def offer_rollback(self, params: Params, changes: int) -> None:
        """While the live model has not changed since ``changes``, ``train`` restores to ``params``
        (the round guard's copy, held weakly) on a divergence instead of copying the model."""
        with self._lock:
            self.rollback.offer(params, changes)

    def drop_optimizer_state(self) -> None:
        """Forget the optimizer's state (momenta, Adam moments); ``train`` sets its step size."""
        with self._lock:
            self.optimizer = self._make_optimizer()

    def reset_after_divergence(self, params: Params) -> None:
        """Back to ``params`` (the last finite model) with fresh optimizer state: a momentum or
        Adam buffer that saw the blow-up would carry it into the next step."""
        with self._lock:
            self.set_params(params)
            self.optimizer = self._make_optimizer()
            self.optimizer.lr = self.cfg.lr * self.step_guard.lr_scale

    def apply_gradient(self, grad: Params) -> None:
        self._check(grad, "grad")
        with self._lock, self.live_reads.writing():
            self.rollback.changed()
            for n, p in self.model.named_parameters():
                p.grad = grad[n].to(p.device, p.dtype).clone()
            if self.cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.lr = self.cfg.lr * self.step_guard.lr_scale
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ parts
    def loss(
        self,
        params: Params | None = None,
        split: Split = "train",
        max_samples: int | None = None,
        reduction: Literal["mean", "sum"] = "mean",
    ) -> EvalResult:
        return self._evals.loss(params, split, max_samples, reduction)

    def evaluate(self, split: Split = "test", params: Params | None = None) -> EvalResult:
        return self._evals.evaluate(split, params)

    def gradient(
        self,
        params: Params | None = None,
        split: Split = "train",
        max_samples: int | None = None,
        reduction: Literal["mean", "sum"] = "mean",
    ) -> tuple[Params, EvalResult]:
        return self._evals.gradient(params, split, max_samples, reduction)

    def clipped_loss_sum(self, params: Params | None, split: Split, indices, clip: float) -> float:
        return self._private.clipped_loss_sum(params, split, indices, clip)

    def clipped_gradient_sum(self, params: Params | None, split: Split, indices, clip: float) -> Params:
        return self._private.clipped_gradient_sum(params, split, indices, clip)

    def evaluate_mixture(self, members: list[tuple[float, Params | None]], split: Split = "test") -> EvalResult:
        return self._mixture.evaluate_mixture(members, split)

    def evaluate_blends(
        self, members: list[tuple[float, Params | None]], other: Params, alphas: list[float], split: Split = "val"
    ) -> list[EvalResult]:
        return self._mixture.evaluate_blends(members, other, alphas, split)

    def export_state(
        self, reuse: dict[str, torch.Tensor] | None = None, live: bool = False
    ) -> tuple[dict[str, torch.Tensor], dict]:
        return self._state.export_state(reuse, live)

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self._state.import_state(tensors, meta)

    def _install_optimizer(self, opt: LocalOptimizer) -> None:
        self.optimizer = opt


def build_learner(cfg: LearnerConfig, pool: Pool | None = None) -> TorchLearner:
    """The learner for ``cfg.node_index``: reads the node's own files (``cfg.data``) or loads the
    pool (cached in-process) and partitions it; builds θ⁰ from ``cfg.init_seed``. Pass ``pool`` to
    reuse one already loaded."""
    return TorchLearner(cfg, pool=pool)
