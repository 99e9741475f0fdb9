"""The builder: wires one node's peer plane — membership, privacy, the ``NodeNetwork`` its strategy
sees, the strategy, admission and the served side — onto a ``daemon.Node`` whose identity,
learner, transport and metrics are set (``Node.__init__`` calls it once; the node owns the
lifecycle and the loops)."""
from __future__ import annotations

import hashlib
import random
from typing import Any

from .config import NodeConfig
from .learning.learner import Learner
from .peering.admission import Admission
from .peering.deadlines import Deadlines
from .peering.inbox import PushInbox
from .peering.loop_lag import LoopLag
from .peering.membership import Membership, Settings
from .peering.network import NodeNetwork
from .peering.peer_table import PeerTable
from .peering.problems import ProblemLog
from .peering.served import ServedRequests
from .peering.snapshots import PublishBoard, SnapshotCache
from .privacy.ledger import PrivacyLedger
from .privacy.mechanisms import PrivateData
from .privacy.purposes import purposes_of
from .strategies.registry import get_strategy


def wire_peer_plane(node: Any, cfg: NodeConfig, learner: Learner) -> None:
        seed = int(hashlib.sha256(f"{cfg.seed}:{node.node_id}".encode()).hexdigest()[:8], 16)
        # the peer plane: who is out there, what this node publishes, what it pulled and was pushed
        mcfg = cfg.membership
        node.loop_lag = LoopLag()  # how late the event loop runs: stalls show per round
        node.peers = PeerTable(node.node_id, cfg.suspect_after_s, cfg.dead_after_s,
                               reconnect_min_s=mcfg.reconnect_min_s, reconnect_max_s=mcfg.reconnect_max_s)
        node.problems = ProblemLog(on_rejected=lambda: node.m.rejected.labels(kind="input").inc())
        node.board = PublishBoard()
        node.cache = SnapshotCache(cfg.snapshot_cache_bytes)
        node.inbox = PushInbox()
        node.client = node.transport.connect(node.node_id, node.traffic)
        node.membership = Membership(node.info, node.position, node.peers, node.client, node.problems,
                                     bootstrap=cfg.peers, heartbeat_interval_s=cfg.heartbeat_interval_s,
                                     request_timeout_s=cfg.request_timeout_s, link_delay_s=cfg.delay_ms / 1000,
                                     rng=random.Random(seed), on_gauges=node._peer_gauges,
                                     settings=Settings.from_config(mcfg), loop_lag=node.loop_lag)
        deadlines = Deadlines(cfg.request_timeout_s + 2 * cfg.delay_ms / 1000, floor_s=cfg.deadline_floor_s,
                              mult=cfg.deadline_mult)
        # privacy: everything computed on my data that leaves (served or sent) goes through one door
        node.ledger = PrivacyLedger(node.store.dir, delta=cfg.privacy.delta, budget=cfg.privacy.budget_epsilon,
                                    peer_budget=cfg.privacy.peer_budget_epsilon, on_change=node._privacy_gauges)
        node._privacy_gauges()
        node.private = PrivateData(learner, cfg.privacy, node.ledger)
        node.serves = (tuple(cfg.privacy.serve_purposes) if cfg.privacy.serve_purposes is not None
                       else purposes_of(cfg.strategy))
        node.network = NodeNetwork(node.node_id, node.client, node.peers, node.cache, node.inbox,
                                   lambda: node.board.current, node.spec, node.problems, node.private,
                                   labels=node.labels, request_timeout_s=cfg.request_timeout_s,
                                   deadlines=deadlines, exchange_timeout_s=cfg.exchange_timeout_s,
                                   on_call_failed=node.membership.suspect_hint, watch=cfg.watch_snapshots)
        node.strategy = get_strategy(cfg.strategy)(node.node_id, learner, node.network,
                                                   cfg.strategy_params, seed=seed)
        node._budget_noted: dict[tuple[str, str], float] = {}
        node.admission = Admission(cfg.limits, on_refused=node._over_budget)
        node.served = ServedRequests(node.node_id, node.info, node.membership, learner, node.spec,
                                     node.strategy, node.board, node.cache, node.inbox, node.problems,
                                     node.private, node.serves,
                                     on_refused=lambda kind: node.m.rejected.labels(kind=kind).inc(),
                                     admission=node.admission, push_policy=cfg.limits,
                                     compute_workers=cfg.limits.compute_workers)
