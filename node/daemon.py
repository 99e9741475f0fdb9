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
from typing import Any

from .config import PROTOCOL_VERSION, ConfigError, NodeConfig
from .fsutil import atomic_write_json
from .learning.learner import Learner
from .logs import RoundLog
from .metrics import Metrics
from .peering.faults import with_fault
from .peering.inbox import PushInbox
from .peering.membership import Membership
from .peering.messages import LocalSnapshot, NodeInfo
from .peering.interfaces import PeerServer, TransportFactory
from .peering.network import NodeNetwork
from .peering.peer_table import PeerTable
from .peering.problems import ProblemLog
from .peering.served import ServedRequests
from .peering.snapshots import PublishBoard, SnapshotCache
from .peering.traffic import TrafficStats
from .persistence import StateError, StateStore
from .strategies.registry import get_strategy

log = logging.getLogger("coterie.node")

CAPABILITIES = ("snapshot", "cross-loss", "cross-gradient", "push-gradient", "gossip")


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
        self.store = StateStore(cfg.state_dir)
        self.node_id = self.store.node_id(cfg.node_id)
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

        seed = int(hashlib.sha256(f"{cfg.seed}:{self.node_id}".encode()).hexdigest()[:8], 16)
        # the peer plane: who is out there, what this node publishes, what it pulled and was pushed
        self.peers = PeerTable(self.node_id, cfg.suspect_after_s, cfg.dead_after_s)
        self.problems = ProblemLog(on_rejected=lambda: self.m_rejected.labels(kind="input").inc())
        self.board = PublishBoard()
        self.cache = SnapshotCache()
        self.inbox = PushInbox()
        if transport is None:
            from .transport.grpc_transport import GrpcTransport
            transport = GrpcTransport.from_config(cfg)
        self.transport = transport
        self.client = transport.connect(self.node_id, self.traffic)
        self.membership = Membership(self.info, self.position, self.peers, self.client, self.problems,
                                     bootstrap=cfg.peers, heartbeat_interval_s=cfg.heartbeat_interval_s,
                                     request_timeout_s=cfg.request_timeout_s, link_delay_s=cfg.delay_ms / 1000,
                                     rng=random.Random(seed), on_gauges=self._peer_gauges)
        self.network = NodeNetwork(self.node_id, self.client, self.peers, self.cache, self.inbox,
                                   lambda: self.board.current, self.spec, self.problems,
                                   labels=self.labels, request_timeout_s=cfg.request_timeout_s)
        self.strategy = get_strategy(cfg.strategy)(self.node_id, learner, self.network,
                                                   cfg.strategy_params, seed=seed)
        self.served = ServedRequests(self.node_id, self.info, self.membership, learner, self.spec,
                                     self.strategy, self.board, self.cache, self.inbox, self.problems,
                                     on_refused=lambda kind: self.m_rejected.labels(kind=kind).inc())

        self.round = 0
        self.version = 0
        self.history: list[dict[str, Any]] = []
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

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._restore()
        self.publish()
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
        self._tasks.append(asyncio.create_task(self.membership.run(), name="membership"))
        self._round_task = asyncio.create_task(self._round_loop(), name="rounds")
        self._tasks.append(self._round_task)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.stop()
        if self._admin is not None:
            await self._admin.cleanup()
        await self.client.close()
        log.info("node %s stopped at round %d", self.node_id, self.round)

    def healthy(self) -> bool:
        return self._round_task is not None and (not self._round_task.done() or self.done)

    def info(self) -> NodeInfo:
        return NodeInfo(self.node_id, PROTOCOL_VERSION, self.fingerprint, CAPABILITIES, self.address,
                        self.admin_url, self.labels)

    def position(self) -> tuple[int, int]:
        """(round, published snapshot version), as heartbeats announce them."""
        return self.round, self.version

    def _peer_gauges(self, counts: dict[str, int]) -> None:
        for state, n in counts.items():
            self.m_peers.labels(state=state).set(n)

    # ------------------------------------------------------------------ persistence
    def _restore(self) -> None:
        restored = self.store.load(self.learner)
        if restored is None:
            return
        meta, strategy_state, peers = restored
        if meta.get("fingerprint") not in (None, self.fingerprint):
            raise StateError(f"checkpoint in {self.store.dir} is for another architecture "
                             f"({meta.get('fingerprint', '')[:12]} ≠ {self.fingerprint[:12]})")
        self.round = int(meta["round"])
        self.version = int(meta["version"]) - 1  # publish() below re-issues the checkpointed version
        self.strategy.load_state_dict(strategy_state)
        self.peers.load_json(peers)
        self.membership.pending.update(p["address"] for p in peers)
        self.history = self.store.read_history(upto_round=self.round)
        self.store.rewrite_history(self.history)
        if self.history:
            self.last_eval = self.history[-1].get("eval", {})
        log.info("resumed %s at round %d (version %d) from %s", self.node_id, self.round, self.version + 1,
                 self.store.current())

    def _checkpoint(self) -> None:
        self.store.save(self.round, self.version, self.learner, self.strategy.state_dict(),
                        self.peers.to_json(), {"node_id": self.node_id, "fingerprint": self.fingerprint,
                                               "strategy": self.cfg.strategy, "time": time.time(),
                                               "weights": self.strategy.weights()})

    # ------------------------------------------------------------------ publishing
    def publish(self) -> None:
        shared = self.strategy.shared_params()
        groups = {"params": shared if shared is not None else self.learner.get_params()}
        for name, tensors in self.strategy.published_extras().items():
            groups[f"x:{name}"] = tensors
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
        while self.cfg.rounds is None or self.round < self.cfg.rounds:
            t0 = time.monotonic()
            rnd = self.round + 1
            try:
                report = await self.strategy.run_round(rnd)
                evaluation = await asyncio.to_thread(self.strategy.evaluate)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("round %d failed; retrying", rnd)
                await asyncio.sleep(1.0)  # back off so a persistent failure does not spin
                continue
            self.round = rnd
            self.publish()
            sent, received = self.traffic.take_round()
            record = {"round": rnd, "t": time.time(), "duration_s": round(time.monotonic() - t0, 4),
                      "model_version": self.version, "train_loss": report.train_loss, "eval": evaluation,
                      "weights": self.strategy.weights(), "contacted": report.contacted,
                      "bytes_sent": sent, "bytes_received": received, "info": report.info,
                      "peers_alive": len(self.peers.alive())}
            self.history.append(record)
            # history first, checkpoint second: a crash between the two leaves the history one
            # round ahead, which a restart trims to the checkpoint (read_history(upto_round)).
            # The other order left a checkpoint with no history line, and a gap after the restart.
            await asyncio.to_thread(self.store.append_history, record)
            await asyncio.to_thread(self._checkpoint)
            self.last_eval = evaluation
            self.m_rounds.inc()
            self.m_round.set(rnd)
            self.m_round_s.observe(time.monotonic() - t0)
            if "test_acc" in evaluation:
                self.m_acc.set(evaluation["test_acc"])
            self.round_log.round_done(rnd, time.monotonic() - t0, evaluation)
            wait = self.cfg.round_interval_s - (time.monotonic() - t0)
            if wait > 0:
                await asyncio.sleep(wait)  # pacing: a deliberately slow node
        self.done = True
        log.info("node %s finished its %d rounds; still serving peers", self.node_id, self.round)

    # ------------------------------------------------------------------ admin views
    def status(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "round": self.round, "model_version": self.version,
                "strategy": self.cfg.strategy, "device": self.learner.device,
                "peers_alive": len(self.peers.alive()), "peers_known": len(self.peers.records),
                "uptime_s": round(time.time() - self.started, 3), "done": self.done,
                "rounds_target": self.cfg.rounds, "address": self.address, "admin_url": self.admin_url,
                "fingerprint": self.fingerprint, "labels": self.labels, "last_eval": self.last_eval,
                "strategy_state": self.strategy.public_state(), "problems": self.problems.recent(10),
                "faulty": self.cfg.faulty}

    def peers_table(self) -> list[dict[str, Any]]:
        weights = self.strategy.weights()
        rows = self.peers.view()
        for r in rows:
            r["weight"] = weights.get(r["node_id"], 0.0)
            snap = self.cache.get(r["node_id"])
            r["cached_version"] = snap.version if snap else None
        return rows

    def weights_view(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "round": self.round, "strategy": self.cfg.strategy,
                "weights": self.strategy.weights(), "strategy_state": self.strategy.public_state()}


def run_node(cfg: NodeConfig) -> int:
    """Run a node until SIGTERM/SIGINT. Returns the process exit code."""
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)

    async def main() -> int:
        try:
            node = Node(cfg)
        except (StateError, ConfigError, ValueError) as e:
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
        await node.stop()
        return 0

    return asyncio.run(main())
