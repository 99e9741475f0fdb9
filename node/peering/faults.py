"""Fault injection: a bad actor on demand, for the testbed and tests (hivemind's ``Fault``
fixtures are the model). A fault wraps this node's served side and corrupts what it hands out;
the node itself learns normally and never knows. Switched on by ``faulty = "<name>"``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..learning.learner import Params
from .interfaces import PeerHandler
from .messages import LocalSnapshot


def random_weights(params: Params, version: int) -> Params:
    """Plausible-looking garbage of the right shapes (a fresh draw per version)."""
    g = torch.Generator().manual_seed(version)
    return {k: torch.randn(v.shape, generator=g) * (v.std() if v.numel() > 1 else 1.0) for k, v in params.items()}


def scaled_weights(params: Params, version: int) -> Params:
    """The right model, blown up 25×: a magnitude attack on averaging strategies."""
    return {k: v * 25.0 for k, v in params.items()}


FAULTS: dict[str, Callable[[Params, int], Params]] = {"random": random_weights, "scale": scaled_weights}


class FaultyPeer:
    """A ``PeerHandler`` that serves corrupted snapshots and otherwise delegates."""

    def __init__(self, inner: PeerHandler, fault: str):
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {sorted(FAULTS)}")
        self.inner, self.fault = inner, fault
        self._corrupt = FAULTS[fault]
        self._last: tuple[int, LocalSnapshot] | None = None  # one corrupted copy per version

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def snapshot(self, requester: str, min_round: int = 0, wait_s: float = 0.0) -> LocalSnapshot:
        snap = await self.inner.snapshot(requester, min_round, wait_s)
        if self._last is None or self._last[0] != snap.version:
            groups = {**snap.groups, "params": self._corrupt(snap.params, snap.version)}
            self._last = (snap.version, LocalSnapshot(snap.node_id, snap.version, snap.round, groups))
        return await self._last[1].ready()


def with_fault(handler: PeerHandler, fault: str) -> PeerHandler:
    return handler if fault in ("", "none") else FaultyPeer(handler, fault)
