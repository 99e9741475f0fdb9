"""FedeRiCo (Sui et al., "Find Your Friends", federico.txt §2.1–2.2, Alg. 1) as a serverless
strategy.

Round at node i (Alg. 1):
  sample M peers B ε-greedily on w_i·                                            (line 7)
  ℓ_ij kept from the previous round for every j (0 until first seen)             (line 11)
  pull θ_b; ℓ_ib = loss of θ_b on my data (ℓ_ii of my own model every round)      (line 13)
  L̂_ij ← (1−β) L̂_ij + β ℓ_ij   for *every* known j, with the kept ℓ_ij            (line 14)
  w_ij = softmax_j(−L̂_ij) over all known nodes, self included                    (line 15, eq. 3)
  push g = w_ib ∇_θb loss(θ_b; my data) to every sampled b (for b's snapshot version) (line 19)
  θ_i ← θ_i − η (w_ii ∇loss(θ_i; my data) + Σ received g), with my optimizer     (line 24, eq. 8)
Prediction: mixture Σ_j w_ij p(y|x; θ_j) with the cached peer models (§2.1).

Settled open choices (see ``defaults``):
- Loss reduction (the softmax temperature). The paper sums the loss over the n_i local samples
  (eq. 3), i.e. a temperature of 1/n_i on the mean loss: the E-step is then one-hot after the
  first comparison and unsampled peers (L̂ = 0) swallow all weight, including the own term.
  Default here: the *mean* loss over the whole train split ("loss_reduction": "mean"); "sum"
  reproduces the paper exactly.
- Unanswered peers. Alg. 1 starts every L̂_ij at 0, which makes untried peers look best: that
  is the paper's exploration and is kept. But a peer that was sampled and did not answer (dead, or
  a link too slow for its snapshot to arrive in time) would keep L̂ = 0 and with it all the weight,
  round after round, while no evidence about it ever arrives (seen in the container testbed: a
  late joiner put 100% on an unreachable peer and learned alone). Such a peer gets no weight until
  it answers; ε-greedy sampling still tries it again.
- Own loss (``own_loss``) and untried peers (``untried``). Read literally, Alg. 1 updates ℓ only
  for the sampled neighbours B^t (l.12-13), starting every ℓ and L̂ at 0 (l.3); the own model is
  no neighbour, so ℓ_ii would stay 0 and exp(0) = 1 is the bar a peer must clear: w_ij/w_ii =
  exp(−L̂_ij/T). That bar does not scale with the loss: a same-cluster peer with a mean validation
  loss of 1.2 at the container testbed's T = 0.2 gets exp(−6) ≈ 0.25% of the own weight, so
  w_ii ≈ 0.99 and nobody collaborates; with the paper's summed loss it is exp(−n·ℓ) ≈ 0 always.
  The E-step of §2.1 (eq. 3) compares *models* on my data, mine among them, so "track" measures
  ℓ_ii of my own model on the same split as the peers', every round. The default is "prior", the
  literal reading, because of what "track" does to the M-step: at the start every model's loss is
  about the same, so a node's weights are near uniform, its peers' pushes (each weighted by the
  pusher's w_ji) outweigh its own gradient 11 to 1 in a 12-node network, the models pull together,
  the losses stay alike and the weights stay uniform. On S1 (label-permuted clusters) "track" ended
  below local on 3 of 3 seeds (in-cluster weight 0.27; without pushes it found the clusters, 0.90),
  while the prior's self-anchoring lets cluster-mates' weights grow as their models improve on my
  data (seed 0: 74.5% against local's 42.0%, in-cluster 0.96). "track" is for a sharp temperature
  (the container testbed's T = 0.2 on validation losses, where the prior leaves w_ii ≈ 0.99), and
  docker-compose.yml sets it there. The literal L̂ = 0 start is the other half: it makes an untried peer look
  better than any measured one, and with a tracked own loss it swallowed all of i's weight in
  round 1 (w_ii ≈ 0: i's data stopped training i's model, the model ids got permuted; Fig. 1
  bench: weight on self + adjacent 0.16 against 0.34 uniform). Default ``untried = "skip"``: a
  node gets mixture weight only once there is evidence about it (a measured loss), its L̂ starts
  at that first loss (no 0-biased EMA that favours whoever was measured last), and the paper's
  exploration moves to the sampling, where untried peers are picked first. ``"optimistic"`` keeps
  Alg. 1's zero start.
- Gradients are mean-reduced minibatch gradients (Σ over samples in eq. 8 only rescales η).
- Several M-steps per round (``local_steps`` > 1; Alg. 1 l.18: "could also do multiple"): every
  step is Alg. 1 l.24's update, own weighted gradient *and* the gradients peers pushed this round
  (reused, stale within the round, like COBO's neighbour snapshots). Applying the pushes at the
  first step only would weigh the own term S times the peers' and turn the M-step into local
  training after one step.
- Bounded pushes (*decentral*, a peer's demands are bounded): at most one push per peer per
  round (its newest), at most ``max_pushes`` in a round (default: one per known peer), each
  clipped to ``push_norm_factor`` × the norm of my own gradient at the round's first step (an
  honest push is w_ib ∇ℓ_i(θ_b) with w_ib ≤ 1). A stream of valid-looking pushes then moves the
  model no more than one honest peer's push can.
- Staleness: a pushed gradient carries the version of my snapshot the sender differentiated.
  The node does not tell a strategy its own version, so the reference is the newest version any
  push has carried; gradients more than ``max_staleness`` versions older are dropped, the rest are
  applied as they are (the E-step argument of §2.2: models move slowly between rounds).
- The peer term under differential privacy (``peer_term``). A push is a gradient computed on the
  pusher's private data, so with privacy on it leaves through the DP mechanism: per-sample
  gradients clipped to C, noise σC/B per coordinate. Measured on S1 (bench/push_snr.py): the
  clipped mean of a mate's model on my 300 samples has norm 0.07–0.09 (the per-sample gradients,
  norms 2–70, point every way), the noise 4.8 at the defaults: a push is 98% noise, its SNR ≤ 0.02,
  and neither the whole split as the batch (0.09, at ε 33 for S1's 90 pushes) nor adaptive
  clipping (the same SNR: every sample is clipped, signal and noise scale together) nor σ = 1
  over the whole split (0.18, ε 89) gets near 1. The pushes then only add noise: FedeRiCo kept
  4–5% of its exact gain under the defaults. With ``"model"`` the M-step's peer terms are
  estimated from what the peers already publish, with nothing released: Σ_j w_ij ∇ℓ_j(θ_i) ≈
  Σ_j w_ij μ (θ_i − θ_j) (ℓ_j's quadratic model around θ_j, the model j trained on it, with my
  own w_ij for the pusher's w_ji: neither needs j's data), taken as one mixing step per round over
  me and the round's sampled peers B^t — the nodes Alg. 1 exchanges with — θ_i ← (w_ii θ_i +
  Σ_b w_ib θ_b) / (w_ii + Σ_b w_ib), then the local steps on my data. The E-step and the mixture
  prediction are the paper's. ``"auto"`` (default) pushes when my releases are exact (privacy
  off: the paper's setting, every scenario under scenarios/) and uses ``"model"`` when they are
  noised or withheld (own files with fewer samples than privacy.min_batch release nothing).
  Mixing over the sampled peers only, not every cached one, keeps the early rounds' weights
  (before the clusters show) from averaging across clusters: 65.2% against 60.5% on S1 seed 0.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..learning.learner import Params
from . import common as C
from .base import RoundReport, Strategy, gather_bounded

# --- the update rule as pure functions ---


def federico_ema(
    L_hat: dict[str, float], last_loss: dict[str, float], sampled: dict[str, float], beta: float
) -> tuple[dict[str, float], dict[str, float]]:
    """Alg. 1 l.11-14: ℓ_ij^t = ℓ_ij^{t-1} for every j ("keep the loss from previous round"), the
    sampled ones replaced by their fresh loss; then L̂_ij ← (1−β) L̂_ij + β ℓ_ij for *every* j
    (ℓ_ij = 0 until j is first sampled, l.3). Returns (L̂, ℓ)."""
    loss = {**{j: 0.0 for j in L_hat}, **last_loss, **sampled}
    L = {j: (1.0 - beta) * L_hat.get(j, 0.0) + beta * loss[j] for j in loss}
    return L, loss


def federico_weights(L_hat: dict[str, float], temperature: float = 1.0) -> dict[str, float]:
    """E-step: w_ij = exp(−L̂_ij) / Σ_j' exp(−L̂_ij') over every known node (Alg. 1 l.15)."""
    keys = sorted(L_hat)
    w = C.softmax([-L_hat[k] for k in keys], temperature)
    return {k: float(v) for k, v in zip(keys, w, strict=True)}


def federico_mix(own: Params, w_self: float, members: list[tuple[float, Params]]) -> Params:
    """The ``peer_term = "model"`` M-step's peer terms (module doc): (w_ii θ_i + Σ_b w_ib θ_b) /
    (w_ii + Σ_b w_ib) over the sampled peers' published models; my own model if no weight."""
    terms = [(w_self, own)] + [(w, p) for w, p in members if w > 0]
    total = sum(w for w, _ in terms)
    if total <= 0 or len(terms) == 1:
        return own
    return C.lincomb([(w / total, p) for w, p in terms], own)


