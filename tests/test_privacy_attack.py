"""The attacks of issue 9, run as an attacker would: against a real daemon over gRPC.

A peer that handshakes under a new id and asks for the cross-gradient of a model of its choice on
one sample reads that sample off the first layer: grad(W)[i] / grad(b)[i] is the input, and the
negative entry of the last bias gradient is its label. A staircase model (last-layer bias K·c)
makes a single-sample cross-loss spell out the label. Each attack runs twice with the same code:
against the unprotected learner function (what the node used to serve; the attack must succeed, so
the test can fail) and against a daemon with its default privacy settings (it must fail)."""

from __future__ import annotations

import asyncio
import math
import signal

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from coterie.cli.main import app
from coterie.node.config import PROTOCOL_VERSION
from coterie.node.fsutil import read_json
from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.torch_learner import build_learner
from coterie.node.peering.errors import PRIVACY_BUDGET, PeerCallError
from coterie.node.peering.messages import CROSS_GRADIENT, CROSS_LOSS, ComputeRequest, NodeInfo
from coterie.node.privacy.ledger import FILE
from coterie.node.transport.client import PeerClient
from tests.nodeproc import NodeProc, node_certs, tiny_learner, wait_for

pytestmark = pytest.mark.slow

QUERIES = 20
START_S = 180  # a daemon start on a loaded 2-core CI box (torch import, data, warm-up)
STAIR = 0.45  # staircase step K: logits K·c stay under the default loss clip, the attacker's best case


class _NoTraffic:
    def record(self, *a, **kw): ...
    def latency(self, *a, **kw): ...


def _learner_cfg() -> dict:
    return tiny_learner(2, 0, samples=500)  # 300 training samples: a realistic sample rate 32/300


@pytest.fixture(scope="module")
def truth():
    """The victim's own data, rebuilt from its config (partitions are deterministic)."""
    lrn = build_learner(LearnerConfig(**_learner_cfg()))
    return lrn


UNLIMITED = {
    "requests_per_s": 1e6,
    "request_burst": 1e6,
    "compute_share": 1e6,
    "compute_burst_s": 1e6,
    "max_concurrent": 64,
}
# likewise the per-peer share of the ε budget and the per-peer release rate (tests/test_insiders.py
# attacks those): here one peer may spend the whole budget, as fast as it asks
ONE_PEER = {"expected_peers": 1, "peer_release_rate": 1e6, "peer_release_burst": 1_000_000}


@pytest.fixture(scope="module")
def victim(tmp_path_factory):
    # SCool serves cross-losses and cross-gradients; privacy is left at its defaults. The per-peer
    # compute budget (tests/test_security_limits.py) would cut the attacker off after a few calls:
    # lifted here, so what is measured is what the privacy mechanism alone lets out.
    node = NodeProc(
        tmp_path_factory.mktemp("priv"),
        "victim",
        {"strategy": "scool-sbm", "rounds": 0, "learner": _learner_cfg(), "limits": UNLIMITED, "privacy": ONE_PEER},
    ).start(timeout=START_S)
    yield node
    node.stop()


# ------------------------------------------------------------------------------ the attack code
def reconstruct(grad: dict[str, torch.Tensor]) -> tuple[np.ndarray, int]:
    """Single-sample inversion: the first layer's row with the largest bias gradient gives the
    input (dL/dW_i = dL/db_i · x), the last bias gradient's negative entry the label."""
    names = list(grad)
    w = next(n for n in names if grad[n].dim() == 2)
    b = names[names.index(w) + 1]
    i = int(grad[b].abs().argmax())
    x = (grad[w][i] / grad[b][i]).numpy()
    return x, int(grad[names[-1]].argmin())


