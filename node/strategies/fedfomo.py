"""FedFomo (Zhang et al., ICLR 2021; fedfomo.txt §3.1, eq. 3, App. A.1) as a serverless strategy.

Round at node i (the client loop of §3: download → federated update → train → upload):
  θ_base = own model after the previous federated update (before my last local training);
  candidates: my trained model (the live one, as published) + M peers' published (trained)
  models pulled, chosen ε-greedily by affinity P_i;
  δ_n = (L_i^val(θ_base) − L_i^val(θ_n)) / ‖θ_n − θ_base‖₁   for n ∈ {i} ∪ pulled   (eq. 3)
  w_n = max(δ_n, 0) / Σ max(δ, 0);  θ_i ← θ_base + Σ_n w_n (θ_n − θ_base)          (eq. 3, 13)
  if no δ_n > 0: θ_i ← θ_base  ("early stopping" at the previous model, §3.1)
  P_i,n += δ_n / |Σ_n δ_n|   (signed; paper: p ← p + w, *code* normalises by |Σδ|)
  then local training from the new θ_i; the node publishes the trained model.

Ours, not the paper's: where local training resumes after an early stop (``early_stop``). The
paper keeps θ_base when my own freshly trained model is worse on validation and no peer helps;
restarting local training from that θ_base (``"restore"``, the paper as printed) replays the
rejected steps: exactly when the train split fits one batch (full-batch steps are deterministic),
nearly so otherwise. On small regressions (24–40 samples, 5 in validation) one noisy rejection
thus froze a node for the rest of the run, publishing the same rejected model every round
(issue 33: ×6–26 local-only MSE with ~100% self weight). ``"continue"`` (default) keeps θ_base as
the reference the next update compares and mixes against, but trains on from the live model, so
the node is never stuck replaying the steps it just rejected. Its cost where restarts draw other
minibatches: on S1 (300 training samples, batch 32) ``"continue"`` ends 2.2 points below
``"restore"`` (58.6 vs 60.8%, lower on each of 3 seeds, in-process, 30 rounds; local ≈ 45%), a
smaller loss than the regression networks' freeze; a rule that restores there and trains on only
where the replay is exact (one batch) was tried and left the sine network's minibatch nodes stuck.

Nothing is sent back to the peers (pull-only). ``weights()`` is the w* the last federated update
actually combined with (eq. 3 / 13; {self: 1} whenever it fell back to θ_base, e.g. when local
training overfits the validation split), so the row logged in history and results is the one that
shaped the model. The affinity P (what the paper's Fig. 2 plots, ``client_weights`` in the authors'
``federation.py``) is ``public_state()["affinity"]``.
"""

from __future__ import annotations

from typing import Any

from ..learning.learner import Params
from . import common as C
from .base import RoundReport, Strategy, gather_bounded

# --- the update rule as pure functions (tested against hand-computed references) ---


def fomo_deltas(
    base_loss: float, cand_losses: dict[str, float], dists: dict[str, float], min_dist: float = 1e-12
) -> dict[str, float]:
    """δ_n = (L(θ_base) − L(θ_n)) / ‖θ_n − θ_base‖ (eq. 3); a candidate at (numerically) zero
    distance from the base carries no information: δ_n = 0 (guard against 0/0)."""
    out = {}
    for n, loss in cand_losses.items():
        d = dists[n]
        out[n] = 0.0 if d <= min_dist else (base_loss - loss) / d
    return out


def fomo_weights(deltas: dict[str, float]) -> dict[str, float]:
    """w*_n = max(δ_n,0)/Σ max(δ,0) (eq. 13); all zero when no δ is positive (keep θ_base)."""
    return C.normalise_row(deltas)


def fomo_update(base: Params, candidates: dict[str, Params], w: dict[str, float]) -> Params:
    """θ ← θ_base + Σ_n w_n (θ_n − θ_base); θ_base itself if every w_n is zero."""
    if not any(w.get(n, 0.0) > 0 for n in candidates):
        return C.clone(base)
    terms = [(1.0, base)]
    for n, theta in candidates.items():
        wn = w.get(n, 0.0)
        if wn > 0:
            terms += [(wn, theta), (-wn, base)]
    return C.lincomb(terms, base)


def fomo_affinity(p_row: dict[str, float], deltas: dict[str, float], normalise: bool = True) -> dict[str, float]:
    """p_i ← p_i + δ (signed, §3.1); *code*: δ divided by |Σ_n δ_n| first."""
    s = abs(sum(deltas.values())) if normalise else 1.0
    out = dict(p_row)
    if s <= 0:
        return out
    for n, d in deltas.items():
        out[n] = out.get(n, 0.0) + d / s
    return out


