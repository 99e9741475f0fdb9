"""SCool (scool.txt App. C–E): the SBM E-step (eqs. 43–48) against a direct numpy transcription,
the attention E-step (eq. 29), update mixing, exact M-step, Ω/encoder gossip; in-process network."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from coterie.node.persistence import pack_state, unpack_state
from coterie.node.strategies import common as C
from coterie.node.strategies.scool import (
    SCoolAttention,
    SCoolSBM,
    attention_estep,
    attention_weights,
    estimate_num_blocks,
    evidence_matrix,
    row_with_self,
    sbm_alpha_mstep,
    sbm_B_mstep,
    sbm_estep_node,
    sbm_node_stats,
    sbm_self_weight,
)
from tests.strategy_harness import (
    assert_encoder_resumes,
    build_network,
    in_cluster_mass,
    msgpack_roundtrip_state,
    run_rounds,
)

torch.set_num_threads(1)


def _digamma(x):
    return torch.special.digamma(torch.as_tensor(x, dtype=torch.float64)).numpy()


def reference_estep(Y, Om, B, alpha, tau):
    """Eqs. 43–48 transcribed over the whole graph, with explicit sums over g, h (self pairs
    excluded: Y_ii is not evidence of cooperation)."""
    K, G = Om.shape
    W = np.zeros((K, K))
    for i in range(K):
        for j in range(K):
            if i == j:
                continue
            w_hat = Y[i, j]
            for g in range(G):
                for h in range(G):
                    w_hat += Om[i, g] * Om[j, h] * np.log(B[g, h])  # eq. 43
                    w_hat -= Om[i, g] * Om[j, h] * np.log(1 - B[g, h])
            W[i, j] = 1.0 / (1.0 + np.exp(-w_hat / tau))  # eq. 44 (temperature, App. C.1)
    gamma = Om + alpha[None, :]  # eq. 46
    Om_new = np.zeros_like(Om)
    for i in range(K):
        logit = np.zeros(G)
        for k in range(G):
            s = 0.0
            for j in range(K):
                if j == i:
                    continue
                for h in range(G):
                    s += W[i, j] * Om[j, h] * np.log(B[k, h])
                    s += W[j, i] * Om[j, h] * np.log(B[h, k])
                    s += (1 - W[i, j]) * Om[j, h] * np.log(1 - B[k, h])
                    s += (1 - W[j, i]) * Om[j, h] * np.log(1 - B[h, k])
            logit[k] = s + _digamma(gamma[i, k]) - _digamma(gamma[i].sum())  # eq. 47–48
        e = np.exp(logit - logit.max())
        Om_new[i] = e / e.sum()  # normalised (after eq. 48)
    return W, gamma, Om_new


@pytest.mark.parametrize("G,tau,asym", [(2, 1.0, False), (3, 2.0, True)])
def test_sbm_estep_matches_numpy_transcription(G, tau, asym):
    rng = np.random.default_rng(G)
    K = 5
    Y = -rng.exponential(1.0, size=(K, K))
    Om = rng.dirichlet(np.ones(G), size=K)
    B = np.full((G, G), 0.2) + 0.6 * np.eye(G)
    if asym:
        B[0, 1] = 0.35  # B need not be symmetric in eq. 48
    alpha = rng.uniform(0.5, 2.0, size=G)
    W, gamma, Om_new = reference_estep(Y, Om, B, alpha, tau)
    ids = [f"n{k}" for k in range(K)]
    for i in range(K):
        Yi = {ids[j]: Y[i, j] for j in range(K) if j != i}
        oms = {ids[j]: Om[j] for j in range(K) if j != i}
        w_in = {ids[j]: W[j, i] for j in range(K) if j != i}
        w, g, o = sbm_estep_node(Yi, Om[i], oms, w_in, B, alpha, tau)
        assert np.allclose([w[ids[j]] for j in range(K) if j != i], [W[i, j] for j in range(K) if j != i])
        assert np.allclose(g, gamma[i])
        assert np.allclose(o, Om_new[i], atol=1e-10)


def test_row_normalisation_with_self():
    row = row_with_self({"a": 0.5, "b": 0.25, "me": 7.0}, "me")
    assert row == {"me": pytest.approx(1 / 1.75), "a": pytest.approx(0.5 / 1.75), "b": pytest.approx(0.25 / 1.75)}


def test_attention_estep_eq29():
    y = np.array([-0.5, -0.2, -3.0])
    logits = np.array([1.0, 0.5, -0.5])
    p = np.exp(logits) / np.exp(logits).sum()
    ref = np.exp(y / 2.0) * p
    assert np.allclose(attention_weights(y, logits, 2.0), ref / ref.sum())


def test_prior_msteps_from_per_node_terms_match_the_graph_sums():
    """Eq. 52 (B) and eq. 50 (α) transcribed over the whole graph equal the M-steps computed from
    the sum of the per-node terms each node can compute alone."""
    rng = np.random.default_rng(3)
    K, G = 5, 3
    Om = rng.dirichlet(np.ones(G), size=K)
    W = rng.uniform(size=(K, K))
    gamma = Om + 0.7
    ids = [f"n{i}" for i in range(K)]
    B0 = np.full((G, G), 0.3)
    num, den = np.zeros((G, G)), np.zeros((G, G))
    for i in range(K):
        for j in range(K):
            if i != j:
                for g in range(G):
                    for h in range(G):
                        num[g, h] += W[i, j] * Om[i, g] * Om[j, h]
                        den[g, h] += Om[i, g] * Om[j, h]
    stats = [
        sbm_node_stats(
            {ids[j]: W[i, j] for j in range(K) if j != i}, Om[i], {ids[j]: Om[j] for j in range(K) if j != i}, gamma[i]
        )
        for i in range(K)
    ]
    N, D = sum(st["N"] for st in stats), sum(st["D"] for st in stats)
    np.testing.assert_allclose(sbm_B_mstep(N, D, B0), num / den)
    np.testing.assert_allclose(sbm_B_mstep(N / K, D / K, B0), num / den)  # network means do too
    alpha = np.array([0.5, 1.0, 2.0])
    s_ref = sum(_digamma(gamma[i]) - _digamma(gamma[i].sum()) for i in range(K))
    grad = s_ref - K * _digamma(alpha) + K * _digamma(alpha.sum())
    np.testing.assert_allclose(
        sbm_alpha_mstep(alpha, sum(st["s"] for st in stats), K, 0.01), np.maximum(alpha + 0.01 * grad, 1e-3)
    )


def test_learned_prior_tracks_the_network_by_gossip():
    """learn_B/learn_alpha: the tracked estimates always sum to the sum of the current per-node
    terms (pairwise exchanges move both ends by opposite amounts), and every node's B ends near
    the B of eq. 24 computed from the whole graph."""
    hub = build_network(
        SCoolSBM,
        {"learn_B": True, "learn_alpha": True, "prune_after": 0},
        num_nodes=6,
        num_clusters=2,
        learner_kw={"local_steps": 20},
    )
    asyncio.run(run_rounds(hub, 10))
    strategies = [n.strategy for n in hub.nodes.values()]
    for k in ("N", "D", "s"):
        est = sum(s._est[k] for s in strategies)
        mine = sum(s._mine[k] for s in strategies)
        np.testing.assert_allclose(est, mine, rtol=1e-4, atol=1e-4)
    B_graph = sbm_B_mstep(sum(s._mine["N"] for s in strategies), sum(s._mine["D"] for s in strategies), strategies[0].B)
    for s in strategies:
        assert np.abs(s.B - B_graph).max() < 0.05, (s.B, B_graph)
        assert not np.allclose(s.B, [[0.8, 0.2], [0.2, 0.8]])  # it moved
        assert not np.allclose(s.alpha, 1.0)
    s = strategies[0]
    before = {k: v.copy() for k, v in s._est.items()}
    for bad in (
        {"N": [1.0] * 3, "D": [1.0] * 4, "s": [0.0] * 2},  # wrong size
        {"N": [float("nan")] * 4, "D": [1.0] * 4, "s": [0.0] * 2},  # not finite
        "garbage",
    ):
        assert "omega" in s.on_gossip("n1", "omega", {"omega": [0.5, 0.5], "stats": bad, "mix": 0.5})
    assert all(np.array_equal(s._est[k], before[k]) for k in before)
    s2 = SCoolSBM(s.node_id, s.learner, s.net, s.p, seed=77)
    s2.load_state_dict(unpack_state(pack_state(s.state_dict())))
    assert np.array_equal(s2.B, s.B) and np.array_equal(s2.alpha, s.alpha)
    assert all(np.array_equal(s2._est[k], s._est[k]) for k in s._est)


def test_mixing_round_matches_reference():
    """Round 2 aggregates iteration 1 (App. C.1): θ^2 = θ^1 − Σ_j w̄_ij Δθ_j^1 with the peers'
    published deltas of round 1, then trains from θ^2 and publishes that round's Δθ."""
    hub = build_network(SCoolSBM, {"prune_after": 0}, num_nodes=4, num_clusters=2)
    asyncio.run(run_rounds(hub, 1))  # every node trains and publishes a delta
    n0 = hub.nodes["n0"]
    base, own = n0.strategy._base, n0.strategy._delta
    deltas = {p: hub.nodes[p].snapshot.extras["delta"] for p in ("n1", "n2", "n3")}
    torch.manual_seed(5)
    rep = asyncio.run(n0.strategy.run_round(2))
    row = n0.strategy.weights()
    assert sum(row.values()) == pytest.approx(1.0) and set(row) == {"n0", "n1", "n2", "n3"}
    ref = C.mix_updates(base, [(row["n0"], own)] + [(row[p], deltas[p]) for p in deltas])
    for k in ref:
        assert torch.allclose(n0.strategy._base[k], ref[k], atol=1e-6)  # what round 2 trained from
    assert rep.info["same_round"] == 3 and rep.info["of_round"] == 1
    after = n0.learner.get_params()
    d = n0.strategy.published_extras()["delta"]
    assert all(torch.allclose(d[k], ref[k] - after[k], atol=1e-6) for k in ref)
    # Ω was exchanged with every peer, both ways
    assert set(n0.strategy._omegas) == {"n1", "n2", "n3"}
    assert "n0" in hub.nodes["n1"].strategy._omegas