def staircase(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Logits K·c whatever the input: the loss of one sample is LSE(K·c) − K·y."""
    out = {k: torch.zeros_like(v) for k, v in params.items()}
    last = list(out)[-1]
    out[last] = STAIR * torch.arange(out[last].numel(), dtype=torch.float32)
    return out


def decode_label(loss: float, classes: int) -> float:
    return (float(torch.logsumexp(STAIR * torch.arange(classes, dtype=torch.float32), 0)) - loss) / STAIR


def score(pairs, x_train: np.ndarray, y_train: np.ndarray) -> tuple[float, float]:
    """(median relative error to the nearest training input, share of labels that match it)."""
    errs, hits = [], 0
    for x, y in pairs:
        rel = np.linalg.norm(x_train - x, axis=1) / np.linalg.norm(x_train, axis=1)
        j = int(np.argmin(rel)) if np.all(np.isfinite(rel)) else 0
        errs.append(float(rel[j]) if np.isfinite(rel[j]) else math.inf)
        hits += int(y == int(y_train[j]))
    return float(np.median(errs)), hits / len(pairs)


# the attacker's queries must reach the privacy layer: admission (tested in test_security_limits)
# would otherwise stop a few hundred of them first and hide what the privacy defence does alone


async def _attacker(node: NodeProc, fingerprint: str) -> PeerClient:
    """A certified member of the network (mTLS keeps strangers out; privacy must hold against
    the insiders that are let in)."""
    from coterie.node.security.pki import load_credentials
    from coterie.node.transport.tls import TLS

    tls = TLS(load_credentials(node_certs(node.dir.parent, "mallory")))
    client = PeerClient(
        "mallory",
        _NoTraffic(),
        chunk_bytes=1 << 20,
        max_model_bytes=1 << 28,
        max_gossip_bytes=1 << 20,
        timeout_s=60,
        tls=tls,
    )
    await client.handshake(
        node.address, NodeInfo("mallory", PROTOCOL_VERSION, fingerprint, address="127.0.0.1:9"), timeout=30
    )
    return client


def _request(kind: str, params, purpose: str, **kw) -> ComputeRequest:
    return ComputeRequest(kind, "mallory", groups={"params": params}, max_samples=1, purpose=purpose, **kw)


# ------------------------------------------------------------------------------ tests
def test_gradient_inversion_recovers_samples_from_the_unprotected_function(truth):
    x_train, y_train = (t.cpu().numpy() for t in truth._data["train"])
    params = truth.get_params()
    pairs = [reconstruct(truth.gradient(params, "train", 1)[0]) for _ in range(QUERIES)]
    err, labels = score(pairs, x_train.reshape(len(x_train), -1), y_train)
    assert err < 1e-3 and labels == 1.0  # every sample read back exactly: the attack works


def test_gradient_inversion_fails_against_a_daemon(victim, truth):
    x_train, y_train = (t.cpu().numpy() for t in truth._data["train"])
    fp = victim.status()["fingerprint"]

    async def go():
        client = await _attacker(victim, fp)
        try:
            params = truth.get_params()
            replies = [
                await client.compute(victim.address, _request(CROSS_GRADIENT, params, "scool-gradient"))
                for _ in range(QUERIES)
            ]
        finally:
            await client.close()
        return replies

    replies = asyncio.run(go())
    assert all(r.samples >= 64 for r in replies)  # never one sample, whatever was asked (min_batch)
    assert all(math.isnan(r.loss) for r in replies)  # no exact loss beside a private gradient
    pairs = [reconstruct(r.grad["grad"]) for r in replies]
    err, labels = score(pairs, x_train.reshape(len(x_train), -1), y_train)
    assert err > 0.5, f"reconstruction came within {err:.3f} of a training sample"
    assert labels <= 0.4, f"labels recovered {labels:.0%} of the time (chance ~10%)"
    led = victim.status()["privacy"]
    assert led["peers"]["mallory"]["releases"] >= QUERIES and 0 < led["epsilon"] <= led["budget_epsilon"]


def test_cross_loss_label_leak(victim, truth):
    classes = truth.num_classes
    stair = staircase(truth.get_params())
    # unprotected: one query, one sample, its label exactly
    open_labels = [decode_label(truth.loss(stair, "train", 1).loss, classes) for _ in range(QUERIES)]
    assert all(abs(v - round(v)) < 1e-3 and 0 <= round(v) < classes for v in open_labels)
    assert {round(v) for v in open_labels} <= set(truth._data["train"][1].tolist())

    async def go():
        client = await _attacker(victim, victim.status()["fingerprint"])
        try:
            return [
                await client.compute(victim.address, _request(CROSS_LOSS, stair, "scool-evidence"))
                for _ in range(QUERIES)
            ]
        finally:
            await client.close()

    replies = asyncio.run(go())
    assert all(r.samples >= 64 for r in replies)
    decoded = [decode_label(r.loss, classes) for r in replies]
    exact = sum(abs(v - round(v)) < 1e-3 for v in decoded)
    assert exact <= 2, f"{exact} of {QUERIES} noisy batch losses decoded to an exact label: {decoded}"


def test_requests_outside_a_purpose_are_refused(victim, truth):
    params = truth.get_params()

    async def go():
        client = await _attacker(victim, victim.status()["fingerprint"])
        out = []
        try:
            for req in (
                _request(CROSS_GRADIENT, params, "scool-gradient", split="test"),
                _request(CROSS_GRADIENT, params, "scool-gradient", split="val"),
                _request(CROSS_GRADIENT, params, ""),
                _request(CROSS_GRADIENT, params, "scool-evidence"),
                _request(CROSS_LOSS, params, "federico-push"),
                _request(CROSS_GRADIENT, params, "cobo-alignment", align=False),
            ):
                with pytest.raises(PeerCallError) as err:
                    await client.compute(victim.address, req)
                out.append(err.value.message)
        finally:
            await client.close()
        return out

    test, val, none, kind, push, other = asyncio.run(go())
    assert "test split is never served" in test
    assert "answered on the 'train' split only" in val
    assert "names no purpose" in none
    assert "is for loss requests, not gradient" in kind
    assert "is for push requests, not loss" in push
    assert "is for alignment requests, not gradient" in other


def test_budget_refusal_and_ledger_survive_kill_9(tmp_path, truth):
    """Every answer is on disk before it leaves; a spent budget is refused with a clear error,
    across a kill -9 and a restart."""
    cfg = {
        "strategy": "scool-sbm",
        "rounds": 0,
        "learner": _learner_cfg(),
        "limits": UNLIMITED,
        "privacy": {"budget_epsilon": 3.0, "noise_multiplier": 1.0, "min_batch": 32, **ONE_PEER},
    }
    node = NodeProc(tmp_path, "victim", cfg).start(timeout=START_S)
    ledger_path = node.state_dir / FILE
    params = truth.get_params()

    async def drain(limit: int = 200):
        client = await _attacker(node, node.status()["fingerprint"])
        answered = 0
        try:
            for _ in range(limit):
                try:
                    await client.compute(node.address, _request(CROSS_LOSS, params, "scool-evidence"))
                except PeerCallError as e:
                    return answered, e
                answered += 1
                # the ledger entry was written before the reply left
                assert read_json(ledger_path)["peers"]["mallory"]["releases"] >= answered
        finally:
            await client.close()
        return answered, None

    try:
        answered, err = asyncio.run(drain())
        assert answered > 0 and err is not None, "the budget was never reached"
        assert err.kind == PRIVACY_BUDGET and "privacy budget spent" in err.message
        before = node.status()["privacy"]
        assert before["epsilon"] <= 3.0 and before["releases"] == answered and before["budget_refusals"] >= 1
        assert "coterie_privacy_epsilon " in node.get_text("/metrics")
        shown = CliRunner().invoke(app, ["status", "--admin", node.admin, "--state-dir", str(node.state_dir)])
        assert shown.exit_code == 0 and "budget spent" in shown.output and "mallory" in shown.output

        node.kill(signal.SIGKILL)
        node.start(timeout=START_S)
        after = node.status()["privacy"]
        assert after["releases"] == before["releases"] and after["epsilon"] == pytest.approx(before["epsilon"])
        again, err = asyncio.run(drain(3))
        assert again == 0 and err.kind == PRIVACY_BUDGET  # still spent after the restart
    finally:
        node.stop()


def test_strategies_carry_on_when_a_peer_budget_is_spent(tmp_path):
    """Two SCool nodes whose budget is below one answer (σ = 2 on 64 of 72 samples costs ε 2.05):
    every evidence request is refused as "privacy budget spent", nothing is released, and both
    nodes finish their rounds on what they have, as they would with an unreachable peer."""
    nodes: list[NodeProc] = []
    try:
        for i in range(2):
            cfg = {
                "strategy": "scool-sbm",
                "rounds": 4,
                "learner": tiny_learner(2, i),
                "min_peers": 1,
                "start_timeout_s": 600,  # n0 waits for n1, however long its start takes
                "suspect_after_s": 10.0,
                "dead_after_s": 60.0,  # a loaded box delays heartbeats
                "privacy": {"budget_epsilon": 1.0},
                "peers": [nodes[-1].address] if nodes else [],
            }
            nodes.append(NodeProc(tmp_path, f"n{i}", cfg).start(timeout=START_S))
        for n in nodes:
            wait_for(lambda n=n: n.status()["done"], 240, f"{n.node_id} to finish its rounds")
        statuses = [n.status() for n in nodes]
        assert all(st["round"] == 4 for st in statuses)
        assert all(st["privacy"]["epsilon"] == 0 and st["privacy"]["releases"] == 0 for st in statuses)
        assert sum(st["privacy"]["budget_refusals"] for st in statuses) >= 1
        problems = " ".join(p.get("message", "") for st in statuses for p in st["problems"])
        assert "privacy budget spent" in problems
    finally:
        for n in nodes:
            n.stop()