class FedFomo(Strategy):
    name = "fedfomo"
    defaults = {
        "num_models": 5,  # M: models downloaded per round, FedFomo App. A.3 (n = 5), §4 ablation
        "eps": 0.3,  # ε-greedy exploration, FedFomo §3.1 / App. A.3 (ε = 0.3)
        "eps_decay": 0.05,  # App. A.3: "ε = 0.3 with 0.05 decay each round" (subtracted per round)
        "eps_min": 0.0,  # floor of the decayed ε (decay stops at pure top-M)
        "distance": "l1",  # ‖θ_n − θ_base‖ in eq. 3; *code* uses the L1 norm ("l2" available)
        "normalise_affinity": True,  # *code*: P += δ/|Σδ| (paper §3.1: P += w)
        "val_samples": None,  # None = whole validation split (eq. 3 uses L_i on D_i^val, §3.1)
        "early_stop": "continue",  # ours: train on from the live model after an early stop (module doc)
    }
    choices = {"distance": ("l1", "l2"), "early_stop": ("continue", "restore")}

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self._t = 0
        self._P: dict[str, float] = {self.node_id: 1.0}  # P = diag(1,…,1) initially (§3.1)
        self._w: dict[str, float] = {self.node_id: 1.0}
        self._delta: dict[str, float] = {}
        self._base: Params | None = None  # θ_base: my model after the last federated update

    def _eps(self) -> float:
        return max(float(self.p["eps_min"]), float(self.p["eps"]) - float(self.p["eps_decay"]) * self._t)

    def _dist(self, a: Params, b: Params) -> float:
        return C.distance(a, b, str(self.p["distance"]))

    async def run_round(self, rnd: int) -> RoundReport:
        # FedFomo's client loop is download → federated update → local training → upload, so the
        # published model (the "upload") is always a freshly trained one: the federated update of
        # this round combines the trained models of the last round (mine = the live model, the
        # peers' = their snapshots) relative to θ_base = my model after the previous federated
        # update, i.e. before my last training (eq. 3, App. A.1 eq. 5); then I train from it.
        mine = self.learner.get_params()
        base = self._base if self._base is not None and C.same_shapes(self._base, mine) else mine
        eps = self._eps()
        peers = self.net.peers()
        scores = {p: self._P.get(p, 0.0) for p in peers}
        chosen = C.eps_greedy(peers, scores, int(self.p["num_models"]), eps, self.rng)
        snaps = await gather_bounded({p: self.net.pull(p) for p in chosen})
        cands: dict[str, Params] = {self.node_id: mine}
        for p, s in snaps.items():
            if C.same_shapes(s.params, base):
                cands[p] = s.params

        vs = self.p["val_samples"]

        def evaluate_all() -> tuple[float, dict[str, float], dict[str, float]]:
            # the distances too, off the event loop: for a 21 MB model each is ~5 ms of tensor work
            lb = self.learner.loss(base, "val", vs).loss
            losses = {n: self.learner.loss(th, "val", vs).loss for n, th in cands.items()}
            return lb, losses, {n: self._dist(th, base) for n, th in cands.items()}

        base_loss, losses, dists = await self.compute(evaluate_all)
        delta = fomo_deltas(base_loss, losses, dists)
        w = fomo_weights(delta)
        kept_base = not any(v > 0 for v in w.values())
        adopt = not (kept_base and self.p["early_stop"] == "continue")

        def combine() -> Params:  # float64 sums over model-sized tensors: off the loop as well
            new = fomo_update(base, cands, w)
            if adopt:
                self.learner.set_params(new)
            return C.clone(new)

        self._base = await self.compute(combine)

        self._P = fomo_affinity(self._P, delta, bool(self.p["normalise_affinity"]))
        self._delta = delta
        self._w = {self.node_id: 1.0} if kept_base else dict(w)
        self._w.setdefault(self.node_id, 0.0)
        self._t += 1
        res = await self.compute(self.learner.train)
        return RoundReport(
            train_loss=res.loss,
            contacted=sorted(snaps),
            info={"eps": eps, "base_val_loss": base_loss, "kept_base": kept_base},
        )

    def weights(self) -> dict[str, float]:
        """The weights the last federated update used: w*_n of eq. 3/13 over me and the models I
        pulled, {self: 1} when it kept θ_base (authors' federation.py: ``model_weights = [1.]``).
        The affinity P that picks whom to pull (Fig. 2) is ``public_state()["affinity"]``."""
        return dict(self._w)

    def affinity_row(self) -> dict[str, float]:
        """The positive part of p_i, normalised (self included): Fig. 2's view of P."""
        row = C.normalise_row(self._P)
        return row if any(v > 0 for v in row.values()) else {self.node_id: 1.0}

    def public_state(self) -> dict[str, Any]:
        return {
            "affinity": dict(self._P),
            "eps": self._eps(),
            "last_delta": dict(self._delta),
            "last_w": dict(self._w),
            "rounds": self._t,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "t": self._t,
            "P": dict(self._P),
            "w": dict(self._w),
            "delta": dict(self._delta),
            "base": C.params_state(self._base),
            "rng": C.rng_state(self.rng),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._t = int(state.get("t", 0))
        self._P = {str(k): float(v) for k, v in state.get("P", {self.node_id: 1.0}).items()}
        self._w = {str(k): float(v) for k, v in state.get("w", {self.node_id: 1.0}).items()}
        self._delta = {str(k): float(v) for k, v in state.get("delta", {}).items()}
        self._base = state.get("base")
        C.set_rng_state(self.rng, state.get("rng"))
