"""L2C / meta-L2C (l2c.txt §3.2–3.4, Alg. 1): the α-gradient against finite differences through
the softmax, mixing, Adam, pruning at T0, encoder training and gossip; in-process network."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from coterie.node.strategies import common as C
from coterie.node.strategies.l2c import L2C, MetaL2C, l2c_alpha_grad
from tests.strategy_harness import (
    assert_encoder_resumes,
    build_network,
    in_cluster_mass,
    msgpack_roundtrip_state,
    run_free,
    run_rounds,
)

torch.set_num_threads(1)


def _val_loss_of_alpha(learner, theta, deltas, alpha):
    w = C.softmax(alpha)
    return learner.loss(C.mix_updates(theta, list(zip(w.tolist(), deltas, strict=True))), "val").loss


def test_alpha_gradient_matches_finite_differences():
    hub = build_network(L2C, num_nodes=4, num_clusters=2)
    asyncio.run(run_rounds(hub, 1))
    n0 = hub.nodes["n0"]
    theta = {k: v.double() for k, v in n0.learner.get_params().items()}
    deltas = [
        {k: v.double() * 20 for k, v in hub.nodes[p].snapshot.extras["delta"].items()} for p in ("n0", "n1", "n2", "n3")
    ]  # enlarged so the loss moves measurably
    learner = n0.learner
    learner.model.double()
    learner.data = {k: (x.double(), y) for k, (x, y) in learner.data.items()}  # float64 for clean FD
    alpha = np.array([0.3, -0.2, 0.1, 0.5])
    w = C.softmax(alpha)
    g, _ = learner.gradient(C.mix_updates(theta, list(zip(w.tolist(), deltas, strict=True))), "val", None)
    ana = l2c_alpha_grad(alpha, g, deltas)
    h = 1e-5
    fd = np.array(
        [
            (
                _val_loss_of_alpha(learner, theta, deltas, alpha + h * e)
                - _val_loss_of_alpha(learner, theta, deltas, alpha - h * e)
            )
            / (2 * h)
            for e in np.eye(4)
        ]
    )
    assert np.abs(ana).max() > 1e-3  # a non-trivial gradient
    assert np.allclose(ana, fd, rtol=1e-4, atol=1e-7)
    assert abs(ana.sum()) < 1e-9  # softmax: invariant to adding a constant to α


def test_adam_scalars_matches_torch_adam():
    x = {"a": 0.5, "b": -1.0}
    st: dict = {}
    p = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([p], lr=0.1, weight_decay=0.01)
    for g in ([0.3, -0.7], [0.1, 0.2], [-0.5, 0.0]):
        x = C.adam_scalars(x, {"a": g[0], "b": g[1]}, st, 0.1, 0.01)
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    assert [x["a"], x["b"]] == pytest.approx(p.detach().tolist(), rel=1e-9)


def test_round_mixes_the_same_iteration_then_trains():
    """Round 2 at n0 aggregates iteration 1 (Alg. 1 l.13-18): θ^2 = θ^1 − Σ softmax(α)_j Δθ_j^1
    with every neighbour's Δθ of round 1 (the round n0's own Δθ is from), takes one Adam step on
    α, then runs the local steps of iteration 2 from θ^2 and publishes their Δθ."""
    hub = build_network(L2C, num_nodes=3, num_clusters=1)
    asyncio.run(run_rounds(hub, 1))
    n0 = hub.nodes["n0"]
    s = n0.strategy
    assert s._t == 0 and s._delta_round == 1  # round 1: local steps only
    base, own = s._base, s._delta
    alpha_before = dict(s._alpha)
    deltas = {p: hub.nodes[p].snapshot.extras["delta"] for p in ("n1", "n2")}
    rep = asyncio.run(s.run_round(2))
    ids = ["n0", "n1", "n2"]
    w = C.softmax([alpha_before.get(p, 0.0) for p in ids])
    assert [s._row[p] for p in ids] == pytest.approx(w.tolist())
    ref = C.mix_updates(base, [(w[0], own), (w[1], deltas["n1"]), (w[2], deltas["n2"])])
    assert all(torch.allclose(s._base[k], ref[k], atol=1e-6) for k in ref)  # θ^2: trained from
    after = n0.learner.get_params()
    assert all(torch.allclose(s._delta[k], ref[k] - after[k], atol=1e-6) for k in ref)
    assert s._delta_round == 2 and rep.info["same_round"] == 2 and rep.info["of_round"] == 1
    assert s._alpha != alpha_before  # one Adam step on α
    assert sum(s.weights().values()) == pytest.approx(1.0)


def test_round_aligned_pull_waits_for_a_slow_neighbour():
    """Daemons run free: a neighbour three times slower still has its Δθ of the same iteration
    mixed every round (the pull waits for it), where the unaligned variant takes whatever
    snapshot is there and reuses or skips the slow node's updates."""

    def run(params):
        hub = build_network(L2C, params, num_nodes=3, num_clusters=1)
        reports = asyncio.run(run_free(hub, 6, delay_s={"n2": 0.3}))
        return [r.info for r in reports["n0"][1:]]

    aligned = run({})
    assert all(i["mixed"] == 2 and i["same_round"] == 2 for i in aligned), aligned
    unaligned = run({"round_aligned": False})
    assert any(i["same_round"] < 2 for i in unaligned), unaligned
    # a bounded wait: a neighbour that never publishes that round is left out, not waited for
    hub = build_network(L2C, {"sync_wait_s": 0.05}, num_nodes=3, num_clusters=1)
    asyncio.run(run_rounds(hub, 1))
    hub.nodes["n2"].snapshot.round = 0  # n2 "still in round 1"
    rep = asyncio.run(hub.nodes["n0"].strategy.run_round(2))
    assert rep.info["mixed"] == 1 and rep.contacted == ["n1"]


