"""Baselines: learning alone, D-PSGD gossip averaging, and the cluster oracle."""
from __future__ import annotations

from typing import Any

import torch

from ..learning.learner import Params
from ..offload import OFF_LOOP_BYTES
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
    """D-PSGD (Lian et al. 2017; SCool §4.1 eq. 16 / App. B Alg. 1) with local steps, in the
    adapt-then-combine form of decentralized local SGD (Koloskova et al. 2020):
    y_i = θ_i after the local steps, published; θ_i ← Σ_j w_ij y_j with uniform w over the alive
    neighbours that answered. The node keeps (and is evaluated on) the neighbourhood average, as
    Alg. 1's iterate x_{t+1,i} is.

    Peers pull the *trained* y_j (``shared_params``), not the average: with asynchronous rounds,
    publishing the average would let each node's own steps reach the others only after being
    diluted by 1/n, and the network would learn slower than a single node. (Averaging first and
    training after instead would make every published model a locally fine-tuned one — a
    personalisation method, not the consensus baseline.)

    Bounded staleness (stale-synchronous parallel, Ho et al. 2013): in round t a node mixes only
    models of round >= t - ``max_staleness``; a peer still behind holds the pull open until it gets
    there, at most ``sync_wait_s``, and is otherwise left out of this round. Without the bound a
    node that happens to run fast drifts rounds ahead and averages with ever older models (in a
    4-node test run: up to 10 rounds apart, and the network's gain over training alone halved)."""
    name = "dpsgd"
    defaults = {
        "max_neighbours": 0,   # 0 = all alive peers
        "max_staleness": 1,    # rounds a mixed model may lag mine; 0 = fully asynchronous
        "sync_wait_s": 10.0,   # longest wait for a lagging peer (then this round goes without it)
    }

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self._w: dict[str, float] = {self.node_id: 1.0}
        self._trained: Params | None = None

    def candidates(self) -> list[str]:
        peers = self.net.peers()
        k = int(self.p["max_neighbours"])
        if k and len(peers) > k:
            peers = sorted(self.rng.choice(peers, size=k, replace=False).tolist())
        return peers

    async def run_round(self, rnd: int) -> RoundReport:
        res = await self.compute(self.learner.train)
        trained = self.learner.get_params()
        peers = self.candidates()
        stale = int(self.p["max_staleness"])
        floor = rnd - stale if stale > 0 and rnd - stale >= 1 else None
        wait = float(self.p["sync_wait_s"])
        snaps = await gather_bounded({p: self.net.pull(p, min_round=floor, wait_s=wait) for p in peers})
        w = 1.0 / (1 + len(snaps))
        members = [(w, trained)] + [(w, s.params) for s in snaps.values()]
        def average() -> None:
            self.learner.set_params(weighted_average(members))
        if sum(t.numel() * t.element_size() for t in trained.values()) > OFF_LOOP_BYTES:
            await self.compute(average)  # a large model-sized sum: off the event loop
        else:
            average()
        self._trained = trained
        self._w = {self.node_id: w, **{p: w for p in snaps}}
        return RoundReport(train_loss=res.loss, contacted=sorted(snaps))

    def shared_params(self) -> Params | None:
        return self._trained

    def on_diverged(self) -> None:
        self._trained = None  # share the restored live model until a round trains a finite one

    def weights(self) -> dict[str, float]:
        return dict(self._w)


class Oracle(DPSGD):
    """D-PSGD restricted to the true cluster (benchmarks only: it reads the partitioner's truth)."""
    name = "oracle"

    def candidates(self) -> list[str]:
        mine = self.net.true_cluster(self.node_id)
        if mine is None and self.learner.own_data:
            raise ValueError("oracle: this node learns from its own files, which have no true cluster; "
                             "set labels.cluster on every node or pick another strategy")
        return [p for p in self.net.peers() if mine is not None and self.net.true_cluster(p) == mine]
