"""The node daemon: one long-lived asyncio process per device.

It wires together the peer plane (``transport``), local learning (``learning``), the
collaboration strategy (``strategies``, which sees the network only through ``NodeNetwork``),
persistence and the admin API. Three loops run concurrently: membership (handshakes, heartbeats,
peer exchange), rounds (train → exchange → publish → checkpoint), and the servers. Compute runs
in worker threads, so heartbeats and requests keep flowing while a round trains."""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import signal
import sys
import time
from collections import defaultdict, deque
from typing import Any

import grpc
import torch

from ..proto.v1 import peer_pb2 as pb
from .config import PROTOCOL_VERSION, ConfigError, NodeConfig
from .checkpointing import Checkpointer
from .failures import Backoff, Failures
from .fsutil import atomic_write_json
from .learning.learner import Learner, Params
from .metrics import Metrics
from .network import NodeNetwork
from .persistence import HISTORY_TAIL, Snapshot, StateError, StateStore, make_snapshot
from .strategies.base import PushedGradient
from .strategies.registry import get_strategy
from .transport.client import PeerClient
from .transport.errors import invalid, not_cached, refused, unknown_peer
from .transport.membership import DEAD, PeerTable
from .transport.server import HealthStatus, Published, serve
from .transport.chunks import sha256
from .wire.codec import Groups, WireError, check_finite, check_spec, encode

log = logging.getLogger("coterie.node")

CAPABILITIES = ["snapshot", "cross-loss", "cross-gradient", "push-gradient", "gossip"]
MAX_PUSHED = 256  # queued gradient pushes kept between two rounds; the oldest are dropped first


