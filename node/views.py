"""The node's admin read model: what ``/status``, ``/peers``, ``/weights`` and ``/history`` show
(``admin.py`` serves it). Read-only views over a ``daemon.Node``'s state; their JSON shapes are
the public contract."""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from .builder import PeerPlane
from .history import view as history_summary
from .modelfile import export_state_dir

if TYPE_CHECKING:
    from .config import NodeConfig
    from .failures import Failures
    from .learning.learner import Learner
    from .peering.interfaces import TransportFactory
    from .peering.traffic import TrafficStats
    from .persistence import StateStore


class NodeViews(PeerPlane):
    """Mixed into ``daemon.Node``: the views read its attributes and change none."""

    # the node's own state (``Node.__init__``; the peer plane's: ``PeerPlane``), declared for the type checker
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
    round: int
    done: bool
    started: float
    address: str
    admin_url: str
    failures: Failures
    if TYPE_CHECKING:
        def healthy(self) -> bool: ...

    async def history_view(self, since: int | None) -> list[dict[str, Any]]:
        """Checkpointed rounds after ``since`` (default: the in-memory tail), from the file when
        they go back further than the tail."""
        if since is None or (self.history and since >= self.history[0]["round"] - 1) or self.saved["round"] <= since:
            return [r for r in self.history if since is None or r["round"] > since]
        return await asyncio.to_thread(lambda: list(self.store.history_since(since)))


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
                "admission": self.admission.view(), "traffic_since_last_round": self.traffic.pending(),
                "membership": self.membership_view(), "discovery": self.network.discovery_view(),
                "privacy": self.privacy_view(),
                "collaboration": self.network.releases.view(),
                "data": self.learner.data_info(), "history_summary": history_summary(self.store.summary),
                "relay": self.relay_view()}

    def relay_view(self) -> dict[str, Any]:
        """Reachability (``direct`` or ``relayed via ...``) and relaying, from a transport that relays."""
        view = getattr(self.transport, "relay_view", None)
        return view() if view is not None else {"reachability": "direct"}

    def privacy_view(self) -> dict[str, Any]:
        """The privacy ledger (ε per peer and in total) and the knobs that bound it."""
        p = self.cfg.privacy
        return {"enabled": p.enabled, "noise_multiplier": p.noise_multiplier, "grad_clip": p.grad_clip,
                "loss_clip": p.loss_clip, "min_batch": p.min_batch, "serves": list(self.serves),
                "withheld": self.withheld,
                **self.ledger.view()}

    def membership_view(self) -> dict[str, Any]:
        """The peer plane's own health: SWIM counters, candidate set, channels, loop lag."""
        m = self.membership
        return {"incarnation": m.incarnation, "candidates": len(m.pending),
                "candidates_dropped": m.pending.dropped, "candidates_forgotten": m.pending.forgotten_total,
                "channels": self.client.channels(), "channels_evicted": self.client.evicted,
                "snapshot_cache_bytes": self.cache.bytes, "loop_lag_max_s": round(self.loop_lag.max_s, 4),
                **m.stats, "claim_strikes": m.claims.view()}

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

    async def export_model(self) -> tuple[bytes, dict[str, Any]]:
        """The personalised model of the last checkpoint, as `coterie model export` writes it."""
        return await asyncio.to_thread(export_state_dir, self.store.dir)

    # ------------------------------------------------------------------ publishing
