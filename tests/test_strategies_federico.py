"""FedeRiCo (federico.txt §2.2, Alg. 1): EMA over every entry with the kept losses (Alg. 1 l.11/14), softmax over all known incl.
self, pushed weighted gradients, staleness, mixture prediction; in-process network."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from coterie.node.strategies.base import PushedGradient
from coterie.node.strategies.federico import FedeRiCo, federico_combine, federico_ema, federico_mix, federico_weights
from tests.strategy_harness import build_network, in_cluster_mass, msgpack_roundtrip_state, run_rounds

torch.set_num_threads(1)


def test_ema_updates_every_entry_with_the_kept_losses():
    """Alg. 1 l.11: ℓ_ij kept from the last round; l.14: every L̂_ij moves towards its ℓ_ij, not
    only the sampled ones (an unsampled peer's estimate keeps converging to its last loss)."""
    L = {"me": 0.0, "a": 0.0, "b": 1.0, "c": 2.0, "d": 0.0}
    last = {"me": 0.4, "a": 3.0, "b": 1.5, "c": 0.5}  # d never seen: ℓ = 0 (l.3)
    out, loss = federico_ema(L, last, {"me": 0.5, "a": 2.0, "c": 1.0}, beta=0.6)
    assert loss == {"me": 0.5, "a": 2.0, "b": 1.5, "c": 1.0, "d": 0.0}
    assert out == {
        "me": pytest.approx(0.3),
        "a": pytest.approx(1.2),
        "b": pytest.approx(0.4 * 1.0 + 0.6 * 1.5),  # unsampled: towards its kept loss
        "c": pytest.approx(1.4),
        "d": 0.0,
    }
    assert L["a"] == 0.0 and last["a"] == 3.0  # pure
    # repeated rounds without sampling b: L̂_b converges to b's last loss (the old rule froze it at 1.0)
    for _ in range(30):
        out, loss = federico_ema(out, loss, {}, beta=0.6)
    assert out["b"] == pytest.approx(1.5, abs=1e-6)


def test_softmax_over_all_known_including_unsampled():
    w = federico_weights({"me": 0.3, "a": 1.2, "b": 1.0, "c": 1.4})
    z = sum(math.exp(-v) for v in (0.3, 1.2, 1.0, 1.4))
    assert w == {
        "me": pytest.approx(math.exp(-0.3) / z),
        "a": pytest.approx(math.exp(-1.2) / z),
        "b": pytest.approx(math.exp(-1.0) / z),
        "c": pytest.approx(math.exp(-1.4) / z),
    }
    assert sum(w.values()) == pytest.approx(1.0)


def test_combine_own_weighted_plus_received():
    g = {"w": torch.tensor([1.0, 2.0])}
    out = federico_combine(g, 0.5, [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, -3.0])}])
    assert torch.allclose(out["w"], torch.tensor([1.5, -2.0]))


def test_initial_state_is_uniform_and_zero():
    hub = build_network(FedeRiCo, num_nodes=4, num_clusters=2)
    s = hub.nodes["n0"].strategy
    assert s.weights() == {k: pytest.approx(0.25) for k in ("n0", "n1", "n2", "n3")}  # w = 1/K
    assert s.public_state()["ema_loss"] == {k: 0.0 for k in ("n0", "n1", "n2", "n3")}  # L̂ = 0


