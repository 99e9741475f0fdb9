"""A large model's checkpoint is written from the model's own tensors (issue 34 item 2). On main the
round loop handed the writer private copies of the model, Adam's two moments and the local twin
(83 MB with the 21 MB MLP) and went on training while they were written: the largest transient
of a round. Now, for a model over ``daemon.SPARE_BUFFERS_MAX_BYTES`` (set to 0 here, so that a
small model takes that path), the snapshot holds the live tensors and ``submit`` returns once
they are durable; a write that fails is copied before the round loop goes on, and retried from
those copies. The store's atomic write (and so the kill -9 guarantees of test_persistence.py) is
the same code either way."""

from __future__ import annotations

import asyncio
import json

import torch

from coterie.node import daemon
from coterie.node.checkpointing import Checkpointer
from coterie.node.daemon import Node
from coterie.node.failures import Failures
from coterie.node.persistence import StateStore, make_snapshot, read_checkpoint
from tests.solo import run_until_done, solo_config


def _solo(path, rounds):
    return solo_config(path, rounds, learner={"model": "mlp", "model_params": {"hidden": [32]}, "optimizer": "adam"})


async def test_a_large_models_snapshot_holds_its_own_tensors_and_is_durable_before_the_next_round(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(daemon, "SPARE_BUFFERS_MAX_BYTES", 0)
    node = Node(_solo(tmp_path, 3))
    submitted: list[tuple[int, int, bool]] = []  # (round of the snapshot, round durable on return, shares storage)
    real = node.checkpointer.submit

    async def submit(snap):
        live = {p.untyped_storage().data_ptr() for p in node.learner.model.parameters()}
        held = {t.untyped_storage().data_ptr() for k, t in snap.tensors.items() if k.startswith("learner/model/")}
        await real(snap)
        submitted.append((snap.round, node.store.round, held <= live))

    node.checkpointer.submit = submit
    await run_until_done(node)
    # main: copies (False), and each round's write still pending when the next round began
    assert submitted[-3:] == [(1, 1, True), (2, 2, True), (3, 3, True)]


async def test_a_resumed_node_continues_exactly_as_an_uninterrupted_one_from_live_checkpoints(tmp_path, monkeypatch):
    """test_persistence's resume test, the checkpoints written from the live tensors: every round's
    published snapshot is bit-identical to a run that never stopped, Adam's state included."""
    monkeypatch.setattr(daemon, "SPARE_BUFFERS_MAX_BYTES", 0)
    ref = Node(_solo(tmp_path / "ref", 4))
    await run_until_done(ref)
    await run_until_done(Node(_solo(tmp_path / "cut", 2)))
    await run_until_done(Node(_solo(tmp_path / "cut", 4)))
    shas = [
        [json.loads(x)["snapshot_sha256"] for x in (t / "solo" / "history.jsonl").read_text().splitlines()]
        for t in (tmp_path / "ref", tmp_path / "cut")
    ]
    assert len(shas[0]) == 4 and shas[0] == shas[1]


class _FailingOnce(StateStore):
    """A store whose first commit fails after reading every tensor (a full disk, say)."""

    failed = 0

    def commit(self, snap, records):
        if not self.failed:
            self.failed += 1
            raise OSError(28, "No space left on device")
        return super().commit(snap, records)


async def test_a_failed_live_write_is_retried_from_copies_of_its_round(tmp_path):
    store = _FailingOnce(tmp_path / "state")
    store.open("x")
    failures = Failures(lambda ok: None, lambda *a: None)
    ckpt = Checkpointer(store, 1, failures, lambda batch, s: None)
    ckpt.start()
    weights = torch.arange(6, dtype=torch.float32)
    try:
        snap = make_snapshot(
            round=1,
            version=1,
            node_id="x",
            learner_state=({"model/w": weights}, {}),
            strategy_state={},
            peers=[],
            meta={},
            record={"round": 1},
            live=True,
        )
        await asyncio.wait_for(ckpt.submit(snap), 30)  # returns once the failed write made copies
        assert store.failed == 1 and "checkpoint" in failures.active
        weights.add_(100.0)  # the next round trains: the retry must not see it
        await asyncio.wait_for(ckpt.flush(), 30)
    finally:
        await ckpt.close(5)
    saved = read_checkpoint(store.checkpoints()[-1]).tensors["learner/model/w"]
    assert torch.equal(saved, torch.arange(6, dtype=torch.float32))
