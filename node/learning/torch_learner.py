"""TorchLearner: the ``Learner`` interface on a torch model and this node's shard.

Threading: the live model and optimizer are guarded by ``_lock`` (train, set_params,
apply_gradient, save/load, snapshots). Methods taking ``params`` never touch the live model:
they run ``torch.func.functional_call`` on a private *shadow* copy of the architecture under
its own ``_eval_lock``, so a request thread can evaluate a peer's model while training runs.
With ``params=None`` they snapshot the live parameters first and take the same path.

Persistence: ``export_state()`` returns copies of the parameters (``model/*``), optimizer
state (``optim/*``) and the sampler permutation, plus a JSON-able dict (optimizer
hyper-parameters and step count, RNG states, fingerprint); ``import_state`` restores them. The
state directory (``node/persistence.py``) writes and verifies them. On import the
hyper-parameters come from the config (a restart may change lr).
"""
from __future__ import annotations

import hashlib
import json
import math
import threading
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from .config import LearnerConfig
from .datasets import Pool, load_pool
from .guard import StepGuard
from .learner import EvalResult, Learner, Params, Split, TrainResult
from .models import build_model
from .partition import NodeData, node_data

_EVAL_BATCH = 2048
_PER_SAMPLE_BATCH = 256  # per-sample gradients held at once (memory: this × model size)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return "cuda:0"
    return device


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