def federico_combine(own_grad: Params, w_self: float, received: list[Params]) -> Params:
    """The M-step direction at node b: w_bb ∇L_b(θ_b) + Σ_j g_bj (eq. 8, Alg. 1 l.24)."""
    return C.lincomb([(w_self, own_grad)] + [(1.0, g) for g in received], own_grad)


class FedeRiCo(Strategy):
    name = "federico"
    defaults = {
        "num_neighbours": 3,  # M sampled per round, FedeRiCo §3.1/App. D (M = 3 default)
        "eps": 0.3,  # ε-greedy sampling probability, FedeRiCo §2.2 / App. D (ε = 0.3)
        "beta": 0.6,  # EMA momentum of tracked losses, FedeRiCo §2.2, Fig. 6c/7 (β = 0.6)
        "loss_reduction": "mean",  # ℓ_ij: eq. 3 sums over samples (= temperature 1/n_i); settled: mean (module doc)
        "temperature": 1.0,  # w = softmax(−L̂/T); eq. 3 has T = 1 (with the summed loss)
        "loss_samples": None,  # None = whole local train split (eq. 3: Σ_{s=1}^{n_i})
        "loss_split": "train",  # ℓ_ij on the local data D_i (eq. 3)
        "grad_samples": 32,  # minibatch for the pushed/own gradients (stochastic M-step, Thm 2.1)
        "local_steps": None,  # M-step steps per round; None = the learner's per round (Alg. 1 l.18: one, "could also do multiple")
        "max_staleness": 2,  # *decentral*: drop pushed gradients > this many versions old
        "mixture_min_weight": 1e-3,  # skip negligible mixture members at prediction (speed only)
        "own_loss": "prior",  # ℓ_ii: "prior" = Alg. 1 literal (stays 0); "track" = my model's loss each round (module doc)
        "untried": "skip",  # no weight before a loss is measured, L̂ starts there; "optimistic" = Alg. 1 l.3 (L̂ = 0)
        "max_pushes": None,  # *decentral*: pushes applied per round (None = one per known peer)
        "push_norm_factor": 2.0,  # *decentral*: a push is clipped to this × ‖my own gradient‖ (module doc)
        "peer_term": "auto",  # "push" = Alg. 1 l.19-24; "model" = from published models, no release; auto: push unless DP-noised (module doc)
    }

    choices = {
        "peer_term": ("auto", "push", "model"),
        "own_loss": ("prior", "track"),
        "untried": ("skip", "optimistic"),
        "loss_reduction": ("mean", "sum"),
    }

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self._L: dict[str, float] = {}  # L̂_ij, starts at 0 (Alg. 1 l.3)
        self._loss: dict[str, float] = {}  # ℓ_ij: the last loss seen of every j (Alg. 1 l.11)
        self._w: dict[str, float] = {}  # starts at 1/K (Alg. 1 l.3)
        self._unanswered: set[str] = set()  # sampled, but no snapshot came back: no weight until one does
        self._seen: set[str] = set()  # nodes with a measured loss (evidence); the others get no weight
        self._max_version = -1
        self._applied = 0
        self._dropped = 0
        self._prediction: list[tuple[str, float, Params]] = []  # the mixture evaluate() last scored
        self._sync_known()

    def _sync_known(self) -> None:
        known = [self.node_id] + [p for p in self.net.known_peers() if p != self.node_id]
        fresh = [k for k in known if k not in self._L]
        for k in fresh:
            self._L[k] = 0.0
        if fresh or not self._w:
            if not self._loss:  # nothing observed yet: uniform 1/K (Alg. 1 l.3)
                self._w = {k: 1.0 / len(known) for k in known}
            else:
                self._w = self._weights()

    def _skip_untried(self) -> bool:
        return self.p["untried"] != "optimistic"

    def _weights(self) -> dict[str, float]:
        """The E-step over the nodes with evidence: every known node but the unanswered (and, with
        ``untried = "skip"``, those never measured)."""
        known = self._seen | ({self.node_id} if self.p["own_loss"] == "prior" else set())  # prior: ℓ_ii = 0 is known
        live = {
            k: v for k, v in self._L.items() if k not in self._unanswered and (k in known or not self._skip_untried())
        }
        if not live:  # nothing measured yet: keep my own model
            live = {self.node_id: self._L.get(self.node_id, 0.0)}
        w = federico_weights(live, float(self.p["temperature"]))
        return {**{k: 0.0 for k in self._L if k not in live}, **w}

    async def run_round(self, rnd: int) -> RoundReport:
        self._sync_known()
        peers = self.net.peers()
        scores = {p: self._w.get(p, 0.0) for p in peers}
        if self._skip_untried():  # exploration: untried peers first (the role of Alg. 1's L̂ = 0 start)
            scores.update({p: 2.0 for p in peers if p not in self._seen and p not in self._unanswered})
        chosen = C.eps_greedy(peers, scores, int(self.p["num_neighbours"]), float(self.p["eps"]), self.rng)
        snaps = await gather_bounded({p: self.net.pull(p) for p in chosen})
        self._unanswered = (self._unanswered | set(chosen)) - set(snaps)
        own = self.learner.get_params()
        snaps = {p: s for p, s in snaps.items() if C.same_shapes(s.params, own)}

        # E-step (Alg. 1 l.11-15): losses of the sampled models (and my own) on my data
        red, ns, split = self.p["loss_reduction"], self.p["loss_samples"], self.p["loss_split"]

        def estep_losses() -> dict[str, float]:
            out = {}
            if self.p["own_loss"] == "track":
                out[self.node_id] = self.learner.loss(own, split, ns, red).loss
            for p, s in snaps.items():
                out[p] = self.learner.loss(s.params, split, ns, red).loss
            return out

        losses = await self.compute(estep_losses)
        losses = {k: v for k, v in losses.items() if math.isfinite(v)}
        self._L, self._loss = federico_ema(self._L, self._loss, losses, float(self.p["beta"]))
        if self._skip_untried():  # L̂ starts at the first measured loss, not at Alg. 1's 0
            self._L.update({k: v for k, v in losses.items() if k not in self._seen})
        self._seen |= set(losses)
        self._w = self._weights()

        gs = self.p["grad_samples"]
        if self._peer_term() == "model":
            return await self._model_mstep(snaps, own, gs)

        # M-step, sender side (l.17-19): push w_ib ∇ loss(θ_b; my data) to each sampled b

        # my data's gradient leaves this node: released privately, None once my budget is spent
        grads = await gather_bounded(
            {
                p: self.net.private_gradient(p, s.params, purpose="federico-push", max_samples=gs)
                for p, s in snaps.items()
            }
        )
        pushed = await gather_bounded(
            {
                p: self.net.push_gradient(p, snaps[p].version, C.scale(g, self._w.get(p, 0.0)), purpose="federico-push")
                for p, g in grads.items()
            }
        )

        # M-step, receiver side (l.21-24): own weighted gradient + what peers pushed to me, in
        # every step (module doc), the pushes bounded (one per peer, clipped, at most max_pushes)
        received = self._accept(self.net.drain_pushed(), own)
        w_self = self._w.get(self.node_id, 0.0)
        train_losses = await self._m_steps(gs, w_self, received)
        return RoundReport(
            train_loss=float(np.mean(train_losses)),
            contacted=sorted(snaps),
            info={
                "peer_term": "push",
                "pushed": sorted(k for k, ok in pushed.items() if ok),
                "received": len(received),
                "w_self": w_self,
            },
        )

    async def _m_steps(self, gs: int | None, w_self: float, received: list[Params]) -> list[float]:
        """The round's M-step gradient steps (Alg. 1 l.24): w_ii ∇ℓ_i(θ_i) + the pushes received,
        in every step, each push bounded by the first step's own gradient. Returns the losses."""
        steps = self.learner.steps_per_round() if self.p["local_steps"] is None else int(self.p["local_steps"])
        losses = []
        for step in range(max(1, steps)):
            g_own, r = await self.compute(self.learner.gradient, None, "train", gs)
            losses.append(r.loss)
            if step == 0:
                received = self._bound(received, C.l2_norm(g_own))
            await self.compute(self.learner.apply_gradient, federico_combine(g_own, w_self, received))
        return losses

    def _peer_term(self) -> str:
        term = str(self.p["peer_term"])
        if term == "auto":
            return "model" if self.net.releases_noised() else "push"
        return term

    async def _model_mstep(self, snaps: dict[str, Any], own: Params, gs: int | None) -> RoundReport:
        """M-step with the peer terms from the sampled peers' published models (module doc): one
        mixing step, then the local steps on my data (no pushes). Nothing computed on my data leaves."""
        w_self = self._w.get(self.node_id, 0.0)
        members = [(self._w.get(p, 0.0), s.params) for p, s in snaps.items()]
        mixed = federico_mix(own, w_self, members)
        if mixed is not own:
            self.learner.set_params(mixed)
        ignored = len(self.net.drain_pushed())  # a pushing peer's gradients: not this M-step's
        self._dropped += ignored
        # my own gradient at full weight: the mixing step has already weighed me against my peers
        train_losses = await self._m_steps(gs, 1.0, [])
        return RoundReport(
            train_loss=float(np.mean(train_losses)),
            contacted=sorted(snaps),
            info={
                "peer_term": "model",
                "mixed": sum(1 for w, _ in members if w > 0),
                "received": ignored,
                "w_self": w_self,
            },
        )

    def _accept(self, items: list, like: Params) -> list[Params]:
        """The round's pushes worth applying: fresh enough, the right shapes, and only the newest
        of each sender (one push per peer per round)."""
        if items:
            self._max_version = max(self._max_version, max(int(it.version) for it in items))
        newest: dict[str, Any] = {}
        for it in items:
            if int(it.version) < self._max_version - int(self.p["max_staleness"]) or not C.same_shapes(it.grad, like):
                self._dropped += 1
                continue
            old = newest.get(it.sender)
            if old is not None:
                self._dropped += 1
                if int(old.version) > int(it.version):
                    continue
            newest[it.sender] = it
        cap = self.p["max_pushes"]
        cap = max(1, len(self.net.known_peers())) if cap is None else int(cap)
        kept = sorted(newest.values(), key=lambda it: -int(it.version))[:cap]
        self._dropped += len(newest) - len(kept)
        self._applied += len(kept)
        return [it.grad for it in kept]

    def _bound(self, grads: list[Params], own_norm: float) -> list[Params]:
        """Each push clipped to push_norm_factor × ‖my own gradient‖ (non-finite ones dropped)."""
        limit = float(self.p["push_norm_factor"]) * own_norm
        out = []
        for g in grads:
            n = C.l2_norm(g)
            if not math.isfinite(n):
                self._dropped += 1
                continue
            if n > limit:
                if limit <= 0:  # my gradient is zero: no push may move me either
                    continue
                g = C.scale(g, limit / n)
            out.append(g)
        return out

    def weights(self) -> dict[str, float]:
        if not self._w:
            return {self.node_id: 1.0}
        return dict(self._w)

    def evaluate(self) -> dict[str, float]:
        """Mixture prediction Σ_j w_ij p(y|x; θ_j) with cached peer models (§2.1)."""
        own = self.learner.evaluate("test")
        members: list[tuple[str, float, Params]] = [
            (self.node_id, self._w.get(self.node_id, 1.0), self.learner.get_params())
        ]
        for p, w in self._w.items():
            if p == self.node_id or w < float(self.p["mixture_min_weight"]):
                continue
            snap = self.net.cached(p)
            if snap is not None and C.same_shapes(snap.params, members[0][2]):
                members.append((p, w, snap.params))
        tot = sum(w for _, w, _ in members)
        if tot <= 0:
            members, tot = [(self.node_id, 1.0, members[0][2])], 1.0
        # kept for prediction_members: the export holds exactly the mixture scored here
        self._prediction = [(k, w / tot, p) for k, w, p in members]
        r = self.learner.evaluate_mixture([(w, p) for _, w, p in self._prediction], "test")
        out = {"test_loss": r.loss, "own_test_loss": own.loss, "mixture_members": float(len(members))}
        if r.accuracy is not None:
            out["test_acc"] = r.accuracy
        if own.accuracy is not None:
            out["own_test_acc"] = own.accuracy
        return out

    def prediction_members(self) -> list[tuple[str, float, Params]] | None:
        """The mixture the last ``evaluate`` scored (None before the first): the node checkpoints
        it, so an export predicts as the reported test_acc (own model: ``own_test_acc``)."""
        return list(self._prediction) if self._prediction else None

    def public_state(self) -> dict[str, Any]:
        return {
            "ema_loss": dict(self._L),
            "last_loss": dict(self._loss),
            "weights": dict(self._w),
            "pushed_applied": self._applied,
            "pushed_dropped": self._dropped,
            "peer_term": self._peer_term(),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "L": dict(self._L),
            "loss": dict(self._loss),
            "w": dict(self._w),
            "seen": sorted(self._seen),
            "max_version": self._max_version,
            "applied": self._applied,
            "dropped": self._dropped,
            "rng": C.rng_state(self.rng),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._L = {str(k): float(v) for k, v in state.get("L", {}).items()}
        self._loss = {str(k): float(v) for k, v in state.get("loss", {}).items()}
        self._w = {str(k): float(v) for k, v in state.get("w", {}).items()}
        # states written before "seen" existed: a node with a non-zero kept loss was measured
        self._seen = set(map(str, state.get("seen", [k for k, v in self._loss.items() if v != 0.0])))
        self._max_version = int(state.get("max_version", -1))
        self._applied = int(state.get("applied", 0))
        self._dropped = int(state.get("dropped", 0))
        C.set_rng_state(self.rng, state.get("rng"))
        self._sync_known()
