"""COBO (Hu et al., "Collaborative learning via bilevel optimization", cobo.txt eq. 1–4, Alg. 1) as
a serverless strategy.

Round at node i:
  Client-Selection (Alg. 1 l.9-16, eq. 1/4): for each alive peer j > i (the pair's smaller id
    starts its updates, see ``initiates``), with probability p_pair:
    z = (x_i + x_j)/2 (x_j = j's snapshot); send z and my ∇f_i(z) (one fresh minibatch) to j in a
    single cross-gradient-alignment request; j computes ∇f_j(z) on its minibatch, updates its own
    w_ji through ``on_alignment`` and returns the inner product; I set
    w_ij ← clip_[0,1](w_ij + γ ⟨∇f_i(z), ∇f_j(z)⟩). Both ends hold the same value.
  Model step (eq. 2/3), S times: x_i ← x_i − η (g_i + ρ Σ_k w_ik (x_i − x_k)), x_k the snapshots
    of the neighbours with w_ik > 0 pulled once this round (stale within the S steps); g_i a
    0.9-momentum EMA of minibatch gradients (*code*); a plain SGD step with η = ``lr`` (eq. 3):
    ``optimizer = "sgd"``, the paper's and the authors' step (bench/papers pins it).
    ``optimizer = "learner"`` (default: a node trains with the optimizer its owner configured, as
    under every other strategy) splits eq. 3 in its two terms: the consensus term stays eq. 3's plain
    step x_i ← x_i − ηρ Σ_k w_ik (x_i − x_k) (COBO's η), and the node's own optimizer (S1: Adam, as
    local and every other strategy) takes the step on the raw minibatch gradient (its own moment
    estimate replaces the 0.9 EMA). With an SGD learner of lr η and no EMA this is eq. 3 exactly.
    (Handing the whole direction g + ρΣw(x − x_k) to Adam, the earlier reading, broke eq. 3's
    balance: Adam scales every coordinate to ~lr, so the small but consistent pull outweighed the
    noisy gradient; on S3 the models crawled to a train loss of 1.4 in 600 steps.)
*decentral*: the paper updates W every step with per-pair probability p(t); exchanging every step
is too chatty for a network, so S local steps run between exchanges (``local_steps``; default the
learner's steps per round, so COBO trains the budget local training does), and each exchange carries
the paper's expected number of pair updates over those S steps, k = Σ_{t in the S steps} p(t):
a pair is updated with probability min(1, k), by max(1, k)·γ⟨·,·⟩ (the initiator scales the
gradient it sends by max(1, k), so both ends apply the same value). The k updates the paper makes
each draw a fresh minibatch, so their sum has the noise of one minibatch ×√k; one inner product
scaled by k would have k× the noise (on S1 at k = 20: single updates of ±1, W jumping between 0 and
1 at random). The exchange's gradients are therefore taken on k minibatches' worth of samples
(``grad_samples`` × ⌈k⌉, at most the whole split; one minibatch when releases are DP-noised, see
``align_samples``).
Pair schedule p(t), the paper's *mixed* strategy (§4, Table 1: the best of the four): the constant
rate O(1/n) — 2/n per unordered pair, Alg. 1 l.11's 1/n per ordered pair — for the first 0.2% of
the iterations (``warm_fraction`` × ``total_steps``: the node's planned model steps, rounds ×
S, when it has a planned end; else the paper's run, 40,000), then the
time-dependent rate O(1/t), p(t) = min(1, c/(t+1)) with c = 100 (*code*: the authors' O(1/t)
rate, ``p_sample = min(1.0, 100/(self.step+1))`` in grouping.py). W is learnt early (p = 1 until
step 100, so early pair updates are dense) and then settles (Σ γ p(t) grows like log t).
``schedule = "code"`` keeps the authors' shipped run instead (2/n, then 1/√t after 800 steps).
W starts at all ones (Alg. 1 input).
"""

from __future__ import annotations

import math
from typing import Any

from ..learning.learner import Params
from . import common as C
from .base import RoundReport, Strategy, gather_bounded

# --- the update rules as pure functions ---


