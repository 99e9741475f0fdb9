"""Persistence of ``TorchLearner`` (its state part): ``export_state`` copies the parameters
(``model/*``), optimizer state (``optim/*``) and the sampler permutation, plus a JSON-able dict
(optimizer hyper-parameters and step count, RNG states, fingerprint); ``import_state`` restores
them (the hyper-parameters from the config: a restart may change lr)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .config import LearnerConfig
    from .learner import Params
    from .local_optim import LocalOptimizer, _Sampler


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


class TorchState:
    """Copies out and restores a learner's live model, optimizer state, sampler and eval RNG,
    under the learner's lock. The optimizer is read and installed through callables: the
    learner replaces it (after a divergence, on import), so holding one would go stale."""

    def __init__(
        self,
        cfg: LearnerConfig,
        model: torch.nn.Module,
        sampler: _Sampler,
        eval_rng: np.random.Generator,
        lock: threading.RLock,
        *,
        optimizer: Callable[[], LocalOptimizer],  # the learner's current one
        install_optimizer: Callable[[LocalOptimizer], None],  # called under ``lock``
        make_optimizer: Callable[[], LocalOptimizer],  # a fresh one from the config
        check: Callable[[Params, str], None],  # ValueError if params do not fit the model
        set_params: Callable[[Params], None],
        fingerprint: Callable[[], str],
    ):
        self.cfg, self.model, self.sampler, self.eval_rng, self.lock = cfg, model, sampler, eval_rng, lock
        self.optimizer, self.install_optimizer, self.make_optimizer = optimizer, install_optimizer, make_optimizer
        self.check, self.set_params, self.fingerprint = check, set_params, fingerprint

    def export_state(
        self, reuse: dict[str, torch.Tensor] | None = None, live: bool = False
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """Private copies of everything a resume needs, taken under the lock (a memcpy of the
        parameters and optimizer state, into ``reuse``'s buffers where they fit; encoding and
        writing happen elsewhere, off the lock). ``live``: the parameters and optimizer state
        themselves (detached, not copied), for a caller that writes them before the model changes."""
        reuse = reuse or {}

        def copy(key: str, t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if live:
                return t
            old = reuse.get(key)
            if old is not None and old.shape == t.shape and old.dtype == t.dtype:
                return old.copy_(t)
            return t.to("cpu", copy=True)

        with self.lock:
            optimizer = self.optimizer()
            tensors = {f"model/{n}": copy(f"model/{n}", p) for n, p in self.model.named_parameters()}
            tensors.update(
                {
                    f"optim/{k}/{n}": copy(f"optim/{k}/{n}", t)
                    for n, st in optimizer.state.items()
                    for k, t in st.items()
                }
            )
            tensors["sampler/perm"] = torch.from_numpy(self.sampler.perm.copy())
            meta = {
                "fingerprint": self.fingerprint(),
                "optimizer": optimizer.hyper(),
                "sampler": {"rng": self.sampler.rng.bit_generator.state, "pos": int(self.sampler.pos)},
                "eval_rng": self.eval_rng.bit_generator.state,
            }
        return tensors, json.loads(json.dumps(meta, default=_json_default))

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore what ``export_state`` returned; ValueError says what does not fit (the live
        model is untouched then)."""
        params = {k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")}
        opt_tensors = {k[len("optim/") :]: v for k, v in tensors.items() if k.startswith("optim/")}
        self.check(params, "saved parameters")
        try:
            if meta["fingerprint"] != self.fingerprint():
                raise ValueError("architecture fingerprint differs from this model's")
            kind = meta["optimizer"]["kind"]
            if kind != self.cfg.optimizer:
                raise ValueError(f"saved optimizer {kind!r} != configured {self.cfg.optimizer!r}")
            steps = int(meta["optimizer"]["steps"])
            sampler = {
                "rng": meta["sampler"]["rng"],
                "pos": meta["sampler"]["pos"],
                "perm": tensors["sampler/perm"].numpy(),
            }
            eval_rng = meta["eval_rng"]
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"learner state is malformed (missing or malformed {e})") from None
        with self.lock:
            opt = self.make_optimizer()  # hyper-parameters come from the config, state from disk
            opt.load_state(opt_tensors, steps)
            old_sampler = self.sampler.state()
            try:
                self.sampler.set_state(sampler)
                self.eval_rng.bit_generator.state = eval_rng
            except (KeyError, TypeError, ValueError) as e:
                self.sampler.set_state(old_sampler)
                raise ValueError(f"learner state is malformed (sampler state: {e})") from None
            self.set_params(params)
            self.install_optimizer(opt)
