"""Checkpoints off the critical path: the round loop hands over a ``Snapshot`` (private copies,
taken in milliseconds) and goes on training while a worker thread encodes, hashes and writes
it. At most ``max_unsaved`` completed rounds are ever not yet durable — the rounds a ``kill -9``
may lose; 0 makes every round wait for its own write. A write that fails is retried with
backoff (the failure is reported, so health flips) until the disk takes it again; snapshots that
queue up meanwhile are written as one commit (their history lines, the newest checkpoint).

A *live* snapshot (a large model's: ``Snapshot.live``) holds the model's and optimizer's own
tensors instead of copies — model-sized staging copies, held while the next round trains, were
the largest part of a node's peak (issue 34). ``submit`` then waits until it is durable: the
round loop does not change the model while the writer reads it. If its write fails, the writer
copies it (``Snapshot.detach``) before the loop goes on, and retries from the copies."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from .failures import Backoff, Failures
from .memory_release import release_free_memory
from .persistence import Snapshot, StateStore

log = logging.getLogger("coterie.node")


class Checkpointer:
    def __init__(
        self, store: StateStore, max_unsaved: int, failures: Failures, on_saved: Callable[[list[Snapshot], float], None]
    ):
        self.store = store
        self.max_unsaved = max_unsaved
        self.failures = failures
        self.on_saved = on_saved  # (snapshots now durable, seconds the write took), on the loop
        self._pending: list[Snapshot] = []  # submitted, not yet durable (incl. the one being written)
        self._cond = asyncio.Condition()
        self._task: asyncio.Task | None = None

    @property
    def unsaved(self) -> int:
        return len(self._pending)

    @property
    def failing(self) -> bool:
        return "checkpoint" in self.failures.active

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="checkpoint")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        # the writer gone, rounds would wait at room() for good: say so (the stall watch also will)
        if not task.cancelled() and (error := task.exception()) is not None:
            self.failures.failed("checkpoint", error, None)

    async def _until(self, ready: Callable[[], bool]) -> None:
        async with self._cond:
            await self._cond.wait_for(ready)

    async def room(self) -> None:
        """Wait until one more completed round may be unsaved. The round loop calls this before
        it publishes a round, so published-but-unsaved rounds never exceed the bound (with
        the default of 1: round r+1 is published once round r's write is done)."""
        await self._until(lambda: self.unsaved <= max(self.max_unsaved - 1, 0))

    async def submit(self, snap: Snapshot) -> None:
        """Queue ``snap`` for writing (after ``room``); with a bound of 0, wait until it is durable;
        a live snapshot, until it is durable or holds copies (a failed write)."""
        await self.room()
        async with self._cond:
            self._pending.append(snap)
            self._cond.notify_all()
        if self.max_unsaved == 0:
            await self.flush()
        elif snap.live:
            await self._until(lambda: not snap.live or snap not in self._pending)

    async def flush(self) -> None:
        await self._until(lambda: not self._pending)

    async def close(self, timeout: float) -> bool:
        """Write what is pending (unless writes are failing) and stop; True if nothing is lost."""
        ok = True
        if self._pending and not self.failing:
            try:
                await asyncio.wait_for(self.flush(), timeout)
            except asyncio.TimeoutError:
                pass
        if self._pending:
            log.error(
                "stopping with %d completed rounds not checkpointed (last durable: round %d)",
                len(self._pending),
                self.store.round,
            )
            ok = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        return ok

    def _write(self, batch: list[Snapshot], records: list[dict]) -> None:
        try:
            for snap in batch:
                if snap.prepare is not None:
                    snap.prepare()
                    snap.prepare = None
            self.store.commit(batch[-1], records)
        except BaseException:
            for snap in batch:  # the round loop waits on a live one: copy it before it goes on
                if snap.live:
                    snap.detach()
            raise

    async def _run(self) -> None:
        backoff = Backoff()
        while True:
            await self._until(lambda: bool(self._pending))
            batch = list(self._pending)
            records = [s.record for s in batch if s.record is not None]
            t0 = time.perf_counter()
            try:
                await asyncio.to_thread(self._write, batch, records)
            except Exception as e:  # noqa: BLE001 - any failure: report, back off, retry
                delay = backoff.next()
                self.failures.failed("checkpoint", e, delay)
                async with self._cond:  # a live snapshot is copies now: its round loop may go on
                    self._cond.notify_all()
                await asyncio.sleep(delay)
                continue
            seconds = time.perf_counter() - t0
            backoff.reset()
            self.failures.recovered("checkpoint")
            async with self._cond:
                del self._pending[: len(batch)]
                self._cond.notify_all()
            self.on_saved(batch, seconds)
            del batch, records  # the written copies, unless on_saved kept them for reuse
            await asyncio.to_thread(release_free_memory)  # at rest: what the round freed goes back