def cobo_direction(g: Params, x: Params, neighbours: list[tuple[float, Params]], rho: float) -> Params:
    """g_i + ρ Σ_k w_ik (x_i − x_k) (eq. 2/3; not degree-normalised, *code*)."""
    terms = [(1.0, g)]
    for w, xk in neighbours:
        if w != 0.0:
            terms += [(rho * w, x), (-rho * w, xk)]
    return C.lincomb(terms, g)


def cobo_model_step(x: Params, g: Params, neighbours: list[tuple[float, Params]], lr: float, rho: float) -> Params:
    """x_i ← x_i − η (g_i + ρ Σ_k w_ik (x_i − x_k)) (eq. 3)."""
    return C.lincomb([(1.0, x), (-lr, cobo_direction(g, x, neighbours, rho))], x)


def cobo_consensus_step(x: Params, neighbours: list[tuple[float, Params]], lr: float, rho: float) -> Params:
    """eq. 3's consensus term alone: x_i ← x_i − ηρ Σ_k w_ik (x_i − x_k)."""
    terms = [(1.0, x)]
    for w, xk in neighbours:
        if w != 0.0:
            terms += [(-lr * rho * w, x), (lr * rho * w, xk)]
    return C.lincomb(terms, x)


def cobo_pair_update(w: float, inner: float, gamma: float) -> float:
    """Projected gradient ascent on the pair weight: clip_[0,1](w + γ⟨∇f_i(z), ∇f_j(z)⟩) (eq. 1/4)."""
    return min(1.0, max(0.0, w + gamma * inner))


def midpoint(a: Params, b: Params) -> Params:
    return C.lincomb([(0.5, a), (0.5, b)], a)


