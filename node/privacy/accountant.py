"""ε of a node's releases: opacus's RDP accountant, not ours.

Every release is one step of the sampled Gaussian mechanism: Poisson sampling of the split at
rate q, a per-sample-bounded sum, Gaussian noise of σ × the bound. Composition is commutative,
so a ledger keeps only how many steps it made at each (σ, q); the accountant turns that into
(ε, δ)-DP. σ = 0 (no noise) gives ε = ∞.

opacus is imported on first use: importing it pulls torch.distributed (seconds of CPU), which a
node that never releases anything should not pay at start. ``warm()`` does it ahead of time."""
from __future__ import annotations

import math
import threading
from typing import Iterable

Steps = Iterable[tuple[float, float, int]]  # (noise multiplier σ, sample rate q, count)

_lock = threading.Lock()
_rdp = None


def _accountant_class():
    global _rdp
    with _lock:
        if _rdp is None:
            from opacus.accountants import RDPAccountant
            _rdp = RDPAccountant
    return _rdp


def warm() -> None:
    _accountant_class()


def epsilon(steps: Steps, delta: float) -> float:
    """ε at ``delta`` of all ``steps`` composed (RDP accountant, opacus' default orders)."""
    history = [(float(s), float(q), int(n)) for s, q, n in steps if n > 0]
    if not history:
        return 0.0
    if any(s <= 0 for s, _, _ in history):
        return math.inf  # a release without noise: no guarantee at all
    acc = _accountant_class()()
    acc.history = history
    eps = float(acc.get_epsilon(delta=delta))
    return eps if math.isfinite(eps) else math.inf