def test_one_round_reference():
    """n0 samples 2 of 4 peers; only those (and self) move in L̂; pushes carry w_0b ∇L_0(θ_b)."""
    params = {"num_neighbours": 2, "eps": 0.0, "grad_samples": None, "own_loss": "track"}
    hub = build_network(FedeRiCo, params, num_nodes=5, num_clusters=1)
    n0 = hub.nodes["n0"]
    L_before = dict(n0.strategy._L)
    L_model0 = n0.learner.get_params()
    asyncio.run(n0.strategy.run_round(1))
    contacted = set(k for k, v in n0.strategy._loss.items() if k != "n0" and v != 0.0)
    assert len(contacted) == 2 and set(n0.strategy._loss) == {"n0", "n1", "n2", "n3", "n4"}
    # loss reference: mean loss of the peer's snapshot on n0's whole train split; L̂ starts at the
    # first measured loss (untried = "skip"), my own model's measured like the peers' (eq. 3)
    for p in contacted:
        ref = n0.learner.loss(hub.nodes[p].snapshot.params, "train").loss
        assert n0.strategy._L[p] == pytest.approx(ref, rel=1e-5)
    assert n0.strategy._L["n0"] == pytest.approx(n0.learner.loss(L_model0, "train").loss, rel=1e-5)
    for p in set(L_before) - contacted - {"n0"}:
        assert n0.strategy._L[p] == 0.0
    w = n0.strategy.weights()
    # the E-step over the measured models only; the untried peers get no weight before evidence
    assert w == pytest.approx(
        {
            **federico_weights({k: n0.strategy._L[k] for k in contacted | {"n0"}}),
            **{p: 0.0 for p in set(L_before) - contacted - {"n0"}},
        }
    )
    for p in contacted:
        (pg,) = hub.nodes[p].inbox
        assert pg.sender == "n0" and pg.version == hub.nodes[p].snapshot.version
        g_ref, _ = n0.learner.gradient(hub.nodes[p].snapshot.params, "train", None)
        for k in g_ref:
            assert torch.allclose(pg.grad[k], w[p] * g_ref[k], atol=1e-6)


def test_receiver_applies_own_plus_received_and_drops_stale():
    params = {"num_neighbours": 0, "grad_samples": None, "max_staleness": 2, "push_norm_factor": 1e9}
    hub = build_network(FedeRiCo, params, num_nodes=2, num_clusters=1, learner_kw={"lr": 0.1})
    n0 = hub.nodes["n0"]
    s = n0.strategy
    theta = n0.learner.get_params()
    push = {k: torch.ones_like(v) for k, v in theta.items()}
    n0.inbox = [PushedGradient("n1", 10, push), PushedGradient("n1", 7, push)]  # 7 < 10 − 2: stale
    g_own, _ = n0.learner.gradient(theta, "train", None)
    asyncio.run(s.run_round(1))
    w_self = s.weights()["n0"]
    after = n0.learner.get_params()
    for k in theta:  # plain SGD, lr 0.1: θ − 0.1 (w_ii g_own + 1·push)
        assert torch.allclose(after[k], theta[k] - 0.1 * (w_self * g_own[k] + push[k]), atol=1e-6)
    assert s.public_state()["pushed_dropped"] == 1 and s.public_state()["pushed_applied"] == 1


def _same_cluster_mass(hub, nid):
    """Σ w on nid's same-cluster peers, and what uniform weights would give them."""
    w = hub.nodes[nid].strategy.weights()
    same = [k for k in w if k != nid and hub.nodes[k].cluster == hub.nodes[nid].cluster]
    return sum(w[k] for k in same), len(same) / len(w)


def test_the_own_loss_is_measured_so_a_sharp_temperature_still_collaborates():
    """The container testbed's FedeRiCo (T = 0.2, losses on the validation split): with Alg. 1's
    literal ℓ_ii = 0 ("prior") a same-cluster peer with mean loss ~1 gets exp(−L/T) ≈ 0.7% of the
    own weight, w_ii ≈ 1 and nobody collaborates; with the own model's loss measured like the
    peers' ("track", eq. 3) every node puts more than chance on its same-cluster peers."""
    params = {"local_steps": 10, "temperature": 0.2, "loss_split": "val", "grad_samples": None}
    for mode in ("track", "prior"):
        hub = build_network(
            FedeRiCo,
            {**params, "own_loss": mode},
            num_nodes=6,
            num_clusters=2,
            learner_kw={"lr": 0.05},
            data_kw={"noise": 2.5},
        )  # losses ~1, as on mnist1d
        asyncio.run(run_rounds(hub, 8))
        for nid in hub.nodes:
            mass, chance = _same_cluster_mass(hub, nid)
            assert (mass > chance) is (mode == "track"), (mode, nid, mass, chance, hub.nodes[nid].strategy.weights())
        if mode == "prior":
            assert min(n.strategy.weights()[k] for k, n in hub.nodes.items()) > 0.9  # w_ii ≈ 1


