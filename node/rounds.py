"""The round loop: train → exchange → publish → checkpoint, one round after another, and the
typed record each round leaves in the history (``RoundRecord``; written as JSON, its keys are the
persistence format and what ``/history`` shows)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from .failures import Backoff
from .memory_release import release_free_memory
from .peering.deadlines import Phase

log = logging.getLogger("coterie.node")

# a pause between rounds at least this long hands the round's freed heap back first (a trim of a
# few hundred MB heap takes milliseconds; a full-rate node relies on the checkpoint writer's)
IDLE_RELEASE_MIN_S = 1.0


@dataclass
class RoundTiming:
    strategy_s: float
    eval_s: float
    peer_calls: int
    exchange_s: float
    exchange_budget_s: float
    calls_failed: int
    calls_abandoned: int
    calls_skipped: int
    loop_stall_s: float

    @classmethod
    def of(cls, phase: Phase, strategy_s: float, eval_s: float, stall_s: float) -> RoundTiming:
        return cls(
            strategy_s=round(strategy_s, 4),
            eval_s=round(eval_s, 4),
            peer_calls=phase.calls,
            exchange_s=round(phase.exchange_s, 4),
            exchange_budget_s=round(phase.budget_s, 3),
            calls_failed=phase.failed,
            calls_abandoned=phase.abandoned,
            calls_skipped=phase.skipped,
            loop_stall_s=round(stall_s, 4),
        )


@dataclass
class RoundRecord:
    """One round, as the history keeps it (``as_dict``: the JSON line, keys in this order)."""

    round: int
    t: float
    duration_s: float
    model_version: int
    train_loss: Any
    eval: dict[str, float]
    weights: dict[str, float]
    contacted: Any
    bytes_sent: Any
    bytes_received: Any
    info: Any
    peers_alive: int
    timing: RoundTiming

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}  # (shallow: values stay as given)
        out["timing"] = asdict(self.timing)
        return out


class RoundLoop:
    """Drives one ``daemon.Node`` (not imported here: the node owns its loop) through its rounds;
    a failed round is reported, backed off and run again."""

    def __init__(self, node: Any):
        self.node = node

    async def wait_for_peers(self) -> None:
        n, cfg = self.node, self.node.cfg
        deadline = time.monotonic() + cfg.start_timeout_s
        while len(n.peers.alive()) < cfg.min_peers and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # poll membership, bounded by start_timeout_s
        if len(n.peers.alive()) < cfg.min_peers:
            log.warning("starting with %d peers (wanted %d)", len(n.peers.alive()), cfg.min_peers)

    async def one(self, rnd: int, t0: float) -> dict[str, float]:
        """Round ``rnd``: the strategy's work, evaluation, publishing, and its checkpoint handed
        to the writer. Returns its evaluation."""
        n = self.node
        at = n.stall_watch.enter  # each phase named: a round stuck in one is reported (stall_watch.py)
        stall0 = n.loop_lag.total_s
        alone = getattr(n.reference, "trains_alone", False)  # a large model's twin: before the rest
        if alone:  # (before the guard's round-start copy: one model less under its transients)
            at(rnd, "local-only twin's training")
            await asyncio.to_thread(n.reference.train, rnd)
        at(rnd, "divergence guard (before)")
        await asyncio.to_thread(n.guard.before_round)
        n.network.begin_round()  # past the discovery threshold: this round's candidates
        # the local-only twin trains in a worker thread while the strategy trains and exchanges
        twin = None if alone else asyncio.ensure_future(asyncio.to_thread(n.reference.train, rnd))
        try:
            at(rnd, "strategy round (train and exchange)")
            with n.network.exchange_phase() as phase:  # peer calls share the round's deadline
                report = await n.strategy.run_round(rnd)
        finally:
            at(rnd, "local-only twin's training")
            if twin is not None:
                await twin
        at(rnd, "divergence guard (after)")
        await asyncio.to_thread(n.guard.after_round)  # a diverged round is rolled back
        at(rnd, "end of round (discovery asks)")
        await n.network.end_round(n.strategy.weights(), report.contacted)
        self.discovery_metrics()
        t_strategy = time.monotonic() - t0
        at(rnd, "evaluation")
        evaluation = await asyncio.to_thread(n.strategy.evaluate)
        # against the local-only reference; backed off, the twin's figures are the node's
        evaluation = await asyncio.to_thread(n.reference.judge, rnd, evaluation, n.strategy.prediction_members())
        t_eval = time.monotonic() - t0 - t_strategy
        t1, done_at = time.monotonic(), time.time()  # the round's own work ends here
        at(rnd, "waiting for the checkpoint writer")
        await n.checkpointer.room()  # at most max_unsaved published rounds not yet on disk
        waited = time.monotonic() - t1
        n.round = rnd
        at(rnd, "publishing")
        await n.publish_round()  # a large model checked off the loop
        sent, received = n.traffic.take_round()
        record = RoundRecord(
            round=rnd,
            t=done_at,
            duration_s=round(t1 - t0, 4),
            model_version=n.version,
            train_loss=report.train_loss,
            eval=evaluation,
            weights=n.strategy.weights(),
            contacted=report.contacted,
            bytes_sent=sent,
            bytes_received=received,
            info=report.info,
            peers_alive=len(n.peers.alive()),
            timing=RoundTiming.of(phase, t_strategy, t_eval, n.loop_lag.total_s - stall0),
        )
        # a copy now; the writer thread encodes and writes it while the next round trains (a large
        # model's own tensors instead: written before this returns, the next round waits for it)
        t2 = time.monotonic()
        at(rnd, "handing the checkpoint over")
        await n.checkpointer.submit(await n._snapshot(record.as_dict()))
        n.m.ckpt_wait.observe(waited + time.monotonic() - t2)
        return evaluation

    def discovery_metrics(self) -> None:
        view = self.node.network.discovery_view()
        m = self.node.m
        views = view.get("views")
        if views is not None:  # the overlay's views and counters (its own gauges, discovery or not)
            m.view_size.labels(view="active").set(len(views["active"]))
            m.view_size.labels(view="passive").set(views["passive"])
            for what, count in views.items():
                if what not in ("active", "passive"):
                    m.overlay_events.labels(what=what).set(count)
        if not view["active"]:
            return
        m.discovery.labels(what="candidates").set(len(view["candidates"]))
        m.discovery.labels(what="hints").set(view["hints"])
        m.discovery.labels(what="scored").set(view["scored"])
        for what in ("explored", "hinted", "asks", "hints_received", "hints_dropped"):
            m.discovery_events.labels(what=what).set(view[what])
        for outcome, count in view["reintroductions"].items():
            m.reintroductions.labels(outcome=outcome).set(count)

    async def run(self) -> None:
        n, cfg = self.node, self.node.cfg
        if cfg.rounds is None or n.round < cfg.rounds:
            await self.wait_for_peers()
        backoff = Backoff()
        while cfg.rounds is None or n.round < cfg.rounds:
            t0 = time.monotonic()
            rnd = n.round + 1
            failure: BaseException | None = None
            try:
                evaluation = await self.one(rnd, t0)
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if me is None or me.cancelling():
                    raise  # the node is stopping
                # a CancelledError from inside the round (a cancelled call leaked into it): a failed round
                failure = RuntimeError("round cancelled from inside")
            except Exception as e:  # noqa: BLE001 - reported (log, /status, health), then retried
                failure = e
            finally:
                n.stall_watch.leave()
            if failure is not None:
                n.round = rnd - 1  # not checkpointed: the round is run again
                delay = backoff.next()
                n.failures.failed("rounds", failure, delay)
                await asyncio.sleep(delay)
                continue
            backoff.reset()
            n.stall_watch.round_done(time.monotonic() - t0)
            n.failures.recovered("rounds")
            n.m.rounds.inc()
            n.m.round_s.observe(time.monotonic() - t0)
            if "test_acc" in evaluation:
                n.m.acc.set(evaluation["test_acc"])
            n.round_log.round_done(rnd, time.monotonic() - t0, evaluation)
            wait = cfg.round_interval_s - (time.monotonic() - t0)
            if wait >= IDLE_RELEASE_MIN_S:
                # at rest until the next round: what this round freed goes back to the OS (the
                # writer's trim ran while the round's last copies were still alive)
                await asyncio.to_thread(release_free_memory)
                wait = cfg.round_interval_s - (time.monotonic() - t0)
            if wait > 0:
                await asyncio.sleep(wait)  # pacing: a deliberately slow node
        await n.checkpointer.flush()  # done means durable
        # at rest for good: the last round's and its write's freed memory goes back (seen on a lone
        # daemon, 21 MB MLP: up to 60 MB resident after the writer's own trim)
        await asyncio.to_thread(release_free_memory)
        n.done = True
        log.info("node %s finished its %d rounds; still serving peers", n.node_id, n.round)
