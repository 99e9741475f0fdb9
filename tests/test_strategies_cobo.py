"""COBO (cobo.txt eq. 1–4, Alg. 1): the penalised model step, the projected symmetric pair update
at the midpoint; in-process network."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from coterie.node.learning.learner import Params
from coterie.node.strategies import common as C
from coterie.node.strategies.cobo import COBO, cobo_direction, cobo_model_step, cobo_pair_update
from tests.strategy_harness import build_network, in_cluster_mass, msgpack_roundtrip_state, run_rounds

torch.set_num_threads(1)


def test_model_step_by_hand():
    x = {"w": torch.tensor([1.0, 2.0])}
    g = {"w": torch.tensor([0.5, -0.5])}
    nb = [
        (1.0, {"w": torch.tensor([0.0, 0.0])}),
        (0.5, {"w": torch.tensor([3.0, 2.0])}),
        (0.0, {"w": torch.tensor([100.0, 100.0])}),
    ]
    # g + ρ Σ w (x − x_k) = [.5,−.5] + 0.1·(1·[1,2] + .5·[−2,0]) = [0.5, −0.3]
    assert torch.allclose(cobo_direction(g, x, nb, 0.1)["w"], torch.tensor([0.5, -0.3]))
    assert torch.allclose(cobo_model_step(x, g, nb, 0.2, 0.1)["w"], torch.tensor([0.9, 2.06]))


def test_pair_update_is_projected():
    assert cobo_pair_update(0.9, 0.5, 1.0) == 1.0
    assert cobo_pair_update(0.2, -0.5, 1.0) == 0.0
    assert cobo_pair_update(0.5, 0.2, 0.5) == pytest.approx(0.6)


def test_symmetric_pair_update_at_midpoint_matches_reference():
    params = {"gamma": 0.5, "pair_prob": 1.0, "grad_samples": None, "local_steps": 1}
    hub = build_network(COBO, params, num_nodes=2, num_clusters=2)
    asyncio.run(run_rounds(hub, 1))  # both trained and published once; one pair update
    # started by the smaller id only (crossing updates would be applied in opposite orders)
    assert hub.calls["cross_gradient"] == 1
    a, b = hub.nodes["n0"], hub.nodes["n1"]

    def W(n, p):  # raw w_ij ∈ [0,1]
        return hub.nodes[n].strategy.public_state()["W"][p]

    w_ab = W("n0", "n1")
    assert w_ab == W("n1", "n0")
    x0 = a.learner.get_params()
    x1_snap = b.snapshot.params
    # the next update from n0 with full-batch gradients, recomputed independently
    z = C.lincomb([(0.5, x0), (0.5, x1_snap)], x0)
    ip = C.dot(a.learner.gradient(z, "train", None)[0], b.learner.gradient(z, "train", None)[0])
    torch.manual_seed(0)
    asyncio.run(a.strategy.run_round(2))
    assert W("n0", "n1") == pytest.approx(min(1.0, max(0.0, w_ab + 0.5 * ip)), rel=1e-5)
    assert W("n1", "n0") == W("n0", "n1")  # same value at both ends
    w = a.strategy.weights()
    assert sum(w.values()) == pytest.approx(1.0) and w["n1"] / w["n0"] == pytest.approx(W("n0", "n1"))
    assert a.strategy.public_state()["last_inner_product"]["n1"] == pytest.approx(ip, rel=1e-5)


def _one_penalised_step(optimizer: str, learner_kw: dict, shift: float = 0.0) -> tuple[Params, Params, Params, Params]:
    """(x before, gradient, neighbour x_1, x after) of one round of one model step, ρ = 0.5,
    w = 1, γ = 0, η = 0.2, momentum-free."""
    params = {
        "gamma": 0.0,
        "rho": 0.5,
        "local_steps": 1,
        "grad_samples": None,
        "grad_momentum": 0.0,
        "lr": 0.2,
        "optimizer": optimizer,
    }
    hub = build_network(COBO, params, num_nodes=2, num_clusters=1, learner_kw=learner_kw)
    n0 = hub.nodes["n0"]
    hub.nodes["n1"].learner.train(3)
    if shift:  # a neighbour visibly elsewhere
        hub.nodes["n1"].learner.set_params({k: v + shift for k, v in hub.nodes["n1"].learner.get_params().items()})
    hub.publish("n1", 0)
    x = n0.learner.get_params()
    g, _ = n0.learner.gradient(x, "train", None)
    asyncio.run(n0.strategy.run_round(1))
    return x, g, hub.nodes["n1"].snapshot.params, n0.learner.get_params()


def test_round_applies_penalised_steps():
    """With ρ > 0, w = 1 and γ = 0 the model step is eq. 3 with the momentum-free gradient."""
    x, g, x1, after = _one_penalised_step("sgd", {"lr": 0.1})
    ref = cobo_model_step(x, g, [(1.0, x1)], 0.2, 0.5)
    assert all(torch.allclose(after[k], ref[k], atol=1e-6) for k in x)


def test_with_the_learners_optimizer_the_consensus_term_keeps_eq_3s_step():
    """``optimizer = "learner"``: eq. 3's consensus term is a plain step of COBO's η (0.2 · 0.5
    (x − x_1)) and the node's optimizer (SGD, lr 0.1) steps on the gradient alone. The earlier
    reading handed g + ρ(x − x_1) to the optimizer, so its lr (0.1) scaled the pull too — with
    Adam, every coordinate of it normalised to ~lr."""
    x, g, x1, after = _one_penalised_step("learner", {"lr": 0.1})
    ref = C.lincomb([(1.0, x), (-0.2 * 0.5, x), (0.2 * 0.5, x1), (-0.1, g)], x)
    assert all(torch.allclose(after[k], ref[k], atol=1e-6) for k in x)
    # with an SGD learner of COBO's own η it is eq. 3 exactly
    x, g, x1, after = _one_penalised_step("learner", {"lr": 0.2})
    ref = cobo_model_step(x, g, [(1.0, x1)], 0.2, 0.5)
    assert all(torch.allclose(after[k], ref[k], atol=1e-6) for k in x)
    # with Adam the pull is still exactly η ρ (x − x_1): the optimizer only adds its step on g
    x, g, x1, after = _one_penalised_step("learner", {"lr": 1e-6, "optimizer": "adam"}, shift=1.0)
    pulled = C.lincomb([(1.0, x), (-0.2 * 0.5, x), (0.2 * 0.5, x1)], x)
    assert all(torch.allclose(after[k], pulled[k], atol=1e-5) for k in x)
    assert all(torch.allclose(pulled[k] - x[k], torch.full_like(x[k], 0.1), atol=1e-3) for k in x)


def test_pair_probability_schedule():
    hub = build_network(COBO, {"local_steps": 2}, num_nodes=2, num_clusters=1)
    s = hub.nodes["n0"].strategy
    assert s.pair_schedule(20) == pytest.approx((2 * 2 / 20, 1.0))
    assert s.pair_schedule(3) == pytest.approx((1.0, 2 * 2 / 3))  # k > 1: one exchange stands for k
    s._steps = 1600  # past the constant phase: min(1, 100/(t+1)) per step, t = 1601, 1602
    assert s.pair_schedule(20) == pytest.approx((100 / 1602 + 100 / 1603, 1.0))
    s.p["schedule"] = "code"  # the authors' shipped run: 1/√t after 800 steps
    assert s.pair_schedule(20) == pytest.approx((1 / math.sqrt(1601) + 1 / math.sqrt(1602), 1.0))


def test_the_mixed_schedule_switches_to_O_1_over_t_after_0_2_percent_of_the_iterations():
    """cobo.txt §4 (Table 1, mixed): O(1/n) for the first 0.2% of the iterations, then O(1/t)
    (the authors' rate min(1, 100/(t+1))); the old schedule kept 2/n until step 800, then 1/√t."""
    hub = build_network(COBO, {"local_steps": 1, "total_steps": 10000}, num_nodes=2, num_clusters=1)
    s = hub.nodes["n0"].strategy
    n = 12
    assert [s.pair_rate(t, n) for t in (1, 20)] == pytest.approx([2 / n, 2 / n])  # 0.2% of 10,000 = 20
    assert s.pair_rate(21, n) == 1.0 and s.pair_rate(99, n) == 1.0  # 100/(t+1) ≥ 1: every pair
    assert s.pair_rate(400, n) == pytest.approx(100 / 401)
    assert s.pair_rate(4000, n) * 4001 == pytest.approx(100)  # O(1/t), not 1/√t
    s._steps = 499
    assert s.pair_schedule(n) == pytest.approx((100 / 501, 1.0))


def test_an_exchange_standing_for_k_pair_updates_moves_both_ends_by_k():
    """S = 6 steps among 3 nodes: the paper would update a pair k = 6·2/3 = 4 times; one exchange
    applies 4·γ⟨·,·⟩ (γ small enough that no clip hides the factor), identically at both ends."""
    params = {"gamma": 0.02, "grad_samples": None, "local_steps": 6}
    hub = build_network(COBO, params, num_nodes=3, num_clusters=3)
    asyncio.run(run_rounds(hub, 1))
    a, b = hub.nodes["n0"], hub.nodes["n1"]

    def W(n, p):
        return hub.nodes[n].strategy.public_state()["W"][p]

    w_ab = W("n0", "n1")
    z = C.lincomb([(0.5, a.learner.get_params()), (0.5, b.snapshot.params)], a.snapshot.params)
    ip = C.dot(a.learner.gradient(z, "train", None)[0], b.learner.gradient(z, "train", None)[0])
    asyncio.run(a.strategy.run_round(2))
    expected = w_ab + 0.02 * 4 * ip
    assert 0.0 < expected < 1.0, (w_ab, ip)  # not clipped: the factor 4 is visible
    assert W("n0", "n1") == pytest.approx(expected, rel=1e-5)
    assert W("n1", "n0") == W("n0", "n1")


def test_in_process_network_disconnects_clusters_and_resumes():
    hub = build_network(COBO, {"gamma": 0.1, "local_steps": 5})
    # 12 rounds: each pair is updated by its smaller id only, at most once a round
    asyncio.run(run_rounds(hub, 12))
    mass, per_node, chance = in_cluster_mass(hub)
    assert mass > 0.9, per_node
    for nid, node in hub.nodes.items():  # symmetric W, out-of-cluster pairs cut (near) to 0
        for p, w in node.strategy.public_state()["W"].items():
            assert w == hub.nodes[p].strategy.public_state()["W"][nid]
            if hub.nodes[p].cluster != node.cluster:
                assert w < 0.05
    s = hub.nodes["n2"].strategy
    s2 = COBO("n2", s.learner, s.net, {"gamma": 0.1, "local_steps": 5}, seed=8)
    s2.load_state_dict(msgpack_roundtrip_state(s.state_dict()))
    assert s2.public_state() == s.public_state()


def test_an_exchange_standing_for_k_updates_draws_k_minibatches_worth_of_samples():
    """k pair updates of the paper each draw a fresh minibatch; one exchange standing for them
    takes its two gradients on ⌈k⌉ × grad_samples samples (one minibatch scaled by k would carry
    k× the noise and throw W between 0 and 1)."""
    hub = build_network(COBO, {"local_steps": 6, "grad_samples": 8}, num_nodes=3, num_clusters=3)
    s = hub.nodes["n0"].strategy
    assert s.pair_schedule(3) == pytest.approx((1.0, 4.0))  # k = 6 · 2/3
    seen = []
    orig = s.net.cross_gradient

    async def recording(peer, params=None, **kw):
        seen.append(kw.get("max_samples"))
        return await orig(peer, params, **kw)

    s.net.cross_gradient = recording
    asyncio.run(s.run_round(1))
    assert seen and set(seen) == {32}
    assert s.align_samples(0.5) == 8 and s.align_samples(1.0) == 8


def test_by_default_cobo_trains_the_nodes_budget_with_the_nodes_optimizer():
    """A node that sets its learner (optimizer, steps per round) and picks COBO trains that budget
    with that optimizer, as under every other strategy: the defaults were 5 plain-SGD steps at
    COBO's own lr 0.1 a round, which left COBO 20 points below local on the demo network."""
    hub = build_network(COBO, None, num_nodes=3, num_clusters=1)
    s = hub.nodes["n0"].strategy
    s.learner.steps_per_round = lambda: 7
    applied = []
    orig = s.learner.apply_gradient

    def counting(grad):
        applied.append(1)
        return orig(grad)

    s.learner.apply_gradient = counting
    asyncio.run(s.run_round(1))
    assert s.public_state()["steps"] == 7
    assert len(applied) == 7  # every gradient step went through the node's optimizer
    assert s.pair_schedule(3) == pytest.approx((1.0, 7 * 2 / 3))  # k counts the same 7 steps


@pytest.mark.parametrize("key,value", [("optimizer", "adam"), ("schedule", "cosine")])
def test_an_unknown_optimizer_or_schedule_is_refused(key, value):
    with pytest.raises(ValueError, match=key):
        build_network(COBO, {key: value}, num_nodes=2, num_clusters=1)


def test_under_noised_releases_an_exchange_releases_one_minibatch():
    """Under DP a batch of ⌈k⌉ minibatches (up to the whole split) gives up subsampling's
    amplification: on a 4-node network at 20 steps a round the first release exceeded a peer's
    share of the budget and COBO never moved a pair weight. One minibatch per release instead."""
    hub = build_network(COBO, {"local_steps": 6, "grad_samples": 8}, num_nodes=3, num_clusters=3)
    hub.noised = True
    s = hub.nodes["n0"].strategy
    seen = []
    orig = s.net.private_gradient

    async def recording(peer, params, **kw):
        seen.append(kw.get("max_samples"))
        return await orig(peer, params, **kw)

    s.net.private_gradient = recording
    asyncio.run(s.run_round(1))
    assert seen and set(seen) == {8}


# --- the warm phase fitted to the node's planned run (issue 33) ---


def _cobo_node(tmp_path, rounds, params=None):
    """A COBO node daemon as the node builds it (in-process transport; not started)."""
    from coterie.node.config import validate_config
    from tests.transports import NodeMaker

    cfg = validate_config(
        {
            "node_id": "n0",
            "state_dir": str(tmp_path / "n0"),
            "strategy": "cobo",
            "strategy_params": params or {},
            "rounds": rounds,
            "learner": {
                "dataset": "gaussian",
                "partition": "iid",
                "num_nodes": 2,
                "node_index": 0,
                "model": "linear",
                "local_steps": 10,
            },
        }
    )
    return NodeMaker("inproc")(cfg)


@pytest.mark.parametrize(
    "rounds,params,total,early_rate",
    [
        (15, None, 150, 1.0),  # planned: 15 rounds × 10 steps; 0.2 % of 150 < 1 step: O(1/t) from step 1
        (15, {"total_steps": 40000}, 40000, 2 / 8),  # an explicit total_steps wins: the constant 2/n to step 80
        (None, None, 40000, 2 / 8),  # no planned end (runs until stopped): the paper's 40,000, as before
    ],
)
def test_the_warm_phase_is_a_share_of_the_run_the_node_plans(tmp_path, rounds, params, total, early_rate):
    """cobo.txt §4: the constant rate for "the initial 0.2 % of iterations". Pinned at the paper's
    40,000, a node planning 150 steps spent 80 of them at the constant rate."""
    node = _cobo_node(tmp_path, rounds, params)
    try:
        s = node.strategy
        assert s.planned_rounds == rounds
        assert s.public_state()["total_steps"] == total
        assert [s.pair_rate(t, 8) for t in (1, 80)] == pytest.approx([early_rate, early_rate])
        assert s.pair_rate(81, 8) == 1.0  # min(1, 100/82) after the warm phase in every case
    finally:
        node.store.unlock()


@pytest.mark.parametrize("value", [0, -150, 0.0, True, "150"])
def test_a_total_steps_that_is_not_a_positive_number_is_refused(value):
    with pytest.raises(ValueError, match="total_steps"):
        build_network(COBO, {"total_steps": value}, num_nodes=2, num_clusters=1)


@pytest.mark.parametrize("value", [-0.1, 1.5, "0.002"])
def test_a_warm_fraction_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match="warm_fraction"):
        build_network(COBO, {"warm_fraction": value}, num_nodes=2, num_clusters=1)


