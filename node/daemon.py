"""The node daemon: one long-lived asyncio process per device.

``Node`` is the composition root and the lifecycle: identity and state dir, local learning
(``learning``), the transport, persistence (checkpoint restore and snapshots) and the admin API;
it starts and stops the loops: membership, rounds and the servers. Its parts live next to it:
``builder.py`` wires the peer plane (``peering``: membership, served requests, the ``NodeNetwork``
a strategy sees; carried by ``transport``) and the strategy; ``rounds.py`` runs the rounds
(train → exchange → publish → checkpoint) and types their records; ``views.py`` is the admin read
model; ``node_metrics.py`` its metrics. Compute runs in worker threads, so heartbeats and
requests keep flowing while a round trains."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import publishing
from .builder import PeerPlane, PlaneHost, build_peer_plane
from .checkpointing import Checkpointer
from .config import ConfigError, NodeConfig
from .failures import Failures
from .fsutil import atomic_write_json
from .learning.learner import Learner
from .local_reference import LocalReference
from .logfilter import install_log_filter
from .logs import RoundLog
from .memory_release import limit_malloc_arenas
from .metrics import Metrics
from .modelfile import describe_model
from .node_metrics import NodeMetrics
from .peering.faults import with_fault
from .peering.interfaces import PeerServer, TransportFactory
from .peering.messages import ALIVE, LocalSnapshot, NodeInfo
from .peering.traffic import TrafficStats
from .peering.versions import PROTOCOL_MAX, PROTOCOL_MIN, RECOMMEND, RELAY, RELEASE, REVOCATIONS, VIEWS
from .persistence import HISTORY_TAIL, Snapshot, StateError, StateStore, make_snapshot
from .privacy import accountant
from .privacy.purposes import LOSS, purpose, purposes_of
from .rounds import RoundLoop
from .service import Service
from .stall_watch import StallWatch
from .views import NodeViews

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("coterie.node")

# snapshot staging buffers kept between rounds up to this size (model + optimizer state); a larger
# model's are freed after each write (issue 34 item 2: a 21 MB MLP with Adam kept 3 spare copies),
# and a model larger than this is not staged at all (written from its own tensors)
SPARE_BUFFERS_MAX_BYTES = 16 << 20
CAPABILITIES = ("snapshot", "cross-loss", "cross-gradient", "push-gradient", "gossip")
MODEL_BYTES_FACTOR, MODEL_BYTES_SLACK = 4, 1 << 20  # default max_model_bytes: 4× my model + 1 MiB


def _snapshot_namer(record: dict[str, Any] | None, published: LocalSnapshot | None) -> Callable[[], None] | None:
    """What puts the published snapshot's sha256 in the history line (None: no line to put it in)."""
    if record is None or published is None:  # (a node publishes before its first snapshot)
        return None

    def name_snapshot() -> None:
        record["snapshot_sha256"] = published.digest  # encodes it once, off the loop (make_snapshot)

    return name_snapshot


