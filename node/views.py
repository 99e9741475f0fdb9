"""The node's admin read model: what ``/status``, ``/peers``, ``/weights`` and ``/history`` show
(``admin.py`` serves it, through the node). Read-only views over a node's state (``ViewedNode``:
what they read of it); their JSON shapes are the public contract."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from .history import view as history_summary
from .modelfile import export_state_dir
from .peering.versions import FEATURES
from .process_stats import process_view

if TYPE_CHECKING:
    from .config import NodeConfig
    from .failures import Failures
    from .learning.learner import Learner
    from .local_reference import LocalReference
    from .peering.admission import Admission
    from .peering.interfaces import PeerTransport, TransportFactory
    from .peering.loop_lag import LoopLag
    from .peering.membership import Membership
    from .peering.messages import NodeInfo
    from .peering.network import NodeNetwork
    from .peering.peer_table import PeerTable
    from .peering.problems import ProblemLog
    from .peering.snapshots import SnapshotCache
    from .peering.traffic import TrafficStats
    from .persistence import StateStore
    from .privacy.ledger import PrivacyLedger
    from .stall_watch import StallWatch
    from .strategies.base import Strategy


class ViewedNode(Protocol):
    """What the views read of a node (``daemon.Node`` is one)."""

    # the node's own state (``Node.__init__``)
    cfg: NodeConfig
    learner: Learner
    transport: TransportFactory
    traffic: TrafficStats
    store: StateStore
    node_id: str
    fingerprint: str
    labels: dict[str, str]
    history: deque[dict[str, Any]]
    saved: dict[str, Any]
    last_eval: dict[str, float]
    reload_outcome: dict[str, Any] | None  # the last SIGHUP reload (reload.py)
    round: int
    done: bool
    started: float
    address: str
    admin_url: str
    failures: Failures
    stall_watch: StallWatch
    reference: LocalReference
    # the peer plane's parts the node holds (``builder.PeerPlane``)
    loop_lag: LoopLag
    peers: PeerTable
    problems: ProblemLog
    cache: SnapshotCache
    client: PeerTransport
    membership: Membership
    ledger: PrivacyLedger
    serves: tuple[str, ...]
    withheld: str | None
    network: NodeNetwork
    strategy: Strategy
    admission: Admission

    def healthy(self) -> bool: ...
    def info(self) -> NodeInfo: ...


class NodeViews:
    """The views over one node: they read its state and change none."""

    def __init__(self, node: ViewedNode):
        self.node = node

    async def history_view(self, since: int | None) -> list[dict[str, Any]]:
        """Checkpointed rounds after ``since`` (default: the in-memory tail), from the file when
        they go back further than the tail."""
        n = self.node
        if since is None or (n.history and since >= n.history[0]["round"] - 1) or n.saved["round"] <= since:
            return [r for r in n.history if since is None or r["round"] > since]
        return await asyncio.to_thread(lambda: list(n.store.history_since(since)))

    def status(self) -> dict[str, Any]:
        # round/model_version are the checkpointed ones: a restart never rolls back what is shown
        n = self.node
        return {
            "node_id": n.node_id,
            "version": self.version_view(),
            "round": n.saved["round"],
            "model_version": n.saved["version"],
            "unsaved_rounds": n.round - n.saved["round"],
            "in_round": n.stall_watch.view(),  # the phase the round loop is in now, and for how long
            "health": "ok" if n.healthy() else "failing",
            "failures": n.failures.view(),
            "strategy": n.cfg.strategy,
            "device": n.learner.device,
            "peers_alive": len(n.peers.alive()),
            "peers_known": len(n.peers.records),
            "uptime_s": round(time.time() - n.started, 3),
            "done": n.done,
            "rounds_target": n.cfg.rounds,
            "address": n.address,
            "admin_url": n.admin_url,
            "fingerprint": n.fingerprint,
            "labels": n.labels,
            "last_eval": n.last_eval,
            "strategy_state": n.strategy.public_state(),
            "problems": n.problems.recent(10),
            "faulty": n.cfg.faulty,
            "mtls": n.transport.mtls,
            "admission": n.admission.view(),
            "traffic_since_last_round": n.traffic.pending(),
            "membership": self.membership_view(),
            "discovery": n.network.discovery_view(),
            "privacy": self.privacy_view(),
            "collaboration": {**n.network.releases.view(), **n.reference.view()},
            "data": n.learner.data_info(),
            "history_summary": history_summary(n.store.summary),
            "relay": self.relay_view(),
            # what a month-long run must keep flat (bench/soak.py); gRPC channels: membership.channels
            "process": process_view(),
            "reload": n.reload_outcome,  # the last SIGHUP's: applied, needs_restart, error
        }

    def version_view(self) -> dict[str, Any]:
        """This node's release and protocol range, and what each alive peer runs and speaks with it."""
        info = self.node.info()
        return {
            "release": info.release,
            "protocol": [info.protocol_version, info.protocol_max],
            "features": [f for f in info.capabilities if f in FEATURES],
            "peers": {
                p: {"release": r.release or "0.1.0 or older", "protocol": r.protocol, "features": list(r.features)}
                for p in self.node.peers.alive()
                if (r := self.node.peers.records.get(p)) is not None
            },
        }

    def relay_view(self) -> dict[str, Any]:
        """Reachability (``direct`` or ``relayed via ...``) and relaying, from a transport that relays."""
        view = getattr(self.node.transport, "relay_view", None)
        return view() if view is not None else {"reachability": "direct"}

    def privacy_view(self) -> dict[str, Any]:
        """The privacy ledger (ε per peer and in total) and the knobs that bound it."""
        n = self.node
        p = n.cfg.privacy
        return {
            "enabled": p.enabled,
            "noise_multiplier": p.noise_multiplier,
            "grad_clip": p.grad_clip,
            "loss_clip": p.loss_clip,
            "min_batch": p.min_batch,
            "serves": list(n.serves),
            "withheld": n.withheld,
            **n.ledger.view(),
        }

    def membership_view(self) -> dict[str, Any]:
        """The peer plane's own health: SWIM counters, candidate set, channels, loop lag."""
        n = self.node
        m = n.membership
        return {
            "incarnation": m.state.incarnation,
            "candidates": len(m.pending),
            "candidates_dropped": m.pending.dropped,
            "candidates_forgotten": m.pending.forgotten_total,
            "channels": n.client.channels(),
            "channels_evicted": n.client.evicted,
            "snapshot_cache_bytes": n.cache.bytes,
            "loop_lag_max_s": round(n.loop_lag.max_s, 4),
            **m.state.stats,
            "deaths_recent": list(m.state.deaths),
            "claim_strikes": m.gossip.claims.view(),
        }

    def peers_table(self) -> list[dict[str, Any]]:
        n = self.node
        weights = n.strategy.weights()
        rows = n.peers.view()
        roles = n.network.roles()  # past the threshold: in which view, candidate, collaborator
        for r in rows:
            r["weight"] = weights.get(r["node_id"], 0.0)
            snap = n.cache.get(r["node_id"])
            r["cached_version"] = snap.version if snap else None
            r.update(roles.get(r["node_id"], {}))
        return rows

    def weights_view(self) -> dict[str, Any]:
        n = self.node
        return {
            "node_id": n.node_id,
            "round": n.saved["round"],
            "strategy": n.cfg.strategy,
            "weights": n.saved["weights"],
            "strategy_state": n.saved["public_state"],
        }

    async def export_model(self) -> tuple[bytes, dict[str, Any]]:
        """The personalised model of the last checkpoint, as `coterie model export` writes it."""
        return await asyncio.to_thread(export_state_dir, self.node.store.dir)
