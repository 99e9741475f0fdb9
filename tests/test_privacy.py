"""The privacy mechanism in-process: purposes, the per-sample bounded sums, the DP release, the ledger.

The attacks against a real daemon are in test_privacy_attack.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from torch.func import functional_call

from coterie.node.config import ConfigError, PrivacyConfig, load_config
from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.torch_learner import build_learner
from coterie.node.privacy import accountant
from coterie.node.privacy.ledger import FILE, BudgetSpent, PrivacyLedger
from coterie.node.privacy.mechanisms import PrivateData
from coterie.node.privacy.purposes import PURPOSES, SERVED_SPLITS, purpose, purposes_of
from tests.test_architecture import _imports

LEARNER = LearnerConfig(
    dataset="mnist1d",
    dataset_params={"num_samples": 2000},
    partition="label_permutation",
    partition_params={"num_clusters": 1, "samples_per_node": 120},
    num_nodes=2,
    node_index=0,
    model="mlp",
    model_params={"hidden": [16]},
)


@pytest.fixture(scope="module")
def learner():
    return build_learner(LEARNER)


def _norm(g: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((v.double() ** 2).sum() for v in g.values())))


# ---------------------------------------------------------------------------- purposes, config
def test_purposes_never_touch_the_test_split_and_belong_to_strategies():
    assert all(p.split in SERVED_SPLITS and p.split != "test" for p in PURPOSES.values())
    assert purposes_of("scool-sbm") == ("scool-evidence", "scool-gradient")
    assert purposes_of("cobo") == ("cobo-alignment",)
    assert purposes_of("federico") == ("federico-push",)
    for s in ("local", "dpsgd", "oracle", "fedfomo", "l2c", "meta-l2c"):
        assert purposes_of(s) == ()  # they evaluate peers' models on their own data
    with pytest.raises(ValueError, match="unknown purpose 'peek'"):
        purpose("peek")


def test_config_is_private_by_default_and_refuses_a_budget_without_noise():
    p = load_config(None, environ={}).privacy
    assert p.enabled and p.noise_multiplier > 0 and math.isfinite(p.budget_epsilon) and p.min_batch >= 32
    with pytest.raises(ConfigError, match="noise_multiplier = 0"):
        load_config(None, overrides={"privacy": {"noise_multiplier": 0}}, environ={})
    assert (
        load_config(
            None, overrides={"privacy": {"noise_multiplier": 0, "budget_epsilon": math.inf}}, environ={}
        ).privacy.noise_multiplier
        == 0
    )
    with pytest.raises(ConfigError, match="unknown purpose"):
        load_config(None, overrides={"privacy": {"serve_purposes": ["all-of-it"]}}, environ={})
    env = load_config(None, environ={"COTERIE_PRIVACY__BUDGET_EPSILON": "3.5"}).privacy
    assert env.budget_epsilon == 3.5


def test_privacy_package_stays_below_the_peer_plane():
    assert (
        _imports(
            "coterie.node.privacy",
            (
                "grpc",
                "coterie.proto",
                "coterie.node.transport",
                "coterie.node.peering",
                "coterie.node.strategies",
                "coterie.node.daemon",
            ),
        )
        == []
    )


# ---------------------------------------------------------------------------- per-sample sums
def test_clipped_gradient_sum_is_the_per_sample_gradient_clipped(learner):
    x, y = learner._data["train"]
    idx = [0, 3, 5, 8]
    p = {k: v.to(x.device).requires_grad_(True) for k, v in learner.get_params().items()}  # x: on the learner's device
    per = []
    for i in idx:
        loss = torch.nn.functional.cross_entropy(functional_call(learner._shadow, p, (x[i : i + 1],)), y[i : i + 1])
        per.append(dict(zip(p, torch.autograd.grad(loss, list(p.values())), strict=True)))
    unclipped = learner.clipped_gradient_sum(None, "train", idx, 1e9)
    for k in p:
        assert torch.allclose(unclipped[k], sum(g[k] for g in per).cpu(), atol=1e-5)
    clip = 0.5 * min(_norm(g) for g in per)  # every sample gets clipped
    clipped = learner.clipped_gradient_sum(None, "train", idx, clip)
    want = {k: sum(g[k] * (clip / (_norm(g) + 1e-6)) for g in per) for k in p}
    for k in p:
        assert torch.allclose(clipped[k], want[k].cpu(), atol=1e-5)
    assert _norm(learner.clipped_gradient_sum(None, "train", [3], clip)) <= clip * (1 + 1e-5)


def test_clipped_loss_sum_bounds_each_sample(learner):
    x, y = learner._data["train"]
    idx = list(range(10))
    params = {k: v.to(x.device) for k, v in learner.get_params().items()}  # x: on the learner's device
    per = torch.nn.functional.cross_entropy(
        functional_call(learner._shadow, params, (x[:10],)), y[:10], reduction="none"
    )
    assert learner.clipped_loss_sum(None, "train", idx, 100.0) == pytest.approx(float(per.sum()), rel=1e-5)
    c = float(per.median())
    assert learner.clipped_loss_sum(None, "train", idx, c) == pytest.approx(float(per.clamp(max=c).sum()), rel=1e-5)
    with pytest.raises(ValueError, match="out of range"):
        learner.clipped_loss_sum(None, "train", [10_000], 1.0)


# ---------------------------------------------------------------------------- the release
def _private(learner, tmp_path, seed=0, **cfg):
    cfg = PrivacyConfig(**cfg)
    ledger = PrivacyLedger(tmp_path, delta=cfg.delta, budget=cfg.budget_epsilon, peer_budget=cfg.peer_budget_epsilon)
    return PrivateData(learner, cfg, ledger, rng=np.random.default_rng(seed)), ledger


def test_batch_is_never_below_the_minimum(learner, tmp_path):
    priv, _ = _private(learner, tmp_path, min_batch=32)
    n = learner.num_samples("train")
    assert priv.batch_size("train", 1) == (32, n)
    assert priv.batch_size("train", 50) == (50, n)
    assert priv.batch_size("train", 0) == (n, n)  # 0 asks for the whole split
    priv, _ = _private(learner, tmp_path / "b", min_batch=10_000)
    assert priv.batch_size("train", 1) == (n, n)  # a split smaller than the minimum: all of it


def test_release_without_privacy_is_the_exact_mean(learner, tmp_path):
    priv, ledger = _private(learner, tmp_path, enabled=False)
    p = purpose("scool-gradient")
    rel, loss = priv.gradient("peer", p, None, 0)
    g, r = learner.gradient(None, "train", None, "mean")
    assert all(torch.allclose(rel.value[k], g[k], atol=1e-6) for k in g) and loss == pytest.approx(r.loss)
    assert rel.noise_std == 0 and ledger.epsilon() == math.inf  # counted, and honest about it


def test_clip_only_release_is_bounded(learner, tmp_path):
    priv, _ = _private(learner, tmp_path, noise_multiplier=0.0, budget_epsilon=math.inf, grad_clip=0.01)
    rel, loss = priv.gradient("peer", purpose("scool-gradient"), None, 0)  # q = 1: every sample, clipped
    assert _norm(rel.value) <= 0.01 * (1 + 1e-4) and math.isnan(loss)


def test_gaussian_noise_has_the_calibrated_scale(learner, tmp_path):
    sigma, clip = 2.0, 0.5
    priv, ledger = _private(
        learner, tmp_path, noise_multiplier=sigma, grad_clip=clip, budget_epsilon=math.inf, min_batch=32
    )
    rel, _ = priv.gradient("peer", purpose("scool-gradient"), None, 40)
    exact = learner.clipped_gradient_sum(None, "train", np.arange(learner.num_samples("train")), clip)
    assert rel.samples == 40 and rel.noise_std == pytest.approx(sigma * clip / 40)
    noise = torch.cat([(rel.value[k] - exact[k] / 40).reshape(-1) for k in exact])
    # the signal is a clipped mean (norm <= clip/40·n/40 at most); per-coordinate noise dominates
    assert float(noise.std()) == pytest.approx(sigma * clip / 40, rel=0.15)
    loss = priv.loss("peer", purpose("scool-evidence"), None, 40)
    assert loss.samples == 40 and loss.noise_std == pytest.approx(sigma * PrivacyConfig().loss_clip / 40)
    assert ledger.total.releases == 2


def test_ledger_matches_opacus_and_persists(tmp_path):
    ledger = PrivacyLedger(tmp_path, delta=1e-5)
    for _ in range(5):
        ledger.charge("a", "scool-evidence", 1.0, 0.1)
    for _ in range(3):
        ledger.charge("b", "federico-push", 1.0, 0.2)
    ref = RDPAccountant()
    ref.history = [(1.0, 0.1, 5), (1.0, 0.2, 3)]
    assert ledger.epsilon() == pytest.approx(ref.get_epsilon(delta=1e-5))
    assert ledger.epsilon("a") < ledger.epsilon() and ledger.epsilon("b") < ledger.epsilon()
    again = PrivacyLedger(tmp_path, delta=1e-5)
    assert again.epsilon() == pytest.approx(ledger.epsilon()) and again.epsilon("a") == pytest.approx(
        ledger.epsilon("a")
    )
    assert again.view()["peers"]["a"]["purposes"] == {"scool-evidence": 5}
    assert accountant.epsilon([(0.0, 0.5, 1)], 1e-5) == math.inf


def test_budget_is_never_exceeded_and_no_compute_happens_after(tmp_path):
    ledger = PrivacyLedger(tmp_path, delta=1e-5, budget=4.0)
    answered = 0
    with pytest.raises(BudgetSpent, match="privacy budget spent"):
        for _ in range(1000):
            ledger.charge("a", "scool-evidence", 1.0, 0.1)
            answered += 1
    assert 5 < answered < 1000 and ledger.epsilon() <= 4.0
    with pytest.raises(BudgetSpent):
        ledger.charge("b", "scool-evidence", 1.0, 0.1)  # the total is spent, for everyone
    assert PrivacyLedger(tmp_path, delta=1e-5, budget=4.0).total.releases == answered  # persisted

    per_peer = PrivacyLedger(tmp_path / "p", delta=1e-5, peer_budget=2.5)
    with pytest.raises(BudgetSpent, match="per-peer budget"):
        for _ in range(1000):
            per_peer.charge("greedy", "scool-evidence", 1.0, 0.1)
    per_peer.charge("other", "scool-evidence", 1.0, 0.1)  # one peer's share does not stop the rest
    assert per_peer.epsilon("greedy") <= 2.5 < per_peer.epsilon()


def test_release_is_charged_before_it_is_computed(learner, tmp_path):
    """A release that would pass the budget computes nothing; one that fails after the charge
    is still counted (over-counting is the safe side)."""

    class Exploding:
        def __getattr__(self, name):
            return getattr(learner, name)

        def clipped_loss_sum(self, *a, **kw):
            raise RuntimeError("boom")

    cfg = PrivacyConfig(noise_multiplier=1.0, budget_epsilon=100.0)
    ledger = PrivacyLedger(tmp_path, delta=cfg.delta, budget=cfg.budget_epsilon)
    with pytest.raises(RuntimeError, match="boom"):
        PrivateData(Exploding(), cfg, ledger).loss("peer", purpose("scool-evidence"), None, 32)
    assert json.loads((tmp_path / FILE).read_text())["total"]["releases"] == 1


def test_corrupt_ledger_is_never_reset(tmp_path):
    (tmp_path / FILE).write_text('{"format": "coterie-privacy-ledger/1", "total": {"steps": [[1, 7, 1]]}}')
    with pytest.raises(ValueError, match="privacy-ledger.json is corrupt"):
        PrivacyLedger(tmp_path, delta=1e-5)
    (tmp_path / FILE).write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        PrivacyLedger(tmp_path, delta=1e-5)
