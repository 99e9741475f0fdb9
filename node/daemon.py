"""The node daemon: one long-lived asyncio process per device.

``Node`` is the composition root and the lifecycle: it wires local learning (``learning``), the
collaboration strategy (``strategies``), the peer plane (``peering``: membership, served requests,
the ``NodeNetwork`` a strategy sees; carried by ``transport``), persistence and the admin API, and
runs the loops: membership, rounds (train → exchange → publish → checkpoint), and the servers.
Compute runs in worker threads, so heartbeats and requests keep flowing while a round trains."""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import signal
import sys
import time
from collections import deque
from typing import Any

from .checkpointing import Checkpointer
from .config import PROTOCOL_VERSION, ConfigError, NodeConfig
from .failures import Backoff, Failures
from .fsutil import atomic_write_json
from .learning.guard import RoundGuard
from .learning.learner import Learner
from .logfilter import install_log_filter
from .logs import RoundLog
from .metrics import Metrics
from .peering.admission import Admission
from .peering.faults import with_fault
from .peering.deadlines import Deadlines
from .peering.inbox import PushInbox
from .peering.loop_lag import LoopLag
from .peering.membership import Membership, Settings
from .peering.messages import LocalSnapshot, NodeInfo
from .peering.interfaces import PeerServer, TransportFactory
from .peering.network import NodeNetwork
from .peering.peer_table import PeerTable
from .peering.problems import ProblemLog
from .peering.served import ServedRequests
from .peering.snapshots import PublishBoard, SnapshotCache
from .peering.traffic import TrafficStats
from .privacy import accountant
from .privacy.ledger import PrivacyLedger
from .privacy.mechanisms import PrivateData
from .privacy.purposes import LOSS, purpose, purposes_of
from .persistence import HISTORY_TAIL, Snapshot, StateError, StateStore, make_snapshot
from .strategies.registry import get_strategy

log = logging.getLogger("coterie.node")

CAPABILITIES = ("snapshot", "cross-loss", "cross-gradient", "push-gradient", "gossip")
MODEL_BYTES_FACTOR, MODEL_BYTES_SLACK = 4, 1 << 20  # default max_model_bytes: 4× my model + 1 MiB