def test_sbm_in_process_network_prunes_to_cluster_and_resumes():
    hub = build_network(SCoolSBM, learner_kw={"local_steps": 20})
    asyncio.run(run_rounds(hub, 12))
    mass, per_node, chance = in_cluster_mass(hub)
    assert mass > 0.8 and min(per_node) > chance, per_node
    for node in hub.nodes.values():  # pruned after round 10 to the top 20% = 1 peer, in-cluster
        (kept,) = node.strategy._kept
        assert hub.nodes[kept].cluster == node.cluster
    calls = dict(hub.calls)
    asyncio.run(run_rounds(hub, 1, start=13))
    assert hub.calls["cross_loss"] - calls["cross_loss"] == 6  # one kept peer each
    s = hub.nodes["n0"].strategy
    s2 = SCoolSBM("n0", s.learner, s.net, seed=77)
    s2.load_state_dict(msgpack_roundtrip_state(s.state_dict()))
    assert s2.public_state() == s.public_state()


def test_sbm_does_not_prune_peers_it_has_not_met():
    """A node that met no peer by round T0 (here: offered none for 11 rounds, as a slow starter on a
    loaded network is) must not prune everyone it has not scored: it keeps collaborating once it
    meets them, and prunes among them (seen on real daemons: n0 pruned all its peers for good)."""
    hub = build_network(SCoolSBM, learner_kw={"local_steps": 5})
    s0 = hub.nodes["n0"].strategy
    offered = s0.candidates
    s0.candidates = lambda: []  # type: ignore[method-assign]
    asyncio.run(run_rounds(hub, 11))
    assert s0._t >= 10 and s0._kept is None, (s0._t, s0._kept)
    s0.candidates = offered  # type: ignore[method-assign]
    asyncio.run(run_rounds(hub, 3, start=12))
    assert s0._kept, "n0 pruned to nobody, or never pruned, once it met its peers"
    assert set(s0._kept) <= set(hub.nodes) - {"n0"}