class LocalOptimizer:
    """SGD (momentum, L2 weight decay) and Adam with exactly torch.optim's update rules.

    In-house because constructing any ``torch.optim`` optimizer imports ``torch._dynamo``, which
    costs seconds of CPU at every daemon start. State is keyed by parameter name, which makes
    it straightforward to persist."""

    def __init__(self, kind: str, params: list[tuple[str, torch.nn.Parameter]], lr: float,
                 momentum: float = 0.0, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        if kind not in ("sgd", "adam"):
            raise ValueError(f"unknown optimizer {kind!r}")
        self.kind, self.params = kind, list(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.betas, self.eps = betas, eps
        self.steps = 0
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
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
                bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
                denom = (v.sqrt() / math.sqrt(bc2)).add_(self.eps)
                p.addcdiv_(m, denom, value=-self.lr / bc1)

    def hyper(self) -> dict:
        return {"kind": self.kind, "lr": self.lr, "momentum": self.momentum,
                "weight_decay": self.weight_decay, "betas": list(self.betas), "eps": self.eps,
                "steps": self.steps}

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
            take = self.perm[self.pos:self.pos + need]
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


class TorchLearner(Learner):
    def __init__(self, cfg: LearnerConfig, pool: Pool | None = None,
                 data: NodeData | None = None):
        self.cfg = cfg
        torch.set_num_threads(cfg.torch_threads)
        self.device = resolve_device(cfg.device)
        if pool is None:
            pool = load_pool(cfg.dataset, cfg.dataset_params, cfg.data_seed)
        if data is None:
            data = node_data(pool, cfg)
        self.task = pool.task
        self.num_classes = pool.num_classes
        self.input_shape = pool.input_shape
        # what output i means, the same on every node of the network (None for regression)
        self.class_names: list[str] | None = (
            [str(i) for i in range(pool.num_classes)] if pool.task == "classification" else None)
        self.true_cluster = int(data.shard.cluster)
        self.shard = data.shard
        self.noisy_train = data.noisy
        ydt = torch.int64 if self.task == "classification" else torch.float32
        self._data: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for split in ("train", "val", "test"):
            x = torch.as_tensor(getattr(data, f"x_{split}"), dtype=torch.float32)
            y = torch.as_tensor(getattr(data, f"y_{split}"), dtype=ydt)
            self._data[split] = (x.to(self.device), y.to(self.device))

        # θ⁰ is the same on every node: seed right before construction, leaving global RNG as is
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)
            self.model = build_model(cfg.model, pool.input_shape, pool.num_classes,
                                     **cfg.model_params)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)
            self._shadow = build_model(cfg.model, pool.input_shape, pool.num_classes,
                                       **cfg.model_params)
        self.model.to(self.device)
        self._shadow.to(self.device).eval()
        for p in self._shadow.parameters():
            p.requires_grad_(False)
        self._names = [n for n, _ in self.model.named_parameters()]
        self._spec = {n: (tuple(p.shape), str(p.dtype).removeprefix("torch."))
                      for n, p in self.model.named_parameters()}
        self.optimizer = self._make_optimizer()
        self._sampler = _Sampler(len(self._data["train"][1]), _seed(cfg.data_seed, cfg.node_index))
        self._eval_rng = np.random.default_rng(_seed(cfg.data_seed, cfg.node_index, 0xE7A1))
        self._lock = threading.RLock()
        self._eval_lock = threading.Lock()
        # a diverged step is rolled back and backs off the step size (guard.py)
        self.step_guard = StepGuard(factor=cfg.divergence_factor)

    # ------------------------------------------------------------------ params
    def _make_optimizer(self) -> LocalOptimizer:
        c = self.cfg
        return LocalOptimizer(c.optimizer, list(self.model.named_parameters()), lr=c.lr,
                              momentum=c.momentum if c.optimizer == "sgd" else 0.0,
                              weight_decay=c.weight_decay)

    def get_params(self) -> Params:
        with self._lock:
            return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    def _check(self, params: Params, what: str = "params") -> None:
        if list(params) != self._names and set(params) != set(self._names):
            missing, extra = set(self._names) - set(params), set(params) - set(self._names)
            raise ValueError(f"{what} do not match the model: missing {sorted(missing)}, "
                             f"unexpected {sorted(extra)}")
        for n in self._names:
            if tuple(params[n].shape) != self._spec[n][0]:
                raise ValueError(f"{what}[{n!r}] has shape {tuple(params[n].shape)}, "
                                 f"expected {self._spec[n][0]}")

    def set_params(self, params: Params) -> None:
        self._check(params)
        with self._lock, torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(params[n].to(p.device, p.dtype))

    def param_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return dict(self._spec)

    def fingerprint(self) -> str:
        spec = [[n, list(s), d] for n, (s, d) in self._spec.items()]
        return hashlib.sha256(json.dumps([self.cfg.model, spec]).encode()).hexdigest()

    # ------------------------------------------------------------------ core
    def _loss_fn(self, out: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
        if self.task == "regression":
            return F.mse_loss(out.reshape(-1), y.reshape(-1), reduction=reduction)
        return F.cross_entropy(out, y, reduction=reduction)

    def num_samples(self, split: Split = "train") -> int:
        return len(self._data[split][1])

    def train(self, steps: int | None = None) -> TrainResult:
        n = self.num_samples("train")
        bs = self.cfg.batch_size
        if steps is None:
            steps = (self.cfg.local_epochs * math.ceil(n / bs) if self.cfg.local_epochs > 0
                     else self.cfg.local_steps)
        if steps <= 0:
            return TrainResult(loss=float("nan"), steps=0, samples=0)
        x, y = self._data["train"]
        total, samples, done = 0.0, 0, 0
        guard = self.step_guard
        with self._lock:
            start = {n: p.detach().clone() for n, p in self.model.named_parameters()}  # last finite state
            self.optimizer.lr = self.cfg.lr * guard.lr_scale
            self.model.train()
            problem = None
            for _ in range(steps):
                idx = torch.from_numpy(self._sampler.next(bs)).to(self.device)
                self.optimizer.zero_grad(set_to_none=True)
                loss = self._loss_fn(self.model(x[idx]), y[idx], "mean")
                value = float(loss.detach())
                problem = guard.loss_problem(value)
                if problem is not None:
                    break
                loss.backward()
                grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                norm = (torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
                        if self.cfg.grad_clip else torch.nn.utils.get_total_norm(grads))
                if not math.isfinite(float(norm)):
                    problem = f"gradient norm is {float(norm)}"
                    break
                self.optimizer.step()
                guard.observe(value)
                total += value
                samples += len(idx)
                done += 1
            if problem is None and not all(bool(torch.isfinite(p).all()) for p in self.model.parameters()):
                problem = "non-finite parameters after the local steps"
            self.optimizer.zero_grad(set_to_none=True)
            if problem is not None:
                guard.diverged("step", problem)
                self.reset_after_divergence(start)
                return TrainResult(loss=total / done if done else float("nan"), steps=done, samples=samples)
            guard.clean()
        return TrainResult(loss=total / steps, steps=steps, samples=samples)

    def reset_after_divergence(self, params: Params) -> None:
        """Back to ``params`` (the last finite model) with fresh optimizer state: a momentum or
        Adam buffer that saw the blow-up would carry it into the next step."""
        with self._lock:
            self.set_params(params)
            self.optimizer = self._make_optimizer()
            self.optimizer.lr = self.cfg.lr * self.step_guard.lr_scale

    def apply_gradient(self, grad: Params) -> None:
        self._check(grad, "grad")
        with self._lock:
            for n, p in self.model.named_parameters():
                p.grad = grad[n].to(p.device, p.dtype).clone()
            if self.cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.lr = self.cfg.lr * self.step_guard.lr_scale
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def _device_params(self, params: Params | None, requires_grad: bool = False) -> Params:
        if params is None:
            with self._lock:
                out = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        else:
            self._check(params)
            out = {n: params[n].detach().to(self.device, torch.float32, copy=True)
                   for n in self._names}
        if requires_grad:
            for t in out.values():
                t.requires_grad_(True)
        return out

    def _batch(self, split: Split, max_samples: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self._data[split]
        if max_samples is not None and max_samples < len(y):
            idx = np.sort(self._eval_rng.choice(len(y), max_samples, replace=False))
            t = torch.from_numpy(idx).to(self.device)
            return x[t], y[t]
        return x, y

    def loss(self, params: Params | None = None, split: Split = "train",
             max_samples: int | None = None,
             reduction: Literal["mean", "sum"] = "mean") -> EvalResult:
        p = self._device_params(params)
        with self._eval_lock:
            x, y = self._batch(split, max_samples)
            return self._eval(p, x, y, reduction)

    def evaluate(self, split: Split = "test", params: Params | None = None) -> EvalResult:
        p = self._device_params(params)
        x, y = self._data[split]
        with self._eval_lock:
            return self._eval(p, x, y, "mean")

    def _eval(self, p: Params, x: torch.Tensor, y: torch.Tensor, reduction: str) -> EvalResult:
        n = len(y)
        if n == 0:
            return EvalResult(loss=float("nan"), n=0, accuracy=None)
        total, correct = 0.0, 0
        with torch.no_grad():
            for i in range(0, n, _EVAL_BATCH):
                out = functional_call(self._shadow, p, (x[i:i + _EVAL_BATCH],))
                yb = y[i:i + _EVAL_BATCH]
                total += float(self._loss_fn(out, yb, "sum"))
                if self.task == "classification":
                    correct += int((out.argmax(1) == yb).sum())
        acc = correct / n if self.task == "classification" else None
        return EvalResult(loss=total / n if reduction == "mean" else total, n=n, accuracy=acc)

    def gradient(self, params: Params | None = None, split: Split = "train",
                 max_samples: int | None = None,
                 reduction: Literal["mean", "sum"] = "mean") -> tuple[Params, EvalResult]:
        p = self._device_params(params, requires_grad=True)
        with self._eval_lock:
            x, y = self._batch(split, max_samples)
            if len(y) == 0:
                raise ValueError(f"split {split!r} is empty on this node: no gradient")
            with torch.enable_grad():
                out = functional_call(self._shadow, p, (x,))
                loss = self._loss_fn(out, y, reduction)
                grads = torch.autograd.grad(loss, [p[n] for n in self._names])
            acc = (float((out.argmax(1) == y).float().mean())
                   if self.task == "classification" else None)
        g = {n: t.detach().to("cpu", torch.float32) for n, t in zip(self._names, grads)}
        return g, EvalResult(loss=float(loss.detach()), n=len(y), accuracy=acc)

    # ------------------------------------------------------------------ per-sample (privacy)
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
            for i in range(0, len(idx), _EVAL_BATCH):
                j = idx[i:i + _EVAL_BATCH]
                out = functional_call(self._shadow, p, (x[j],))
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
            out = functional_call(self._shadow, params, (xi.unsqueeze(0),))
            return self._loss_fn(out, yi.unsqueeze(0), "sum")

        per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))
        with self._eval_lock, torch.no_grad():
            for i in range(0, len(idx), _PER_SAMPLE_BATCH):
                j = idx[i:i + _PER_SAMPLE_BATCH]
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

    def evaluate_mixture(self, members: list[tuple[float, Params]],
                         split: Split = "test") -> EvalResult:
        """Σ_j w_j p(y|x; θ_j) with the weights normalised to sum to 1 (classification: softmax
        probabilities, loss = NLL of the mixture; regression: weighted mean prediction, MSE)."""
        if not members:
            raise ValueError("evaluate_mixture needs at least one member")
        w = np.asarray([float(m[0]) for m in members])
        if np.any(w < 0) or not w.sum() > 0:
            raise ValueError(f"mixture weights must be >= 0 with a positive sum, got {w.tolist()}")
        w = w / w.sum()
        ps = [self._device_params(m[1]) for m in members]
        x, y = self._data[split]
        n = len(y)
        if n == 0:
            return EvalResult(loss=float("nan"), n=0, accuracy=None)
        total, correct = 0.0, 0
        with self._eval_lock, torch.no_grad():
            for i in range(0, n, _EVAL_BATCH):
                xb, yb = x[i:i + _EVAL_BATCH], y[i:i + _EVAL_BATCH]
                mix = None
                for wj, pj in zip(w, ps):
                    if wj == 0:
                        continue
                    out = functional_call(self._shadow, pj, (xb,))
                    out = out.softmax(1) if self.task == "classification" else out.reshape(-1)
                    mix = wj * out if mix is None else mix + wj * out
                if self.task == "classification":
                    py = mix.gather(1, yb.view(-1, 1)).clamp_min(1e-12)
                    total += float(-py.log().sum())
                    correct += int((mix.argmax(1) == yb).sum())
                else:
                    total += float(F.mse_loss(mix, yb.reshape(-1), reduction="sum"))
        acc = correct / n if self.task == "classification" else None
        return EvalResult(loss=total / n, n=n, accuracy=acc)

    # ------------------------------------------------------------------ persistence
    def export_state(self, reuse: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        """Private copies of everything a resume needs, taken under the lock (a memcpy of the
        parameters and optimizer state, into ``reuse``'s buffers where they fit; encoding and
        writing happen elsewhere, off the lock)."""
        reuse = reuse or {}

        def copy(key: str, t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            old = reuse.get(key)
            if old is not None and old.shape == t.shape and old.dtype == t.dtype:
                return old.copy_(t)
            return t.to("cpu", copy=True)

        with self._lock:
            tensors = {f"model/{n}": copy(f"model/{n}", p) for n, p in self.model.named_parameters()}
            tensors.update({f"optim/{k}/{n}": copy(f"optim/{k}/{n}", t)
                            for n, st in self.optimizer.state.items() for k, t in st.items()})
            tensors["sampler/perm"] = torch.from_numpy(self._sampler.perm.copy())
            meta = {
                "fingerprint": self.fingerprint(),
                "optimizer": self.optimizer.hyper(),
                "sampler": {"rng": self._sampler.rng.bit_generator.state, "pos": int(self._sampler.pos)},
                "eval_rng": self._eval_rng.bit_generator.state,
            }
        return tensors, json.loads(json.dumps(meta, default=_json_default))

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore what ``export_state`` returned; ValueError says what does not fit (the live
        model is untouched then)."""
        params = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
        opt_tensors = {k[len("optim/"):]: v for k, v in tensors.items() if k.startswith("optim/")}
        self._check(params, "saved parameters")
        try:
            if meta["fingerprint"] != self.fingerprint():
                raise ValueError("architecture fingerprint differs from this model's")
            kind = meta["optimizer"]["kind"]
            if kind != self.cfg.optimizer:
                raise ValueError(f"saved optimizer {kind!r} != configured {self.cfg.optimizer!r}")
            steps = int(meta["optimizer"]["steps"])
            sampler = {"rng": meta["sampler"]["rng"], "pos": meta["sampler"]["pos"],
                       "perm": tensors["sampler/perm"].numpy()}
            eval_rng = meta["eval_rng"]
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"learner state is malformed (missing or malformed {e})") from None
        with self._lock:
            opt = self._make_optimizer()  # hyper-parameters come from the config, state from disk
            opt.load_state(opt_tensors, steps)
            old_sampler = self._sampler.state()
            try:
                self._sampler.set_state(sampler)
                self._eval_rng.bit_generator.state = eval_rng
            except (KeyError, TypeError, ValueError) as e:
                self._sampler.set_state(old_sampler)
                raise ValueError(f"learner state is malformed (sampler state: {e})") from None
            self.set_params(params)
            self.optimizer = opt


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def build_learner(cfg: LearnerConfig, pool: Pool | None = None) -> TorchLearner:
    """The learner for ``cfg.node_index``: loads the pool (cached in-process), partitions it,
    builds θ⁰ from ``cfg.init_seed``. Pass ``pool`` to reuse one already loaded."""
    return TorchLearner(cfg, pool=pool)
