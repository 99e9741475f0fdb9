"""FedFomo (fedfomo.txt §3.1, eq. 3): δ, normalisation, fallback, affinity; in-process network."""
from __future__ import annotations

import asyncio

import pytest
import torch

from coterie.node.strategies import common as C
from coterie.node.strategies.fedfomo import FedFomo, fomo_affinity, fomo_deltas, fomo_update, fomo_weights
from tests.strategy_harness import build_network, in_cluster_mass, msgpack_roundtrip_state, run_rounds

torch.set_num_threads(1)


def test_delta_by_hand_with_zero_distance_guard():
    d = fomo_deltas(1.0, {"a": 0.5, "b": 1.5, "c": 0.8}, {"a": 2.0, "b": 1.0, "c": 0.0})
    assert d == {"a": pytest.approx(0.25), "b": pytest.approx(-0.5), "c": 0.0}


def test_weights_normalise_positive_part():
    w = fomo_weights({"a": 0.25, "b": -0.5, "d": 0.75})
    assert w == {"a": pytest.approx(0.25), "b": 0.0, "d": pytest.approx(0.75)}


def test_fallback_keeps_base_when_no_delta_positive():
    base = {"w": torch.tensor([1.0, -1.0])}
    cands = {"a": {"w": torch.tensor([5.0, 5.0])}, "b": {"w": torch.tensor([0.0, 0.0])}}
    w = fomo_weights({"a": -0.1, "b": 0.0})
    assert w == {"a": 0.0, "b": 0.0}
    out = fomo_update(base, cands, w)
    assert torch.equal(out["w"], base["w"])


def test_update_by_hand():
    base = {"w": torch.tensor([0.0, 0.0])}
    cands = {"a": {"w": torch.tensor([1.0, 2.0])}, "b": {"w": torch.tensor([3.0, 0.0])}}
    out = fomo_update(base, cands, {"a": 0.25, "b": 0.75})
    # θ_base + Σ w_n (θ_n − θ_base) = 0.25·[1,2] + 0.75·[3,0]
    assert torch.allclose(out["w"], torch.tensor([2.5, 0.5]))


def test_affinity_signed_and_code_normalised():
    p = fomo_affinity({"me": 1.0}, {"a": 0.5, "b": -0.25})
    assert p == {"me": 1.0, "a": pytest.approx(2.0), "b": pytest.approx(-1.0)}  # δ/|Σδ|, |Σδ| = 0.25
    p = fomo_affinity({"me": 1.0}, {"a": 0.5, "b": -0.25}, normalise=False)
    assert p == {"me": 1.0, "a": 0.5, "b": -0.25}


def test_distance_is_l1_and_eps_decays():
    hub = build_network(FedFomo, num_nodes=2, num_clusters=1)
    s = hub.nodes["n0"].strategy
    a = {"w": torch.tensor([3.0, -4.0])}
    z = {"w": torch.zeros(2)}
    assert s._dist(a, z) == pytest.approx(7.0)  # L1 (code), not the L2 value 5
    assert s._eps() == pytest.approx(0.3)
    s._t = 4
    assert s._eps() == pytest.approx(0.1)
    s._t = 100
    assert s._eps() == 0.0


def test_round_uses_val_split_and_matches_reference():
    """One real round at n0, recomputed independently from the same inputs: θ_base is n0's model
    after its previous federated update, the candidates its trained live model and the pulled
    peers' published (trained) models; the result is what n0 trains from."""
    hub = build_network(FedFomo, {"eps": 0.0}, num_nodes=4, num_clusters=2)
    asyncio.run(run_rounds(hub, 2))
    n0 = hub.nodes["n0"]
    s = n0.strategy
    base = C.clone(s._base)
    mine = n0.learner.get_params()
    assert not all(torch.equal(mine[k], base[k]) for k in base)  # trained since the update
    asyncio.run(s.run_round(3))
    delta = s._delta
    assert "n0" in delta and len(delta) == 4  # self + M = min(5, 3) peers
    lb = n0.learner.loss(base, "val").loss
    cands = {"n0": mine, **{p: hub.nodes[p].snapshot.params for p in delta if p != "n0"}}
    for p, th in cands.items():
        ref = (lb - n0.learner.loss(th, "val").loss) / C.l1_norm(C.sub(th, base))
        assert delta[p] == pytest.approx(ref, rel=1e-5)
    ref_w = fomo_weights({p: delta[p] for p in cands})
    ref_new = fomo_update(base, cands, ref_w)
    assert all(torch.allclose(s._base[k], ref_new[k], atol=1e-6) for k in base)
    assert sum(s.weights().values()) == pytest.approx(1.0)
    w = s.public_state()["last_w"]
    if all(v <= 0 for v in delta.values()):
        assert w == {"n0": 1.0} and all(torch.equal(s._base[k], base[k]) for k in base)
    else:
        assert w == pytest.approx({p: v for p, v in ref_w.items()})
    # the row logged everywhere (history, results, /weights) is the one the update used
    assert s.weights() == w


def test_logged_weights_are_the_update_weights_not_the_affinity():
    """weights() is w* of the last update (eq. 3/13), which differs from the normalised
    affinity P; a fallback to θ_base shows as {self: 1}."""
    hub = build_network(FedFomo, {"eps": 0.0}, num_nodes=4, num_clusters=2)
    asyncio.run(run_rounds(hub, 3))
    for nid, node in hub.nodes.items():
        s = node.strategy
        delta = s.public_state()["last_delta"]
        used = fomo_weights(delta)
        if any(v > 0 for v in used.values()):
            assert s.weights() == pytest.approx({**used, nid: used.get(nid, 0.0)})
        else:
            assert s.weights() == {nid: 1.0}
        assert set(s.weights()) <= set(delta) | {nid}  # only models actually combined
    # the affinity view differs (it accumulates over rounds and covers every peer ever scored)
    assert any(n.strategy.weights() != pytest.approx(n.strategy.affinity_row()) for n in hub.nodes.values())
    # a fallback round: every candidate worse than the base -> {self: 1}
    s = hub.nodes["n0"].strategy
    s._P = {"n0": 1.0, "n1": 5.0}
    s._w = {"n0": 1.0}
    assert s.weights() == {"n0": 1.0} and s.affinity_row()["n1"] > 0.8


def test_in_process_network_finds_clusters_and_resumes():
    hub = build_network(FedFomo, num_nodes=6, num_clusters=2)
    asyncio.run(run_rounds(hub, 6))
    mass, per_node, chance = in_cluster_mass(hub)
    assert chance == pytest.approx(0.4)
    assert mass > 0.8, per_node
    # affinity: in-cluster peers end above out-of-cluster ones at every node
    for nid, node in hub.nodes.items():
        P = node.strategy.public_state()["affinity"]
        inc = [P.get(p, 0) for p, n in hub.nodes.items() if p != nid and n.cluster == node.cluster]
        out = [P.get(p, 0) for p, n in hub.nodes.items() if n.cluster != node.cluster]
        assert min(inc) > max(out), (nid, P)
        w = node.strategy.affinity_row()  # the positive part of P, normalised
        assert sum(w.values()) == pytest.approx(1.0) and all(w.get(p, 0) == 0 for p in P if P[p] <= 0)
    # persistence: msgpack-able, and a fresh strategy resumes the same state
    s = hub.nodes["n0"].strategy
    st = msgpack_roundtrip_state(s.state_dict())
    s2 = FedFomo("n0", s.learner, s.net, seed=123)
    s2.load_state_dict(st)
    assert s2.public_state() == s.public_state()
    assert s2.rng.random() == s.rng.random()
