"""L2C and meta-L2C (Li et al., "Learning to Collaborate in Decentralized Learning of Personalized
Models", l2c.txt §3.2–3.4, Alg. 1) as serverless strategies.

Alg. 1 is synchronous: iteration t mixes every neighbour's Δθ of the *same* iteration t. A node
publishes only at the end of a round, so iteration t spans two daemon rounds: round r ends with
the local steps of iteration r (published: Δθ^r), and round r+1 starts with the aggregation of
iteration r, pulling each neighbour's snapshot of round ≥ r (round-aligned exchange: the peer
holds the request until it has published that round, at most ``sync_wait_s``; a peer that does
not make it is left out this round).

Round r at node i:
  aggregation of iteration t = r−1 (from round 2 on):
    w_i = softmax(α_i) over self + neighbours (L2C, eq. 3), or
    w_ij = softmax_j ⟨E(û_i), E(û_j)⟩ (meta-L2C, eq. 4-8)                         (l.13-14)
    θ_i^{t+1} = θ_i^t − Σ_j w_ij Δθ_j^t                                           (eq. 2, l.16)
    gradient step on L_i^val(θ_i^{t+1}) w.r.t. α_i (or the encoder):              (l.18)
      ∂L/∂w_ij = −⟨∇L^val(θ_i^{t+1}), Δθ_j⟩, chained through the softmax (exact, not approximate)
    at t = T0: drop the K0 share of neighbours with the smallest w_ij, self kept   (l.20-21)
    meta-L2C: the encoder is global (AllReduce, l.24); *decentral*: gossip-averaged with the
      peers contacted this round.
  local steps of iteration r: θ_i^r → θ_i^{r+½}; Δθ_i^r = θ_i^r − θ_i^{r+½} (extras "delta"),
    û_i = θ_i^{r+½} − θ_i^0 (extras "update", meta-L2C)                           (l.6-11)
The live (published, evaluated) model at the end of round r is θ_i^{r+½}. A peer whose Δθ is
missing this round is left out of the softmax for the round (its α is kept). ``sync_wait_s = 0``
(or ``round_aligned = False``) gives the earlier asynchronous variant: whatever snapshot is there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..learning.learner import Params
from . import common as C
from .base import RoundReport, Strategy, gather_bounded

# --- the α-gradient as a pure function ---


def l2c_weight_grads(g_val: Params, deltas: list[Params]) -> np.ndarray:
    """∂L/∂w_j = −⟨∇L^val(θ^{t+1}), Δθ_j⟩ (θ^{t+1} = θ^t − Σ_j w_j Δθ_j)."""
    return np.array([-C.dot(g_val, d) for d in deltas])


def l2c_alpha_grad(alpha: np.ndarray, g_val: Params, deltas: list[Params]) -> np.ndarray:
    """∂L/∂α_k = Σ_j ∂L/∂w_j · w_j (δ_jk − w_k) = w_k (c_k − Σ_j w_j c_j), w = softmax(α)."""
    w = C.softmax(alpha)
    c = l2c_weight_grads(g_val, deltas)
    return w * (c - np.dot(w, c))


class L2C(Strategy):
    name = "l2c"
    defaults = {
        "lr": 0.1,  # Adam learning rate for α / the encoder, L2C §4 ("Adam lr 0.1")
        "weight_decay": 0.01,  # Adam weight decay, L2C §4
        "alpha_steps": 1,  # gradient steps on α per round, Alg. 1 l.18 (one)
        "val_samples": None,  # None = whole D_i^val for L^val (eq. 3)
        "prune_round": 10,  # T0 = 10, L2C §4
        "prune_fraction": 0.9,  # K0: remove 90% of neighbours at T0, L2C §4 (self always kept)
        "max_neighbours": 0,  # 0 = every alive peer is a neighbour until pruning
        "round_aligned": True,  # Alg. 1 is synchronous: mix the neighbours' Δθ of my iteration
        "sync_wait_s": 30.0,  # longest wait for a neighbour to publish that round (then without it)
    }

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self._t = 0
        self._alpha: dict[str, float] = {self.node_id: 0.0}  # α starts uniform (Alg. 1 l.3)
        self._adam: dict[str, list[float]] = {}
        self._row: dict[str, float] = {self.node_id: 1.0}
        self._kept: list[str] | None = None
        self._delta: Params | None = None
        self._base: Params | None = None  # θ_i^t: the model my last local steps started from
        self._delta_round = 0  # the round whose local steps gave Δθ_i (= my published round)
        self.theta0 = self.learner.get_params()
        self._update: Params | None = None
        self._val_loss: float | None = None
        self._aligned = 0  # this round: neighbours whose Δθ was of my iteration

    # --- neighbours ---
    def neighbours(self) -> list[str]:
        peers = self.net.peers()
        if self._kept is not None:
            peers = [p for p in peers if p in self._kept]
        k = int(self.p["max_neighbours"])
        if k and len(peers) > k:
            peers = sorted(self.rng.choice(peers, size=k, replace=False).tolist())
        return peers

    def published_extras(self) -> dict[str, Params]:
        out = {}
        if self._delta is not None:
            out["delta"] = self._delta
        if self._update is not None and self.name == "meta-l2c":
            out["update"] = self._update
        return out

    # --- the weights of this round (L2C: softmax of α) ---
    def _usable(self, snaps: dict, like: Params) -> list[str]:
        return [p for p, s in snaps.items() if C.same_shapes(s.extras.get("delta", {}), like)]

    async def _weights_and_learn(self, theta: Params, ids: list[str], deltas: list[Params], snaps: dict) -> np.ndarray:
        for p in ids:
            self._alpha.setdefault(p, 0.0)
        alpha = np.array([self._alpha[p] for p in ids])
        w = C.softmax(alpha)
        new = C.mix_updates(theta, list(zip(w.tolist(), deltas, strict=True)))
        self.learner.set_params(new)
        for _ in range(max(1, int(self.p["alpha_steps"]))):
            theta_next = C.mix_updates(theta, list(zip(C.softmax(alpha).tolist(), deltas, strict=True)))
            g, r = await self.compute(self.learner.gradient, theta_next, "val", self.p["val_samples"])
            self._val_loss = r.loss
            grad = l2c_alpha_grad(alpha, g, deltas)
            self._alpha = C.adam_scalars(
                self._alpha,
                dict(zip(ids, grad.tolist(), strict=True)),
                self._adam,
                float(self.p["lr"]),
                float(self.p["weight_decay"]),
            )
            alpha = np.array([self._alpha[p] for p in ids])
        return w

    def _prune_scores(self, ids: list[str], w: np.ndarray) -> dict[str, float]:
        return {p: float(self._alpha.get(p, 0.0)) for p in self._alpha if p != self.node_id}

    def _observe_row(self, ids: list[str], w: np.ndarray) -> None:
        """Called with every round's row (meta-L2C accumulates them for pruning)."""

    async def _pull_neighbours(self) -> dict:
        """The neighbours' snapshots holding their Δθ of my last iteration (round-aligned), or
        whatever they published last (``round_aligned`` off)."""
        peers = self.neighbours()
        if not self.p["round_aligned"]:
            return await gather_bounded({p: self.net.pull(p) for p in peers})
        r, wait = self._delta_round, float(self.p["sync_wait_s"])
        return await gather_bounded({p: self.net.pull(p, min_round=r, wait_s=wait) for p in peers})

    async def run_round(self, rnd: int) -> RoundReport:
        snaps: dict = {}
        info: dict[str, Any] = {}
        if self._delta is not None and self._base is not None and C.same_shapes(self._base, self._delta):
            # aggregation of the iteration my last round's local steps began (Alg. 1 l.13-21)
            snaps = await self._pull_neighbours()
            ids = [self.node_id] + self._usable(snaps, self._base)
            deltas = [self._delta] + [snaps[p].extras["delta"] for p in ids[1:]]
            self._aligned = sum(1 for p in ids[1:] if snaps[p].round == self._delta_round)
            w = await self._weights_and_learn(self._base, ids, deltas, snaps)
            self._row = {p: float(v) for p, v in zip(ids, w, strict=True)}
            self._observe_row(ids, w)
            self._t += 1
            if self._kept is None and self._t >= int(self.p["prune_round"]) > 0:
                scores = self._prune_scores(ids, w)
                self._kept = C.top_keep(scores, 1.0 - float(self.p["prune_fraction"]))
            info = {
                "val_loss_after": self._val_loss,
                "mixed": len(ids) - 1,
                "same_round": self._aligned,
                "of_round": self._delta_round,
            }
        # local steps of this round's iteration (Alg. 1 l.6-11); published: Δθ^r, û^r
        theta = self.learner.get_params()
        res = await self.compute(self.learner.train)
        half = self.learner.get_params()
        self._base, self._delta, self._delta_round = theta, C.sub(theta, half), rnd
        self._update = C.sub(half, self.theta0)
        return RoundReport(
            train_loss=res.loss, contacted=sorted(snaps), info={**info, "pruned": self._kept is not None}
        )

    def weights(self) -> dict[str, float]:
        """L2C: softmax(α) over self and every neighbour seen (kept ones after pruning)."""
        ids = [p for p in self._alpha if p == self.node_id or self._kept is None or p in self._kept]
        w = C.softmax([self._alpha[p] for p in ids])
        return {p: float(v) for p, v in zip(ids, w, strict=True)}

    def public_state(self) -> dict[str, Any]:
        return {
            "alpha": dict(self._alpha),
            "last_row": dict(self._row),
            "kept": self._kept,
            "val_loss_after": self._val_loss,
            "rounds": self._t,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "t": self._t,
            "alpha": dict(self._alpha),
            "adam": {k: list(v) for k, v in self._adam.items()},
            "row": dict(self._row),
            "kept": self._kept,
            "delta": C.params_state(self._delta),
            "base": C.params_state(self._base),
            "delta_round": self._delta_round,
            "update": C.params_state(self._update),
            "theta0": C.params_state(self.theta0),
            "val_loss": self._val_loss,
            "rng": C.rng_state(self.rng),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._t = int(state.get("t", 0))
        self._val_loss = state.get("val_loss")
        self._alpha = {str(k): float(v) for k, v in state.get("alpha", {self.node_id: 0.0}).items()}
        self._adam = {str(k): [float(x) for x in v] for k, v in state.get("adam", {}).items()}
        self._row = {str(k): float(v) for k, v in state.get("row", {self.node_id: 1.0}).items()}
        self._kept = None if state.get("kept") is None else [str(k) for k in state["kept"]]
        self._delta = state.get("delta")
        self._base = state.get("base")
        self._delta_round = int(state.get("delta_round", 0))
        self._update = state.get("update")
        if state.get("theta0") is not None:
            self.theta0 = state["theta0"]
        C.set_rng_state(self.rng, state.get("rng"))


class MetaL2C(L2C):
    """meta-L2C. Two departures from the paper's text: the attention is the sum over layers of
    the cosine of their tanh embeddings, ⟨E_i, E_j⟩ = Σ_l cos(φ_l^i, φ_l^j) (``attention =
    "layer-cosine"``, ``UpdateEncoder`` normalise "layer"), instead of the raw dot product of
    unnormalised 610-dim embeddings (eq. 5), where one node with large updates became a hub (four
    S1 nodes put 0.6–0.78 on the same peer); the per-filter average of the SCool authors' code
    (``"cosine"``) has no hub either but lets the many filters of the shared feature layers
    outvote the few that differ between tasks, so before pruning the rows stayed near uniform
    (in-cluster share 0.21 at T0 on S1, chance 0.18; issue 23). And pruning at T0 ranks the
    peers by their mean weight over the rounds so far (``prune_on = "mean"``), not by the last
    row alone, which is one noisy draw (L2C's own pruning ranks α, itself an accumulation)."""

    name = "meta-l2c"
    defaults = {
        **L2C.defaults,
        "encoder_dims": [10, 5],  # L2C §4: E_l two FC layers, output dims (10, 5), per filter (eq. 7)
        "encoder_seed": 0,  # *decentral*: common encoder init, like the models' θ⁰
        "attention": "layer-cosine",  # Σ over layers of cos(φ_l^i, φ_l^j) (UpdateEncoder "layer");
        # "cosine" = the SCool *code*'s per-filter average; "dot" = eq. 5/26
        "prune_on": "mean",  # rank peers at T0 by their mean row weight; "last" = the last row
    }

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        d = self.p["encoder_dims"]
        self.encoder = C.UpdateEncoder(
            self.theta0,
            (int(d[0]), int(d[1])),
            int(self.p["encoder_seed"]),
            normalise=C.encoder_norm(self.p["attention"], self.name),
        )
        self._row_sum: dict[str, float] = {}  # Σ over rounds of each peer's row weight
        self._row_cnt: dict[str, int] = {}  # rounds in which it was in the row
        self.opt = torch.optim.Adam(
            self.encoder.parameters(), lr=float(self.p["lr"]), weight_decay=float(self.p["weight_decay"])
        )

    def _usable(self, snaps: dict, like: Params) -> list[str]:
        return [p for p in super()._usable(snaps, like) if C.same_shapes(snaps[p].extras.get("update", {}), like)]

    async def _weights_and_learn(self, theta: Params, ids: list[str], deltas: list[Params], snaps: dict) -> np.ndarray:
        ups = [snaps[p].extras["update"] for p in ids[1:]]
        update = self._update
        assert update is not None  # this round's local steps set it before the weights are learned

        def logits() -> torch.Tensor:
            return C.attention_logits(self.encoder, update, ups)

        def weights_now() -> np.ndarray:
            # grad mode is per thread: switch it off here, in the worker, never around an await
            with torch.no_grad():
                return torch.softmax(logits(), 0).numpy().astype(np.float64)

        C.encoder_fold(self.encoder)  # peers' gossip since my last round, before I use the encoder
        w = await self.compute(weights_now)
        new = C.mix_updates(theta, list(zip(w.tolist(), deltas, strict=True)))
        self.learner.set_params(new)
        # Alone this round (no usable peer), w = [1] whatever the encoder: eq. 6 has no gradient, and
        # Adam would turn the bare weight decay into lr-sized steps on every parameter (it scales
        # steps to ~lr whatever the gradient's size), wrecking the shared encoder. No step then.
        steps = max(1, int(self.p["alpha_steps"])) if len(ids) > 1 else 0
        if not steps:
            self._val_loss = (await self.compute(self.learner.loss, new, "val", self.p["val_samples"])).loss
        for _ in range(steps):

            def step() -> float:
                lg = logits()
                wt = torch.softmax(lg, 0)
                theta_next = C.mix_updates(theta, list(zip(wt.detach().double().tolist(), deltas, strict=True)))
                g, r = self.learner.gradient(theta_next, "val", self.p["val_samples"])
                c = torch.as_tensor(l2c_weight_grads(g, deltas), dtype=torch.float32)
                # Σ_j w_j(φ) · ∂L/∂w_j has the exact gradient dL/dφ (chain rule through eq. 2)
                self.opt.zero_grad()
                (wt * c).sum().backward()
                self.opt.step()
                return r.loss

            self._val_loss = await self.compute(step)
        replies = await gather_bounded(
            {q: self.net.gossip(q, "encoder", {"vec": C.vec_to_wire(C.encoder_current(self.encoder))}) for q in snaps}
        )
        C.encoder_average(self.encoder, replies.values())
        return w

    def _observe_row(self, ids: list[str], w: np.ndarray) -> None:
        for p, v in zip(ids, w, strict=True):
            if p != self.node_id:
                self._row_sum[p] = self._row_sum.get(p, 0.0) + float(v)
                self._row_cnt[p] = self._row_cnt.get(p, 0) + 1

    def _prune_scores(self, ids: list[str], w: np.ndarray) -> dict[str, float]:
        if self.p["prune_on"] == "last":
            return {p: float(v) for p, v in zip(ids, w, strict=True) if p != self.node_id}
        return {p: self._row_sum[p] / self._row_cnt[p] for p in self._row_sum}

    def on_gossip(self, peer: str, key: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        return C.encoder_on_gossip(self.encoder, payload) if key == "encoder" else None

    def weights(self) -> dict[str, float]:
        """meta-L2C: the attention row of the last round."""
        return dict(self._row)

    def public_state(self) -> dict[str, Any]:
        st = super().public_state()
        st.pop("alpha")
        return st

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "row_sum": dict(self._row_sum),
            "row_cnt": dict(self._row_cnt),
            "encoder": C.vec_to_wire(self.encoder.get_vector()),
            "encoder_pending": C.encoder_pending_state(self.encoder),
            "encoder_opt": C.optimizer_state(self.opt),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._row_sum = {str(k): float(v) for k, v in state.get("row_sum", {}).items()}
        self._row_cnt = {str(k): int(v) for k, v in state.get("row_cnt", {}).items()}
        v = C.vec_from_wire(state.get("encoder"))
        if v is not None and v.size == self.encoder.num_params():
            self.encoder.set_vector(v)
        C.set_encoder_pending(self.encoder, state.get("encoder_pending"))
        C.load_optimizer_state(self.opt, state.get("encoder_opt"))
