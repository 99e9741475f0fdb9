"""Real node processes on loopback: discovery, rounds, crash and resume."""

from __future__ import annotations

import signal

import pytest

from coterie.node.persistence import StateStore, read_checkpoint
from tests.nodeproc import NodeProc, tiny_learner, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """n0 ← n1 ← n2: each node is only told about its predecessor."""
    root = tmp_path_factory.mktemp("chain")
    nodes: list[NodeProc] = []
    try:
        for i in range(3):
            cfg = {
                "strategy": "dpsgd",
                "round_interval_s": 0.3,
                "learner": tiny_learner(3, i),
                "peers": [nodes[-1].address] if nodes else [],
            }
            nodes.append(NodeProc(root, f"n{i}", cfg).start())
        yield nodes
    finally:
        for n in nodes:
            n.stop()


def test_chain_bootstrap_reaches_full_membership(chain):
    for n in chain:
        wait_for(lambda n=n: n.status()["peers_alive"] == 2, 30, f"{n.node_id} to know both others")
    ids = {p["node_id"] for p in chain[0].get("/peers")}
    assert ids == {"n1", "n2"}  # n0 was told about nobody; it learned n2 by peer exchange


def test_rounds_advance_everywhere(chain):
    for n in chain:
        start = n.status()["round"]
        wait_for(lambda n=n, s=start: n.status()["round"] >= s + 2, 60, f"{n.node_id} to advance")
    st = chain[1].status()
    assert st["model_version"] >= st["round"]
    weights = chain[1].get("/weights")["weights"]
    assert set(weights) <= {"n0", "n1", "n2"} and abs(sum(weights.values()) - 1) < 1e-6
    metrics = chain[1].get_text("/metrics")
    assert "coterie_rounds_total" in metrics and 'coterie_sent_bytes_total{kind="snapshot"}' in metrics


def test_kill9_is_detected_without_stalling_and_restart_resumes(chain):
    n0, n1, n2 = chain
    wait_for(lambda: n2.status()["round"] >= 2, 60, "n2 to checkpoint a few rounds")
    n2.kill(signal.SIGKILL)
    ckpt_round = read_checkpoint(StateStore(n2.state_dir).checkpoints()[-1]).round

    def n2_dead_on(n):
        return any(p["node_id"] == "n2" and p["state"] == "dead" for p in n.get("/peers"))

    for n in (n0, n1):
        wait_for(lambda n=n: n2_dead_on(n), 20, f"{n.node_id} to mark n2 dead")
    # the survivors keep going while n2 is dead
    for n in (n0, n1):
        r = n.status()["round"]
        wait_for(lambda n=n, r=r: n.status()["round"] >= r + 2, 30, f"{n.node_id} to advance without n2")
        assert n.status()["peers_alive"] == 1

    n2.start()
    st = n2.status()
    assert st["round"] >= ckpt_round, f"restart resumed at {st['round']}, checkpoint was {ckpt_round}"
    history = n2.get("/history")
    rounds = [h["round"] for h in history]
    assert rounds == list(range(1, len(rounds) + 1)) and rounds[-1] >= ckpt_round
    for n in (n0, n1):
        wait_for(
            lambda n=n: not n2_dead_on(n) and n.status()["peers_alive"] == 2, 20, f"{n.node_id} to see n2 alive again"
        )
    wait_for(lambda: n2.status()["round"] > st["round"], 30, "restarted n2 to run new rounds")
