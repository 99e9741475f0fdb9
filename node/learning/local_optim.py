"""The local optimizer and minibatch sampler of ``torch_learner.TorchLearner`` (their own module so
that its persistence part, ``torch_state.TorchState``, can name their types without an import
cycle)."""

from __future__ import annotations

import math

import numpy as np
import torch

STEP_CHUNK = 1 << 20  # elements of a parameter updated at once (Adam's temporaries stay this size)


def _chunks(*tensors: torch.Tensor) -> zip:
    """Matching chunks of same-shaped tensors: flat views of ``STEP_CHUNK`` elements (the whole
    tensors where one is not contiguous)."""
    if not all(t.is_contiguous() for t in tensors):
        return zip(*([t] for t in tensors), strict=True)
    return zip(*(t.view(-1).split(STEP_CHUNK) for t in tensors), strict=True)


def _scratch(
    buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor], like: torch.Tensor, size: int
) -> torch.Tensor:
    """A buffer shaped like ``like`` from the step's one buffer of its dtype and device, of ``size``
    elements (or more, for a chunk larger than that: a whole non-contiguous tensor)."""
    key = (like.dtype, like.device)
    buf = buffers.get(key)
    if buf is None or buf.numel() < like.numel():
        buf = buffers[key] = torch.empty(max(size, like.numel()), dtype=like.dtype, device=like.device)
    return buf[: like.numel()].view(like.shape)


class LocalOptimizer:
    """SGD (momentum, L2 weight decay) and Adam with exactly torch.optim's update rules.

    In-house because constructing any ``torch.optim`` optimizer imports ``torch._dynamo``, which
    costs seconds of CPU at every daemon start. State is keyed by parameter name, which makes
    it straightforward to persist."""

    def __init__(
        self,
        kind: str,
        params: list[tuple[str, torch.nn.Parameter]],
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ):
        if kind not in ("sgd", "adam"):
            raise ValueError(f"unknown optimizer {kind!r}")
        self.kind, self.params = kind, list(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.betas, self.eps = betas, eps
        self.steps = 0
        self._chunk = min(STEP_CHUNK, max((p.numel() for _, p in self.params), default=0))  # Adam's buffer
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # Adam's one buffer this step
        for name, p in self.params:
            if p.grad is None:
                continue
            g = p.grad
            if self.weight_decay:
                g = g.add(p, alpha=self.weight_decay)
            st = self.state.setdefault(name, {})
            if self.kind == "sgd":
                if self.momentum:
                    buf = st.get("momentum_buffer")
                    if buf is None:
                        buf = st["momentum_buffer"] = g.clone()
                    else:
                        buf.mul_(self.momentum).add_(g)
                    g = buf
                p.add_(g, alpha=-self.lr)
            else:
                b1, b2 = self.betas
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                    st["step"] = torch.zeros((), dtype=torch.float32)
                st["step"] += 1
                t = float(st["step"])
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                bc1, bc2 = 1 - b1**t, 1 - b2**t
                # the update in chunks: ``denom`` of a whole tensor is a model-sized temporary (two
                # alive at once: the sqrt and its quotient), a chunk's ~4 MB; elementwise, so the
                # values are bit for bit those of the whole-tensor formula (tests/test_round_transients.py).
                # Every chunk's ``denom`` is computed in one buffer of the step: two fresh temporaries
                # per chunk landed in different holes of glibc's heap from step to step, and a
                # round's training touched ~25 MB more than was ever alive (bench/results/memory.md)
                for pc, mc, vc in _chunks(p, m, v):
                    denom = _scratch(scratch, vc, self._chunk)
                    torch.sqrt(vc, out=denom)
                    denom.div_(math.sqrt(bc2)).add_(self.eps)
                    pc.addcdiv_(mc, denom, value=-self.lr / bc1)

    def hyper(self) -> dict:
        return {
            "kind": self.kind,
            "lr": self.lr,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "betas": list(self.betas),
            "eps": self.eps,
            "steps": self.steps,
        }

    def load_state(self, tensors: dict[str, torch.Tensor], steps: int) -> None:
        devices = {n: p for n, p in self.params}
        state: dict[str, dict[str, torch.Tensor]] = {}
        allowed = {"sgd": {"momentum_buffer"}, "adam": {"exp_avg", "exp_avg_sq", "step"}}[self.kind]
        for key, t in tensors.items():
            k, _, name = key.partition("/")
            if name not in devices or k not in allowed:
                raise ValueError(f"unexpected optimizer state {key!r}")
            p = devices[name]
            if k != "step" and tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"optimizer state {key!r} has shape {tuple(t.shape)}")
            state.setdefault(name, {})[k] = t.to(p.device) if k != "step" else t.clone()
        self.state, self.steps = state, int(steps)


class _Sampler:
    """Minibatch indices: passes over fresh permutations of the train split."""

    def __init__(self, n: int, seed: int):
        self.n = n
        self.rng = np.random.default_rng(seed)
        self.perm = np.zeros(0, dtype=np.int64)
        self.pos = 0

    def next(self, batch: int) -> np.ndarray:
        out = []
        need = min(batch, self.n)
        while need > 0:
            if self.pos >= len(self.perm):
                self.perm, self.pos = self.rng.permutation(self.n), 0
            take = self.perm[self.pos : self.pos + need]
            self.pos += len(take)
            need -= len(take)
            out.append(take)
        return np.concatenate(out)

    def state(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "perm": self.perm.tolist(), "pos": self.pos}

    def set_state(self, s: dict) -> None:
        perm, pos = np.asarray(s["perm"], dtype=np.int64), int(s["pos"])
        if perm.ndim != 1 or not 0 <= pos <= len(perm) or (len(perm) and not 0 <= perm.min() <= perm.max() < self.n):
            raise ValueError(f"a permutation of {len(perm)} indices at {pos} does not fit {self.n} samples")
        self.rng.bit_generator.state = s["rng"]
        self.perm, self.pos = perm, pos
