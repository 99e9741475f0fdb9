"""Shared math of the paper strategies: parameter arithmetic, softmax, ε-greedy sampling,
mixing of model updates, pruning, gossip encoding, and the per-layer attention encoder used by
meta-L2C and SCool-attention.

Everything here is a pure function over tensors/arrays (or a small torch module) so the tests can
compare each update rule against an independently written reference.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..learning.learner import Params

# --------------------------------------------------------------------------------------------
# Parameter arithmetic (Params = dict[name, Tensor], all on CPU)
# --------------------------------------------------------------------------------------------


def clone(p: Params) -> Params:
    return {k: v.detach().clone() for k, v in p.items()}


def zeros_like(p: Params) -> Params:
    return {k: torch.zeros_like(v) for k, v in p.items()}


def sub(a: Params, b: Params) -> Params:
    return {k: a[k] - b[k] for k in a}


def add(a: Params, b: Params) -> Params:
    return {k: a[k] + b[k] for k in a}


def scale(a: Params, s: float) -> Params:
    return {k: v * s for k, v in a.items()}


def lincomb(terms: Iterable[tuple[float, Params]], like: Params) -> Params:
    """Σ_t c_t · p_t (float64 accumulation, cast back to ``like``'s dtypes)."""
    out = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in like.items()}
    for c, p in terms:
        if c == 0.0:
            continue
        for k in out:
            out[k].add_(p[k].to(torch.float64), alpha=float(c))
    return {k: out[k].to(like[k].dtype) for k in out}


def dot(a: Params, b: Params) -> float:
    return float(sum(torch.sum(a[k].to(torch.float64) * b[k].to(torch.float64)) for k in a))


def l1_norm(a: Params) -> float:
    return float(sum(torch.sum(torch.abs(v.to(torch.float64))) for v in a.values()))


def l2_norm(a: Params) -> float:
    return math.sqrt(dot(a, a))


DISTANCE_CHUNK = 1 << 20  # elements: a model-sized tensor costs chunk-sized temporaries, not 3 models


def distance(a: Params, b: Params, kind: str = "l1") -> float:
    """‖a − b‖ (``kind`` "l1" or "l2"), the same values as ``l1_norm(sub(a, b))`` / ``l2_norm``
    (the difference in the tensors' dtype, summed in float64) without the model-sized difference
    and its float64 copy those make: 3 models of temporaries for a 21 MB model, and 7-10× slower."""
    if kind not in ("l1", "l2"):
        raise ValueError(f"distance: unknown kind {kind!r} (l1 or l2)")
    total = 0.0
    for x, y in ((a[k].reshape(-1), b[k].reshape(-1)) for k in a):
        n = x.numel()
        for i in range(0, n, DISTANCE_CHUNK):
            d = torch.sub(x[i : i + DISTANCE_CHUNK], y[i : i + DISTANCE_CHUNK]) if n > DISTANCE_CHUNK else x - y
            if kind == "l1":
                total += float(torch.sum(d.abs_(), dtype=torch.float64))
            else:
                d = d.to(torch.float64)
                total += float(torch.dot(d, d))
            del d  # before the next chunk's is made: kept, the two would be alive at once
    return total if kind == "l1" else math.sqrt(total)


def flatten(p: Params) -> torch.Tensor:
    """All parameters as one float32 vector, in the dict's (= param_spec) order."""
    return torch.cat([v.reshape(-1).to(torch.float32) for v in p.values()])


def unflatten(vec: torch.Tensor, like: Params) -> Params:
    out, i = {}, 0
    for k, v in like.items():
        n = v.numel()
        out[k] = vec[i : i + n].reshape(v.shape).to(v.dtype).clone()
        i += n
    if i != vec.numel():
        raise ValueError(f"vector has {vec.numel()} entries, parameters need {i}")
    return out


def same_shapes(a: Params, b: Params) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)