class _Stats:
    """Byte and latency accounting for the transport, into Prometheus and per-round tallies."""

    def __init__(self, metrics: Metrics):
        self.sent = metrics.counter("coterie_bytes_sent_total", "Bytes sent to peers", ("kind",))
        self.received = metrics.counter("coterie_bytes_received_total", "Bytes received from peers", ("kind",))
        self.lat = metrics.histogram("coterie_request_latency_seconds", "Peer request latency",
                                     ("kind", "side"),
                                     buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.round_sent: dict[str, int] = defaultdict(int)
        self.round_received: dict[str, int] = defaultdict(int)

    def record(self, kind: str, *, sent: int = 0, received: int = 0) -> None:
        if sent:
            self.sent.labels(kind=kind).inc(sent)
            self.round_sent[kind] += sent
        if received:
            self.received.labels(kind=kind).inc(received)
            self.round_received[kind] += received

    def latency(self, kind: str, seconds: float, side: str) -> None:
        self.lat.labels(kind=kind, side=side).observe(seconds)

    def take_round(self) -> tuple[dict[str, int], dict[str, int]]:
        out = dict(self.round_sent), dict(self.round_received)
        self.round_sent.clear()
        self.round_received.clear()
        return out


def _hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class Node:
    def __init__(self, cfg: NodeConfig, learner: Learner | None = None):
        self.cfg = cfg
        self.store = StateStore(cfg.state_dir)
        self.store.lock()  # one owner per state dir, for this process's lifetime
        self.node_id, self._checkpoint = self.store.open(cfg.node_id, reset=cfg.reset)
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
        self.stats = _Stats(self.metrics)
        self.m_rounds = self.metrics.counter("coterie_rounds_total", "Completed rounds")
        self.m_round_s = self.metrics.histogram("coterie_round_seconds", "Round wall time",
                                                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
        self.m_peers = self.metrics.gauge("coterie_peers", "Known peers by state", ("state",))
        self.m_rejected = self.metrics.counter("coterie_rejected_total", "Peer inputs rejected", ("kind",))
        self.m_round = self.metrics.gauge("coterie_round", "Current round")
        self.m_acc = self.metrics.gauge("coterie_test_accuracy", "Test accuracy after the last round")
        self.m_ckpt_s = self.metrics.histogram("coterie_checkpoint_write_seconds",
                                               "Checkpoint write (background thread)",
                                               buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.m_ckpt_wait = self.metrics.histogram("coterie_checkpoint_wait_seconds",
                                                  "Round loop time spent on checkpoints (snapshot + waiting for the writer)",
                                                  buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))

        self.chunk_bytes = cfg.chunk_bytes
        self.max_model_bytes = cfg.max_model_bytes
        self.max_gossip_bytes = cfg.max_gossip_bytes
        self.peers = PeerTable(self.node_id, cfg.suspect_after_s, cfg.dead_after_s)
        self.client = PeerClient(self.node_id, self.stats, chunk_bytes=cfg.chunk_bytes,
                                 max_model_bytes=cfg.max_model_bytes, max_gossip_bytes=cfg.max_gossip_bytes,
                                 timeout_s=cfg.request_timeout_s, delay_ms=cfg.delay_ms)
        self.network = NodeNetwork(self)
        seed = int(hashlib.sha256(f"{cfg.seed}:{self.node_id}".encode()).hexdigest()[:8], 16)
        self.strategy = get_strategy(cfg.strategy)(self.node_id, learner, self.network,
                                                   cfg.strategy_params, seed=seed)
        self._rng = random.Random(seed)

        self.round = 0
        self.version = 0
        self._published: Published | None = None
        self._published_params: Params = {}
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_TAIL)  # checkpointed rounds; the file keeps all
        self.saved: dict[str, Any] = {"round": 0, "version": 0, "weights": {}, "public_state": {}}
        self.last_eval: dict[str, float] = {}
        self.problems: deque[dict[str, Any]] = deque(maxlen=50)
        self.done = False
        self.started = time.time()
        self.address = ""
        self.admin_url = ""
        self._pending: set[str] = set(cfg.peers)  # addresses to handshake
        self._tasks: list[asyncio.Task] = []
        self._server: grpc.aio.Server | None = None
        self._admin = None
        self._round_task: asyncio.Task | None = None
        self.health = HealthStatus()
        self._health_tasks: set[asyncio.Task] = set()
        self.failures = Failures(self._set_serving, lambda part, msg: self.note_problem(f"this node ({part})", msg))
        self.checkpointer = Checkpointer(self.store, cfg.checkpoint_max_unsaved_rounds, self.failures,
                                         self._on_saved)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        resumed = self._restore()
        self.publish()
        if not resumed:  # round 0 on disk first: identity or history never exist without a checkpoint
            await asyncio.to_thread(self.store.commit, await self._snapshot(None), [])
        self.checkpointer.start()
        self._server, port = await serve(self, self.cfg.listen, self.health)
        host, _ = _hostport(self.cfg.listen)
        self.address = self.cfg.advertise or f"{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}"
        from .admin import start_admin
        ahost, aport = _hostport(self.cfg.admin_listen)
        self._admin, bound = await start_admin(self, ahost, aport)
        self.admin_url = f"http://{'127.0.0.1' if ahost in ('0.0.0.0', '::', '') else ahost}:{bound}"
        atomic_write_json(self.store.dir / "node.json", {
            "node_id": self.node_id, "address": self.address, "admin_url": self.admin_url,
            "pid": os.getpid(), "started": self.started})
        log.info("node %s up: peer %s, admin %s, strategy %s, device %s, round %d",
                 self.node_id, self.address, self.admin_url, self.cfg.strategy, self.learner.device, self.round)
        self._tasks.append(asyncio.create_task(self._membership_loop(), name="membership"))
        self._round_task = asyncio.create_task(self._round_loop(), name="rounds")
        self._round_task.add_done_callback(self._round_loop_ended)
        self._tasks.append(self._round_task)

    async def stop(self) -> bool:
        """Stop everything; write the checkpoints still pending. True when nothing is lost and
        no failure is outstanding (the process exit code says so)."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        saved = await self.checkpointer.close(timeout=60.0)
        if self._server is not None:
            await self._server.stop(grace=0.5)
        if self._admin is not None:
            await self._admin.cleanup()
        await self.client.close()
        self.store.unlock()
        clean = saved and self.failures.healthy
        log.log(logging.INFO if clean else logging.ERROR, "node %s stopped at round %d (checkpointed: %d)%s",
                self.node_id, self.round, self.saved["round"],
                "" if clean else f" with unresolved failures: {self.failures.summary() or 'unsaved rounds'}")
        return clean

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
        self._pending.update(p["address"] for p in st["peers"])
        self.history.extend(ckpt.history)
        self._set_saved(ckpt.round, ckpt.version, st, ckpt.history[-1] if ckpt.history else None)
        log.info("resumed %s at round %d (version %d) from %s", self.node_id, self.round, ckpt.version, ckpt.path)
        return True

    async def _snapshot(self, record: dict[str, Any] | None) -> Snapshot:
        """A consistent copy of this node's state now (between rounds). Strategy state and peers
        are read on the loop, where served requests also touch them; the learner copies its
        tensors under its lock in a thread."""
        strategy_state = self.strategy.state_dict()
        peers = self.peers.to_json()
        meta = {"fingerprint": self.fingerprint, "strategy": self.cfg.strategy, "time": time.time(),
                "weights": self.strategy.weights(), "public_state": self.strategy.public_state()}
        learner_state = await asyncio.to_thread(self.learner.export_state)
        return make_snapshot(round=self.round, version=self.version, node_id=self.node_id,
                             learner_state=learner_state, strategy_state=strategy_state, peers=peers,
                             meta=meta, record=record)

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
        params = shared if shared is not None else self.learner.get_params()
        self._published_params = params
        out = params
        if self.cfg.faulty == "random":  # bad actor: plausible-looking garbage of the right shape
            g = torch.Generator().manual_seed(self.version)
            out = {k: torch.randn(v.shape, generator=g) * (v.std() if v.numel() > 1 else 1.0) for k, v in params.items()}
        elif self.cfg.faulty == "scale":
            out = {k: v * 25.0 for k, v in params.items()}
        groups: Groups = {"params": out}
        for name, tensors in self.strategy.published_extras().items():
            groups[f"x:{name}"] = tensors
        self.version += 1
        data = encode(groups, {"node_id": self.node_id, "version": self.version, "round": self.round})
        self._published = Published(self.node_id, self.version, self.round, data, sha256(data),
                                    self.cfg.chunk_bytes)

    def published(self) -> Published | None:
        return self._published

    def published_params(self) -> Params:
        return self._published_params

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
            rnd = self.round + 1
            try:
                report = await self.strategy.run_round(rnd)
                evaluation = await asyncio.to_thread(self.strategy.evaluate)
                t1, done_at = time.monotonic(), time.time()  # the round's own work ends here
                await self.checkpointer.room()  # at most max_unsaved published rounds not yet on disk
                waited = time.monotonic() - t1
                self.round = rnd
                self.publish()
                sent, received = self.stats.take_round()
                record = {"round": rnd, "t": done_at, "duration_s": round(t1 - t0, 4),
                          "model_version": self.version, "snapshot_sha256": self._published.sha256,
                          "train_loss": report.train_loss, "eval": evaluation,
                          "weights": self.strategy.weights(), "contacted": report.contacted,
                          "bytes_sent": sent, "bytes_received": received, "info": report.info,
                          "peers_alive": len(self.peers.alive())}
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
            log.info("round %d done in %.2fs: %s", rnd, time.monotonic() - t0,
                     ", ".join(f"{k}={v:.4f}" for k, v in evaluation.items()))
            wait = self.cfg.round_interval_s - (time.monotonic() - t0)
            if wait > 0:
                await asyncio.sleep(wait)  # pacing: a deliberately slow node
        await self.checkpointer.flush()  # done means durable
        self.done = True
        log.info("node %s finished its %d rounds; still serving peers", self.node_id, self.round)

    # ------------------------------------------------------------------ membership loop
    def info(self) -> pb.NodeInfo:
        return pb.NodeInfo(node_id=self.node_id, protocol_version=PROTOCOL_VERSION,
                           arch_fingerprint=self.fingerprint, capabilities=CAPABILITIES,
                           address=self.address, admin_url=self.admin_url, labels=self.labels)

    def _entries(self) -> list[pb.PeerEntry]:
        now = time.monotonic()
        return [pb.PeerEntry(node_id=r.node_id, address=r.address, last_seen_age_s=r.age(now))
                for r in self.peers.records.values() if r.state != DEAD]

    def _learn(self, entries: list[pb.PeerEntry]) -> None:
        for e in entries:
            if e.node_id != self.node_id and e.node_id not in self.peers.records and e.address:
                self._pending.add(e.address)

    async def _contact(self, address: str) -> None:
        if address == self.address:
            self._pending.discard(address)
            return
        try:
            reply = await self.client.handshake(address, self.info(), timeout=max(2.0, self.cfg.heartbeat_interval_s * 2))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self.note_problem(address, f"handshake refused: {e.details()}")
                log.error("peer at %s refused us: %s", address, e.details())
            return
        remote = reply.node
        why = self._incompatible(remote)
        if why:
            self.note_problem(address, f"handshake: {why}")
            log.error("refusing peer at %s: %s", address, why)
            return
        self._pending.discard(address)
        if remote.node_id != self.node_id:
            self.peers.upsert(remote.node_id, remote.address or address, labels=dict(remote.labels),
                              admin_url=remote.admin_url)
        self._learn(list(reply.peers))

    def _incompatible(self, remote: pb.NodeInfo) -> str | None:
        if remote.protocol_version != PROTOCOL_VERSION:
            return (f"node {remote.node_id!r} speaks protocol version {remote.protocol_version}, "
                    f"this node speaks {PROTOCOL_VERSION}")
        if remote.arch_fingerprint != self.fingerprint:
            return (f"node {remote.node_id!r} runs another model architecture (fingerprint "
                    f"{remote.arch_fingerprint[:12]}…, this node {self.fingerprint[:12]}…)")
        return None

    async def _ping(self, node_id: str, address: str) -> None:
        try:
            reply, rtt = await self.client.heartbeat(address, self.round, self.version,
                                                     timeout=max(1.0, self.cfg.heartbeat_interval_s) + 2 * self.client.delay_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.PERMISSION_DENIED:  # it forgot us (fresh restart)
                self._pending.add(address)
            return
        if reply.node_id != node_id:  # someone else lives at that address now
            self._pending.add(address)
            return
        self.peers.seen(node_id, round=reply.round, version=reply.snapshot_version, rtt_s=rtt)

    async def _membership_loop(self) -> None:
        tick = 0
        while True:
            jobs = [self._contact(a) for a in list(self._pending)]
            jobs += [self._ping(r.node_id, r.address) for r in list(self.peers.records.values())]
            await asyncio.gather(*jobs, return_exceptions=True)
            if tick % 3 == 0 and self.peers.alive():  # anti-entropy peer exchange
                target = self.peers.records[self._rng.choice(self.peers.alive())]
                try:
                    self._learn(await self.client.exchange_peers(target.address, self._entries(),
                                                                 timeout=self.cfg.request_timeout_s))
                except grpc.aio.AioRpcError:
                    pass
            for node_id, old, new in self.peers.refresh():
                log.info("peer %s: %s -> %s", node_id, old, new)
            for state, n in self.peers.counts().items():
                self.m_peers.labels(state=state).set(n)
            tick += 1
            await asyncio.sleep(self.cfg.heartbeat_interval_s)  # heartbeat period

    # ------------------------------------------------------------------ served requests (PeerHandler)
    def on_handshake(self, remote: pb.NodeInfo, peer_addr: str) -> list[pb.PeerEntry]:
        why = self._incompatible(remote)
        if why:
            self.note_problem(remote.node_id or peer_addr, f"handshake: {why}")
            raise refused(why)
        if remote.node_id == self.node_id:
            raise refused(f"node id {remote.node_id!r} is this node's own id")
        if not remote.node_id or not remote.address:
            raise invalid("handshake lacks node_id or address")
        self.peers.upsert(remote.node_id, remote.address, labels=dict(remote.labels), admin_url=remote.admin_url)
        self._pending.discard(remote.address)
        return self._entries()

    def check_known(self, node_id: str) -> None:
        if node_id not in self.peers.records:
            self.m_rejected.labels(kind="unknown_peer").inc()
            raise unknown_peer(node_id)
        self.peers.seen(node_id)

    def on_heartbeat(self, node_id: str, round: int, version: int) -> tuple[int, int]:
        self.check_known(node_id)
        self.peers.seen(node_id, round=round, version=version)
        return self.round, self.version

    def on_peer_list(self, sender: str, entries: list[pb.PeerEntry]) -> list[pb.PeerEntry]:
        self._learn(entries)
        return self._entries()

    def resolve_ref(self, ref: pb.SnapshotRef) -> Groups:
        if ref.node_id == self.node_id and self._published and ref.version == self._published.version:
            return {"params": self._published_params}
        snap = self.network.cache.get(ref.node_id)
        if snap is not None and snap.version == ref.version and snap.sha256 == ref.sha256:
            return {"params": snap.params}
        raise not_cached(f"{ref.node_id} v{ref.version}")

    def _tensors_in(self, requester: str, groups: Groups, group: str, what: str) -> Params:
        """A tensor group a peer sent: present, this architecture's shapes, finite — or refused."""
        tensors = groups.get(group)
        if tensors is None:
            raise invalid(f"{what} from {requester}: no {group!r} in the request")
        try:
            check_spec(tensors, self.spec, f"{what} {group} from {requester}")
            check_finite(groups)
        except WireError as e:
            self.m_rejected.labels(kind=what).inc()
            self.note_problem(requester, str(e), rejected=True)
            raise invalid(str(e)) from None
        return tensors

    @staticmethod
    def _split(h: pb.ComputeHeader) -> str:
        split = h.split or "train"
        if split not in ("train", "val", "test"):
            raise invalid(f"unknown split {split!r}")
        return split

    async def cross_loss(self, requester: str, groups: Groups, h: pb.ComputeHeader) -> tuple[float, int]:
        params = self._tensors_in(requester, groups, "params", "cross_loss")
        res = await asyncio.to_thread(self.learner.loss, params, self._split(h), h.max_samples or None,
                                      h.reduction or "mean")
        return res.loss, res.n

    async def cross_gradient(self, requester: str, groups: Groups, h: pb.ComputeHeader
                             ) -> tuple[Groups | None, float, int, float]:
        params = self._tensors_in(requester, groups, "params", "cross_gradient")
        grad, res = await asyncio.to_thread(self.learner.gradient, params, self._split(h),
                                            h.max_samples or None, h.reduction or "mean")
        if h.align:
            align = self._tensors_in(requester, groups, "align", "cross_gradient")
            ip = float(sum(torch.sum(grad[k] * align[k]) for k in grad))
            self.strategy.on_alignment(requester, ip)
            return None, res.loss, res.n, ip
        return {"grad": grad}, res.loss, res.n, 0.0

    async def push_gradient(self, requester: str, groups: Groups, h: pb.ComputeHeader) -> tuple[bool, str]:
        grad = self._tensors_in(requester, groups, "grad", "push_gradient")
        queue = self.network.pushed
        queue.append(PushedGradient(requester, int(h.target_version), grad))
        del queue[:-MAX_PUSHED]
        return True, f"queued for the update after version {self.version}"

    async def gossip(self, requester: str, key: str, payload: dict[str, Any]) -> dict[str, Any]:
        reply = self.strategy.on_gossip(requester, key, payload)
        if reply is None:
            raise invalid(f"strategy {self.cfg.strategy!r} does not understand gossip key {key!r}")
        return reply

    def note_problem(self, who: str, message: str, rejected: bool = False) -> None:
        self.problems.append({"t": time.time(), "peer": who, "message": message, "rejected": rejected})
        if rejected:
            self.m_rejected.labels(kind="input").inc()

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
                "strategy_state": self.strategy.public_state(), "problems": list(self.problems)[-10:],
                "faulty": self.cfg.faulty}

    def peers_table(self) -> list[dict[str, Any]]:
        weights = self.strategy.weights()
        rows = self.peers.view()
        for r in rows:
            r["weight"] = weights.get(r["node_id"], 0.0)
            snap = self.network.cache.get(r["node_id"])
            r["cached_version"] = snap.version if snap else None
        return rows

    def weights_view(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "round": self.saved["round"], "strategy": self.cfg.strategy,
                "weights": self.saved["weights"], "strategy_state": self.saved["public_state"]}


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
        if not await node.stop():
            print(f"coterie: node stopped with unresolved failures: "
                  f"{node.failures.summary() or 'completed rounds not checkpointed'}", file=sys.stderr)
            return 1
        return 0

    return asyncio.run(main())
