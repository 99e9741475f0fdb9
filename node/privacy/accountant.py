"""ε of a node's releases: opacus' RDP analysis, not ours.

Every release is one step of the sampled Gaussian mechanism: Poisson sampling of the split at
rate q, a per-sample-bounded sum, Gaussian noise of σ × the bound. Composition is commutative,
so a ledger keeps only how many steps it made at each (σ, q); this turns that into (ε, δ)-DP the
way opacus' ``RDPAccountant`` does (its orders, ``compute_rdp``, ``get_privacy_spent``), with one
difference: the RDP of one step at (σ, q) is computed once and kept. RDP composes linearly in the
number of steps, so the result is the same, and a charge costs microseconds instead of the ~0.1–1 s
of re-deriving the fractional orders' series every time (a node charges on every answer).

opacus is imported on first use: importing it pulls torch.distributed (seconds of CPU), which a
node that never releases anything should not pay at start. ``warm()`` does it ahead of time."""
from __future__ import annotations

import functools
import math
import threading
from typing import Iterable

import numpy as np

Steps = Iterable[tuple[float, float, int]]  # (noise multiplier σ, sample rate q, count)

_lock = threading.Lock()
_analysis = None


def _rdp():
    """opacus' RDP analysis module and its default orders (imported once, on first use)."""
    global _analysis
    with _lock:
        if _analysis is None:
            from opacus.accountants import RDPAccountant
            from opacus.accountants.analysis import rdp
            _analysis = (rdp, list(RDPAccountant.DEFAULT_ALPHAS))
    return _analysis


def warm() -> None:
    _rdp()


@functools.lru_cache(maxsize=4096)
def _one_step(sigma: float, q: float) -> np.ndarray:
    rdp, orders = _rdp()
    return np.asarray(rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=orders), dtype=float)


def epsilon(steps: Steps, delta: float) -> float:
    """ε at ``delta`` of all ``steps`` composed (RDP, opacus' default orders)."""
    history = [(float(s), float(q), int(n)) for s, q, n in steps if n > 0]
    if not history:
        return 0.0
    if any(s <= 0 for s, _, _ in history):
        return math.inf  # a release without noise: no guarantee at all
    rdp, orders = _rdp()
    total = sum(n * _one_step(s, q) for s, q, n in history)
    eps, _ = rdp.get_privacy_spent(orders=orders, rdp=total, delta=delta)
    eps = float(eps)
    return eps if math.isfinite(eps) else math.inf