class Node:
    """``transport`` carries the peer plane (default: gRPC on ``cfg.listen``; the in-process
    launcher passes ``transport/inproc.py``'s). ``admin=False`` runs without the HTTP admin API
    (in-process nodes: their launcher reads ``status()`` directly)."""

    def __init__(
        self,
        cfg: NodeConfig,
        learner: Learner | None = None,
        transport: TransportFactory | None = None,
        *,
        admin: bool = True,
    ):
        self.cfg = cfg
        if transport is None:  # gRPC with the node's certificate (refuses to start without one unless insecure)
            from .transport.grpc_transport import GrpcTransport

            transport = GrpcTransport.from_config(cfg)
        self.transport = transport
        self.health = transport.health  # what this node tells the transport's health checks
        identity = transport.identity  # the node id the transport's credentials prove, if any
        self.store = StateStore(cfg.state_dir, cfg.history.max_bytes)
        self.store.lock()  # one owner per state dir, for this process's lifetime
        # verified (or refused) before anything slow: a broken state dir fails in a second
        self.node_id, self._checkpoint = self.store.open(cfg.node_id or identity, reset=cfg.reset)
        if identity is not None and identity != self.node_id:
            self.store.unlock()
            raise ConfigError(
                f"security: the certificate is for node {identity!r}, but the state "
                f"dir {cfg.state_dir} belongs to {self.node_id!r}"
            )
        if learner is None:
            from .learning.torch_learner import build_learner  # torch-specific code stays behind the interface

            learner = build_learner(cfg.learner)
        self.learner = learner
        self.model_card = describe_model(cfg.learner, learner)  # in every checkpoint: `coterie model export`
        self.spec = learner.param_spec()
        self.fingerprint = learner.fingerprint()
        self.labels = dict(cfg.labels)
        # the snapshot codecs it advertises in its handshake (fp32 always: every node speaks it)
        self.codecs = tuple(dict.fromkeys([*cfg.snapshots.codecs, "fp32"]))
        if learner.true_cluster is not None:
            self.labels.setdefault("cluster", str(learner.true_cluster))
        self.labels.setdefault("strategy", cfg.strategy)
        cfg.labels.update(self.labels)

        self.metrics = Metrics()
        self.traffic = TrafficStats(self.metrics)
        self.m = NodeMetrics(self.metrics)

        # membership, served side, NodeNetwork, strategy (builder.py)
        self.plane = self._hold(
            build_peer_plane(
                PlaneHost(
                    self.node_id,
                    transport,
                    self.traffic,
                    self.m,
                    self.store,
                    self._checkpoint,
                    self.spec,
                    self.labels,
                    self.info,
                    self.position,
                ),
                cfg,
                learner,
            )
        )

        # what this node would have alone, and the back-off when collaboration does worse (local_reference.py)
        self.reference = LocalReference(cfg.reference, learner, cfg.strategy)
        self.round = 0
        self.version = 0
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_TAIL)  # checkpointed rounds; the file keeps all
        self.saved: dict[str, Any] = {"round": 0, "version": 0, "weights": {}, "public_state": {}}
        self._spare_tensors: dict[str, Any] | None = None  # a written snapshot's buffers, reused by the next
        # a model over SPARE_BUFFERS_MAX_BYTES is checkpointed from its own tensors, written before the
        # next round starts (no staging copies alive while it trains: checkpointing.py, issue 34)
        self._live_checkpoints = _checkpoints_live(learner)
        self.last_eval: dict[str, float] = {}
        self.done = False
        self.started = time.time()
        self.address = ""
        self.admin_url = ""
        self.reload_outcome: dict[str, Any] | None = None  # the last SIGHUP reload's (reload.py), in /status
        self.round_log = RoundLog(log)  # per-round lines only while rounds are slow, else summaries
        self._tasks: list[asyncio.Task] = []
        self._server: PeerServer | None = None
        self.serve_admin = admin
        self._admin: web.AppRunner | None = None
        self._round_task: asyncio.Task | None = None
        self._stopping = False
        self._health_tasks: set[asyncio.Task] = set()
        self.failures = Failures(self._set_serving, lambda part, msg: self.problems.note(f"this node ({part})", msg))
        self.stall_watch = StallWatch(self.failures, cfg.round_stall_s)  # a round stuck in one phase is reported
        self.rounds = RoundLoop(self)
        # the admin API's reads (admin.py: /status, /peers, /weights, /history, /model), answered by the views
        self.views = views = NodeViews(self)
        self.status, self.peers_table, self.weights_view = views.status, views.peers_table, views.weights_view
        self.history_view, self.export_model = views.history_view, views.export_model
        self.checkpointer = Checkpointer(self.store, cfg.checkpoint_max_unsaved_rounds, self.failures, self._on_saved)

    def _hold(self, plane: PeerPlane) -> PeerPlane:
        """The plane's parts as the node's own attributes: the rounds and the views read them."""
        self.loop_lag, self.peers, self.revocations, self.problems = (
            plane.loop_lag,
            plane.peers,
            plane.revocations,
            plane.problems,
        )
        self.board, self.cache, self.inbox, self.client = plane.board, plane.cache, plane.inbox, plane.client
        self.membership, self.ledger, self.private = plane.membership, plane.ledger, plane.private
        self.serves, self.withheld, self.network, self.strategy = (
            plane.serves,
            plane.withheld,
            plane.network,
            plane.strategy,
        )
        self.guard, self.admission, self.served = plane.guard, plane.admission, plane.served
        return plane

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        resumed = self._restore()
        self.publish()
        if not resumed:  # round 0 on disk first: identity or history never exist without a checkpoint
            await asyncio.to_thread(self.store.commit, await self._snapshot(None), [])
        self.checkpointer.start()
        # both ways, for the server and this node's client, now that the model's size is known
        self.transport.limits.max_model_bytes = self.model_limit()
        # a testbed bad actor corrupts what it serves (peering/faults.py); it learns normally
        handler = with_fault(self.served, self.cfg.faulty)
        movable: Any = self.transport
        if hasattr(movable, "on_moved"):  # a transport that moves this node's address (relays)
            movable.members = lambda: [r.address for r in self.peers.records.values() if r.state == ALIVE]
            movable.on_moved = self._moved
        self._server = await self.transport.serve(handler, self.traffic)
        self.address = self._server.address
        token_file = None
        if self.serve_admin:
            from .admin import serve_node_admin

            self._admin, self.admin_url, token_file = await serve_node_admin(self, self.cfg, self.store.dir)
        atomic_write_json(
            self.store.dir / "node.json",
            {
                "node_id": self.node_id,
                "address": self.address,
                "admin_url": self.admin_url,
                "admin_token_file": str(token_file) if token_file else None,
                "pid": os.getpid(),
                "started": self.started,
            },
        )
        log.info(
            "node %s up: peer %s, admin %s, strategy %s, device %s, round %d",
            self.node_id,
            self.address,
            self.admin_url,
            self.cfg.strategy,
            self.learner.device,
            self.round,
        )
        self._tasks.append(asyncio.create_task(self.loop_lag.run(), name="loop-lag"))
        self._tasks.append(asyncio.create_task(self.stall_watch.run(), name="stall-watch"))
        if self.cfg.privacy.enabled and purposes_of(self.cfg.strategy) + self.serves:
            self._tasks.append(asyncio.create_task(asyncio.to_thread(self._warm_privacy), name="privacy-warmup"))
        self._tasks.append(asyncio.create_task(self.membership.run(), name="membership"))
        overlay = self.network.overlay
        if overlay is not None:  # partial views, past the discovery threshold
            peers = self.peers
            contacts = lambda: [p for p in peers.alive() if VIEWS in peers.records[p].features]  # noqa: E731
            run = overlay.run(self.cfg.heartbeat_interval_s, self.network.discovering, contacts)
            self._tasks.append(asyncio.create_task(run, name="overlay"))
        if self.revocations is not None:  # the CA's revocation list reaches every node (security/crl_gossip.py)
            self._tasks.append(asyncio.create_task(self.revocations.spread(), name="crl-gossip"))
        self._round_task = asyncio.create_task(self.rounds.run(), name="rounds")
        self._round_task.add_done_callback(self._round_loop_ended)
        self._tasks.append(self._round_task)

    async def stop(self) -> bool:
        """Stop everything; write the checkpoints still pending. True when nothing is lost and
        no failure is outstanding (the process exit code says so)."""
        self._stopping = True
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
        log.log(
            logging.INFO if clean else logging.ERROR,
            "node %s stopped at round %d (checkpointed: %d)%s",
            self.node_id,
            self.round,
            self.saved["round"],
            "" if clean else f" with unresolved failures: {self.failures.summary() or 'unsaved rounds'}",
        )
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
        return self.failures.healthy and self._round_task is not None and (not self._round_task.done() or self.done)

    def _set_serving(self, serving: bool) -> None:
        task = asyncio.get_running_loop().create_task(self.health.set(serving))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    def _round_loop_ended(self, task: asyncio.Task) -> None:
        if task.cancelled():
            if not self._stopping:  # nobody stopped it: a round loop that ends is a failure
                self.failures.failed("rounds", RuntimeError("the round loop was cancelled"), None)
        elif (error := task.exception()) is not None:
            self.failures.failed("rounds", error, None)

    def _moved(self, address: str) -> None:
        """This node is reached at ``address`` now (relays: nobody could dial the old one, or its
        relays changed; or its own address again, once peers can dial it). A
        member's address changes only by its own handshake: shake hands with every member again;
        the raised incarnation tells the others to (``Dissemination.merge``)."""
        self.address = address
        st = self.membership.state
        st.incarnation += 1
        st.broadcasts.add(st.me())
        for rec in list(self.peers.records.values()):
            self.membership.tasks.spawn(self.membership.handshakes.contact(rec.address))
        info_file = self.store.dir / "node.json"
        if info_file.exists():
            atomic_write_json(info_file, {**json.loads(info_file.read_text()), "address": address})

    def info(self) -> NodeInfo:
        return NodeInfo(
            self.node_id,
            PROTOCOL_MIN,
            self.fingerprint,
            CAPABILITIES + self.features(),
            self.address,
            self.admin_url,
            self.labels,
            self.learner.task_spec(),
            self.codecs,
            PROTOCOL_MAX,
            RELEASE,
        )

    def features(self) -> tuple[str, ...]:
        """The optional protocol features it advertises (peering/versions.py): peers ask only for these."""
        crl = getattr(self, "revocations", None) is not None  # (info() may be asked while the node is built)
        relays = self.cfg.relay.serve and not self.cfg.no_listen
        on_off = ((REVOCATIONS, crl), (RELAY, relays), (RECOMMEND, True), (VIEWS, True))
        return tuple(f for f, on in on_off if on)

    def position(self) -> tuple[int, int]:
        """(round, published snapshot version), as heartbeats announce them."""
        return self.round, self.version

    def model_limit(self) -> int:
        """Largest model a peer may send or serve: configured, else a small multiple of this node's
        own model (a snapshot carries at most the params and two extra groups of their size)."""
        if self.cfg.max_model_bytes is not None:
            return self.cfg.max_model_bytes
        own = LocalSnapshot(self.node_id, 0, 0, {"params": self.learner.get_params()}).encoded
        return MODEL_BYTES_FACTOR * len(own) + MODEL_BYTES_SLACK

    # ------------------------------------------------------------------ persistence
    def _restore(self) -> bool:
        """Apply the checkpoint ``StateStore.open`` verified; False for a fresh node."""
        ckpt, self._checkpoint = self._checkpoint, None
        if ckpt is None:
            return False
        st = ckpt.state
        if st.get("fingerprint") != self.fingerprint:
            raise StateError(
                f"{ckpt.path} is for another architecture ({str(st.get('fingerprint'))[:12]} ≠ {self.fingerprint[:12]})"
            )
        if st.get("strategy") != self.cfg.strategy:
            raise StateError(
                f"{ckpt.path} was written by strategy {st.get('strategy')!r}, this node runs "
                f"{self.cfg.strategy!r}: start with --reset to begin again under it"
            )
        try:
            self.learner.import_state(*ckpt.learner_state())
            self.strategy.load_state_dict(ckpt.strategy_state())
            self.reference.import_state(ckpt.reference_state(), ckpt.round)
            self.peers.load_json(st["peers"])
        except StateError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever does not fit, named with the file
            raise StateError(f"{ckpt.path} does not fit this node: {type(e).__name__}: {e}") from None
        self.round = ckpt.round
        self.version = ckpt.version - 1  # publish() re-issues the checkpointed version
        self.membership.state.pending.update(p["address"] for p in st["peers"])
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
        meta = {
            "fingerprint": self.fingerprint,
            "strategy": self.cfg.strategy,
            "time": time.time(),
            "model": self.model_card,
            "weights": self.strategy.weights(),
            "public_state": self.strategy.public_state(),
            "privacy_ledger": self.ledger.pin(),
        }
        # a large model (never a spare to reuse): its own tensors, written before the next round
        reuse, self._spare_tensors = self._spare_tensors, None
        learner_state = await asyncio.to_thread(self.learner.export_state, reuse, self._live_checkpoints)
        reference = await asyncio.to_thread(self.reference.export_state, self._live_checkpoints)
        return make_snapshot(
            round=self.round,
            version=self.version,
            node_id=self.node_id,
            learner_state=learner_state,
            strategy_state=strategy_state,
            peers=peers,
            meta=meta,
            record=record,
            prepare=_snapshot_namer(record, self.board.current),
            mixture=self.reference.prediction_members(
                self.node_id, self.strategy.prediction_members(), self._live_checkpoints
            )
            or self.strategy.prediction_members(),
            reference=reference,
            live=self._live_checkpoints,
        )

    def _set_saved(self, rnd: int, version: int, state: dict[str, Any], record: dict[str, Any] | None) -> None:
        self.saved = {
            "round": rnd,
            "version": version,
            "weights": state.get("weights", {}),
            "public_state": state.get("public_state", {}),
        }
        if record is not None:
            self.last_eval = record.get("eval", {})
        self.m.round.set(rnd)

    def _on_saved(self, batch: list[Snapshot], seconds: float) -> None:
        """The writer made these snapshots durable: the admin API now shows them."""
        records = [s.record for s in batch if s.record is not None]
        self.history.extend(records)
        # a small model's written copies are reused by the next snapshot (no allocation per round);
        # a large one's are dropped: at rest a node holds its model and optimizer, not a staging copy
        spare = batch[-1].learner_tensors
        small = spare is not None and sum(t.nbytes for t in spare.values()) <= SPARE_BUFFERS_MAX_BYTES
        self._spare_tensors = spare if small else None
        last = batch[-1]
        self._set_saved(last.round, last.version, last.state, records[-1] if records else None)
        self.m.ckpt_s.observe(seconds)

    def publish(self) -> None:
        publishing.publish(self)

    async def publish_round(self) -> None:
        await publishing.publish_round(self)  # a large model's passes off the loop