def test_untried_peers_do_not_swallow_the_own_weight():
    """With the own loss measured and the paper's summed loss, Alg. 1's L̂ = 0 start makes every
    untried peer look better than anything measured: after round 1 w_ii ≈ 0 ("optimistic"), so my
    data stops training my model. Untried peers get no weight until measured ("skip"), L̂ starts
    at the first measurement, and sampling tries the untried first (the exploration Alg. 1's
    zero start was for)."""
    base = {"num_neighbours": 2, "eps": 0.0, "grad_samples": None, "loss_reduction": "sum", "own_loss": "track"}
    for untried in ("skip", "optimistic"):
        hub = build_network(FedeRiCo, {**base, "untried": untried}, num_nodes=5, num_clusters=1)
        s = hub.nodes["n0"].strategy
        asyncio.run(s.run_round(1))
        w = s.weights()
        if untried == "optimistic":
            assert w["n0"] < 1e-3, w
            continue
        tried = {k for k in w if k != "n0" and w[k] > 0}
        assert len(tried) == 2 and w["n0"] > 1e-3 and sum(w.values()) == pytest.approx(1.0)
        assert all(w[k] == 0.0 for k in set(w) - tried - {"n0"})
        asyncio.run(s.run_round(2))  # ε = 0: the greedy pick is the two never tried
        assert all(s.weights()[k] > 0 for k in ("n1", "n2", "n3", "n4")), s.weights()


def test_m_steps_follow_the_learners_budget_by_default():
    """local_steps None: as many M-steps a round as the node's local training takes (one step a
    round against local's ten made FedeRiCo lose to local on bench/own_data.py)."""
    hub = build_network(FedeRiCo, {"num_neighbours": 0, "grad_samples": None}, num_nodes=2, num_clusters=1)
    n0 = hub.nodes["n0"]
    n0.learner.steps_per_round = lambda: 4  # type: ignore[method-assign]
    steps = []
    real = n0.learner.apply_gradient
    n0.learner.apply_gradient = lambda g: (steps.append(1), real(g))  # type: ignore[method-assign]
    asyncio.run(n0.strategy.run_round(1))
    assert len(steps) == 4


def _norm(p):
    return math.sqrt(sum(float((v**2).sum()) for v in p.values()))


def test_pushes_reach_every_local_step_not_only_the_first():
    """Alg. 1 l.24 at every M-step of the round: θ_{s+1} = θ_s − η (w_ii ∇L(θ_s) + Σ pushes)."""
    params = {"num_neighbours": 0, "grad_samples": None, "local_steps": 3, "push_norm_factor": 1e9}
    hub = build_network(FedeRiCo, params, num_nodes=2, num_clusters=1, learner_kw={"lr": 0.1})
    n0 = hub.nodes["n0"]
    theta = n0.learner.get_params()
    push = {k: 0.01 * torch.ones_like(v) for k, v in theta.items()}
    n0.inbox = [PushedGradient("n1", 1, push)]
    asyncio.run(n0.strategy.run_round(1))
    w_self = n0.strategy.weights()["n0"]
    ref = dict(theta)
    for _ in range(3):  # full-batch gradients: the reference is exact
        g, _ = n0.learner.gradient(ref, "train", None)
        ref = {k: ref[k] - 0.1 * (w_self * g[k] + push[k]) for k in ref}
    after = n0.learner.get_params()
    for k in theta:
        assert torch.allclose(after[k], ref[k], atol=1e-5)


def test_a_stream_of_pushes_moves_the_model_no_more_than_one_honest_push():
    """200 valid-looking pushes from one peer in one round (each 1000× an honest gradient): one is
    applied, clipped to push_norm_factor × ‖own gradient‖; the model moves no more than an honest
    peer's single push of that size can move it."""
    params = {"num_neighbours": 0, "grad_samples": None, "local_steps": 1}
    moves = {}
    for case in ("honest", "flood"):
        hub = build_network(FedeRiCo, params, num_nodes=3, num_clusters=1, learner_kw={"lr": 0.1})
        n0 = hub.nodes["n0"]
        theta = n0.learner.get_params()
        g_own, _ = n0.learner.gradient(theta, "train", None)
        limit = 2.0 * _norm(g_own)
        honest = {k: v * (limit / _norm(g_own)) for k, v in g_own.items()}  # the largest honest push
        if case == "honest":
            n0.inbox = [PushedGradient("n1", 1, honest)]
        else:
            n0.inbox = [PushedGradient("n1", 1, {k: 1000 * v for k, v in g_own.items()}) for _ in range(200)]
        asyncio.run(n0.strategy.run_round(1))
        after = n0.learner.get_params()
        moves[case] = _norm({k: after[k] - theta[k] for k in theta})
        st = n0.strategy.public_state()
        assert st["pushed_applied"] == 1
    assert st["pushed_dropped"] == 199
    assert moves["flood"] <= moves["honest"] * (1 + 1e-4)