class COBO(Strategy):
    name = "cobo"
    defaults = {
        "rho": 0.05,  # ρ consensus penalty (*code* README); keep η·ρ·degree < 1
        "gamma": 0.01,  # γ step of the pair-weight ascent (*code* README)
        "local_steps": None,  # *decentral*: S model steps between exchanges (paper: exchange each step);
        # None = the learner's steps per round, the budget every strategy trains
        "grad_samples": 32,  # one fresh minibatch per gradient (Alg. 1 l.4, l.13)
        "grad_momentum": 0.9,  # *code*: g_i is a 0.9-momentum EMA of the minibatch gradients
        "lr": 0.1,  # η of eq. 3, ALGORITHMS (COBO lr 0.1)
        "optimizer": "learner",  # the node's optimizer on g, eq. 3's consensus pull a plain step; "sgd" =
        # eq. 3 throughout at COBO's lr (the paper, bench/papers; module doc)
        "pair_rate": None,  # constant-phase pair probability; None = 2/n (Alg. 1 l.11: 1/n per ordered pair)
        "schedule": "mixed",  # §4 Table 1's mixed strategy (module doc); "code": 2/n then 1/√t after 800 steps
        "total_steps": None,  # iterations the 0.2% refers to; None = the node's planned run
        # (planned rounds × S), or the paper's 40,000 when the node runs until stopped
        "warm_fraction": 0.002,  # §4: constant rate for the first 0.2% of the iterations
        "time_constant": 100.0,  # *code*: the O(1/t) rate min(1, c/(t+1)), c = 100
        "pair_prob": None,  # override the per-exchange probability of a pair (None = derived above)
    }

    choices = {"optimizer": ("learner", "sgd"), "schedule": ("mixed", "code")}
    PAPER_STEPS = 40000  # cobo.txt §4: the cross-silo run the 0.2 % was stated for

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        ts = self.p["total_steps"]
        if ts is not None and (isinstance(ts, bool) or not isinstance(ts, int | float) or not ts > 0):
            raise ValueError(f"strategy 'cobo': total_steps must be a positive number of model steps, not {ts!r}")
        wf = self.p["warm_fraction"]
        if isinstance(wf, bool) or not isinstance(wf, int | float) or not 0 <= wf <= 1:
            raise ValueError(f"strategy 'cobo': warm_fraction must be a share of the run in [0, 1], not {wf!r}")
        self._w: dict[str, float] = {}  # w_ij, starts at 1 (Alg. 1 input W⁰ = 1)
        self._m: Params | None = None  # momentum EMA of gradients
        self._steps = 0
        self._t = 0
        self._last_ip: dict[str, float] = {}

    def _wij(self, peer: str) -> float:
        return self._w.get(peer, 1.0)

    def pair_rate(self, t: int, n_nodes: int) -> float:
        """p(t): the probability that a pair is updated at model step t (1-based; module doc)."""
        const = self.p["pair_rate"] if self.p["pair_rate"] is not None else 2.0 / max(n_nodes, 2)
        if self.p["schedule"] == "code":
            return float(const) if t <= 800 else 1.0 / math.sqrt(t)
        if t <= float(self.p["warm_fraction"]) * self.total_steps():
            return float(const)
        return min(1.0, float(self.p["time_constant"]) / (t + 1))

    def total_steps(self) -> float:
        """The run the warm phase is a share of: ``total_steps`` if set, else the node's planned
        model steps (planned rounds × S), else (no planned end) the paper's 40,000. Pinned at
        40,000, a 150-step run spent 80 of its steps at the constant rate, W hardly moved and the
        consensus pulled towards the wrong peers (bench/results/never_worse.md)."""
        if self.p["total_steps"] is not None:
            return float(self.p["total_steps"])
        if self.planned_rounds:  # 0 rounds: nothing runs, keep the paper's
            return float(self.planned_rounds * self.steps_per_exchange())
        return float(self.PAPER_STEPS)

    def steps_per_exchange(self) -> int:
        """S: model steps between two exchanges (``local_steps``, else the learner's per round)."""
        S = self.p["local_steps"]
        return max(1, int(self.learner.steps_per_round() if S is None else S))

    def expected_pair_updates(self, n_nodes: int) -> float:
        """k: the paper's expected number of updates of one pair over my next S model steps."""
        S = self.steps_per_exchange()
        return sum(self.pair_rate(self._steps + s, n_nodes) for s in range(1, S + 1))

    def pair_schedule(self, n_nodes: int) -> tuple[float, float]:
        """(probability that a pair is updated this exchange, how many of the paper's updates
        the one exchange stands for): (min(1, k), max(1, k)), or (pair_prob, 1) if overridden."""
        if self.p["pair_prob"] is not None:
            return float(self.p["pair_prob"]), 1.0
        k = self.expected_pair_updates(n_nodes)
        return min(1.0, k), max(1.0, k)

    def initiates(self, peer: str) -> bool:
        """Each pair's updates are started by one end only, the smaller id. The update is projected
        (clipped to [0,1]), so two updates of a pair do not commute: if both ends started one in
        the same round, the requests would cross and each end would apply the two in the opposite
        order (its served one first, then its reply), leaving w_ij ≠ w_ji by up to γ|⟨·,·⟩|. With one
        initiator, a pair's updates come one at a time (a round awaits its replies) and both ends
        apply them in the same order."""
        return self.node_id < peer

    def align_samples(self, scale: float) -> int | None:
        """Samples per gradient of an exchange standing for ``scale`` pair updates (module doc).
        Under DP-noised releases one minibatch, as each of the paper's updates draws: a batch of
        ⌈k⌉ minibatches (up to the whole split) loses the subsampling that keeps a release
        affordable — at S = 20 steps a round the first release was over a peer's whole share of
        the budget and no pair weight ever moved."""
        gs = self.p["grad_samples"]
        if gs is None:
            return None
        return int(gs) if self.net.releases_noised() else int(gs) * max(1, math.ceil(scale - 1e-9))

    async def _align(self, peer: str, x: Params, xj: Params, scale: float = 1.0) -> float | None:
        z = midpoint(x, xj)
        ns = self.align_samples(scale)
        # my gradient leaves this node inside the request: released privately, like the peer's
        g = await self.net.private_gradient(peer, z, purpose="cobo-alignment", max_samples=ns)
        if g is None:
            return None
        if scale != 1.0:
            g = C.scale(g, scale)
        rep = await self.net.cross_gradient(peer, z, max_samples=ns, align_with=g, purpose="cobo-alignment")
        if rep is None or rep.inner_product is None or not math.isfinite(rep.inner_product):
            return None
        return float(rep.inner_product)

    async def run_round(self, rnd: int) -> RoundReport:
        peers = self.net.peers()
        for p in peers:
            self._w.setdefault(p, 1.0)
        x = self.learner.get_params()
        prob, scale = self.pair_schedule(len(peers) + 1)
        sampled = [p for p in peers if self.initiates(p) and self.rng.random() < prob]
        need = sorted(set(sampled) | {p for p in peers if self._wij(p) > 0})
        snaps = await gather_bounded({p: self.net.pull(p) for p in need})
        snaps = {p: s for p, s in snaps.items() if C.same_shapes(s.params, x)}

        # Client-Selection (eq. 1/4) at the midpoints, before the model step (Alg. 1 l.2)
        ips = await gather_bounded({p: self._align(p, x, snaps[p].params, scale) for p in sampled if p in snaps})
        for p, ip in ips.items():
            self._w[p] = cobo_pair_update(self._wij(p), ip, float(self.p["gamma"]))
            self._last_ip[p] = ip

        # model steps (eq. 2/3) against this round's neighbour snapshots
        nbrs = [(self._wij(p), s.params) for p, s in snaps.items() if self._wij(p) > 0]
        beta = float(self.p["grad_momentum"])
        losses = []
        for _ in range(self.steps_per_exchange()):
            g, r = await self.compute(self.learner.gradient, None, "train", self.p["grad_samples"])
            losses.append(r.loss)
            self._m = g if self._m is None or beta == 0 else C.lincomb([(beta, self._m), (1 - beta, g)], g)
            x_now = self.learner.get_params()
            if self.p["optimizer"] == "learner":
                # eq. 3's consensus term as its own plain step, then the node's optimizer on g
                self.learner.set_params(cobo_consensus_step(x_now, nbrs, float(self.p["lr"]), float(self.p["rho"])))
                await self.compute(self.learner.apply_gradient, g)
            else:
                self.learner.set_params(
                    cobo_model_step(x_now, self._m, nbrs, float(self.p["lr"]), float(self.p["rho"]))
                )
            self._steps += 1
        self._t += 1
        return RoundReport(
            train_loss=sum(losses) / len(losses),
            contacted=sorted(snaps),
            info={"pairs": sorted(ips), "pair_prob": prob, "pair_scale": scale},
        )

    def on_diverged(self) -> None:
        self._m = None  # the gradient EMA saw the diverged model

    def on_alignment(self, peer: str, inner_product: float) -> None:
        """Served side of a pair update: w_ji moves by the same γ⟨·,·⟩ the requester applies."""
        if math.isfinite(inner_product):
            self._w[peer] = cobo_pair_update(self._wij(peer), float(inner_product), float(self.p["gamma"]))
            self._last_ip[peer] = float(inner_product)

    def weights(self) -> dict[str, float]:
        """The COBO row {self: 1 (W⁰ diagonal)} ∪ {k: w_ik}, normalised to sum to one (ratios kept;
        the raw w_ik ∈ [0,1] are in ``public_state()["W"]``)."""
        row = {self.node_id: 1.0}
        row.update({p: self._wij(p) for p in sorted(set(self._w) | set(self.net.peers()))})
        return C.normalise_row(row)

    def public_state(self) -> dict[str, Any]:
        eta_rho = float(self.p["rho"])
        return {
            "W": dict(self._w),
            "last_inner_product": dict(self._last_ip),
            "steps": self._steps,
            "total_steps": self.total_steps(),  # the run the warm phase is a share of
            "consensus_weight_per_unit_lr": {p: eta_rho * w for p, w in self._w.items()},
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "w": dict(self._w),
            "m": C.params_state(self._m),
            "steps": self._steps,
            "t": self._t,
            "ip": dict(self._last_ip),
            "rng": C.rng_state(self.rng),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._w = {str(k): float(v) for k, v in state.get("w", {}).items()}
        self._m = state.get("m")
        self._steps = int(state.get("steps", 0))
        self._t = int(state.get("t", 0))
        self._last_ip = {str(k): float(v) for k, v in state.get("ip", {}).items()}
        C.set_rng_state(self.rng, state.get("rng"))
