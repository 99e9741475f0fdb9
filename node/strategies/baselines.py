"""Baselines: learning alone, D-PSGD gossip averaging, and the cluster oracle."""
from __future__ import annotations

from typing import Any

import torch

from ..learning.learner import Params
from .base import RoundReport, Strategy, gather_bounded


def weighted_average(members: list[tuple[float, Params]]) -> Params:
    """Σ_j w_j θ_j for weights that sum to one."""
    out = {k: torch.zeros_like(v) for k, v in members[0][1].items()}
    for w, params in members:
        for k, v in params.items():
            out[k].add_(v, alpha=w)
    return out


class Local(Strategy):
    """Never communicates: the floor every collaborative strategy must beat."""
    name = "local"

    async def run_round(self, rnd: int) -> RoundReport:
        res = await self.compute(self.learner.train)
        return RoundReport(train_loss=res.loss)

    def weights(self) -> dict[str, float]:
        return {self.node_id: 1.0}


class DPSGD(Strategy):
    """D-PSGD (SCool §4.1 eq. 16, θ_i ← Σ_j w_ij θ_j − α∇L_i): uniform averaging over the alive
    neighbours that answered, *then* the local steps, so the published model carries this round's
    training. (Training first and averaging after would publish averaged-but-untrained models:
    every node's own steps would enter the consensus diluted by 1/n, and on IID data the network
    learned no faster than a single node.)"""
    name = "dpsgd"
    defaults: dict[str, Any] = {"max_neighbours": 0}  # 0 = all alive peers

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self._w: dict[str, float] = {self.node_id: 1.0}

    def candidates(self) -> list[str]:
        peers = self.net.peers()
        k = int(self.p["max_neighbours"])
        if k and len(peers) > k:
            peers = sorted(self.rng.choice(peers, size=k, replace=False).tolist())
        return peers

    async def run_round(self, rnd: int) -> RoundReport:
        peers = self.candidates()
        snaps = await gather_bounded({p: self.net.pull(p) for p in peers})
        w = 1.0 / (1 + len(snaps))
        members = [(w, self.learner.get_params())] + [(w, s.params) for s in snaps.values()]
        self.learner.set_params(weighted_average(members))
        self._w = {self.node_id: w, **{p: w for p in snaps}}
        res = await self.compute(self.learner.train)
        return RoundReport(train_loss=res.loss, contacted=sorted(snaps))

    def weights(self) -> dict[str, float]:
        return dict(self._w)


class Oracle(DPSGD):
    """D-PSGD restricted to the true cluster (benchmarks only: it reads the partitioner's truth)."""
    name = "oracle"

    def candidates(self) -> list[str]:
        mine = self.net.true_cluster(self.node_id)
        return [p for p in self.net.peers() if mine is not None and self.net.true_cluster(p) == mine]