def test_exact_mstep_matches_reference():
    """mstep="exact" (eq. 22): θ ← θ − η(w̄_ii ∇L(D_i;θ) + Σ_j w̄_ij ∇L(D_j;θ)), the peers'
    gradients computed by them on their data (cross-gradient requests)."""
    hub = build_network(
        SCoolSBM,
        {"mstep": "exact", "exact_steps": 1, "grad_samples": None, "prune_after": 0},
        num_nodes=4,
        num_clusters=2,
        learner_kw={"lr": 0.2},
    )
    asyncio.run(run_rounds(hub, 1))
    n0 = hub.nodes["n0"]
    theta = n0.learner.get_params()
    before = hub.calls.get("cross_gradient", 0)
    asyncio.run(n0.strategy.run_round(2))
    assert hub.calls["cross_gradient"] - before == 3
    row = n0.strategy.weights()
    grads = {"n0": n0.learner.gradient(theta, "train", None)[0]}
    grads.update({p: hub.nodes[p].learner.gradient(theta, "train", None)[0] for p in ("n1", "n2", "n3")})
    after = n0.learner.get_params()
    for k in theta:
        ref = theta[k] - 0.2 * sum(row[p] * grads[p][k] for p in grads)
        assert torch.allclose(after[k], ref, atol=1e-6)
    # the published delta is the whole round's change
    d = n0.strategy.published_extras()["delta"]
    assert all(torch.allclose(d[k], theta[k] - after[k], atol=1e-6) for k in theta)


