"""A round that stops making progress is reported, not silent (node/stall_watch.py): the phase it
is stuck in is named in /status and the failures, health flips, the log gets every task's and
thread's stack, and progress clears it. The checkpoint writer dying is a failure too (rounds
would otherwise wait for it for good)."""

from __future__ import annotations

import logging
import threading
import time

from coterie.node.daemon import Node
from coterie.node.failures import Failures
from coterie.node.persistence import StateStore
from coterie.node.stall_watch import Progress, StallWatch
from tests.solo import solo_config, until


async def test_a_round_stuck_on_the_checkpoint_writer_is_reported_with_stacks_and_recovers(
    tmp_path, monkeypatch, caplog
):
    gate = threading.Event()
    real = StateStore.commit

    def commit(self, snap, records):
        if snap.round >= 3:
            gate.wait(60)  # a write that does not come back (a hung disk, a stuck lock)
        return real(self, snap, records)

    monkeypatch.setattr(StateStore, "commit", commit)
    caplog.set_level(logging.WARNING, logger="coterie.node")
    node = Node(solo_config(tmp_path, 6, round_stall_s=1.0))
    await node.start()
    try:
        await until(lambda: "round-stall" in node.failures.active, 30)
        error = node.failures.active["round-stall"]["error"]
        assert "round 4" in error and "waiting for the checkpoint writer" in error, error
        status = node.status()
        assert status["health"] == "failing" and not node.healthy()
        assert status["in_round"]["phase"] == "waiting for the checkpoint writer" and status["in_round"]["stalled"]
        logged = caplog.text
        # the round's whole await chain, down to the wait for the writer
        assert "on a stalled round" in logged and "--- rounds\n" in logged and "checkpointing.py" in logged
        assert "in commit" in logged and "gate.wait(60)" in logged, "the blocked writer thread's stack is missing"
        gate.set()
        await until(lambda: node.done, 30)
        assert node.failures.healthy and node.status()["round"] == 6 and node.status()["in_round"] is None
    finally:
        gate.set()
        await node.stop()


async def test_the_checkpoint_writer_dying_is_a_failure_and_the_round_it_holds_up_is_named(tmp_path):
    node = Node(solo_config(tmp_path, 5, round_stall_s=1.0))
    real = node.checkpointer.on_saved

    def on_saved(batch, seconds):
        if batch[-1].round >= 2:
            raise RuntimeError("a bug after the write")
        real(batch, seconds)

    node.checkpointer.on_saved = on_saved
    await node.start()
    try:
        await until(lambda: "round-stall" in node.failures.active, 30)
        assert "a bug after the write" in node.failures.active["checkpoint"]["error"]
        assert "waiting for the checkpoint writer" in node.failures.active["round-stall"]["error"]
        assert node.status()["round"] == 1 and not node.healthy()
    finally:
        await node.stop()


class _Failures(Failures):
    def __init__(self) -> None:
        super().__init__(lambda ok: None, lambda *a: None)


def test_the_bar_is_the_floor_or_ten_times_the_longest_recent_round():
    watch = StallWatch(_Failures(), stall_s=30.0)
    now = time.monotonic()
    watch.at = Progress(7, "evaluation", now - 40)
    watch.round_done(5.0)  # a slow device: 50 s rounds are not stalls here
    watch.check(now)
    assert watch.stalled is None and watch.view()["stall_after_s"] == 50.0
    watch.check(now + 11)
    assert watch.stalled == watch.at and "round-stall" in watch.failures.active
    watch.enter(7, "waiting for the checkpoint writer")  # progress: cleared
    watch.check(now + 12)
    assert watch.stalled is None and watch.failures.healthy


def test_a_stalled_first_round_is_reported_but_not_worth_a_restart():
    """No round to compare with (a slow device's first round may just be long): the watchdog
    keeps being fed; once rounds have run, a stall past the bar stops it."""
    watch = StallWatch(_Failures(), stall_s=30.0)
    watch.at = Progress(1, "strategy round (train and exchange)", time.monotonic() - 40)
    watch.check()
    assert watch.stalled is not None and not watch.restart_worthy
    watch.leave()
    watch.round_done(2.0)
    watch.at = Progress(2, "evaluation", time.monotonic() - 40)
    watch.check()
    assert watch.restart_worthy


def test_zero_never_flags_a_stall():
    watch = StallWatch(_Failures(), stall_s=0.0)
    watch.at = Progress(1, "evaluation", time.monotonic() - 1e6)
    watch.check()
    assert watch.stalled is None and watch.failures.healthy