def test_pushes_per_round_are_capped():
    params = {"num_neighbours": 0, "grad_samples": None, "max_pushes": 2, "push_norm_factor": 1e9}
    hub = build_network(FedeRiCo, params, num_nodes=5, num_clusters=1)
    n0 = hub.nodes["n0"]
    theta = n0.learner.get_params()
    n0.inbox = [
        PushedGradient(f"n{i}", 1, {k: 0.01 * torch.ones_like(v) for k, v in theta.items()}) for i in range(1, 5)
    ]
    asyncio.run(n0.strategy.run_round(1))
    assert n0.strategy.public_state()["pushed_applied"] == 2
    assert n0.strategy.public_state()["pushed_dropped"] == 2


def test_mixture_prediction_uses_cached_peer_models():
    hub = build_network(FedeRiCo, num_nodes=3, num_clusters=1)
    asyncio.run(run_rounds(hub, 2))
    n0 = hub.nodes["n0"]
    w = n0.strategy.weights()
    members = [(w["n0"], n0.learner.get_params())] + [(w[p], hub.nodes[p].snapshot.params) for p in ("n1", "n2")]
    ref = n0.learner.evaluate_mixture(members, "test")
    out = n0.strategy.evaluate()
    assert out["test_acc"] == pytest.approx(ref.accuracy)
    assert out["test_loss"] == pytest.approx(ref.loss, rel=1e-5)
    assert out["mixture_members"] == 3


def test_in_process_network_finds_clusters_and_resumes():
    hub = build_network(FedeRiCo, {"local_steps": 5}, num_nodes=6, num_clusters=2)
    asyncio.run(run_rounds(hub, 20))
    mass, per_node, chance = in_cluster_mass(hub)
    assert mass > 0.65 and min(per_node) > chance, (mass, per_node)
    s = hub.nodes["n0"].strategy
    st = msgpack_roundtrip_state(s.state_dict())
    s2 = FedeRiCo("n0", s.learner, s.net, {"local_steps": 5}, seed=99)
    s2.load_state_dict(st)
    assert s2.weights() == pytest.approx(s.weights())
    assert s2.public_state() == s.public_state()


def test_a_sampled_peer_that_never_answers_gets_no_weight_until_it_does():
    """Alg. 1's L̂ = 0 start makes untried peers look best (exploration); a peer that was tried and
    sent nothing back (dead, or its snapshot too slow to arrive) must not keep that optimism: it
    would hold all the weight while no evidence about it ever arrives."""
    params = {"num_neighbours": 3, "eps": 0.0, "grad_samples": None}
    hub = build_network(FedeRiCo, params, num_nodes=4, num_clusters=1)
    s = hub.nodes["n0"].strategy
    real_pull = s.net.pull

    async def pull(peer, **kw):
        return None if peer == "n1" and blocked else await real_pull(peer, **kw)

    s.net.pull = pull
    blocked = True
    asyncio.run(s.run_round(1))
    w = s.weights()
    assert w["n1"] == 0.0 and s._L["n1"] == 0.0  # tried, nothing came back: no weight (L̂ still 0)
    assert min(w[p] for p in ("n0", "n2", "n3")) > 0 and sum(w.values()) == pytest.approx(1.0)
    blocked = False
    asyncio.run(s.run_round(2))  # ε = 0: n1 is only tried again because M = 3 takes every peer
    assert s.weights()["n1"] > 0.0 and s._L["n1"] > 0.0  # it answered: evidence, and weight again


def test_the_default_own_loss_keeps_pushes_from_pulling_clusters_together():
    """12 nodes in 4 label-permuted clusters. With the own loss measured ("track", the default
    until the S1 multi-seed sweep) every loss starts alike, so weights start near uniform and the
    11 peers' pushes outweigh a node's own gradient: the models pull together and FedeRiCo ends
    below local training (S1: 3 of 3 seeds). Alg. 1's literal ℓ_ii = 0 ("prior", now the default)
    anchors each node on its own gradient until its cluster-mates' models earn their weight."""
    from coterie.node.strategies.baselines import Local

    def accuracy(cls, params):
        hub = build_network(cls, params, num_nodes=12, num_clusters=4, learner_kw={"lr": 0.05}, data_kw={"noise": 2.5})
        asyncio.run(run_rounds(hub, 15))
        return sum(n.learner.evaluate("test").accuracy for n in hub.nodes.values()) / len(hub.nodes)

    local = accuracy(Local, {})
    default = accuracy(FedeRiCo, {"local_steps": 10})
    track = accuracy(FedeRiCo, {"local_steps": 10, "own_loss": "track"})
    assert default >= local - 0.01, (default, local)
    assert track < local - 0.03, (track, local)  # the failure mode the default avoids