def test_sbm_self_term_is_the_authors_sigmoid():
    """The self weight is σ((Y_ii + Ω_iᵀ logit(B) Ω_i)/τ) with Y_ii = −loss of my published model
    on my own data (not a fixed raw 1, which kept the self share ≥ 0.5 whatever the evidence)."""
    hub = build_network(
        SCoolSBM,
        {"prune_after": 0, "evidence_samples": None, "num_blocks": 2},
        num_nodes=4,
        num_clusters=2,
        learner_kw={"local_steps": 20},
    )
    asyncio.run(run_rounds(hub, 3))
    n0 = hub.nodes["n0"]
    s = n0.strategy
    theta, omega, B = n0.learner.get_params(), s.omega.copy(), s.B.copy()
    asyncio.run(s.run_round(4))
    y_ii = -n0.learner.loss(theta, "train").loss
    assert s._Y["n0"] == pytest.approx(y_ii, rel=1e-5)
    logit_B = np.log(B) - np.log1p(-B)
    w_ii = 1 / (1 + np.exp(-(y_ii + omega @ logit_B @ omega) / s.p["tau"]))
    assert sbm_self_weight(y_ii, omega, B, s.p["tau"]) == pytest.approx(w_ii)
    row = s.weights()
    assert row == pytest.approx(row_with_self({p: s._raw[p] for p in ("n1", "n2", "n3")}, "n0", w_ii))
    assert row["n0"] < 1 / (1 + sum(s._raw[p] for p in ("n1", "n2", "n3")))  # below the raw-1 share


