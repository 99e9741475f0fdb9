"""``simavg``: similarity-weighted averaging (group ``coterie.strategies``).

Each round, node i
  1. pulls the published models of up to ``max_peers`` alive peers, of at least round r−1
     (``PeerNetwork.pull`` with ``min_round``; a peer that does not answer in time is left out),
  2. measures how well each candidate θ_n (its own live model and the pulled ones) predicts its
     *own* validation data, L_n = L_i^val(θ_n) — nothing about i's data leaves the node,
  3. weights them by similarity, w_n ∝ exp(−(L_n − min L) / temperature), and sets
     θ_i ← Σ_n w_n θ_n,
  4. trains locally from there; the node then publishes the trained model.

Peers whose data resembles i's have models that do well on i's data and get most of the weight;
the rest fade out. A deliberately small, real strategy that only uses the public contract:
``Strategy``/``PeerNetwork``/``Learner`` from docs/extending.md, nothing of Coterie's internals.
"""

from __future__ import annotations

import math
from typing import Any

from coterie.node.strategies.base import RoundReport, Strategy, gather_bounded


def similarity_weights(losses: dict[str, float], temperature: float) -> dict[str, float]:
    """w_n ∝ exp(−(L_n − min L)/T); non-finite losses get weight 0."""
    finite = {n: v for n, v in losses.items() if math.isfinite(v)}
    if not finite:
        return {}
    best = min(finite.values())
    raw = {n: math.exp(-(v - best) / temperature) for n, v in finite.items()}
    total = sum(raw.values())
    return {n: raw.get(n, 0.0) / total for n in losses}


class SimilarityAveraging(Strategy):
    name = "simavg"
    defaults: dict[str, Any] = {
        "temperature": 0.1,  # T: lower = only the best-matching models count
        "max_peers": 8,  # models pulled per round (the alive peers, sorted, first ones)
        "val_samples": None,  # None = the whole validation split
        "wait_s": 5.0,  # wait this long for a peer's previous round (0: take what it has)
    }

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        if float(self.p["temperature"]) <= 0:
            raise ValueError(f"simavg: temperature must be > 0, got {self.p['temperature']}")
        self._w: dict[str, float] = {self.node_id: 1.0}
        self._losses: dict[str, float] = {}
        self._rounds = 0

    async def run_round(self, rnd: int) -> RoundReport:
        peers = self.net.peers()
        if len(peers) > int(self.p["max_peers"]):
            peers = [str(p) for p in self.rng.choice(peers, int(self.p["max_peers"]), replace=False)]
        # round-aligned: a peer's model of at least my previous round, so a fast node does not
        # judge its peers by models they have not trained yet; a peer that is later gets left out
        wait = float(self.p["wait_s"])
        snaps = await gather_bounded(
            {p: self.net.pull(p, min_round=rnd - 1, wait_s=wait) if wait > 0 else self.net.pull(p) for p in peers}
        )
        mine = self.learner.get_params()
        cands = {self.node_id: mine}
        for p, s in snaps.items():
            # a peer with another architecture cannot be averaged with: leave it out
            if s.params.keys() == mine.keys() and all(s.params[k].shape == mine[k].shape for k in mine):
                cands[p] = s.params
        vs = self.p["val_samples"]

        def combine() -> dict[str, float]:
            losses = {n: self.learner.loss(th, "val", vs).loss for n, th in cands.items()}
            w = similarity_weights(losses, float(self.p["temperature"]))
            if w:
                self.learner.set_params(
                    {k: sum(w[n] * cands[n][k].float() for n in cands if w[n] > 0).to(mine[k].dtype) for k in mine}
                )
            self._losses = losses
            return w

        w = await self.compute(combine)  # CPU work off the event loop: heartbeats keep flowing
        self._w = w or {self.node_id: 1.0}
        res = await self.compute(self.learner.train)
        self._rounds += 1
        return RoundReport(
            train_loss=res.loss,
            contacted=sorted(snaps),
            info={"candidates": len(cands), "self_weight": self._w.get(self.node_id, 0.0)},
        )

    def weights(self) -> dict[str, float]:
        return dict(self._w)

    def public_state(self) -> dict[str, Any]:
        return {"val_losses": dict(self._losses), "rounds": self._rounds}

    def state_dict(self) -> dict[str, Any]:
        return {"weights": dict(self._w), "rounds": self._rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._w = {str(k): float(v) for k, v in state.get("weights", {self.node_id: 1.0}).items()}
        self._rounds = int(state.get("rounds", 0))
