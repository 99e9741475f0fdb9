"""SCool (Li et al., "Structured Cooperative Learning with Graphical Model Priors", scool.txt
§3.3–4.3, App. C–E): SCool-SBM and SCool-attention as serverless strategies.

Alg. 1 is synchronous, so iteration t spans two daemon rounds (as for L2C): round r ends with the
local training of iteration r (published: Δθ^r), and round r+1 starts with the E-step and the
aggregation of iteration r, pulling every candidate's snapshot of round ≥ r (round-aligned exchange,
bounded by ``sync_wait_s``; a peer that does not make it is left out of that round's mixing).

Iteration t at node i:
  local training θ_i^t → θ_i^{t+½}; Δθ_i = θ_i^t − θ_i^{t+½} (published as extras "delta")
  evidence Y_ij = log P(D_j | θ_i) = −(mean CE of my published model on a minibatch of j's data),
    one cross-loss request per candidate (*code*: one training minibatch)
  E-step
    SBM (eq. 18–20 = App. D eq. 43–48): ŵ_ij = Y_ij + Σ_gh Ω_ig Ω_jh log(B_gh/(1−B_gh)),
      w_ij = σ(ŵ_ij/τ); γ_i = Ω_i + α; Ω_i ∝ exp(Σ_j w_ij Σ_h Ω_jh log B(·,h) + Σ_j w_ji Σ_h Ω_jh
      log B(h,·) + Σ_j (1−w_ij) Σ_h Ω_jh log(1−B(·,h)) + Σ_j (1−w_ji) Σ_h Ω_jh log(1−B(h,·))
      + ψ(γ_i·) − ψ(Σ_g γ_ig)).  *decentral*: Ω_j and w_ji of peers come from gossip ("omega").
      Self term (*code*): w_ii = σ((Y_ii + Ω_iᵀ logit(B) Ω_i)/τ), Y_ii = log P(D_i | θ_i).
    attention (eq. 29): w_i = softmax(Y_i/τ + log p_i) over self and peers, p_i = softmax_j
      ⟨E(û_i), E(û_j)⟩, û = θ^{t+½} − θ^0 (published as extras "update"); E trained by
      cross-entropy towards softmax(Y_i/τ) (*code*; eq. 31 prints w_i) with AdamW, and
      gossip-averaged with the peers contacted ("encoder"). See ``SCoolAttention``.
  M-step (App. C.1, *code* default): θ_i^{t+1} = θ_i^t − Σ_j w̄_ij Δθ_j, w̄ the row normalised
    over self and the peers whose Δθ arrived.
    "exact": eq. 22 with cross-gradients, θ ← θ − η(w̄_ii ∇L(D_i;θ) + Σ_j w̄_ij ∇L(D_j;θ)) for
    ``exact_steps`` steps with my optimizer (each step one cross-gradient request per peer).
  Pruning (App. C.1): after ``prune_after`` E-steps keep the top ``keep_fraction`` peers by w; the
    rest are no longer contacted. Ours: among the peers scored, once every candidate is (at the
    latest at 2·``prune_after``) — the paper's nodes all meet in round 1, an asynchronous node may not.
Number of blocks: ``num_blocks = "auto"`` (default) starts with one block; at E-step
``blocks_after`` each node picks K by ICL (``estimate_num_blocks``: a Gaussian SBM on the
standardised evidence rows Y_j· that the nodes gossip with Ω, K = 1..``max_blocks``), at the next
E-step all adopt the most common estimate among their own and their peers', and the SBM restarts
with K blocks. An integer tells it K (the code's 2; the scenarios' true cluster counts).
SBM prior M-step: by default fixed, as in the code (B = [[.8,.2],[.2,.8]], α = 1). With
``learn_B`` / ``learn_alpha`` the paper's M-steps run: B = Σ_ij w_ij Ω_i Ω_jᵀ / Σ_ij Ω_i Ω_jᵀ
(eq. 24 / 52) and a gradient-ascent step on α (eq. 23 / 50). Both are sums over the whole graph;
*decentral*: each node tracks the network average of the per-node terms (its own row's
N_i = Σ_j w_ij Ω_i Ω_jᵀ, D_i = Σ_j Ω_i Ω_jᵀ, s_i = ψ(γ_i) − ψ(Σγ_i)) by dynamic average consensus:
its estimate moves by the change of its own term each round and is averaged pairwise with the
peers it gossips Ω with, so the sum of the estimates always equals the sum of the current terms.
λ θ_i is left to the learner's weight decay, and the attention M-step term −Σ w_ij ∇θ log p_ij
of eq. 30 is not applied to θ.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch
from scipy.special import digamma

from ..learning.learner import Params
from . import common as C
from .base import RoundReport, Strategy, gather_bounded

# --- SBM E-step as pure functions (App. D) ---


def sbm_edge_logit(y_ij: float, omega_i: np.ndarray, omega_j: np.ndarray, B: np.ndarray) -> float:
    """ŵ_ij = Y_ij + Σ_gh Ω_ig Ω_jh log B(g,h) − Σ_gh Ω_ig Ω_jh log(1−B(g,h))   (eq. 43)."""
    return float(y_ij + omega_i @ (np.log(B) - np.log1p(-B)) @ omega_j)


def sbm_estep_node(
    Y: dict[str, float],
    omega_i: np.ndarray,
    omegas: dict[str, np.ndarray],
    w_in: dict[str, float],
    B: np.ndarray,
    alpha: np.ndarray,
    tau: float = 1.0,
) -> tuple[dict[str, float], np.ndarray, np.ndarray]:
    """Node i's share of the E-step over the peers j ≠ i it has evidence Y_ij and Ω_j for.
    Returns (w_i· eq. 44 with temperature τ, γ_i eq. 46, new Ω_i eq. 48). ``w_in[j]`` is w_ji
    (peer j's weight on me); where missing, w_ij stands in for it (symmetric guess)."""
    peers = [j for j in sorted(Y) if j in omegas]
    w = {j: float(C.sigmoid(sbm_edge_logit(Y[j], omega_i, omegas[j], B) / tau)) for j in peers}
    gamma = omega_i + alpha
    logB, log1B = np.log(B), np.log1p(-B)
    logits = digamma(gamma) - digamma(gamma.sum())
    for j in peers:
        oj = omegas[j]
        wij, wji = w[j], w_in.get(j, w[j])
        logits = (
            logits + wij * (logB @ oj) + wji * (logB.T @ oj) + (1 - wij) * (log1B @ oj) + (1 - wji) * (log1B.T @ oj)
        )
    omega_new = C.softmax(logits)
    return w, gamma, omega_new


def sbm_self_weight(y_ii: float, omega_i: np.ndarray, B: np.ndarray, tau: float = 1.0) -> float:
    """w_ii = σ((Y_ii + Ω_iᵀ logit(B) Ω_i)/τ): the authors' self term (ShuangtongLi/SCool, as
    read in issue 11), eq. 43–44 applied to the pair (i, i) with Y_ii = log P(D_i | θ_i). A fixed
    raw 1 kept the self share ≥ 0.5 whatever the evidence (0.73–0.77 measured on S1)."""
    return float(C.sigmoid(sbm_edge_logit(y_ii, omega_i, omega_i, B) / tau))


def row_with_self(raw: dict[str, float], self_id: str, self_weight: float = 1.0) -> dict[str, float]:
    """Row-normalise {self: self_weight} ∪ raw peer weights (*code*: rows normalised)."""
    row = {self_id: self_weight, **{k: v for k, v in raw.items() if k != self_id}}
    return C.normalise_row(row)


# --- SBM prior M-step (eqs. 23–24 = App. D eqs. 50, 52) ---


def sbm_node_stats(
    w: dict[str, float], omega_i: np.ndarray, omegas: dict[str, np.ndarray], gamma_i: np.ndarray
) -> dict[str, np.ndarray]:
    """Node i's terms of the graph sums: N_i = Σ_j w_ij Ω_i Ω_jᵀ, D_i = Σ_j Ω_i Ω_jᵀ over its
    peers j (eq. 52) and s_i = ψ(γ_i) − ψ(Σ_k γ_ik) (eq. 50)."""
    g = omega_i.size
    N, D = np.zeros((g, g)), np.zeros((g, g))
    for j, wij in w.items():
        if j in omegas:
            outer = np.outer(omega_i, omegas[j])
            N += wij * outer
            D += outer
    return {"N": N, "D": D, "s": digamma(gamma_i) - digamma(gamma_i.sum())}


def sbm_B_mstep(N: np.ndarray, D: np.ndarray, B: np.ndarray, eps: float = 1e-3) -> np.ndarray:
    """B(g,h) = Σ_ij w_ij Ω_ig Ω_jh / Σ_ij Ω_ig Ω_jh (eq. 24 / 52), from the sums (or any common
    multiple of them, e.g. network averages); entries without evidence keep their value."""
    out = B.copy()
    ok = D > 1e-12
    out[ok] = np.clip(N[ok] / D[ok], eps, 1 - eps)
    return out


def sbm_alpha_mstep(alpha: np.ndarray, s_sum: np.ndarray, K: int, lr: float, floor: float = 1e-3) -> np.ndarray:
    """α_g ← α_g + η (Σ_i (ψ(γ_ig) − ψ(Σ_k γ_ik)) − K ψ(α_g) + K ψ(Σ_k α_k)) (eq. 23 / 50; the
    paper prints KΣ_gψ(α_g), but the derivative of the Dirichlet normaliser is Kψ(α_g))."""
    grad = s_sum - K * digamma(alpha) + K * digamma(alpha.sum())
    return np.maximum(alpha + lr * grad, floor)


# --- the number of SBM blocks by model selection (ICL over K) ---


def sbm_icl(S: np.ndarray, labels: np.ndarray) -> float:
    """ICL of a Gaussian SBM on the off-diagonal entries of a symmetric similarity matrix S:
    S_ij ~ N(μ_{z_i z_j}, σ²) (one mean per pair of blocks, a shared variance), with the hard
    assignment ``labels`` (Daudin, Picard & Robin 2008, "A mixture model for random graphs"):
    max log L − ½·K(K+1)/2·log(#pairs) − ½·(K−1)·log n. Higher is better."""
    n = len(S)
    iu = np.triu_indices(n, 1)
    vals = S[iu]
    zi, zj = labels[iu[0]], labels[iu[1]]
    lo, hi = np.minimum(zi, zj), np.maximum(zi, zj)
    fit = np.zeros_like(vals)
    blocks = np.unique(labels)
    for a in blocks:
        for b in blocks[blocks >= a]:
            m = (lo == a) & (hi == b)
            if m.any():
                fit[m] = vals[m].mean()
    pairs = len(vals)
    # a floor on σ² (relative to the spread of S): a perfect fit must not buy infinite likelihood
    var = max(float(np.mean((vals - fit) ** 2)), 1e-4 * float(np.var(vals)) + 1e-12)
    loglik = -0.5 * pairs * (np.log(2 * np.pi * var) + 1.0)
    K = len(blocks)
    return float(loglik - 0.25 * K * (K + 1) * np.log(pairs) - 0.5 * (K - 1) * np.log(n))


def estimate_num_blocks(S: np.ndarray, k_max: int, seed: int = 0) -> tuple[int, np.ndarray]:
    """The number of SBM blocks that maximises the ICL (``sbm_icl``) over K = 1..k_max (at most
    n/2: blocks of one node would fit noise), each K's assignment from k-means on the rows of S
    (scikit-learn). Returns (K, labels)."""
    from sklearn.cluster import KMeans

    S = np.asarray(S, dtype=np.float64)
    S = (S + S.T) / 2
    n = len(S)
    best_k, best_labels, best = 1, np.zeros(n, dtype=int), sbm_icl(S, np.zeros(n, dtype=int))
    for k in range(2, max(1, min(int(k_max), n // 2)) + 1):
        labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(S)
        score = sbm_icl(S, labels)
        if score > best:
            best_k, best_labels, best = len(np.unique(labels)), labels, score
    return best_k, best_labels


def evidence_matrix(rows: dict[str, dict[str, float]]) -> tuple[list[str], np.ndarray]:
    """The similarity matrix of the nodes whose evidence rows I hold (mine and the peers'
    gossiped ones): row i is node i's Y_i· (log-likelihood of each node's data under i's model,
    Y_ii included) standardised over the row, so nodes whose models fit everyone worse or better
    compare; an entry i does not have is the row mean (0); symmetrised."""
    ids = sorted(rows)
    n = len(ids)
    Z = np.zeros((n, n))
    for a, i in enumerate(ids):
        r = rows[i]
        v = np.array([r[j] for j in ids if j in r], dtype=np.float64)
        mu, sd = (v.mean(), v.std()) if v.size else (0.0, 1.0)
        for b, j in enumerate(ids):
            if j in r:
                Z[a, b] = (r[j] - mu) / (sd if sd > 1e-12 else 1.0)
    return ids, (Z + Z.T) / 2


# --- attention E-step (eq. 29) ---


def attention_weights(y: np.ndarray, logits: np.ndarray, tau: float = 1.0) -> np.ndarray:
    """w_i = softmax(Y_i/τ + log p_i), p_i = softmax(logits) (eq. 29, App. C.1 temperature)."""
    logp = logits - np.max(logits) - np.log(np.sum(np.exp(logits - np.max(logits))))
    return C.softmax(np.asarray(y) / tau + logp)


def attention_estep(
    encoder: C.UpdateEncoder,
    opt: torch.optim.Optimizer,
    mine: Params,
    others: list[Params],
    y: np.ndarray,
    tau: float,
    target: str = "likelihood",
) -> tuple[np.ndarray, np.ndarray]:
    """One attention E-step at node i over [i] + others: returns (w_i of eq. 29, p_i of eq. 25),
    both from the encoder as it was, and takes one optimizer step of the encoder towards the
    target by cross-entropy (eq. 31 / 62): *code* softmax(Y_i/τ) ("likelihood"), or w_i itself
    ("posterior", eq. 31 as printed). Alone (no other), the softmax over one entry has no gradient
    and AdamW would step on weight decay alone, lr-sized moves of every parameter: no step then."""
    logits = C.attention_logits(encoder, mine, others)
    w = attention_weights(y, logits.detach().numpy().astype(np.float64), tau)
    if others:
        t = C.softmax(y, tau) if target == "likelihood" else w
        loss = -(torch.as_tensor(t, dtype=torch.float32) * torch.log_softmax(logits, 0)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w, torch.softmax(logits.detach(), 0).numpy().astype(np.float64)


class _SCoolBase(Strategy):
    defaults = {
        "tau": 1.0,  # temperature of σ/softmax, SCool App. C.1 (*code*: τ = 1–2, fixed)
        "evidence_samples": 32,  # Y_ij on one minibatch of j's train data (*code*)
        "mstep": "mixing",  # App. C.1 update mixing (*code* default); "exact": eq. 22 cross-gradients
        "exact_steps": 5,  # local SGD steps of the exact M-step (Alg. 1 l.13), one request per peer each
        "grad_samples": 32,  # minibatch per (cross-)gradient in the exact M-step
        "prune_after": 10,  # App. C.1: remove neighbours "after 10 rounds"
        "keep_fraction": 0.2,  # *code*: keep the top 20% of the peers (App. C.1 text: remove 90%)
        "max_peers": 0,  # 0 = every alive peer is a candidate until pruning
        "round_aligned": True,  # Alg. 1 is synchronous: mix the peers' Δθ of my iteration
        "sync_wait_s": 30.0,  # longest wait for a peer to publish that round (then without it)
    }

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self._t = 0
        self._Y: dict[str, float] = {}
        self._raw: dict[str, float] = {}
        self._row: dict[str, float] = {self.node_id: 1.0}
        self._kept: list[str] | None = None
        self._delta: Params | None = None
        self._base: Params | None = None  # θ_i^t: the model my last local steps started from
        self._delta_round = 0  # the round whose local steps gave Δθ_i
        self._theta_t: Params | None = None

    def candidates(self) -> list[str]:
        peers = self.net.peers()
        if self._kept is not None:
            peers = [p for p in peers if p in self._kept]
        k = int(self.p["max_peers"])
        if k and len(peers) > k:
            peers = sorted(self.rng.choice(peers, size=k, replace=False).tolist())
        return peers

    def published_extras(self) -> dict[str, Params]:
        return {} if self._delta is None else {"delta": self._delta}

    async def _own_evidence(self) -> float:
        """Y_ii = log P(D_i | θ_i): minus the mean CE of the model my peers evaluated this round (my
        published one, the round's start θ_i^t) on a minibatch of my own train data, the same
        measurement ``_evidence`` asks every peer j for on its data."""
        r = await self.compute(self.learner.loss, self._theta_t, "train", self.p["evidence_samples"])
        self._Y[self.node_id] = -float(r.loss)
        return self._Y[self.node_id]

    async def _evidence(self, peers: list[str]) -> dict[str, float]:
        n = self.p["evidence_samples"]
        got = await gather_bounded({p: self.net.cross_loss(p, max_samples=n, purpose="scool-evidence") for p in peers})
        return {p: -float(v[0]) for p, v in got.items() if np.isfinite(v[0])}

    async def _estep(self, rnd: int, theta_half: Params, snaps: dict) -> None:
        raise NotImplementedError

    async def _pull_peers(self, peers: list[str]) -> dict:
        """The peers' snapshots of my last iteration's round or later (round-aligned, SCool's
        Alg. 1 is synchronous), or whatever they published last (``round_aligned`` off)."""
        if not self.p["round_aligned"] or self._delta_round == 0:
            return await gather_bounded({p: self.net.pull(p) for p in peers})
        r, wait = self._delta_round, float(self.p["sync_wait_s"])
        return await gather_bounded({p: self.net.pull(p, min_round=r, wait_s=wait) for p in peers})

    async def run_round(self, rnd: int) -> RoundReport:
        live = self.learner.get_params()
        self._theta_t = live  # = my published model: what the peers' cross-losses evaluate
        exact = self.p["mstep"] == "exact"
        ev: dict[str, float] = {}
        snaps: dict = {}
        info: dict[str, Any] = {}
        if exact or self._delta is not None:
            # E-step and aggregation of the iteration my last round's local steps began (App. C.1)
            peers = self.candidates()
            ev, snaps = await asyncio.gather(self._evidence(peers), self._pull_peers(peers))
            self._Y.update(ev)
            await self._estep(rnd, live, snaps)
            if (
                not exact
                and self._base is not None
                and self._delta is not None
                and C.same_shapes(self._base, self._delta)
            ):
                wts = {self.node_id: self._row.get(self.node_id, 1.0)}
                for p, sn in snaps.items():
                    d = sn.extras.get("delta")
                    if d is not None and C.same_shapes(d, self._base) and self._row.get(p, 0.0) > 0:
                        wts[p] = self._row[p]
                tot = sum(wts.values())
                members = [(wts[self.node_id] / tot, self._delta)] + [
                    (wts[p] / tot, snaps[p].extras["delta"]) for p in wts if p != self.node_id
                ]
                self.learner.set_params(C.mix_updates(self._base, members))
                info = {
                    "mixed": len(wts) - 1,
                    "of_round": self._delta_round,
                    "same_round": sum(1 for p in wts if p != self.node_id and snaps[p].round == self._delta_round),
                }
            self._t += 1
            after = int(self.p["prune_after"])
            scores = {p: v for p, v in self._raw.items() if p != self.node_id}
            # prune among the peers it has scored: a node that met few or none of those it is offered by
            # round T0 (a slow start, a late joiner: asynchronous rounds) would otherwise keep none of
            # them for good. It waits until it has scored every candidate, at most until 2·T0.
            met = scores and (set(peers) <= set(scores) or self._t >= 2 * after)
            if self._kept is None and self._t >= after > 0 and met:
                # *code*: keeps int(keep_fraction·n) peers (20% of 11 = 2, not ⌈2.2⌉ = 3)
                self._kept = C.top_keep(scores, float(self.p["keep_fraction"]), rounding="floor")
        theta = self.learner.get_params()
        if exact:
            train_loss = await self._exact_mstep(sorted(set(ev) | set(snaps)))
        else:  # local steps of this round's iteration; published: Δθ^r (and û^r)
            train_loss = (await self.compute(self.learner.train)).loss
        self._base, self._delta_round = theta, rnd
        self._delta = C.sub(theta, self.learner.get_params())
        self._after_local_steps()
        return RoundReport(
            train_loss=train_loss,
            contacted=sorted(set(ev) | set(snaps)),
            info={**info, "pruned": self._kept is not None},
        )

    def _after_local_steps(self) -> None:
        """Hook: the round's local steps are done (the live model is what will be published)."""

    async def _exact_mstep(self, peers: list[str]) -> float:
        gs = self.p["grad_samples"]
        losses = []
        for _ in range(max(1, int(self.p["exact_steps"]))):
            theta = self.learner.get_params()
            use = [p for p in peers if self._row.get(p, 0.0) > 0]
            replies = await gather_bounded(
                {p: self.net.cross_gradient(p, theta, max_samples=gs, purpose="scool-gradient") for p in use}
            )
            g_own, r = await self.compute(self.learner.gradient, None, "train", gs)
            losses.append(r.loss)
            wts = {self.node_id: self._row.get(self.node_id, 1.0)}
            grads = {p: rep.grad for p, rep in replies.items() if rep.grad is not None}
            wts.update({p: self._row[p] for p in grads})
            tot = sum(wts.values())
            terms = [(wts[self.node_id] / tot, g_own)] + [(wts[p] / tot, grads[p]) for p in wts if p != self.node_id]
            await self.compute(self.learner.apply_gradient, C.lincomb(terms, g_own))
        return float(np.mean(losses))

    def weights(self) -> dict[str, float]:
        return dict(self._row)

    def _base_state(self) -> dict[str, Any]:
        return {
            "t": self._t,
            "Y": dict(self._Y),
            "raw": dict(self._raw),
            "row": dict(self._row),
            "kept": self._kept,
            "delta": C.params_state(self._delta),
            "base": C.params_state(self._base),
            "delta_round": self._delta_round,
            "rng": C.rng_state(self.rng),
        }

    def _load_base(self, st: dict[str, Any]) -> None:
        self._t = int(st.get("t", 0))
        self._Y = {str(k): float(v) for k, v in st.get("Y", {}).items()}
        self._raw = {str(k): float(v) for k, v in st.get("raw", {}).items()}
        self._row = {str(k): float(v) for k, v in st.get("row", {self.node_id: 1.0}).items()}
        self._kept = None if st.get("kept") is None else [str(k) for k in st["kept"]]
        self._delta = st.get("delta")
        self._base = st.get("base")
        self._delta_round = int(st.get("delta_round", 0))
        C.set_rng_state(self.rng, st.get("rng"))


class SCoolSBM(_SCoolBase):
    name = "scool-sbm"
    defaults = {
        **_SCoolBase.defaults,
        "tau": 2.0,  # App. C.1 temperature (*code* range 1–2): 2 resists Ω locking in on
        # the uninformative evidence of the first rounds (all models ≈ θ⁰)
        "num_blocks": "auto",  # "auto": K chosen by ICL (``estimate_num_blocks``) on the gossiped
        # evidence rows; an int = told (*code*: 2 blocks)
        "max_blocks": 8,  # "auto": K ≤ this (and ≤ n/2)
        "blocks_after": 2,  # "auto": estimate K at this E-step (the models have trained twice;
        # the first evidence, all models ≈ θ⁰, says nothing), one block before
        "B_in": 0.8,  # *code*: B fixed at [[.8,.2],[.2,.8]]
        "B_out": 0.2,  # (M-step eq. 24 not applied)
        "dirichlet_alpha": 1.0,  # α of π_i ~ Dir(α) (§4.2) at the start
        "learn_B": False,  # *code*: B fixed; True = M-step eq. 24 (module doc)
        "learn_alpha": False,  # *code*: α fixed; True = M-step eq. 23
        "alpha_lr": 0.01,  # η2 of eq. 23 (no value in the paper or code)
        "self_weight": "sbm",  # *code*: w_ii = σ((Y_ii + Ω_iᵀ logit(B) Ω_i)/τ); "one" = fixed raw 1
    }

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        nb = self.p["num_blocks"]
        if not (nb == "auto" or (isinstance(nb, int) and not isinstance(nb, bool) and nb >= 1)):
            raise ValueError(f"strategy 'scool-sbm': num_blocks must be a positive integer or 'auto', got {nb!r}")
        self.auto_blocks = nb == "auto"
        self._rows: dict[str, dict[str, float]] = {}  # "auto": peers' gossiped evidence rows Y_j·
        self._k_hat: int | None = None  # "auto": my ICL estimate, once made
        self._k_votes: dict[str, int] = {}  # "auto": the peers' estimates
        self._set_blocks(1 if self.auto_blocks else int(nb))

    def _set_blocks(self, g: int) -> None:
        """(Re)start the SBM with g blocks: B = B_in on the diagonal, B_out off it, α uniform, Ω
        random (the draw breaks the blocks' symmetry), the graph-sum trackers at zero."""
        self.num_blocks = int(g)
        self.B = np.full((g, g), float(self.p["B_out"]))
        np.fill_diagonal(self.B, float(self.p["B_in"]))
        self.alpha = np.full(g, float(self.p["dirichlet_alpha"]))
        self.omega = self.rng.dirichlet(np.ones(g))
        self.gamma = self.omega + self.alpha
        self._omegas: dict[str, np.ndarray] = {}
        self._w_in: dict[str, float] = {}
        zero = {"N": np.zeros((g, g)), "D": np.zeros((g, g)), "s": np.zeros(g)}
        self._est = {k: v.copy() for k, v in zero.items()}  # my estimate of the network mean
        self._mine = {k: v.copy() for k, v in zero.items()}  # my own current terms

    # --- "auto": the number of blocks by ICL on the evidence rows, agreed by a vote ---
    def _my_row(self) -> dict[str, float]:
        return {p: float(v) for p, v in self._Y.items()}

    def _take_row(self, peer: str, msg: dict[str, Any]) -> None:
        row, k = msg.get("y"), msg.get("k")
        limit = len(self.net.known_peers()) + 1
        if (
            isinstance(row, dict)
            and 0 < len(row) <= limit
            and all(isinstance(a, str) and isinstance(v, (int, float)) and np.isfinite(v) for a, v in row.items())
        ):
            self._rows[peer] = {a: float(v) for a, v in row.items()}
        if isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= int(self.p["max_blocks"]):
            self._k_votes[peer] = k

    def _choose_blocks(self) -> None:
        """At E-step ``blocks_after``: my K̂ by ICL over the rows I hold (mine and the peers'); at
        the next E-step every node adopts the most common K̂ among its own and the peers' (ties:
        the smaller), so all nodes share Ω's dimension, and restarts the SBM with it."""
        if self._t + 1 == int(self.p["blocks_after"]) and self._k_hat is None:
            rows = {**self._rows, self.node_id: self._my_row()}
            if len(rows) >= 2:
                _, S = evidence_matrix(rows)
                self._k_hat, _ = estimate_num_blocks(S, int(self.p["max_blocks"]), seed=0)
        elif self._k_hat is not None and self._t + 1 == int(self.p["blocks_after"]) + 1:
            votes = [self._k_hat] + [k for p, k in self._k_votes.items() if p != self.node_id]
            counts = {k: votes.count(k) for k in set(votes)}
            k = min(counts, key=lambda c: (-counts[c], c))
            if k != self.num_blocks:
                self._set_blocks(k)

    @property
    def learns_prior(self) -> bool:
        return bool(self.p["learn_B"]) or bool(self.p["learn_alpha"])

    def _omega_payload(self, peer: str, mix: float = 0.0) -> dict[str, Any]:
        msg: dict[str, Any] = {"omega": C.vec_to_wire(self.omega), "w": float(self._raw.get(peer, -1.0))}
        if self.auto_blocks:
            msg["y"] = self._my_row()
            if self._k_hat is not None:
                msg["k"] = int(self._k_hat)
        if self.learns_prior:
            msg["stats"] = {k: C.vec_to_wire(v) for k, v in self._est.items()}
            msg["mix"] = mix
        return msg

    def _read_stats(self, msg: dict[str, Any] | None) -> dict[str, np.ndarray] | None:
        st = msg.get("stats") if isinstance(msg, dict) else None
        if not self.learns_prior or not isinstance(st, dict):
            return None
        out = {}
        for k, mine in self._est.items():
            v = C.vec_from_wire(st.get(k))
            # tracked means may dip below zero while a node's own term shrinks: only shape and
            # finiteness (vec_from_wire) are checked
            if v is None or v.size != mine.size:
                return None  # malformed: ignore the whole message rather than half of it
            out[k] = v.reshape(mine.shape)
        return out

    def _mix_stats(self, eps: float, theirs: list[dict[str, np.ndarray]], ref: dict[str, np.ndarray]) -> None:
        """est += ε Σ (theirs − ref), ref = my estimate as I sent it (requester) or as I replied
        with it (server): both ends of an exchange move by opposite amounts (the requester sends
        ε = 1/(peers+1), the server applies the same ε), so the network sum of the estimates is
        kept whatever the interleaving of rounds (a reply lost after the server applied its side
        leaves the sum off by that exchange; B and α only use ratios and means, so they stay
        well defined)."""
        self._est = {k: self._est[k] + eps * sum(t[k] - ref[k] for t in theirs) for k in self._est}

    def _take_omega(self, peer: str, msg: dict[str, Any] | None) -> None:
        if not msg:
            return
        if self.auto_blocks and isinstance(msg, dict):
            self._take_row(peer, msg)
        om = C.vec_from_wire(msg.get("omega"))
        if om is not None and om.shape == self.omega.shape and np.all(om >= 0) and om.sum() > 0:
            self._omegas[peer] = om / om.sum()
        w = msg.get("w")
        if isinstance(w, (int, float)) and 0.0 <= w <= 1.0:
            self._w_in[peer] = float(w)

    def on_gossip(self, peer: str, key: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        if key != "omega":
            return None
        reply = self._omega_payload(peer)
        self._take_omega(peer, payload)
        theirs = self._read_stats(payload)
        eps = payload.get("mix") if isinstance(payload, dict) else None
        if theirs is not None and isinstance(eps, (int, float)) and 0.0 < eps <= 0.5:
            self._mix_stats(float(eps), [theirs], self._est)
        return reply

    def _prior_mstep(self, w: dict[str, float]) -> None:
        """Track the network means of the eq. 23–24 terms, then apply the M-steps from them."""
        new = sbm_node_stats(w, self.omega, self._omegas, self.gamma)
        for k in self._est:
            self._est[k] = self._est[k] + new[k] - self._mine[k]
        self._mine = new
        if self.p["learn_B"]:
            self.B = sbm_B_mstep(self._est["N"], self._est["D"], self.B)
        if self.p["learn_alpha"]:
            K = len(set(self.net.known_peers()) | {self.node_id})
            self.alpha = sbm_alpha_mstep(self.alpha, K * self._est["s"], K, float(self.p["alpha_lr"]))

    async def _estep(self, rnd: int, theta_half: Params, snaps: dict) -> None:
        peers = sorted(set(self._Y) & set(self.candidates() if self._kept is None else self._kept))
        if self.auto_blocks:
            self._choose_blocks()
        eps = 1.0 / (len(peers) + 1)
        sent = {k: v.copy() for k, v in self._est.items()}
        replies = await gather_bounded({p: self.net.gossip(p, "omega", self._omega_payload(p, eps)) for p in peers})
        theirs = []
        for p, msg in replies.items():
            self._take_omega(p, msg)
            stats = self._read_stats(msg)
            if stats is not None:
                theirs.append(stats)
        self._mix_stats(eps, theirs, sent)
        y_self = await self._own_evidence()
        Y = {p: self._Y[p] for p in self._Y if p != self.node_id and (self._kept is None or p in self._kept)}
        tau = float(self.p["tau"])
        w_self = sbm_self_weight(y_self, self.omega, self.B, tau) if self.p["self_weight"] == "sbm" else 1.0
        w, self.gamma, self.omega = sbm_estep_node(Y, self.omega, self._omegas, self._w_in, self.B, self.alpha, tau)
        self._raw.update(w)
        self._raw[self.node_id] = w_self
        if self.learns_prior:
            self._prior_mstep(w)
        keep = {p: v for p, v in self._raw.items() if p != self.node_id and (self._kept is None or p in self._kept)}
        self._row = row_with_self(keep, self.node_id, w_self)

    def public_state(self) -> dict[str, Any]:
        return {
            "num_blocks": self.num_blocks,
            "k_hat": self._k_hat,
            "omega": self.omega.tolist(),
            "gamma": self.gamma.tolist(),
            "B": self.B.tolist(),
            "alpha": self.alpha.tolist(),
            "evidence": dict(self._Y),
            "w_raw": dict(self._raw),
            "kept": self._kept,
            "peer_omega": {k: v.tolist() for k, v in self._omegas.items()},
            "rounds": self._t,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            **self._base_state(),
            "omega": self.omega.tolist(),
            "gamma": self.gamma.tolist(),
            "omegas": {k: v.tolist() for k, v in self._omegas.items()},
            "w_in": dict(self._w_in),
            "B": self.B.tolist(),
            "alpha": self.alpha.tolist(),
            "num_blocks": self.num_blocks,
            "k_hat": self._k_hat,
            "k_votes": dict(self._k_votes),
            "rows": {k: dict(v) for k, v in self._rows.items()},
            "est": {k: v.tolist() for k, v in self._est.items()},
            "mine": {k: v.tolist() for k, v in self._mine.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        g = state.get("num_blocks")  # before the rng is restored: _set_blocks draws Ω from it
        if self.auto_blocks and isinstance(g, int) and 1 <= g <= int(self.p["max_blocks"]) and g != self.num_blocks:
            self._set_blocks(g)
        self._load_base(state)
        if self.auto_blocks:
            k = state.get("k_hat")
            self._k_hat = int(k) if isinstance(k, int) else None
            self._k_votes = {str(p): int(v) for p, v in (state.get("k_votes") or {}).items()}
            self._rows = {
                str(p): {str(a): float(v) for a, v in r.items()} for p, r in (state.get("rows") or {}).items()
            }
        if "omega" in state and np.shape(state["omega"]) == self.omega.shape:
            self.omega = np.asarray(state["omega"], dtype=np.float64)
            self.gamma = np.asarray(state["gamma"], dtype=np.float64)
        self._omegas = {str(k): np.asarray(v, dtype=np.float64) for k, v in state.get("omegas", {}).items()}
        self._w_in = {str(k): float(v) for k, v in state.get("w_in", {}).items()}
        if "B" in state and np.shape(state["B"]) == self.B.shape:
            self.B = np.asarray(state["B"], dtype=np.float64)
        if "alpha" in state and np.shape(state["alpha"]) == self.alpha.shape:
            self.alpha = np.asarray(state["alpha"], dtype=np.float64)
        for name, target in (("est", self._est), ("mine", self._mine)):
            for k, v in (state.get(name) or {}).items():
                if k in target and np.shape(v) == target[k].shape:
                    target[k] = np.asarray(v, dtype=np.float64)


class SCoolAttention(_SCoolBase):
    """SCool-attention as the authors' code runs it (ShuangtongLi/SCool, as read in issue 11; the
    repository itself could not be retrieved here): the encoder is trained towards the
    likelihood-only target softmax(Y_i/τ) over self and peers (eq. 31 with w replaced by the
    likelihood part of eq. 29), the row is the eq. 29 softmax over self *and* peers, τ = 9 in the
    clustered setting, AdamW lr 0.2, the top 20% of peers kept after round 10. The encoder's
    logits are Σ over layers of the cosine of their tanh embeddings (``attention =
    "layer-cosine"``; see ``MetaL2C``): with the code's per-filter average (``"cosine"``) two
    peers' logits differ by at most 2·(filters that differ)/(all filters), so the rows were near
    uniform until pruning (issue 23)."""

    name = "scool-attention"
    defaults = {
        **_SCoolBase.defaults,
        "tau": 9.0,  # *code*: τ = 9 in the clustered setting (App. C.1: a fixed hyper-parameter)
        "keep_fraction": 0.2,  # *code*: keep 20% of the peers (App. C.1 text: remove 90%)
        "encoder_dims": [10, 5],  # App. C.1: two FC layers with output dims (10, 5)
        "encoder_lr": 0.2,  # *code*: AdamW lr 0.2 (App. C.1 text: Adam lr 0.1)
        "encoder_wd": 0.01,  # App. C.1: weight decay 0.01 (decoupled, AdamW, in the code)
        "encoder_seed": 0,  # *decentral*: common encoder init, like the models' θ⁰
        "attention": "layer-cosine",  # Σ over layers of cos(φ_l^i, φ_l^j) (UpdateEncoder "layer");
        # "cosine" = the SCool *code*'s per-filter average; "dot" = eq. 5/26
        "encoder_target": "likelihood",  # *code*: softmax(Y/τ); "posterior" = eq. 31's w_i (eq. 29)
    }

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.theta0 = self.learner.get_params()
        d = self.p["encoder_dims"]
        self.encoder = C.UpdateEncoder(
            self.theta0,
            (int(d[0]), int(d[1])),
            int(self.p["encoder_seed"]),
            normalise=C.encoder_norm(self.p["attention"], self.name),
        )
        self.opt = torch.optim.AdamW(
            self.encoder.parameters(), lr=float(self.p["encoder_lr"]), weight_decay=float(self.p["encoder_wd"])
        )
        self._update: Params | None = None
        self._p: dict[str, float] = {}

    def published_extras(self) -> dict[str, Params]:
        out = super().published_extras()
        if self._update is not None:
            out["update"] = self._update
        return out

    def on_gossip(self, peer: str, key: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        return C.encoder_on_gossip(self.encoder, payload) if key == "encoder" else None

    def _after_local_steps(self) -> None:
        self._update = C.sub(self.learner.get_params(), self.theta0)  # û^r, published for the next E-step

    async def _estep(self, rnd: int, theta_half: Params, snaps: dict) -> None:
        mine = C.sub(theta_half, self.theta0)  # û of the iteration aggregated now
        y_self = await self._own_evidence()
        peers = [
            p
            for p, s in snaps.items()
            if p in self._Y and "update" in s.extras and C.same_shapes(s.extras["update"], theta_half)
        ]
        ups = [snaps[p].extras["update"] for p in peers]
        y = np.array([y_self] + [self._Y[p] for p in peers])
        tau = float(self.p["tau"])

        C.encoder_fold(self.encoder)  # peers' gossip since my last round, before I use the encoder

        w, p = await self.compute(attention_estep, self.encoder, self.opt, mine, ups, y, tau, self.p["encoder_target"])
        ids = [self.node_id] + peers
        self._p = {k: float(v) for k, v in zip(ids, p, strict=True)}
        self._raw.update({k: float(v) for k, v in zip(ids, w, strict=True)})
        # *code*: the mixing row is w_i itself (eq. 29), a softmax over self and the peers
        self._row = {k: float(v) for k, v in zip(ids, w, strict=True)}
        # gossip-average the encoder with the peers contacted (*decentral* for the global φ)
        vec = C.vec_to_wire(C.encoder_current(self.encoder))
        replies = await gather_bounded({q: self.net.gossip(q, "encoder", {"vec": vec}) for q in snaps})
        C.encoder_average(self.encoder, replies.values())

    def public_state(self) -> dict[str, Any]:
        return {
            "evidence": dict(self._Y),
            "attention": dict(self._p),
            "w": dict(self._row),
            "kept": self._kept,
            "rounds": self._t,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            **self._base_state(),
            "theta0": C.params_state(self.theta0),
            "update": C.params_state(self._update),
            "p": dict(self._p),
            "encoder": C.vec_to_wire(self.encoder.get_vector()),
            "encoder_pending": C.encoder_pending_state(self.encoder),
            "encoder_opt": C.optimizer_state(self.opt),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_base(state)
        if state.get("theta0") is not None:
            self.theta0 = state["theta0"]
        self._update = state.get("update")
        self._p = {str(k): float(v) for k, v in state.get("p", {}).items()}
        v = C.vec_from_wire(state.get("encoder"))
        if v is not None and v.size == self.encoder.num_params():
            self.encoder.set_vector(v)
        C.set_encoder_pending(self.encoder, state.get("encoder_pending"))
        C.load_optimizer_state(self.opt, state.get("encoder_opt"))
