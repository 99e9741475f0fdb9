"""State directory: checkpoints survive kill -9 at any moment, are written off the round's
critical path with a bounded number of unsaved rounds, and pin the history they belong to."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

from coterie.node import daemon
from coterie.node.checkpointing import Checkpointer
from coterie.node.daemon import Node
from coterie.node.failures import Failures
from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.torch_learner import build_learner
from coterie.node.persistence import StateError, StateStore, make_snapshot, pack_state, read_checkpoint, unpack_state
from tests.solo import run_until_done, solo_config, until

CFG = dict(dataset="gaussian", partition="iid", num_nodes=2, node_index=0, model="mlp")

WRITER = textwrap.dedent("""
    import sys, torch
    from coterie.node.learning.config import LearnerConfig
    from coterie.node.learning.torch_learner import build_learner
    from coterie.node.persistence import StateStore, make_snapshot
    learner = build_learner(LearnerConfig(**{cfg!r}))
    store = StateStore(sys.argv[1])
    store.open("w")
    r = 0
    while True:
        r += 1
        learner.set_params({{k: torch.full_like(v, float(r)) for k, v in learner.get_params().items()}})
        snap = make_snapshot(round=r, version=r, node_id="w", learner_state=learner.export_state(),
                             strategy_state={{"r": r, "row": torch.full((3,), float(r))}}, peers=[],
                             meta={{}}, record={{"round": r, "pad": "x" * (r % 7) * 100}})
        store.commit(snap, [snap.record])
        print(r, flush=True)
""")


def test_kill9_at_random_moments_always_leaves_a_complete_checkpoint(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(cfg=CFG))
    learner = build_learner(LearnerConfig(**CFG))
    rng = random.Random(7)
    for trial in range(3):
        state = tmp_path / f"state{trial}"
        p = subprocess.Popen([sys.executable, str(script), str(state)], stdout=subprocess.PIPE, text=True)
        target = rng.randint(2, 6)
        committed = 0
        for line in p.stdout:  # let it commit a few rounds, then kill it mid-flight
            committed = int(line)
            if committed >= target:
                break
        p.send_signal(signal.SIGKILL)
        p.wait()
        node_id, ckpt = StateStore(state).open()
        r = ckpt.round
        assert node_id == "w" and r >= committed, f"lost committed round {committed}: loaded {r}"
        learner.import_state(*ckpt.learner_state())
        assert all(torch.all(v == float(r)) for v in learner.get_params().values())
        st = ckpt.strategy_state()
        assert st["r"] == r and torch.all(st["row"] == float(r))
        assert [h["round"] for h in ckpt.history] == list(range(1, r + 1))  # lines past it dropped


def test_fresh_dir_opens_empty_and_keeps_its_identity_after_the_first_commit(tmp_path):
    learner = build_learner(LearnerConfig(**CFG))
    store = StateStore(tmp_path)
    nid, ckpt = store.open(None)
    assert ckpt is None and not (tmp_path / "identity.json").exists()
    store.commit(
        make_snapshot(
            round=0,
            version=1,
            node_id=nid,
            learner_state=learner.export_state(),
            strategy_state={},
            peers=[],
            meta={},
            record=None,
        ),
        [],
    )
    assert json.loads((tmp_path / "identity.json").read_text())["node_id"] == nid
    assert StateStore(tmp_path).open(None)[0] == nid
    with pytest.raises(StateError, match="belongs to node"):
        StateStore(tmp_path).open("someone-else")


def test_strategy_state_round_trips_through_the_checkpoint_encoding():
    state = {
        "P": {"a": 0.5, "b": -1.0, "nan": float("nan")},
        "t": torch.arange(4.0),
        "arr": np.eye(2),
        "l": [1, {"x": torch.ones(1)}],
        "blob": b"\x00\xff",
        "big": 2**70,
        "none": None,
        "bf": torch.ones(2, dtype=torch.bfloat16),
        "view": torch.arange(10.0)[2:5],
    }
    out = unpack_state(pack_state(state))
    assert out["P"]["a"] == 0.5 and np.isnan(out["P"]["nan"]) and torch.equal(out["t"], state["t"])
    assert np.array_equal(out["arr"], state["arr"]) and torch.equal(out["l"][1]["x"], torch.ones(1))
    assert out["blob"] == b"\x00\xff" and out["big"] == 2**70 and out["none"] is None
    assert torch.equal(out["bf"], state["bf"]) and torch.equal(out["view"], torch.tensor([2.0, 3.0, 4.0]))


def test_one_checkpoint_file_and_the_history_it_pins(tmp_path):
    learner = build_learner(LearnerConfig(**CFG))
    store = StateStore(tmp_path)
    store.open("a")
    for r in (1, 2, 3):
        snap = make_snapshot(
            round=r,
            version=r + 1,
            node_id="a",
            learner_state=learner.export_state(),
            strategy_state={},
            peers=[],
            meta={},
            record={"round": r},
        )
        store.commit(snap, [snap.record])
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["LOCK", "ckpt-000003.safetensors", "history.jsonl", "identity.json"] or files == [
        "ckpt-000003.safetensors",
        "history.jsonl",
        "identity.json",
    ]
    ckpt = read_checkpoint(tmp_path / "ckpt-000003.safetensors")
    assert ckpt.state["history"]["bytes"] == (tmp_path / "history.jsonl").stat().st_size
    # a crash after the history append but before the rename leaves lines past the checkpoint
    with open(tmp_path / "history.jsonl", "a") as f:
        f.write('{"round": 4}\n{"round": 5, "tor')
    _, ckpt = StateStore(tmp_path).open("a")
    assert ckpt.round == 3 and [h["round"] for h in ckpt.history] == [1, 2, 3]
    assert (tmp_path / "history.jsonl").stat().st_size == ckpt.state["history"]["bytes"]


def test_a_retried_commit_never_duplicates_or_tears_history_lines(tmp_path, monkeypatch):
    """A commit that fails half-way (history appended, checkpoint not written) and is retried
    with a longer batch writes each round's line exactly once."""
    learner = build_learner(LearnerConfig(**CFG))
    store = StateStore(tmp_path)
    store.open("a")
    snaps = [
        make_snapshot(
            round=r,
            version=r,
            node_id="a",
            learner_state=learner.export_state(),
            strategy_state={},
            peers=[],
            meta={},
            record={"round": r},
        )
        for r in (1, 2, 3)
    ]
    store.commit(snaps[0], [snaps[0].record])
    import coterie.node.persistence as P

    real = P.st_save_file
    monkeypatch.setattr(
        P, "st_save_file", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    )
    with pytest.raises(OSError):
        store.commit(snaps[1], [snaps[1].record])
    monkeypatch.setattr(P, "st_save_file", real)
    store.commit(snaps[2], [s.record for s in snaps])  # the writer retries with all pending rounds
    rows = [json.loads(x)["round"] for x in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3]
    assert StateStore(tmp_path).open("a")[1].round == 3