def test_mix_of_sampled_models_weights_them_by_the_estep():
    own = {"w": torch.tensor([1.0, 0.0])}
    a, b = {"w": torch.tensor([0.0, 2.0])}, {"w": torch.tensor([4.0, 4.0])}
    out = federico_mix(own, 0.5, [(0.25, a), (0.0, b)])  # b's zero weight: not mixed in
    assert torch.allclose(out["w"], (0.5 * own["w"] + 0.25 * a["w"]) / 0.75)
    assert federico_mix(own, 0.0, [(0.0, a)]) is own  # no weight anywhere: my own model


def test_under_dp_noise_the_peer_terms_come_from_published_models_and_nothing_is_released():
    """``peer_term = "auto"`` with noised releases (privacy on, the node default): a push there is
    ~98% noise (bench/push_snr.py), so the M-step takes its peer terms from the sampled peers'
    published models — one E-step-weighted mixing step, then the local steps — and releases
    nothing computed on my data. On the old code the round pushed a DP gradient to every sampled
    peer and applied the noisy pushes it received."""
    params = {"num_neighbours": 2, "eps": 0.0, "grad_samples": None, "local_steps": 1}
    hub = build_network(FedeRiCo, params, num_nodes=5, num_clusters=1, learner_kw={"lr": 0.1})
    hub.noised = True
    for i in range(1, 5):  # peers that have trained apart from n0 (the harness starts everyone at θ⁰)
        peer = hub.nodes[f"n{i}"]
        peer.learner.train(steps=3 * i)
        hub.publish(peer.node_id, 1)
    n0 = hub.nodes["n0"]
    s = n0.strategy
    theta = n0.learner.get_params()
    n0.inbox = [PushedGradient("n1", 0, {k: 1e3 * torch.ones_like(v) for k, v in theta.items()})]
    first_step: list = []  # the parameters the round's first gradient step starts from
    step = n0.learner.apply_gradient

    def recording_step(g):
        if not first_step:
            first_step.append(n0.learner.get_params())
        step(g)

    n0.learner.apply_gradient = recording_step
    asyncio.run(s.run_round(1))
    assert hub.calls.get("private_gradient", 0) == 0 and hub.calls.get("push", 0) == 0
    assert s.public_state()["peer_term"] == "model" and s.public_state()["pushed_applied"] == 0
    assert n0.inbox == []  # the noisy push was drained, not applied
    w = s.weights()
    sampled = [p for p in w if p != "n0" and w[p] > 0]
    assert len(sampled) == 2
    ref = federico_mix(theta, w["n0"], [(w[p], hub.nodes[p].snapshot.params) for p in sampled])
    for k in theta:  # the local step ran on the mix of me and the two sampled models
        assert torch.allclose(first_step[0][k], ref[k], atol=1e-6)
        assert not torch.allclose(first_step[0][k], theta[k])
    # exact releases (privacy off, the papers' setting): the same round pushes, as Alg. 1 does
    hub2 = build_network(FedeRiCo, params, num_nodes=5, num_clusters=1)
    asyncio.run(hub2.nodes["n0"].strategy.run_round(1))
    assert hub2.calls.get("push", 0) == 2 and hub2.nodes["n0"].strategy.public_state()["peer_term"] == "push"


@pytest.mark.parametrize(
    "key,value",
    [("peer_term", "gradients"), ("own_loss", "measured"), ("untried", "pessimistic"), ("loss_reduction", "max")],
)
def test_a_choice_parameter_must_be_one_of_its_values(key, value):
    """A misspelt choice is refused with its name (own_loss and untried used to fall through their
    if-branches silently, as if some other value had been set)."""
    with pytest.raises(ValueError, match=f"{key} must be one of"):
        build_network(FedeRiCo, {key: value}, num_nodes=2, num_clusters=1)
