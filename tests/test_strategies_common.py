"""Shared strategy math (node/strategies/common.py) against direct references."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import torch

from coterie.node.strategies import common as C
from coterie.node.strategies.registry import get_strategy

torch.set_num_threads(1)


def test_softmax_matches_definition_and_temperature():
    x = [1.0, -2.0, 0.5]
    ref = np.exp(np.array(x)) / np.exp(np.array(x)).sum()
    assert np.allclose(C.softmax(x), ref)
    ref_t = np.exp(np.array(x) / 0.5) / np.exp(np.array(x) / 0.5).sum()
    assert np.allclose(C.softmax(x, 0.5), ref_t)
    assert np.allclose(C.softmax([1000.0, 0.0]), [1.0, 0.0])  # stable


def test_sigmoid_stable():
    assert np.allclose(C.sigmoid(np.array([-800.0, 0.0, 3.0])), [0.0, 0.5, 1 / (1 + math.exp(-3))])


def test_mix_updates_and_lincomb():
    theta = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[3.0]])}
    d1 = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([[1.0]])}
    d2 = {"a": torch.tensor([0.0, 4.0]), "b": torch.tensor([[-1.0]])}
    out = C.mix_updates(theta, [(0.5, d1), (0.25, d2)])
    assert torch.allclose(out["a"], torch.tensor([0.5, 1.0]))
    assert torch.allclose(out["b"], torch.tensor([[2.75]]))
    assert torch.allclose(theta["a"], torch.tensor([1.0, 2.0]))  # inputs untouched


def test_flatten_roundtrip_and_norms():
    p = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([-1.0, 1.0])}
    v = C.flatten(p)
    assert v.tolist() == [0, 1, 2, 3, 4, 5, -1, 1]
    q = C.unflatten(v, p)
    assert all(torch.equal(p[k], q[k]) for k in p)
    assert C.l1_norm(p) == pytest.approx(17.0)
    assert C.l2_norm(p) == pytest.approx(math.sqrt(57.0))
    assert C.dot(p, p) == pytest.approx(57.0)


def test_eps_greedy_greedy_and_random():
    rng = np.random.default_rng(0)
    scores = {"a": 0.1, "b": 3.0, "c": 2.0, "d": -1.0}
    assert C.eps_greedy(list(scores), scores, 2, 0.0, rng) == ["b", "c"]
    assert C.eps_greedy(list(scores), scores, 10, 0.0, rng) == ["b", "c", "a", "d"]
    # ε = 1: uniform picks — every candidate shows up as the first pick over many draws
    firsts = {C.eps_greedy(list(scores), scores, 1, 1.0, rng)[0] for _ in range(200)}
    assert firsts == set(scores)
    # ε = 0.3: the top candidate comes first in ≈ 0.7 + 0.3/4 of draws
    rng = np.random.default_rng(1)
    share = np.mean([C.eps_greedy(list(scores), scores, 1, 0.3, rng)[0] == "b" for _ in range(4000)])
    assert abs(share - (0.7 + 0.3 / 4)) < 0.03


def test_top_keep():
    s = {"a": 0.5, "b": 0.1, "c": 0.9, "d": 0.2, "e": 0.3}
    assert C.top_keep(s, 0.2) == ["c"]
    assert C.top_keep(s, 0.5) == ["a", "c", "e"]
    assert C.top_keep(s, 0.0, min_keep=1) == ["c"]
    eleven = {f"p{i:02d}": float(i) for i in range(11)}
    assert C.top_keep(eleven, 0.2) == ["p08", "p09", "p10"]  # ⌈2.2⌉
    assert C.top_keep(eleven, 0.2, rounding="floor") == ["p09", "p10"]  # int(2.2): SCool's code
    assert C.top_keep(s, 0.1, rounding="floor") == ["c"]  # at least one


def test_encoder_shapes_and_vector_roundtrip():
    spec = {
        "0.weight": torch.zeros(16, 8),
        "0.bias": torch.zeros(16),
        "2.weight": torch.zeros(4, 16),
        "2.bias": torch.zeros(4),
    }
    enc = C.UpdateEncoder(spec, (10, 5), seed=3)
    assert enc(spec).shape == (16 * 5 + 4 * 5,)
    enc2 = C.UpdateEncoder(spec, (10, 5), seed=3)
    assert torch.equal(enc.get_vector(), enc2.get_vector())  # common init across nodes
    v = enc.get_vector() * 2
    enc2.set_vector(C.vec_from_wire(msgpack.unpackb(msgpack.packb(C.vec_to_wire(v)))))
    assert torch.allclose(enc2.get_vector(), v)
    # attention logits are ⟨E(u_i), E(u_j)⟩, self first
    u = {k: torch.randn_like(t) for k, t in spec.items()}
    o = {k: torch.randn_like(t) for k, t in spec.items()}
    lg = C.attention_logits(enc, u, [o])
    assert lg[1].item() == pytest.approx((enc(u) @ enc(o)).item(), rel=1e-5)


def test_rng_state_msgpack_roundtrip():
    rng = np.random.default_rng(7)
    rng.random(3)
    st = msgpack.unpackb(msgpack.packb(C.rng_state(rng)))
    r2 = np.random.default_rng(0)
    C.set_rng_state(r2, st)
    assert rng.random() == r2.random()


@pytest.mark.parametrize("name", ["fedfomo", "federico", "cobo", "l2c", "meta-l2c", "scool-sbm", "scool-attention"])
def test_registered_and_rejects_unknown_params(name):
    cls = get_strategy(name)
    assert cls.name == name
    with pytest.raises(ValueError, match="unknown parameter"):
        cls("x", None, None, {"no_such_param": 1})


def test_normalised_encoder_gives_averaged_cosine_logits():
    """normalise=True (SCool authors' encoder): per filter tanh then unit length; the logit is the
    mean over filters of the per-filter cosines, in [−1, 1], self = 1. The raw dot product grows
    with the update's size, so one node with a large update became every node's favourite."""
    spec = {
        "0.weight": torch.zeros(16, 8),
        "0.bias": torch.zeros(16),
        "2.weight": torch.zeros(4, 16),
        "2.bias": torch.zeros(4),
    }
    g = torch.Generator().manual_seed(0)
    u, o = ({k: torch.randn(t.shape, generator=g) for k, t in spec.items()} for _ in range(2))
    big = {k: 100 * v for k, v in o.items()}
    enc = C.UpdateEncoder(spec, (10, 5), seed=3, normalise=True)
    lg = C.attention_logits(enc, u, [o, big]).detach()
    assert lg[0].item() == pytest.approx(1.0, abs=1e-5) and torch.all(lg.abs() <= 1 + 1e-5)
    # reference: average of per-filter cosines of tanh(E_l(filter))
    cos = []
    for (_, ru), (_, ro), mlp in zip(C.layer_filters(u), C.layer_filters(o), enc.mlps, strict=True):
        eu, eo = torch.tanh(mlp(ru)), torch.tanh(mlp(ro))
        cos.append(torch.nn.functional.cosine_similarity(eu, eo, dim=1))
    assert lg[1].item() == pytest.approx(torch.cat(cos).mean().item(), abs=1e-5)
    raw = C.UpdateEncoder(spec, (10, 5), seed=3)  # eq. 5 as printed: the big update dominates
    lr = C.attention_logits(raw, u, [o, big]).detach()
    assert abs(lr[2].item()) > 10 * max(abs(lr[0].item()), abs(lr[1].item()))


def test_layer_normalised_encoder_sums_per_layer_cosines():
    """normalise="layer" (meta-L2C / SCool-attention default): each layer's embedding φ_l (eq. 7,
    tanh'd) at unit length, so the logit is Σ_l cos(φ_l^i, φ_l^j) ∈ [−L, L], self = L, and a
    scaled-up update changes nothing (no hub)."""
    spec = {
        "0.weight": torch.zeros(16, 8),
        "0.bias": torch.zeros(16),
        "2.weight": torch.zeros(4, 16),
        "2.bias": torch.zeros(4),
    }
    g = torch.Generator().manual_seed(0)
    u, o = ({k: torch.randn(t.shape, generator=g) for k, t in spec.items()} for _ in range(2))
    enc = C.UpdateEncoder(spec, (10, 5), seed=3, normalise="layer")
    lg = C.attention_logits(enc, u, [o, {k: 100 * v for k, v in u.items()}]).detach()
    assert lg[0].item() == pytest.approx(2.0, abs=1e-5)
    cos = 0.0
    for (_, ru), (_, ro), mlp in zip(C.layer_filters(u), C.layer_filters(o), enc.mlps, strict=True):
        eu, eo = torch.tanh(mlp(ru)).reshape(-1), torch.tanh(mlp(ro)).reshape(-1)
        cos += torch.nn.functional.cosine_similarity(eu, eo, dim=0).item()
    assert lg[1].item() == pytest.approx(cos, abs=1e-5)
    assert abs(lg[2].item()) <= 2.0 + 1e-5
    with pytest.raises(ValueError, match="normalise must be"):
        C.UpdateEncoder(spec, normalise="filters")