def test_attention_estep_targets_the_likelihood_softmax():
    """One encoder step is AdamW on CE(softmax(Y/τ), p(φ)) (*code*), and w is eq. 29 over self
    and the others, from the encoder as it was before the step."""
    spec = {
        "0.weight": torch.zeros(6, 4),
        "0.bias": torch.zeros(6),
        "2.weight": torch.zeros(3, 6),
        "2.bias": torch.zeros(3),
    }
    g = torch.Generator().manual_seed(0)
    ups = [{k: torch.randn(v.shape, generator=g) for k, v in spec.items()} for _ in range(4)]
    y = np.array([-0.2, -0.3, -4.0, -5.0])
    enc = C.UpdateEncoder(spec, (10, 5), seed=1, normalise=True)
    ref = C.UpdateEncoder(spec, (10, 5), seed=1, normalise=True)
    opt = torch.optim.AdamW(enc.parameters(), lr=0.2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.2, weight_decay=0.01)
    with torch.no_grad():
        logits0 = C.attention_logits(ref, ups[0], ups[1:]).double().numpy()
    w, p = attention_estep(enc, opt, ups[0], ups[1:], y, 9.0)
    assert p == pytest.approx(np.exp(logits0) / np.exp(logits0).sum(), rel=1e-5)
    assert w == pytest.approx(attention_weights(y, logits0, 9.0), rel=1e-5)
    target = torch.as_tensor(np.exp(y / 9) / np.exp(y / 9).sum(), dtype=torch.float32)
    loss = -(target * torch.log_softmax(C.attention_logits(ref, ups[0], ups[1:]), 0)).sum()
    ref_opt.zero_grad()
    loss.backward()
    ref_opt.step()
    assert torch.allclose(enc.get_vector(), ref.get_vector(), atol=1e-6)
    # alone: w = [1] and no step (AdamW would move every parameter on weight decay alone)
    before = enc.get_vector().clone()
    w1, _ = attention_estep(enc, opt, ups[0], [], y[:1], 9.0)
    assert w1.tolist() == [1.0] and torch.equal(enc.get_vector(), before)


def test_attention_row_is_the_eq29_softmax_over_self_and_peers():
    hub = build_network(SCoolAttention, {"prune_after": 0}, learner_kw={"local_steps": 20})
    n0 = hub.nodes["n0"]
    enc0 = n0.strategy.encoder.get_vector().clone()
    asyncio.run(n0.strategy.run_round(1))  # nobody has published an update yet: alone, no step
    assert torch.equal(n0.strategy.encoder.get_vector(), enc0)
    asyncio.run(run_rounds(hub, 3, start=2))
    s = hub.nodes["n3"].strategy
    st = s.public_state()
    ids = sorted(st["attention"])
    y = np.array([st["evidence"][k] for k in ids])
    logp = np.log([st["attention"][k] for k in ids])
    ref = np.exp(y / 9.0 + logp)
    ref /= ref.sum()
    assert s.weights() == pytest.approx(dict(zip(ids, ref.tolist(), strict=True)), rel=1e-4)
    assert len(ids) == 6 and sum(s.weights().values()) == pytest.approx(1.0)


def test_attention_in_process_network_and_encoder_gossip():
    hub = build_network(SCoolAttention, {"prune_after": 0}, learner_kw={"local_steps": 20})
    enc0 = hub.nodes["n0"].strategy.encoder.get_vector().clone()
    asyncio.run(run_rounds(hub, 10))
    for nid, node in hub.nodes.items():  # every in-cluster peer above every other one
        w = node.strategy.weights()
        inc = [w[p] for p, n in hub.nodes.items() if p != nid and n.cluster == node.cluster]
        out = [w[p] for p, n in hub.nodes.items() if n.cluster != node.cluster]
        assert min(inc) > max(out), (nid, w)
    vecs = torch.stack([n.strategy.encoder.get_vector() for n in hub.nodes.values()])
    assert not torch.allclose(vecs[0], enc0)  # trained
    spread = (vecs - vecs.mean(0)).norm(dim=1).max()
    assert spread < 0.5 * (vecs[0] - enc0).norm()  # gossip keeps the copies close to each other
    s = hub.nodes["n3"].strategy
    s2 = SCoolAttention("n3", s.learner, s.net, seed=5)
    s2.load_state_dict(msgpack_roundtrip_state(s.state_dict()))
    assert s2.public_state() == s.public_state()
    assert_encoder_resumes(s)
    assert torch.allclose(s2.encoder.get_vector(), s.encoder.get_vector())


def test_attention_prunes_to_its_cluster():
    hub = build_network(SCoolAttention, learner_kw={"local_steps": 20})  # keep 20% after 10 E-steps
    asyncio.run(run_rounds(hub, 12))
    mass, per_node, _ = in_cluster_mass(hub)
    assert mass > 0.95, per_node
    for node in hub.nodes.values():
        (kept,) = node.strategy._kept
        assert hub.nodes[kept].cluster == node.cluster