class _BlockingStore:
    """A store whose commits wait for the test to release them."""

    def __init__(self):
        self.release = threading.Semaphore(0)
        self.committed: list[int] = []
        self.round = 0

    def commit(self, snap, records):
        self.release.acquire()
        self.committed.append(snap.round)


def _snap(r):
    return make_snapshot(
        round=r,
        version=r,
        node_id="x",
        learner_state=({}, {}),
        strategy_state={},
        peers=[],
        meta={},
        record={"round": r},
    )


@pytest.mark.parametrize("max_unsaved", [0, 1, 2])
async def test_the_round_loop_never_runs_more_than_max_unsaved_rounds_ahead_of_the_disk(max_unsaved):
    store = _BlockingStore()
    saved: list[int] = []
    ckpt = Checkpointer(
        store,
        max_unsaved,
        Failures(lambda ok: None, lambda *a: None),
        lambda batch, s: saved.extend(x.round for x in batch),
    )
    ckpt.start()
    try:
        for r in range(1, max_unsaved + 1):  # these return while their writes are still held
            await asyncio.wait_for(ckpt.submit(_snap(r)), 10)
        assert ckpt.unsaved == max_unsaved
        nxt = asyncio.create_task(ckpt.submit(_snap(max_unsaved + 1)))
        done, _ = await asyncio.wait({nxt}, timeout=0.3)
        assert not done, "a submit went past the bound of unsaved rounds"
        store.release.release()  # the oldest write completes: now there is room
        await asyncio.wait_for(nxt, 10)
        assert saved[:1] == [1] and ckpt.unsaved <= max_unsaved
        for _ in range(max_unsaved + 1):
            store.release.release()
        await asyncio.wait_for(ckpt.flush(), 10)
        assert saved == list(range(1, max_unsaved + 2))
    finally:
        for _ in range(5):
            store.release.release()
        await ckpt.close(5)


async def test_admin_api_shows_only_checkpointed_rounds(tmp_path, monkeypatch):
    """While round 2's checkpoint is held back, /status and /weights still say round 1."""
    gate = threading.Event()
    real = StateStore.commit

    def commit(self, snap, records):
        if snap.round >= 2:
            gate.wait(30)
        return real(self, snap, records)

    monkeypatch.setattr(StateStore, "commit", commit)
    node = Node(solo_config(tmp_path, 3))
    await node.start()
    try:
        await until(lambda: node.round >= 2 and node.saved["round"] == 1, 30)
        assert node.status()["round"] == 1 and node.weights_view()["round"] == 1
        assert [h["round"] for h in await node.history_view(None)] == [1]
        gate.set()
        await until(lambda: node.done, 30)
        assert node.status()["round"] == 3 and [h["round"] for h in await node.history_view(0)] == [1, 2, 3]
    finally:
        gate.set()
        await node.stop()


async def test_history_in_memory_is_bounded_and_the_file_keeps_everything(tmp_path, monkeypatch):
    monkeypatch.setattr(daemon, "HISTORY_TAIL", 3)
    node = Node(solo_config(tmp_path, 6))
    await run_until_done(node)
    assert [h["round"] for h in node.history] == [4, 5, 6]
    assert [h["round"] for h in await node.history_view(None)] == [4, 5, 6]
    assert [h["round"] for h in await node.history_view(1)] == [2, 3, 4, 5, 6]  # from the file
    assert [h["round"] for h in await node.history_view(4)] == [5, 6]


async def test_a_resumed_node_continues_exactly_as_an_uninterrupted_one(tmp_path):
    """Stop after 2 rounds and resume to 4: every round's published snapshot (weights, version,
    round) is bit-identical to a run that never stopped — optimizer and sampler state included."""
    ref = Node(solo_config(tmp_path / "ref", 4))
    await run_until_done(ref)
    await run_until_done(Node(solo_config(tmp_path / "cut", 2)))
    await run_until_done(Node(solo_config(tmp_path / "cut", 4)))
    shas = [
        [json.loads(x)["snapshot_sha256"] for x in (t / "solo" / "history.jsonl").read_text().splitlines()]
        for t in (tmp_path / "ref", tmp_path / "cut")
    ]
    assert len(shas[0]) == 4 and shas[0] == shas[1]