def test_l2c_in_process_network_prunes_at_T0_and_resumes():
    hub = build_network(L2C)
    asyncio.run(run_rounds(hub, 9))
    mass9, per9, chance = in_cluster_mass(hub)
    assert mass9 > chance + 0.2, per9  # α alone, before pruning
    asyncio.run(run_rounds(hub, 2, start=10))
    mass, per_node, _ = in_cluster_mass(hub)
    assert mass > 0.9, per_node
    for node in hub.nodes.values():  # T0 = 10: 90% of 5 peers dropped, one kept, in-cluster
        (kept,) = node.strategy._kept
        assert hub.nodes[kept].cluster == node.cluster
    before = hub.calls["pull"]
    asyncio.run(run_rounds(hub, 1, start=12))
    assert hub.calls["pull"] - before == 6
    s = hub.nodes["n4"].strategy
    s2 = L2C("n4", s.learner, s.net, seed=3)
    s2.load_state_dict(msgpack_roundtrip_state(s.state_dict()))
    assert s2.public_state() == s.public_state() and s2.weights() == s.weights()


def test_meta_l2c_in_process_network_and_encoder_gossip():
    params = {"alpha_steps": 5, "prune_round": 3}
    hub = build_network(MetaL2C, params, learner_kw={"local_steps": 20})
    enc0 = hub.nodes["n0"].strategy.encoder.get_vector().clone()
    asyncio.run(run_rounds(hub, 5))
    mass, per_node, chance = in_cluster_mass(hub)
    assert mass > 0.8, per_node
    assert hub.calls["gossip"] > 0
    # each node's copy as gossip sees it (served gossip is folded in at the node's next round)
    vecs = torch.stack(
        [torch.as_tensor(C.encoder_current(n.strategy.encoder), dtype=torch.float32) for n in hub.nodes.values()]
    )
    assert not torch.allclose(vecs[0], enc0)
    assert (vecs - vecs.mean(0)).norm(dim=1).max() < 0.5 * (vecs[0] - enc0).norm()
    snap = hub.nodes["n1"].snapshot
    assert set(snap.extras) == {"delta", "update"}
    s = hub.nodes["n1"].strategy
    s2 = MetaL2C("n1", s.learner, s.net, params, seed=3)
    s2.load_state_dict(msgpack_roundtrip_state(s.state_dict()))
    assert s2.public_state() == s.public_state()
    assert_encoder_resumes(s)
    assert torch.allclose(s2.encoder.get_vector(), s.encoder.get_vector())
    assert np.array_equal(C.encoder_current(s2.encoder), C.encoder_current(s.encoder))


