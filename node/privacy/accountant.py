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
from collections.abc import Iterable

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


def orders() -> tuple[float, ...]:
    """The RDP orders ε is computed over (opacus' defaults)."""
    return tuple(float(a) for a in _rdp()[1])  # floats: a ledger's fold reads back as it was written


@functools.lru_cache(maxsize=4096)
def _one_step(sigma: float, q: float, at: tuple[float, ...] | None = None) -> np.ndarray:
    rdp, default = _rdp()
    return np.asarray(rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(at or default)), dtype=float)


def rdp_of(steps: Steps, at: tuple[float, ...]) -> np.ndarray:
    """The RDP of all ``steps`` composed, at the orders ``at`` (inf where a step has no noise)."""
    total = np.zeros(len(at))
    for s, q, n in steps:
        if n > 0:
            one = _one_step(float(s), float(q), None if at == orders() else at)  # one cache entry per (σ, q)
            total = total + (np.full(len(at), math.inf) if s <= 0 else n * one)
    return total


def epsilon(steps: Steps, delta: float, folded: tuple[tuple[float, ...], np.ndarray] | None = None) -> float:
    """ε at ``delta`` of all ``steps`` composed (RDP, opacus' default orders), plus ``folded``: the
    RDP (orders, values) of steps a ledger compacted — composition adds RDP, so this is exact."""
    history = [(float(s), float(q), int(n)) for s, q, n in steps if n > 0]
    if not history and folded is None:
        return 0.0
    if any(s <= 0 for s, _, _ in history):
        return math.inf  # a release without noise: no guarantee at all
    analysis, default = _rdp()
    if folded is None:
        total = sum(n * _one_step(s, q) for s, q, n in history)
        at = tuple(default)
    else:
        at = folded[0]
        total = rdp_of(history, at) + folded[1]
    if not np.all(np.isfinite(total)):
        return math.inf
    eps, _ = analysis.get_privacy_spent(orders=list(at), rdp=total, delta=delta)
    eps = float(eps)
    return eps if math.isfinite(eps) else math.inf