@pytest.mark.parametrize("rounds", [-1, 2.5, True, "15"])
def test_a_planned_run_that_is_not_a_round_count_is_refused(rounds):
    s = build_network(COBO, None, num_nodes=2, num_clusters=1).nodes["n0"].strategy
    with pytest.raises(ValueError, match="planned rounds"):
        s.plan_run(rounds)
    assert s.planned_rounds is None and s.total_steps() == 40000


def test_with_the_planned_run_w_separates_clusters_within_a_short_run():
    """Two label-permuted clusters of 3, 10 rounds × 5 steps: with the warm phase a share of those
    50 steps every pair is updated every step (the O(1/t) rate is 1 until step 99) and the
    cross-cluster weights fall below 0.6; pinned to 40,000 the whole run is warm phase (rate 2/6)
    and they stay above 0.7."""

    def cross_w(params):
        hub = build_network(COBO, params, num_nodes=6, num_clusters=2)
        for node in hub.nodes.values():
            node.strategy.plan_run(10)
        asyncio.run(run_rounds(hub, 10))
        return [
            w
            for n in hub.nodes.values()
            for p, w in n.strategy.public_state()["W"].items()
            if hub.nodes[p].cluster != n.cluster
        ]

    planned, pinned = cross_w({"local_steps": 5}), cross_w({"local_steps": 5, "total_steps": 40000})
    assert max(planned) < 0.6, planned
    assert min(pinned) > 0.7, pinned