def test_meta_l2c_prunes_on_the_mean_row_not_the_last_one():
    """At T0 the peers are ranked by their mean weight over the rounds so far: a last row that
    happens to favour another peer does not decide the topology."""
    hub = build_network(MetaL2C, {"prune_round": 4}, num_nodes=4, num_clusters=2)
    s = hub.nodes["n0"].strategy
    ids = ["n0", "n1", "n2", "n3"]
    for _ in range(3):
        s._observe_row(ids, np.array([0.4, 0.1, 0.4, 0.1]))
    last = np.array([0.3, 0.5, 0.1, 0.1])
    s._observe_row(ids, last)
    assert C.top_keep(s._prune_scores(ids, last), 0.1) == ["n2"]
    s.p["prune_on"] = "last"
    assert C.top_keep(s._prune_scores(ids, last), 0.1) == ["n1"]
    # in a run, every round's row is accumulated, and the kept peer is the best on average
    hub = build_network(MetaL2C, {"prune_round": 4, "alpha_steps": 5}, learner_kw={"local_steps": 20})
    asyncio.run(run_rounds(hub, 5))
    s = hub.nodes["n0"].strategy
    assert set(s._row_cnt.values()) == {4}  # aggregations in rounds 2-5 (round 1: local steps only)
    means = {p: s._row_sum[p] / s._row_cnt[p] for p in s._row_sum}
    assert s._kept == C.top_keep(means, 0.1)


def test_meta_l2c_attention_is_layer_cosine_by_default():
    hub = build_network(MetaL2C, num_nodes=2, num_clusters=1)
    assert hub.nodes["n0"].strategy.encoder.normalise == "layer"
    assert (
        build_network(MetaL2C, {"attention": "cosine"}, num_nodes=2, num_clusters=1)
        .nodes["n0"]
        .strategy.encoder.normalise
        == "filter"
    )
    assert (
        not build_network(MetaL2C, {"attention": "dot"}, num_nodes=2, num_clusters=1)
        .nodes["n0"]
        .strategy.encoder.normalise
    )
    with pytest.raises(ValueError, match="attention must be one of"):
        build_network(MetaL2C, {"attention": "cosin"}, num_nodes=2, num_clusters=1)


def _one_layer_tells(big: int = 100, seed: int = 0):
    """Updates where only a 2-filter layer tells two tasks apart; a 100-filter layer moves the
    same way for everyone (S1's CNN: shared features, permuted output layer)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(big, 6, generator=g)
    x = 10 * torch.randn(2, 6, generator=g)
    mine = {"a.weight": shared.clone(), "b.weight": x.clone()}
    same = {"a.weight": shared.clone(), "b.weight": x.clone()}
    other = {"a.weight": shared.clone(), "b.weight": -x}
    return mine, same, other


def test_meta_l2c_attention_keeps_the_say_of_the_layer_that_tells_tasks_apart():
    """Issue 23: before pruning the meta-L2C rows were near uniform. With the per-filter average
    ("cosine") the gap between the logits of a same-task and an other-task peer is at most
    2·(filters that differ)/(all filters) — here 2·2/102 — whatever the encoder learns; per layer
    ("layer-cosine", the default) the discriminating layer keeps its whole cosine."""
    mine, same, other = _one_layer_tells()
    net = build_network(MetaL2C, num_nodes=2, num_clusters=1)
    enc = net.nodes["n0"].strategy.encoder
    layer = C.UpdateEncoder(mine, seed=0, normalise=enc.normalise)
    filt = C.UpdateEncoder(mine, seed=0, normalise="filter")
    with torch.no_grad():
        gap_layer = (lambda lg: float(lg[1] - lg[2]))(C.attention_logits(layer, mine, [same, other]))
        gap_filter = (lambda lg: float(lg[1] - lg[2]))(C.attention_logits(filt, mine, [same, other]))
    assert gap_filter <= 2 * 2 / 102 + 1e-6
    assert gap_layer > 0.5, gap_layer
    # the softmax row over [self, same, other] gives the same-task peer a real share
    with torch.no_grad():
        w = torch.softmax(C.attention_logits(layer, mine, [same, other]), 0)
    assert float(w[1] / w[2]) > np.exp(0.5)