def mix_updates(theta: Params, members: Sequence[tuple[float, Params]]) -> Params:
    """Update mixing (L2C eq. 2, SCool App. C.1): θ ← θ − Σ_j w_j Δθ_j."""
    return lincomb([(1.0, theta)] + [(-w, d) for w, d in members], theta)


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def softmax(x: Sequence[float] | np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = np.asarray(x, dtype=np.float64) / float(temperature)
    if z.size == 0:
        return z
    z = z - np.max(z)
    e = np.exp(z)
    return e / e.sum()


def sigmoid(x: np.ndarray | float) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return np.where(x >= 0, 1.0 / (1.0 + np.exp(-np.abs(x))), np.exp(-np.abs(x)) / (1.0 + np.exp(-np.abs(x))))


def normalise_row(row: dict[str, float]) -> dict[str, float]:
    s = sum(max(v, 0.0) for v in row.values())
    if s <= 0:
        return {k: 0.0 for k in row}
    return {k: max(v, 0.0) / s for k, v in row.items()}


def eps_greedy(
    candidates: Sequence[str], scores: dict[str, float], m: int, eps: float, rng: np.random.Generator
) -> list[str]:
    """Pick ``m`` distinct candidates: each slot is, with probability ε, a uniformly random one of
    those left, else the best-scored one left (ties broken by id). FedFomo §3.1 / FedeRiCo §2.2."""
    left = sorted(candidates)
    picked: list[str] = []
    while left and len(picked) < m:
        if eps > 0 and rng.random() < eps:
            j = left[int(rng.integers(len(left)))]
        else:
            j = max(left, key=lambda c: (scores.get(c, float("-inf")), _neg_id(c)))
        picked.append(j)
        left.remove(j)
    return picked


def _neg_id(c: str) -> tuple[int, ...]:
    # deterministic tie-break preferring the smaller id
    return tuple(-ord(ch) for ch in c)


def top_keep(scores: dict[str, float], fraction: float, min_keep: int = 1, rounding: str = "ceil") -> list[str]:
    """The ⌈fraction·n⌉ (``rounding="floor"``: ⌊fraction·n⌋), at least ``min_keep``, best-scored
    ids, sorted. L2C Alg. 1 l.21 *removes* the K0 share with the smallest weights, i.e. keeps
    n − ⌊K0·n⌋ = ⌈(1−K0)·n⌉; SCool's code *keeps* a share, int(fraction·n)."""
    if not scores:
        return []
    x = fraction * len(scores)
    k = max(min_keep, int(math.floor(x + 1e-9) if rounding == "floor" else math.ceil(x - 1e-9)))
    best = sorted(scores, key=lambda c: (-scores[c], c))[:k]
    return sorted(best)


# --------------------------------------------------------------------------------------------
# Gossip / persistence encoding (msgpack-able)
# --------------------------------------------------------------------------------------------


def vec_to_wire(v: torch.Tensor | np.ndarray) -> list[float]:
    return (
        np.asarray(v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v, dtype=np.float32)
        .reshape(-1)
        .tolist()
    )


def vec_from_wire(x: Any) -> np.ndarray | None:
    """Accept a list or a float32 ndarray (or bytes of float32); None if unusable."""
    try:
        if isinstance(x, (bytes, bytearray)):
            a = np.frombuffer(x, dtype=np.float32)
        else:
            a = np.asarray(x, dtype=np.float64)
        a = a.reshape(-1).astype(np.float64)
    except (TypeError, ValueError):
        return None
    if not np.all(np.isfinite(a)):
        return None
    return a


def params_state(p: Params | None) -> Params | None:
    return None if p is None else clone(p)


# --------------------------------------------------------------------------------------------
# Attention encoder of model updates (meta-L2C §3.3 eq. 5–8; SCool-attention eq. 26)
# --------------------------------------------------------------------------------------------


def layer_filters(p: Params) -> list[tuple[str, torch.Tensor]]:
    """Per layer, the matrix of its output filters: one row per output unit/channel holding that
    unit's incoming weights (flattened) and, if present, its bias (meta-L2C eq. 7, channel
    sharing). Parameters of rank 1 without a matching weight (e.g. norm scales) are left out."""
    out = []
    for name, w in p.items():
        if w.dim() < 2:
            continue
        rows = w.reshape(w.shape[0], -1)
        bias_name = name[: -len("weight")] + "bias" if name.endswith("weight") else None
        if bias_name and bias_name in p and p[bias_name].shape == (w.shape[0],):
            rows = torch.cat([rows, p[bias_name].reshape(-1, 1)], dim=1)
        out.append((name, rows))
    return out


class UpdateEncoder(nn.Module):
    """E(·): per layer l a two-layer MLP E_l (output dims 10, 5) applied to every output filter;
    the model's representation is the concatenation over filters and layers (eq. 7–8).

    ``normalise`` (the SCool authors' encoder, ShuangtongLi/SCool, as read in issue 11; SCool's
    attention prior eq. 25–26 is meta-L2C's eq. 4–5): every filter's embedding goes through tanh
    and is scaled to unit length, and the concatenation is divided by √(#filters), so
    ⟨E(û_i), E(û_j)⟩ is the *average* over filters of their cosine similarities, in [−1, 1]. The
    raw dot product of eq. 5 grows with the number of filters and the size of the updates: on a
    610-dim embedding one node's large update made it every node's favourite (a hub).

    ``normalise = "layer"``: each layer's φ_l (eq. 7, tanh'd) is scaled to unit length and the
    layers are concatenated (eq. 8), so ⟨E(û_i), E(û_j)⟩ = Σ_l cos(φ_l^i, φ_l^j) ∈ [−L, L]: still
    bounded (no hub), but a layer that tells the tasks apart keeps its whole say. The per-filter
    average lets every filter of every layer vote equally, and the filters of the shared feature
    layers outnumber those that differ between tasks (S1's CNN: 10 of 122 filters are the output
    layer's), so the logits of in- and out-of-cluster peers ended within ~0.2 of each other and the
    softmax rows stayed near uniform before pruning (issue 23)."""

    def __init__(self, spec: Params, dims: tuple[int, int] = (10, 5), seed: int = 0, normalise: bool | str = False):
        super().__init__()
        # "filter" (True): per-filter unit norm, averaged; "layer": per-layer unit norm, summed
        self.normalise = "filter" if normalise is True else (normalise or "")
        if self.normalise not in ("", "filter", "layer"):
            raise ValueError(f"UpdateEncoder: normalise must be 'filter', 'layer' or off, got {normalise!r}")
        g = torch.Generator().manual_seed(int(seed))
        self.names: list[str] = []
        self.mlps = nn.ModuleList()
        for name, rows in layer_filters(spec):
            mlp = nn.Sequential(nn.Linear(rows.shape[1], dims[0]), nn.ReLU(), nn.Linear(dims[0], dims[1]))
            for mod in mlp:
                if isinstance(mod, nn.Linear):  # deterministic common init: every node agrees
                    bound = 1.0 / math.sqrt(mod.in_features)
                    with torch.no_grad():
                        mod.weight.copy_(torch.rand(mod.weight.shape, generator=g) * 2 * bound - bound)
                        mod.bias.copy_(torch.rand(mod.bias.shape, generator=g) * 2 * bound - bound)
            self.names.append(name)
            self.mlps.append(mlp)
        # Σ of the pairwise-averaging corrections owed to peers' gossip (float64), applied by
        # encoder_fold at the round's safe points: the served side never writes the parameters,
        # a worker thread may be back-propagating through them
        self.pending: np.ndarray | None = None

    def forward(self, update: Params) -> torch.Tensor:
        filt = dict(layer_filters(update))
        parts = [mlp(filt[n].to(torch.float32)) for n, mlp in zip(self.names, self.mlps, strict=True)]
        if not parts:
            return torch.zeros(0)
        if self.normalise == "filter":
            parts = [nn.functional.normalize(torch.tanh(e), dim=1, eps=1e-12) for e in parts]
            filters = sum(e.shape[0] for e in parts)
            return torch.cat([e.reshape(-1) for e in parts]) / math.sqrt(filters)
        if self.normalise == "layer":
            # φ_l (eq. 7) scaled to unit length per layer: ⟨E_i, E_j⟩ = Σ_l cos(φ_l^i, φ_l^j) ∈ [−L, L]
            return torch.cat([nn.functional.normalize(torch.tanh(e).reshape(-1), dim=0, eps=1e-12) for e in parts])
        return torch.cat([e.reshape(-1) for e in parts])

    def get_vector(self) -> torch.Tensor:
        return torch.cat([q.detach().reshape(-1) for q in self.parameters()])

    def set_vector(self, v: torch.Tensor | np.ndarray) -> None:
        v = torch.as_tensor(np.asarray(v, dtype=np.float32))
        i = 0
        with torch.no_grad():
            for q in self.parameters():
                n = q.numel()
                q.copy_(v[i : i + n].reshape(q.shape))
                i += n

    def num_params(self) -> int:
        return sum(q.numel() for q in self.parameters())


ENCODER_NORM: dict[str, bool | str] = {"dot": False, "cosine": "filter", "layer-cosine": "layer"}
"""The strategies' ``attention`` parameter → ``UpdateEncoder``'s ``normalise``."""


def encoder_norm(attention: Any, strategy: str) -> bool | str:
    if attention not in ENCODER_NORM:
        raise ValueError(f"strategy {strategy!r}: attention must be one of {sorted(ENCODER_NORM)}, got {attention!r}")
    return ENCODER_NORM[attention]


def attention_logits(encoder: UpdateEncoder, mine: Params, others: Sequence[Params]) -> torch.Tensor:
    """f(θ_i, θ_j) = ⟨E(û_i), E(û_j)⟩ for j in [i] + others (meta-L2C eq. 5, SCool eq. 26),
    differentiable w.r.t. the encoder."""
    e_i = encoder(mine)
    embs = torch.stack([e_i] + [encoder(o) for o in others])
    return embs @ e_i


# --------------------------------------------------------------------------------------------
# RNG persistence (PCG64 state holds 128-bit ints: msgpack needs them as strings)
# --------------------------------------------------------------------------------------------


def rng_state(rng: np.random.Generator) -> dict[str, Any]:
    st = rng.bit_generator.state
    return {
        "bit_generator": st["bit_generator"],
        "state": {k: str(v) for k, v in st["state"].items()},
        "has_uint32": int(st.get("has_uint32", 0)),
        "uinteger": int(st.get("uinteger", 0)),
    }


def set_rng_state(rng: np.random.Generator, st: dict[str, Any] | None) -> None:
    if not st:
        return
    try:
        rng.bit_generator.state = {
            "bit_generator": st["bit_generator"],
            "state": {k: int(v) for k, v in st["state"].items()},
            "has_uint32": int(st.get("has_uint32", 0)),
            "uinteger": int(st.get("uinteger", 0)),
        }
    except (KeyError, TypeError, ValueError):
        pass  # a state from another generator: keep the seeded one


def encoder_current(encoder: UpdateEncoder) -> np.ndarray:
    """My copy as gossip sees it: the parameters plus the corrections not yet folded in."""
    v = encoder.get_vector().numpy().astype(np.float64)
    return v if encoder.pending is None else v + encoder.pending


def encoder_on_gossip(encoder: UpdateEncoder, payload: dict[str, Any]) -> dict[str, Any]:
    """Served side of encoder gossip: a pairwise average with the requester, x ← (x + x_req)/2,
    deferred. Reply with my current copy; the correction (x_req − x)/2 is queued in
    ``encoder.pending`` and added at my next safe point (encoder_fold), on top of whatever my own
    round trained meanwhile. (A request can arrive while my round trains the encoder in a worker
    thread, so the parameters are not written here.) With nothing trained in between, the fold
    gives exactly the immediate pairwise average; several requests chain like immediate ones."""
    cur = encoder_current(encoder)
    reply = {"vec": vec_to_wire(cur)}
    v = vec_from_wire(payload.get("vec"))
    if v is not None and v.size == cur.size:
        corr = (v - cur) / 2
        encoder.pending = corr if encoder.pending is None else encoder.pending + corr
    return reply


def encoder_fold(encoder: UpdateEncoder) -> bool:
    """Apply the queued gossip corrections (call only where no worker uses the encoder: on the
    event loop between the round's compute calls). Returns whether there were any."""
    if encoder.pending is None:
        return False
    v = encoder_current(encoder)
    encoder.pending = None
    encoder.set_vector(v)
    return True


def encoder_pending_state(encoder: UpdateEncoder) -> list[float] | None:
    """The queued gossip corrections, msgpack-able (for state_dict), float64."""
    return None if encoder.pending is None else encoder.pending.tolist()


def set_encoder_pending(encoder: UpdateEncoder, x: Any) -> None:
    v = None if x is None else vec_from_wire(x)
    encoder.pending = v if v is not None and v.size == encoder.num_params() else None


def optimizer_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """A torch optimizer's per-parameter state (Adam moments and step counts), for state_dict:
    resuming without it restarts Adam's bias correction, i.e. lr-sized steps on every parameter."""
    return {
        str(k): {n: (v.detach().clone() if torch.is_tensor(v) else v) for n, v in st.items()}
        for k, st in opt.state_dict()["state"].items()
    }


def load_optimizer_state(opt: torch.optim.Optimizer, state: dict[str, Any] | None) -> None:
    """Inverse of ``optimizer_state``; ignores a state that does not fit this optimizer."""
    if not state:
        return
    sd = opt.state_dict()
    try:
        sd["state"] = {
            int(k): {n: (torch.as_tensor(v).clone() if not isinstance(v, (int, float)) else v) for n, v in st.items()}
            for k, st in state.items()
        }
        opt.load_state_dict(sd)
    except (ValueError, KeyError, TypeError, RuntimeError):
        return


def encoder_average(encoder: UpdateEncoder, replies: Iterable[dict[str, Any] | None]) -> int:
    """Requester side: my copy (queued corrections folded in) ← mean of it and the copies peers
    replied with (*decentral* replacement of the AllReduce of meta-L2C Alg. 1 l.24). Returns how
    many were averaged in."""
    encoder_fold(encoder)
    vecs = [encoder.get_vector().numpy().astype(np.float64)]
    for msg in replies:
        v = vec_from_wire((msg or {}).get("vec"))
        if v is not None and v.size == vecs[0].size:
            vecs.append(v)
    encoder.set_vector(np.mean(vecs, axis=0))
    return len(vecs) - 1


# --------------------------------------------------------------------------------------------
# Adam on a dict of scalars (per-entry moments and step counts: the neighbour set may change)
# --------------------------------------------------------------------------------------------


def adam_scalars(
    x: dict[str, float],
    grad: dict[str, float],
    state: dict[str, list[float]],
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> dict[str, float]:
    """One torch.optim.Adam step (L2 weight decay added to the gradient) for each entry of
    ``grad``; ``state[k] = [m, v, t]`` is updated in place."""
    out = dict(x)
    for k, g in grad.items():
        g = g + weight_decay * out.get(k, 0.0)
        m, v, t = state.get(k, [0.0, 0.0, 0.0])
        t += 1
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        mhat, vhat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
        out[k] = out.get(k, 0.0) - lr * mhat / (math.sqrt(vhat) + eps)
        state[k] = [m, v, t]
    return out