# --- the number of SBM blocks, estimated (issue 23 item 4) ---


@pytest.mark.parametrize("n,K", [(12, 2), (12, 3), (12, 4), (15, 5)])
def test_estimate_num_blocks_recovers_K_on_a_synthetic_similarity_matrix(n, K):
    """ICL over K on a noisy block matrix (1 within a block, 0 across, N(0, 0.3²) noise) finds
    the K it was drawn with, and the blocks themselves."""
    rng = np.random.default_rng(K)
    for trial in range(3):
        z = rng.permutation(np.repeat(np.arange(K), n // K))
        S = (z[:, None] == z[None, :]).astype(float) + 0.3 * rng.standard_normal((n, n))
        k, labels = estimate_num_blocks(S, k_max=8, seed=trial)
        assert k == K, (trial, k)
        same_true, same_est = z[:, None] == z[None, :], labels[:, None] == labels[None, :]
        assert (same_true == same_est).all()


def test_evidence_matrix_standardises_rows_and_symmetrises():
    rows = {"a": {"a": -1.0, "b": -1.2, "c": -5.0}, "b": {"a": -0.5, "b": -0.4, "c": -3.0}, "c": {"c": -2.0, "a": -9.0}}
    ids, S = evidence_matrix(rows)
    assert ids == ["a", "b", "c"]
    assert np.allclose(S, S.T)
    assert S[0, 1] > 0 > S[0, 2]  # a and b fit each other's data, c does not fit theirs


def test_sbm_estimates_its_blocks_in_process_and_resumes():
    """num_blocks = "auto" (the default): one block until the blocks_after-th E-step, then each
    node's ICL estimate from the evidence rows gossiped with Ω, a vote, and the SBM restarts with
    the agreed K — here the 3 true clusters of 9 nodes, where nobody told it 3."""
    hub = build_network(SCoolSBM, {"prune_after": 0}, num_nodes=9, num_clusters=3, learner_kw={"local_steps": 20})
    s0 = hub.nodes["n0"].strategy
    assert s0.auto_blocks and s0.num_blocks == 1
    asyncio.run(run_rounds(hub, 6))
    ks = {nid: n.strategy.num_blocks for nid, n in hub.nodes.items()}
    assert set(ks.values()) == {3}, ks
    assert all(n.strategy.omega.shape == (3,) and n.strategy.B.shape == (3, 3) for n in hub.nodes.values())
    mass, per_node, chance = in_cluster_mass(hub)
    assert mass > 1.5 * chance, per_node  # two E-steps with 3 blocks so far
    s2 = SCoolSBM("n0", s0.learner, s0.net, seed=77)
    s2.load_state_dict(msgpack_roundtrip_state(s0.state_dict()))
    assert s2.num_blocks == 3 and s2.public_state() == s0.public_state()


def test_sbm_told_blocks_and_bad_num_blocks():
    hub = build_network(SCoolSBM, {"num_blocks": 4}, num_nodes=4, num_clusters=2)
    s = hub.nodes["n0"].strategy
    assert not s.auto_blocks and s.num_blocks == 4 and "y" not in s._omega_payload("n1")
    for bad in ("three", 0, True, 2.5):
        with pytest.raises(ValueError, match="num_blocks must be a positive integer or 'auto'"):
            build_network(SCoolSBM, {"num_blocks": bad}, num_nodes=2, num_clusters=1)


def test_sbm_ignores_malformed_gossiped_rows_and_votes():
    hub = build_network(SCoolSBM, num_nodes=4, num_clusters=2)
    s = hub.nodes["n0"].strategy
    for msg in (
        {"y": {"n1": float("nan")}},
        {"y": [1, 2]},
        {"y": {str(i): 0.0 for i in range(50)}},
        {"k": 99},
        {"k": True},
        {"k": "3"},
    ):
        s._take_omega("n1", msg)
    assert s._rows == {} and s._k_votes == {}
    s._take_omega("n1", {"y": {"n0": -1.0, "n1": -0.5}, "k": 2})
    assert s._rows == {"n1": {"n0": -1.0, "n1": -0.5}} and s._k_votes == {"n1": 2}
