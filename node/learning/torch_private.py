"""Per-sample terms of ``TorchLearner`` (its privacy part): losses and gradients clipped sample
by sample, summed, for the DP mechanisms (``privacy/mechanisms.py``) — on the private shadow
model (``torch_shadow.py``), never the live one."""

from __future__ import annotations

import numpy as np
import torch
from torch.func import functional_call

from .learner import Params, Split
from .torch_shadow import EVAL_BATCH, Shadow

_PER_SAMPLE_BATCH = 256  # per-sample gradients held at once (memory: this × model size)


class PerSampleTerms:
    """Clipped per-sample sums of given parameters on chosen samples of a split."""

    def __init__(self, shadow: Shadow):
        self.shadow = shadow

    def _index(self, split: Split, indices) -> torch.Tensor:
        n = len(self.shadow.data[split][1])
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64).reshape(-1), device=self.shadow.device)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise ValueError(f"sample index out of range for split {split!r} of {n} samples")
        return idx

    def clipped_loss_sum(self, params: Params | None, split: Split, indices, clip: float) -> float:
        s = self.shadow
        idx = self._index(split, indices)
        x, y = s.data[split]

        def on(ps: list[Params]) -> float:
            p, total = ps[0], 0.0
            with s.lock, torch.no_grad():
                for i in range(0, len(idx), EVAL_BATCH):
                    j = idx[i : i + EVAL_BATCH]
                    out = functional_call(s.model, p, (s.inputs(x[j]),))
                    per = s.loss_fn(out, y[j], "none").reshape(-1)
                    per = torch.nan_to_num(per, nan=clip, posinf=clip, neginf=0.0).clamp(0.0, clip)
                    total += float(per.sum())
            return total

        return s.run([params], False, on)

    def clipped_gradient_sum(self, params: Params | None, split: Split, indices, clip: float) -> Params:
        """Per-sample gradients by ``torch.func.vmap(grad(...))`` over ``functional_call`` on the
        shadow model — not opacus' GradSampleModule, whose hooks keep counters on the module's own
        nn.Parameters and fail on the tensors functional_call swaps in (AttributeError
        '_forward_counter'); the shadow path is what lets a request thread differentiate a peer's
        model while training runs. torch.func is also what opacus itself falls back to for layers
        its hooks do not know, and it works for any registered model. Clipping as opacus does it:
        factor min(1, C / (‖g_i‖ + 1e-6)) on the whole-model norm."""
        from torch.func import grad, vmap

        s = self.shadow
        idx = self._index(split, indices)
        x, y = s.data[split]

        def sample_loss(params: Params, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            out = functional_call(s.model, params, (s.inputs(xi.unsqueeze(0)),))
            return s.loss_fn(out, yi.unsqueeze(0), "sum")

        per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))

        def on(ps: list[Params]) -> Params:
            p = ps[0]
            total = {n: torch.zeros_like(p[n]) for n in s.names}
            with s.lock, torch.no_grad():
                for i in range(0, len(idx), _PER_SAMPLE_BATCH):
                    j = idx[i : i + _PER_SAMPLE_BATCH]
                    with torch.enable_grad():
                        g = per_sample(p, x[j], y[j])
                    flat = torch.cat([g[n].reshape(len(j), -1) for n in s.names], dim=1)
                    norms = flat.norm(dim=1)
                    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
                    factor = torch.where(torch.isfinite(norms), factor, torch.zeros_like(factor))
                    for n in s.names:
                        gn = torch.nan_to_num(g[n], nan=0.0, posinf=0.0, neginf=0.0)
                        total[n] += torch.einsum("b,b...->...", factor, gn)
            return {n: t.detach().to("cpu", torch.float32) for n, t in total.items()}

        return s.run([params], False, on)