def _hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class Node:
    """``transport`` carries the peer plane (default: gRPC on ``cfg.listen``; the in-process
    launcher passes ``transport/inproc.py``'s). ``admin=False`` runs without the HTTP admin API
    (in-process nodes: their launcher reads ``status()`` directly)."""

    def __init__(self, cfg: NodeConfig, learner: Learner | None = None,
                 transport: TransportFactory | None = None, *, admin: bool = True):
        self.cfg = cfg
        if transport is None:  # gRPC with the node's certificate (refuses to start without one unless insecure)
            from .transport.grpc_transport import GrpcTransport
            transport = GrpcTransport.from_config(cfg)
        self.transport = transport
        self.health = transport.health  # what this node tells the transport's health checks
        identity = transport.identity  # the node id the transport's credentials prove, if any
        self.store = StateStore(cfg.state_dir)
        self.store.lock()  # one owner per state dir, for this process's lifetime
        # verified (or refused) before anything slow: a broken state dir fails in a second
        self.node_id, self._checkpoint = self.store.open(cfg.node_id or identity, reset=cfg.reset)
        if identity is not None and identity != self.node_id:
            self.store.unlock()
            raise ConfigError(f"security: the certificate is for node {identity!r}, but the state "
                              f"dir {cfg.state_dir} belongs to {self.node_id!r}")
        if learner is None:
            from .learning.torch_learner import build_learner  # torch-specific code stays behind the interface
            learner = build_learner(cfg.learner)
        self.learner = learner
        self.spec = learner.param_spec()
        self.fingerprint = learner.fingerprint()
        self.labels = dict(cfg.labels)
        if learner.true_cluster is not None:
            self.labels.setdefault("cluster", str(learner.true_cluster))
        self.labels.setdefault("strategy", cfg.strategy)
        cfg.labels.update(self.labels)

        self.metrics = Metrics()
        self.traffic = TrafficStats(self.metrics)
        self.m_rounds = self.metrics.counter("coterie_rounds_total", "Completed rounds")
        self.m_round_s = self.metrics.histogram("coterie_round_duration_seconds", "Round wall time",
                                                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
        self.m_peers = self.metrics.gauge("coterie_peers", "Known peers by state", ("state",))
        self.m_rejected = self.metrics.counter("coterie_rejected_total", "Peer inputs rejected", ("kind",))
        self.m_round = self.metrics.gauge("coterie_round", "Current round")
        self.m_acc = self.metrics.gauge("coterie_test_accuracy_ratio", "Test accuracy after the last round (0..1)")
        self.m_eps = self.metrics.gauge("coterie_privacy_epsilon",
                                        "ε released about this node's data, all peers composed (at privacy.delta)")
        self.m_eps_peer = self.metrics.gauge("coterie_privacy_peer_epsilon",
                                             "ε released about this node's data to one peer", ("peer",))
        self.m_eps_budget = self.metrics.gauge("coterie_privacy_budget_epsilon", "Configured total ε budget")
        self.m_releases = self.metrics.counter("coterie_privacy_releases_total",
                                               "Answers computed on this node's data that left it", ("purpose",))
        self.m_ckpt_s = self.metrics.histogram("coterie_checkpoint_write_seconds",
                                               "Checkpoint write (background thread)",
                                               buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.m_ckpt_wait = self.metrics.histogram("coterie_checkpoint_wait_seconds",
                                                  "Round loop time spent on checkpoints (snapshot + waiting for the writer)",
                                                  buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))

        seed = int(hashlib.sha256(f"{cfg.seed}:{self.node_id}".encode()).hexdigest()[:8], 16)
        # the peer plane: who is out there, what this node publishes, what it pulled and was pushed
        mcfg = cfg.membership
        self.loop_lag = LoopLag()  # how late the event loop runs: stalls show per round
        self.peers = PeerTable(self.node_id, cfg.suspect_after_s, cfg.dead_after_s,
                               reconnect_min_s=mcfg.reconnect_min_s, reconnect_max_s=mcfg.reconnect_max_s)
        self.problems = ProblemLog(on_rejected=lambda: self.m_rejected.labels(kind="input").inc())
        self.board = PublishBoard()
        self.cache = SnapshotCache(cfg.snapshot_cache_bytes)
        self.inbox = PushInbox()
        self.client = self.transport.connect(self.node_id, self.traffic)
        self.membership = Membership(self.info, self.position, self.peers, self.client, self.problems,
                                     bootstrap=cfg.peers, heartbeat_interval_s=cfg.heartbeat_interval_s,
                                     request_timeout_s=cfg.request_timeout_s, link_delay_s=cfg.delay_ms / 1000,
                                     rng=random.Random(seed), on_gauges=self._peer_gauges,
                                     settings=Settings.from_config(mcfg), loop_lag=self.loop_lag)
        deadlines = Deadlines(cfg.request_timeout_s + 2 * cfg.delay_ms / 1000, floor_s=cfg.deadline_floor_s,
                              mult=cfg.deadline_mult)
        # privacy: everything computed on my data that leaves (served or sent) goes through one door
        self.ledger = PrivacyLedger(self.store.dir, delta=cfg.privacy.delta, budget=cfg.privacy.budget_epsilon,
                                    peer_budget=cfg.privacy.peer_budget_epsilon, on_change=self._privacy_gauges)
        self._privacy_gauges()
        self.private = PrivateData(learner, cfg.privacy, self.ledger)
        self.serves = (tuple(cfg.privacy.serve_purposes) if cfg.privacy.serve_purposes is not None
                       else purposes_of(cfg.strategy))
        self.network = NodeNetwork(self.node_id, self.client, self.peers, self.cache, self.inbox,
                                   lambda: self.board.current, self.spec, self.problems, self.private,
                                   labels=self.labels, request_timeout_s=cfg.request_timeout_s,
                                   deadlines=deadlines, exchange_timeout_s=cfg.exchange_timeout_s,
                                   on_call_failed=self.membership.suspect_hint, watch=cfg.watch_snapshots)
        self.strategy = get_strategy(cfg.strategy)(self.node_id, learner, self.network,
                                                   cfg.strategy_params, seed=seed)
        self._budget_noted: dict[tuple[str, str], float] = {}
        m_div = self.metrics.counter("coterie_training_divergences_total",
                                     "Diverged steps or rounds rolled back", ("where",))
        self.guard = RoundGuard(learner, self.strategy, lambda where, msg: (
            m_div.labels(where=where).inc(), self.problems.note("this node (training)", msg)))
        self.admission = Admission(cfg.limits, on_refused=self._over_budget)
        self.served = ServedRequests(self.node_id, self.info, self.membership, learner, self.spec,
                                     self.strategy, self.board, self.cache, self.inbox, self.problems,
                                     self.private, self.serves,
                                     on_refused=lambda kind: self.m_rejected.labels(kind=kind).inc(),
                                     admission=self.admission, push_policy=cfg.limits,
                                     compute_workers=cfg.limits.compute_workers)

        self.round = 0
        self.version = 0
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_TAIL)  # checkpointed rounds; the file keeps all
        self.saved: dict[str, Any] = {"round": 0, "version": 0, "weights": {}, "public_state": {}}
        self._spare_tensors: dict[str, Any] | None = None  # a written snapshot's buffers, reused by the next
        self.last_eval: dict[str, float] = {}
        self.done = False
        self.started = time.time()
        self.address = ""
        self.admin_url = ""
        self.round_log = RoundLog(log)  # per-round lines only while rounds are slow, else summaries
        self._tasks: list[asyncio.Task] = []
        self._server: PeerServer | None = None
        self.serve_admin = admin
        self._admin = None
        self._round_task: asyncio.Task | None = None
        self._health_tasks: set[asyncio.Task] = set()
        self.failures = Failures(self._set_serving, lambda part, msg: self.problems.note(f"this node ({part})", msg))
        self.checkpointer = Checkpointer(self.store, cfg.checkpoint_max_unsaved_rounds, self.failures,
                                         self._on_saved)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        resumed = self._restore()
        self.publish()
        if not resumed:  # round 0 on disk first: identity or history never exist without a checkpoint
            await asyncio.to_thread(self.store.commit, await self._snapshot(None), [])
        self.checkpointer.start()
        # both ways, for the server and this node's client, now that the model's size is known
        self.transport.max_model_bytes = self.model_limit()
        # a testbed bad actor corrupts what it serves (peering/faults.py); it learns normally
        handler = with_fault(self.served, self.cfg.faulty)
        self._server = await self.transport.serve(handler, self.traffic)
        self.address = self._server.address
        if self.serve_admin:
            from .admin import start_admin
            ahost, aport = _hostport(self.cfg.admin_listen)
            self._admin, bound = await start_admin(self, ahost, aport)
            self.admin_url = f"http://{'127.0.0.1' if ahost in ('0.0.0.0', '::', '') else ahost}:{bound}"
        atomic_write_json(self.store.dir / "node.json", {
            "node_id": self.node_id, "address": self.address, "admin_url": self.admin_url,
            "pid": os.getpid(), "started": self.started})
        log.info("node %s up: peer %s, admin %s, strategy %s, device %s, round %d",
                 self.node_id, self.address, self.admin_url, self.cfg.strategy, self.learner.device, self.round)
        self._tasks.append(asyncio.create_task(self.loop_lag.run(), name="loop-lag"))
        if self.cfg.privacy.enabled and purposes_of(self.cfg.strategy) + self.serves:
            self._tasks.append(asyncio.create_task(asyncio.to_thread(self._warm_privacy), name="privacy-warmup"))
        self._tasks.append(asyncio.create_task(self.membership.run(), name="membership"))
        self._round_task = asyncio.create_task(self._round_loop(), name="rounds")
        self._round_task.add_done_callback(self._round_loop_ended)
        self._tasks.append(self._round_task)

    async def stop(self) -> bool:
        """Stop everything; write the checkpoints still pending. True when nothing is lost and
        no failure is outstanding (the process exit code says so)."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.network.close()
        saved = await self.checkpointer.close(timeout=60.0)
        if self._server is not None:
            await self._server.stop()
        if self._admin is not None:
            await self._admin.cleanup()
        await self.client.close()
        self.served.close()
        self.store.unlock()
        clean = saved and self.failures.healthy
        log.log(logging.INFO if clean else logging.ERROR, "node %s stopped at round %d (checkpointed: %d)%s",
                self.node_id, self.round, self.saved["round"],
                "" if clean else f" with unresolved failures: {self.failures.summary() or 'unsaved rounds'}")
        return clean

    def _warm_privacy(self) -> None:
        """Import opacus' accountant and trace the per-sample gradient once, in the background:
        both take seconds of CPU the first time, which the first peer request should not wait for."""
        try:
            accountant.warm()
            kinds = {purpose(p).kind for p in purposes_of(self.cfg.strategy) + self.serves}
            if kinds - {LOSS} and self.learner.num_samples("train"):
                self.learner.clipped_gradient_sum(None, "train", [0], 1.0)
        except Exception:  # only a warm-up: the real request reports any problem
            log.exception("privacy warm-up failed")

    def healthy(self) -> bool:
        return (self.failures.healthy and self._round_task is not None
                and (not self._round_task.done() or self.done))

    def _set_serving(self, serving: bool) -> None:
        task = asyncio.get_running_loop().create_task(self.health.set(serving))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    def _round_loop_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.failures.failed("rounds", task.exception(), None)

    def info(self) -> NodeInfo:
        return NodeInfo(self.node_id, PROTOCOL_VERSION, self.fingerprint, CAPABILITIES, self.address,
                        self.admin_url, self.labels)

    def position(self) -> tuple[int, int]:
        """(round, published snapshot version), as heartbeats announce them."""
        return self.round, self.version

    def _privacy_gauges(self, peer: str | None = None, purpose: str | None = None) -> None:
        self.m_eps.set(self.ledger.epsilon())
        self.m_eps_budget.set(self.ledger.budget)
        for p in ([peer] if peer else list(self.ledger.peers)):
            self.m_eps_peer.labels(peer=p).set(self.ledger.epsilon(p))
        if purpose:
            self.m_releases.labels(purpose=purpose).inc()

    def model_limit(self) -> int:
        """Largest model a peer may send or serve: configured, else a small multiple of this node's
        own model (a snapshot carries at most the params and two extra groups of their size)."""
        if self.cfg.max_model_bytes is not None:
            return self.cfg.max_model_bytes
        own = LocalSnapshot(self.node_id, 0, 0, {"params": self.learner.get_params()}).encoded
        return MODEL_BYTES_FACTOR * len(own) + MODEL_BYTES_SLACK

    def _over_budget(self, peer: str, why: str) -> None:
        self.m_rejected.labels(kind=f"limit_{why}").inc()
        now = time.monotonic()
        if now - self._budget_noted.get((peer, why), -1e9) >= 10.0:  # a flood is one problem, not 50
            self._budget_noted[(peer, why)] = now
            self.problems.note(peer, f"over its {why} budget: requests refused (RESOURCE_EXHAUSTED)")

    def _peer_gauges(self, counts: dict[str, int]) -> None:
        for state, n in counts.items():
            self.m_peers.labels(state=state).set(n)

    # ------------------------------------------------------------------ persistence
    def _restore(self) -> bool:
        """Apply the checkpoint ``StateStore.open`` verified; False for a fresh node."""
        ckpt, self._checkpoint = self._checkpoint, None
        if ckpt is None:
            return False
        st = ckpt.state
        if st.get("fingerprint") != self.fingerprint:
            raise StateError(f"{ckpt.path} is for another architecture "
                             f"({str(st.get('fingerprint'))[:12]} ≠ {self.fingerprint[:12]})")
        if st.get("strategy") != self.cfg.strategy:
            raise StateError(f"{ckpt.path} was written by strategy {st.get('strategy')!r}, this node runs "
                             f"{self.cfg.strategy!r}: start with --reset to begin again under it")
        try:
            self.learner.import_state(*ckpt.learner_state())
            self.strategy.load_state_dict(ckpt.strategy_state())
            self.peers.load_json(st["peers"])
        except StateError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever does not fit, named with the file
            raise StateError(f"{ckpt.path} does not fit this node: {type(e).__name__}: {e}") from None
        self.round = ckpt.round
        self.version = ckpt.version - 1  # publish() re-issues the checkpointed version
        self.membership.pending.update(p["address"] for p in st["peers"])
        self.history.extend(ckpt.history)
        self._set_saved(ckpt.round, ckpt.version, st, ckpt.history[-1] if ckpt.history else None)
        log.info("resumed %s at round %d (version %d) from %s", self.node_id, self.round, ckpt.version, ckpt.path)
        return True

    async def _snapshot(self, record: dict[str, Any] | None) -> Snapshot:
        """A consistent copy of this node's state now (between rounds). Strategy state and peers
        are read on the loop, where served requests also touch them; the learner copies its
        tensors under its lock in a thread, into the buffers of a snapshot already written."""
        strategy_state = self.strategy.state_dict()
        peers = self.peers.to_json()
        meta = {"fingerprint": self.fingerprint, "strategy": self.cfg.strategy, "time": time.time(),
                "weights": self.strategy.weights(), "public_state": self.strategy.public_state()}
        reuse, self._spare_tensors = self._spare_tensors, None
        learner_state = await asyncio.to_thread(self.learner.export_state, reuse)
        published = self.board.current

        def name_snapshot() -> None:  # the published snapshot's sha256, for the history line
            record["snapshot_sha256"] = published.digest  # encodes it once, off the loop

        return make_snapshot(round=self.round, version=self.version, node_id=self.node_id,
                             learner_state=learner_state, strategy_state=strategy_state, peers=peers,
                             meta=meta, record=record, prepare=name_snapshot if record is not None else None)

    def _set_saved(self, rnd: int, version: int, state: dict[str, Any], record: dict[str, Any] | None) -> None:
        self.saved = {"round": rnd, "version": version, "weights": state.get("weights", {}),
                      "public_state": state.get("public_state", {})}
        if record is not None:
            self.last_eval = record.get("eval", {})
        self.m_round.set(rnd)

    def _on_saved(self, batch: list[Snapshot], seconds: float) -> None:
        """The writer made these snapshots durable: the admin API now shows them."""
        records = [s.record for s in batch if s.record is not None]
        self.history.extend(records)
        self._spare_tensors = batch[-1].learner_tensors
        last = batch[-1]
        self._set_saved(last.round, last.version, last.state, records[-1] if records else None)
        self.m_ckpt_s.observe(seconds)

    async def history_view(self, since: int | None) -> list[dict[str, Any]]:
        """Checkpointed rounds after ``since`` (default: the in-memory tail), from the file when
        they go back further than the tail."""
        if since is None or (self.history and since >= self.history[0]["round"] - 1) or self.saved["round"] <= since:
            return [r for r in self.history if since is None or r["round"] > since]
        return await asyncio.to_thread(lambda: list(self.store.history_since(since)))

    # ------------------------------------------------------------------ publishing
    def publish(self) -> None:
        shared = self.strategy.shared_params()
        groups = {"params": shared if shared is not None else self.learner.get_params()}
        for name, tensors in self.strategy.published_extras().items():
            groups[f"x:{name}"] = tensors
        groups = self.guard.publishable(groups)  # nothing non-finite leaves the node
        self.version += 1
        self.board.publish(LocalSnapshot(self.node_id, self.version, self.round, groups))

    # ------------------------------------------------------------------ round loop
    async def _wait_for_peers(self) -> None:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while len(self.peers.alive()) < self.cfg.min_peers and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # poll membership, bounded by start_timeout_s
        if len(self.peers.alive()) < self.cfg.min_peers:
            log.warning("starting with %d peers (wanted %d)", len(self.peers.alive()), self.cfg.min_peers)

    async def _round_loop(self) -> None:
        if self.cfg.rounds is None or self.round < self.cfg.rounds:
            await self._wait_for_peers()
        backoff = Backoff()
        while self.cfg.rounds is None or self.round < self.cfg.rounds:
            t0 = time.monotonic()
            stall0 = self.loop_lag.total_s
            rnd = self.round + 1
            try:
                await asyncio.to_thread(self.guard.before_round)
                with self.network.exchange_phase() as phase:  # peer calls share the round's deadline
                    report = await self.strategy.run_round(rnd)
                await asyncio.to_thread(self.guard.after_round)  # a diverged round is rolled back
                t_strategy = time.monotonic() - t0
                evaluation = await asyncio.to_thread(self.strategy.evaluate)
                t_eval = time.monotonic() - t0 - t_strategy
                t1, done_at = time.monotonic(), time.time()  # the round's own work ends here
                await self.checkpointer.room()  # at most max_unsaved published rounds not yet on disk
                waited = time.monotonic() - t1
                self.round = rnd
                self.publish()
                sent, received = self.traffic.take_round()
                record = {"round": rnd, "t": done_at, "duration_s": round(t1 - t0, 4),
                          "model_version": self.version, "train_loss": report.train_loss, "eval": evaluation,
                          "weights": self.strategy.weights(), "contacted": report.contacted,
                          "bytes_sent": sent, "bytes_received": received, "info": report.info,
                          "peers_alive": len(self.peers.alive()),
                          "timing": {"strategy_s": round(t_strategy, 4), "eval_s": round(t_eval, 4),
                                     "peer_calls": phase["calls"],
                                     "exchange_s": round(phase.get("exchange_s", 0.0), 4),
                                     "exchange_budget_s": round(phase["budget_s"], 3),
                                     "calls_failed": phase["failed"], "calls_abandoned": phase["abandoned"],
                                     "calls_skipped": phase["skipped"],
                                     "loop_stall_s": round(self.loop_lag.total_s - stall0, 4)}}
                # a copy now; the writer thread encodes and writes it while the next round trains
                t2 = time.monotonic()
                await self.checkpointer.submit(await self._snapshot(record))
                self.m_ckpt_wait.observe(waited + time.monotonic() - t2)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - reported (log, /status, health), then retried
                self.round = rnd - 1  # not checkpointed: the round is run again
                delay = backoff.next()
                self.failures.failed("rounds", e, delay)
                await asyncio.sleep(delay)
                continue
            backoff.reset()
            self.failures.recovered("rounds")
            self.m_rounds.inc()
            self.m_round_s.observe(time.monotonic() - t0)
            if "test_acc" in evaluation:
                self.m_acc.set(evaluation["test_acc"])
            self.round_log.round_done(rnd, time.monotonic() - t0, evaluation)
            wait = self.cfg.round_interval_s - (time.monotonic() - t0)
            if wait > 0:
                await asyncio.sleep(wait)  # pacing: a deliberately slow node
        await self.checkpointer.flush()  # done means durable
        self.done = True
        log.info("node %s finished its %d rounds; still serving peers", self.node_id, self.round)

    # ------------------------------------------------------------------ admin views
    def status(self) -> dict[str, Any]:
        # round/model_version are the checkpointed ones: a restart never rolls back what is shown
        return {"node_id": self.node_id, "round": self.saved["round"], "model_version": self.saved["version"],
                "unsaved_rounds": self.round - self.saved["round"],
                "health": "ok" if self.healthy() else "failing", "failures": self.failures.view(),
                "strategy": self.cfg.strategy, "device": self.learner.device,
                "peers_alive": len(self.peers.alive()), "peers_known": len(self.peers.records),
                "uptime_s": round(time.time() - self.started, 3), "done": self.done,
                "rounds_target": self.cfg.rounds, "address": self.address, "admin_url": self.admin_url,
                "fingerprint": self.fingerprint, "labels": self.labels, "last_eval": self.last_eval,
                "strategy_state": self.strategy.public_state(), "problems": self.problems.recent(10),
                "faulty": self.cfg.faulty, "mtls": self.transport.mtls,
                "admission": self.admission.view(),
                "membership": self.membership_view(), "privacy": self.privacy_view()}

    def privacy_view(self) -> dict[str, Any]:
        """The privacy ledger (ε per peer and in total) and the knobs that bound it."""
        p = self.cfg.privacy
        return {"enabled": p.enabled, "noise_multiplier": p.noise_multiplier, "grad_clip": p.grad_clip,
                "loss_clip": p.loss_clip, "min_batch": p.min_batch, "serves": list(self.serves),
                **self.ledger.view()}

    def membership_view(self) -> dict[str, Any]:
        """The peer plane's own health: SWIM counters, candidate set, channels, loop lag."""
        m = self.membership
        return {"incarnation": m.incarnation, "candidates": len(m.pending),
                "candidates_dropped": m.pending.dropped, "candidates_forgotten": m.pending.forgotten_total,
                "channels": self.client.channels(), "channels_evicted": self.client.evicted,
                "snapshot_cache_bytes": self.cache.bytes, "loop_lag_max_s": round(self.loop_lag.max_s, 4),
                **m.stats}

    def peers_table(self) -> list[dict[str, Any]]:
        weights = self.strategy.weights()
        rows = self.peers.view()
        for r in rows:
            r["weight"] = weights.get(r["node_id"], 0.0)
            snap = self.cache.get(r["node_id"])
            r["cached_version"] = snap.version if snap else None
        return rows

    def weights_view(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "round": self.saved["round"], "strategy": self.cfg.strategy,
                "weights": self.saved["weights"], "strategy_state": self.saved["public_state"]}


def run_node(cfg: NodeConfig) -> int:
    """Run a node until SIGTERM/SIGINT. Returns the process exit code."""
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    install_log_filter()  # peers control much of what gets logged: bounded lines, repeats summarised

    async def main() -> int:
        try:
            node = Node(cfg)
        except (StateError, ConfigError, ValueError, OSError) as e:  # OSError: a state dir it cannot create
            print(f"coterie: cannot start node: {e}", file=sys.stderr)
            return 1
        try:
            await node.start()
        except (StateError, OSError, ValueError) as e:
            print(f"coterie: cannot start node: {e}", file=sys.stderr)
            await node.stop()
            return 1
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        if not await node.stop():
            print(f"coterie: node stopped with unresolved failures: "
                  f"{node.failures.summary() or 'completed rounds not checkpointed'}", file=sys.stderr)
            return 1
        return 0

    return asyncio.run(main())