def _checkpoints_live(learner: Learner) -> bool:
    """A model over SPARE_BUFFERS_MAX_BYTES (float32) is checkpointed from its own tensors."""
    return 4 * sum(math.prod(shape) for shape, _ in learner.param_spec().values()) > SPARE_BUFFERS_MAX_BYTES


def run_node(cfg: NodeConfig, reload: Callable[[], NodeConfig] | None = None) -> int:
    """Run a node until SIGTERM/SIGINT; SIGHUP reloads the config from ``reload`` (service.py).
    Returns the process exit code."""
    limit_malloc_arenas()  # before the gRPC and torch threads that would each take an arena
    logging.basicConfig(
        level=getattr(logging, cfg.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    install_log_filter()  # peers control much of what gets logged: bounded lines, repeats summarised
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload asked for while starting must not kill it

    async def main() -> int:
        running = cfg.model_copy(deep=True)  # as loaded: the node adds its own labels to cfg
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
        service = Service(node, reload, running)  # SIGHUP reloads; READY/WATCHDOG under systemd
        service.start()
        await stop.wait()
        service.stopping()
        clean = await node.stop()
        await service.close()
        if not clean:
            print(
                f"coterie: node stopped with unresolved failures: "
                f"{node.failures.summary() or 'completed rounds not checkpointed'}",
                file=sys.stderr,
            )
            return 1
        return 0

    return asyncio.run(main())
