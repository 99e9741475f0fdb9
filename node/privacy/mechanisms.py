"""The one door through which anything computed on this node's private data leaves it.

``PrivateData.loss`` and ``.gradient`` answer for a peer and a purpose (served cross-losses and
-gradients, COBO's alignment vector, FedeRiCo's pushed gradients all come through here):

1. the purpose fixes the split (``purposes.py``); the expected batch is at least
   ``min_batch`` samples, never a caller-chosen sample. A node on its own files (real data)
   whose split holds fewer than ``min_batch`` samples releases nothing at all
   (``TooFewSamples``: refused like a spent budget; ``withheld()`` says so for /status). The
   built-in synthetic pools keep the old concession (the whole split if smaller), so the shipped
   experiments with small shards run unchanged;
2. with privacy on, the release is the sampled Gaussian mechanism of DP-SGD (Abadi et al. 2016,
   as opacus implements it): the ledger is charged first (and refuses once the budget is spent),
   then a Poisson sample of the split at rate q = batch/n, per-sample clipping (losses into
   [0, loss_clip], gradients to L2 norm grad_clip), the sum plus N(0, (σ·bound)²) per coordinate,
   divided by the *expected* batch size (the realised one is itself private);
3. with privacy off, the exact mean over a uniformly drawn batch of that size (the ledger still
   counts the release, with ε = ∞).

Noise comes from a generator seeded by the OS (never from the experiment seed: a predictable
noise stream could be subtracted). It is numpy's PCG64, not a cryptographic generator."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

import numpy as np
import torch

from ..learning.learner import Learner, Params, Split
from .ledger import BudgetSpent, PrivacyLedger
from .purposes import Purpose


class PrivacySettings(Protocol):
    """The knobs the mechanisms read (``config.PrivacyConfig`` has them; privacy does not import
    the config, the config imports privacy's purposes)."""

    enabled: bool
    noise_multiplier: float
    grad_clip: float
    loss_clip: float
    min_batch: int


class TooFewSamples(BudgetSpent):
    """The split holds fewer than ``min_batch`` samples of real data: nothing computed on it may
    leave. A kind of spent budget, so every caller that handles one handles this too."""


V = TypeVar("V", float, Params)  # a loss or a gradient


@dataclass
class Released(Generic[V]):
    value: V
    samples: int  # expected batch size behind the value
    noise_std: float  # std of the noise on each coordinate of the (mean) value; 0 = exact


class PrivateData:
    def __init__(
        self, learner: Learner, cfg: PrivacySettings, ledger: PrivacyLedger, rng: np.random.Generator | None = None
    ):
        self.learner = learner
        self.cfg = cfg
        self.ledger = ledger
        self._rng = rng or np.random.default_rng()  # OS entropy
        self._rng_lock = threading.Lock()  # numpy generators are not thread-safe

    def batch_size(self, split: Split, requested: int) -> tuple[int, int]:
        """(expected batch, split size): the request's size, at least ``min_batch``, at most the
        whole split; 0 asks for the whole split."""
        n = self.learner.num_samples(split)
        if n == 0:
            raise ValueError(f"split {split!r} is empty on this node")
        if n < self.cfg.min_batch and self.learner.own_data:
            raise TooFewSamples(self._too_few(split, n))
        b = n if requested <= 0 else min(n, max(int(requested), self.cfg.min_batch))
        return b, n

    def _too_few(self, split: str, n: int) -> str:
        # privacy.enabled = false does not lift it: an exact answer over a handful of samples
        # gives them away (a one-sample gradient *is* the sample), so the minimum holds either way
        return (
            f"this node's {split} split holds {n} samples, fewer than privacy.min_batch = "
            f"{self.cfg.min_batch}: it serves no cross-loss/-gradient and sends no gradient "
            f"computed on its data, with privacy on or off; privacy.min_batch = {n} or lower "
            f"lifts this (its answers then rest on {n} samples)"
        )

    def withheld(self, splits: tuple[Split, ...] = ("train", "val")) -> str | None:
        """Why this node releases nothing computed on its data (too few samples), or None."""
        if not self.learner.own_data:
            return None
        for split in splits:
            n = self.learner.num_samples(split)
            if 0 < n < self.cfg.min_batch:
                return self._too_few(split, n)
        return None

    def _sample(self, b: int, n: int) -> np.ndarray:
        with self._rng_lock:
            if b >= n:
                return np.arange(n)
            return np.flatnonzero(self._rng.random(n) < b / n)  # Poisson: what the accountant assumes

    def _noise(self, shape: tuple[int, ...], std: float) -> np.ndarray:
        with self._rng_lock:
            return self._rng.normal(0.0, std, size=shape)

    def _charge(self, peer: str, purpose: Purpose, b: int, n: int, own: bool = False) -> None:
        sigma = self.cfg.noise_multiplier if self.cfg.enabled else 0.0
        self.ledger.charge(peer, purpose.name, sigma, b / n, enforce=self.cfg.enabled, requested=not own)

    def loss(
        self,
        peer: str,
        purpose: Purpose,
        params: Params | None,
        requested: int = 0,
        reduction: Literal["mean", "sum"] = "mean",
    ) -> Released[float]:
        """Mean (or summed) loss of ``params`` on a batch of ``purpose.split``, for ``peer``."""
        b, n = self.batch_size(purpose.split, requested)
        self._charge(peer, purpose, b, n)
        if not self.cfg.enabled:
            r = self.learner.loss(params, purpose.split, b if b < n else None, reduction)
            return Released(float(r.loss), b, 0.0)
        idx = self._sample(b, n)
        c, sigma = self.cfg.loss_clip, self.cfg.noise_multiplier
        total = self.learner.clipped_loss_sum(params, purpose.split, idx, c) if len(idx) else 0.0
        noisy = total + float(self._noise((), sigma * c))
        if reduction == "sum":
            return Released(noisy, b, sigma * c)
        return Released(noisy / b, b, sigma * c / b)

    def gradient(
        self, peer: str, purpose: Purpose, params: Params | None, requested: int = 0, own: bool = False
    ) -> tuple[Released[Params], float]:
        """Mean gradient of ``params`` on a batch of ``purpose.split``, for ``peer``; and the
        batch's loss when it is exact (privacy off), else NaN (it would be a second release)."""
        b, n = self.batch_size(purpose.split, requested)
        self._charge(peer, purpose, b, n, own)  # own: this node chose to send it (a push, its alignment vector)
        if not self.cfg.enabled:
            g, r = self.learner.gradient(params, purpose.split, b if b < n else None, "mean")
            return Released(g, b, 0.0), float(r.loss)
        idx = self._sample(b, n)
        c, sigma = self.cfg.grad_clip, self.cfg.noise_multiplier
        if len(idx):
            total = self.learner.clipped_gradient_sum(params, purpose.split, idx, c)
        else:  # an empty Poisson draw still releases (pure noise), as DP-SGD does
            total = {k: torch.zeros(s) for k, (s, _) in self.learner.param_spec().items()}
        out = {
            k: (t + torch.from_numpy(self._noise(tuple(t.shape), sigma * c)).to(t.dtype)) / b for k, t in total.items()
        }
        return Released(out, b, sigma * c / b), math.nan
