"""Baselines: learning alone, D-PSGD gossip averaging, and the cluster oracle."""

from __future__ import annotations

import asyncio
import contextlib
import math
from typing import Any

from ..learning.learner import Params
from ..offload import OFF_LOOP_BYTES
from .base import RoundReport, Strategy, gather_bounded


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
        "max_neighbours": 0,  # 0 = all alive peers
        "max_staleness": 1,  # rounds a mixed model may lag mine; 0 = fully asynchronous
        "sync_wait_s": 10.0,  # longest wait for a lagging peer (then this round goes without it)
        "big_pulls": 2,  # models over 1 MiB pulled at a time (bounds the exchange's memory); 0 = all at once
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
        # float32 estimate from the shapes: only which side of the off-loop threshold it is on
        big = sum(math.prod(shape) for shape, _ in self.learner.param_spec().values()) * 4 > OFF_LOOP_BYTES
        # a large trained model is published now, before the exchange (Alg. 1 shares y_i = θ_i
        # after the local steps; peers get it sooner): it is held once, as the published buffer's
        # views, through the exchange and after it, instead of a copy encoded again at the end
        trained = await self.publish_now() if big and self.publish_now is not None else None
        if trained is None:
            trained = await self.compute(self.learner.get_params) if big else self.learner.get_params()
        peers = self.candidates()
        stale = int(self.p["max_staleness"])
        floor = rnd - stale if stale > 0 and rnd - stale >= 1 else None
        wait = float(self.p["sync_wait_s"])
        # Stream-averaging into the live model, which holds the trained one now: each pulled model
        # is added into it as it arrives and released at once, and for a large model at most
        # ``big_pulls`` are pulled at a time — the exchange holds a few models, not one per
        # neighbour (issue 24.4); the adds and the final scaling run in worker threads. A large
        # model is pulled ``lazy``: a q8 payload is decoded chunk by chunk into the sum, so what a
        # pull in flight holds is its payload (a quarter of the model), not a decoded copy.
        adding = asyncio.Lock()  # one add at a time into the live model
        k = int(self.p["big_pulls"])
        slots = asyncio.Semaphore(k) if big and k > 0 else None

        async def fold(peer: str) -> bool:
            async with slots if slots is not None else contextlib.nullcontext():
                # a large model's tensors may stay encoded until added: no decoded copy of it
                snap = await self.net.pull(peer, min_round=floor, wait_s=wait, **({"lazy": True} if big else {}))
                if snap is None:
                    return False
                params, snap = snap.params, None
                if big:  # the sum has it now: its tensors go with ``params`` (a small model stays
                    self.net.release(peer)  # cached: its subscription serves the next rounds from there)
                async with adding:
                    if big:
                        await self.compute(self.learner.add_to_params, params)
                    else:
                        self.learner.add_to_params(params)
                return True

        try:
            got = await gather_bounded({p: fold(p) for p in peers})
            mixed = sorted(p for p, ok in got.items() if ok)
            w = 1.0 / (1 + len(mixed))
            if big:
                await self.compute(self.learner.scale_params, w)
            else:
                self.learner.scale_params(w)
        except BaseException:
            # a round cut short (the node stopping) leaves the trained model, not a partial sum
            self.learner.set_params(trained)
            raise
        self._trained = trained
        self._w = {self.node_id: w, **{p: w for p in mixed}}
        return RoundReport(train_loss=res.loss, contacted=mixed)

    def on_published(self, params: Params) -> None:
        if self._trained is not None:
            self._trained = params  # the published snapshot's views: the model held once, not twice

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
            raise ValueError(
                "oracle: this node learns from its own files, which have no true cluster; "
                "set labels.cluster on every node or pick another strategy"
            )
        return [p for p in self.net.peers() if mine is not None and self.net.true_cluster(p) == mine]
