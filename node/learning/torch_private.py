"""Per-sample terms of ``TorchLearner`` (its privacy part): losses and gradients clipped sample
by sample, summed, for the DP mechanisms (``privacy/mechanisms.py``) — on the private shadow
model, never the live one."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.func import functional_call

from .learner import Params, Split

EVAL_BATCH = 2048  # samples evaluated at once
_PER_SAMPLE_BATCH = 256  # per-sample gradients held at once (memory: this × model size)


class PerSampleTerms:
    """Mixed into ``torch_learner.TorchLearner`` (its shadow model, data and locks)."""

    # the host's state and helpers (``TorchLearner``), declared for the type checker
    device: str
    _data: dict[str, tuple[torch.Tensor, torch.Tensor]]
    _shadow: torch.nn.Module
    _names: list[str]
    _eval_lock: threading.Lock
    if TYPE_CHECKING:

        def num_samples(self, split: Split = "train") -> int: ...
        def _x(self, x: torch.Tensor) -> torch.Tensor: ...
        def _loss_fn(self, out: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor: ...
        def _device_params(self, params: Params | None, requires_grad: bool = False) -> Params: ...

    def _index(self, split: Split, indices) -> torch.Tensor:
        n = self.num_samples(split)
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64).reshape(-1), device=self.device)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise ValueError(f"sample index out of range for split {split!r} of {n} samples")
        return idx

    def clipped_loss_sum(self, params: Params | None, split: Split, indices, clip: float) -> float:
        p = self._device_params(params)
        idx = self._index(split, indices)
        x, y = self._data[split]
        total = 0.0
        with self._eval_lock, torch.no_grad():
            for i in range(0, len(idx), EVAL_BATCH):
                j = idx[i : i + EVAL_BATCH]
                out = functional_call(self._shadow, p, (self._x(x[j]),))
                per = self._loss_fn(out, y[j], "none").reshape(-1)
                per = torch.nan_to_num(per, nan=clip, posinf=clip, neginf=0.0).clamp(0.0, clip)
                total += float(per.sum())
        return total

    def clipped_gradient_sum(self, params: Params | None, split: Split, indices, clip: float) -> Params:
        """Per-sample gradients by ``torch.func.vmap(grad(...))`` over ``functional_call`` on the
        shadow model — not opacus' GradSampleModule, whose hooks keep counters on the module's own
        nn.Parameters and fail on the tensors functional_call swaps in (AttributeError
        '_forward_counter'); the shadow path is what lets a request thread differentiate a peer's
        model while training runs. torch.func is also what opacus itself falls back to for layers
        its hooks do not know, and it works for any registered model. Clipping as opacus does it:
        factor min(1, C / (‖g_i‖ + 1e-6)) on the whole-model norm."""
        from torch.func import grad, vmap

        p = self._device_params(params)
        idx = self._index(split, indices)
        x, y = self._data[split]
        total = {n: torch.zeros_like(p[n]) for n in self._names}

        def sample_loss(params: Params, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            out = functional_call(self._shadow, params, (self._x(xi.unsqueeze(0)),))
            return self._loss_fn(out, yi.unsqueeze(0), "sum")

        per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))
        with self._eval_lock, torch.no_grad():
            for i in range(0, len(idx), _PER_SAMPLE_BATCH):
                j = idx[i : i + _PER_SAMPLE_BATCH]
                with torch.enable_grad():
                    g = per_sample(p, x[j], y[j])
                flat = torch.cat([g[n].reshape(len(j), -1) for n in self._names], dim=1)
                norms = flat.norm(dim=1)
                factor = (clip / (norms + 1e-6)).clamp(max=1.0)
                factor = torch.where(torch.isfinite(norms), factor, torch.zeros_like(factor))
                for n in self._names:
                    gn = torch.nan_to_num(g[n], nan=0.0, posinf=0.0, neginf=0.0)
                    total[n] += torch.einsum("b,b...->...", factor, gn)
        return {n: t.detach().to("cpu", torch.float32) for n, t in total.items()}
