"""The builder: wires one node's peer plane — membership, privacy, the ``NodeNetwork`` its strategy
sees, the strategy, admission and the served side — onto a ``daemon.Node`` whose identity,
learner, transport and metrics are set (``Node.__init__`` calls it once; the node owns the
lifecycle and the loops)."""
from __future__ import annotations

import hashlib
import random
from typing import Any

from .config import NodeConfig
from .learning.guard import RoundGuard
from .learning.learner import Learner
from .peering.admission import Admission
from .peering.deadlines import Deadlines
from .peering.discovery import Discovery, DiscoveryHooks, DiscoverySettings
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
from .privacy.purposes import purpose, purposes_of
from .revocations import Revocations
from .security.crl_gossip import CrlExchange
from .peering.interfaces import PeerTransport
from .strategies.base import Strategy
from .strategies.registry import get_strategy


class PeerPlane:
    """What ``wire_peer_plane`` sets on a node, declared for the type checker (``daemon.Node`` is
    one, through ``views.NodeViews``); nothing at run time."""
    loop_lag: LoopLag
    peers: PeerTable
    revocations: Revocations | None
    problems: ProblemLog
    board: PublishBoard
    cache: SnapshotCache
    inbox: PushInbox
    client: PeerTransport  # this node's calling side, from the transport
    membership: Membership
    ledger: PrivacyLedger
    private: PrivateData
    serves: tuple[str, ...]  # the purposes this node answers
    withheld: str | None  # why nothing computed on this node's data leaves, if so
    network: NodeNetwork
    strategy: Strategy
    guard: RoundGuard
    _budget_noted: dict[tuple[str, str], float]
    admission: Admission
    served: ServedRequests


def wire_peer_plane(node: Any, cfg: NodeConfig, learner: Learner) -> None:
    seed = int(hashlib.sha256(f"{cfg.seed}:{node.node_id}".encode()).hexdigest()[:8], 16)
    # the peer plane: who is out there, what this node publishes, what it pulled and was pushed
    mcfg = cfg.membership
    node.loop_lag = LoopLag()  # how late the event loop runs: stalls show per round
    node.peers = PeerTable(node.node_id, cfg.suspect_after_s, cfg.dead_after_s,
                           reconnect_min_s=mcfg.reconnect_min_s, reconnect_max_s=mcfg.reconnect_max_s)
    revocation = getattr(getattr(node.transport, "tls", None), "revocation", None)
    node.revocations = (None if revocation is None  # a node the network CA revoked leaves membership for good
                        else Revocations(revocation, node.node_id, node.peers, cfg.request_timeout_s))
    node.problems = ProblemLog(on_rejected=lambda: node.m.rejected.labels(kind="input").inc())
    node.board = PublishBoard()
    node.cache = SnapshotCache(cfg.snapshot_cache_bytes)
    node.inbox = PushInbox()
    node.client = node.transport.connect(node.node_id, node.traffic)
    if node.revocations is not None:
        node.revocations.client = node.client
    node.membership = Membership(node.info, node.position, node.peers, node.client, node.problems,
                                 bootstrap=cfg.peers, heartbeat_interval_s=cfg.heartbeat_interval_s,
                                 request_timeout_s=cfg.request_timeout_s, link_delay_s=cfg.delay_ms / 1000,
                                 rng=random.Random(seed), on_gauges=node._peer_gauges,
                                 settings=Settings.from_config(mcfg), loop_lag=node.loop_lag,
                                 on_claim_struck=lambda: node.m.rejected.labels(kind="membership_claim").inc())
    deadlines = Deadlines(cfg.request_timeout_s + 2 * cfg.delay_ms / 1000, floor_s=cfg.deadline_floor_s,
                          mult=cfg.deadline_mult)
    # privacy: everything computed on my data that leaves (served or sent) goes through one door
    node.ledger = PrivacyLedger(node.store.dir, delta=cfg.privacy.delta, budget=cfg.privacy.budget_epsilon,
                                peer_budget=cfg.privacy.peer_budget_epsilon, expected_peers=cfg.privacy.expected_peers,
                                peer_rate=cfg.privacy.peer_release_rate, peer_burst=cfg.privacy.peer_release_burst,
                                on_change=node._privacy_gauges)
    if node._checkpoint is not None:  # the ledger is verified state: it must cover the checkpoint's pin
        node.ledger.verify(node._checkpoint.state.get("privacy_ledger"), checkpoint=node._checkpoint.path.name,
                           reset=cfg.reset_privacy_ledger)
    node._privacy_gauges()
    node.private = PrivateData(learner, cfg.privacy, node.ledger)
    node.serves = (tuple(cfg.privacy.serve_purposes) if cfg.privacy.serve_purposes is not None
                   else purposes_of(cfg.strategy))
    # own files too small for privacy.min_batch: the node learns, but nothing on its data leaves
    node.withheld = node.private.withheld(tuple({purpose(p).split for p in purposes_of(cfg.strategy) + node.serves}))
    if node.withheld:
        node.problems.note("this node (data)", node.withheld)
    node.network = NodeNetwork(node.node_id, node.client, node.peers, node.cache, node.inbox,
                               lambda: node.board.current, node.spec, node.problems, node.private,
                               labels=node.labels, request_timeout_s=cfg.request_timeout_s,
                               deadlines=deadlines, exchange_timeout_s=cfg.exchange_timeout_s,
                               on_call_failed=node.membership.suspect_hint, watch=cfg.watch_snapshots)
    d = cfg.discovery
    node.network.discovery = Discovery(
        node.node_id, node.peers.alive, usable=lambda p: node.network._address(p) is not None,
        settings=DiscoverySettings(candidates=d.candidates, explore=d.explore, recommend=d.recommend,
                                   per_recommender=d.per_recommender), rng=random.Random(f"discovery-{seed}"))
    node.network.discovery_above = d.above
    node.strategy = get_strategy(cfg.strategy)(node.node_id, learner, node.network,
                                               cfg.strategy_params, seed=seed)
    # a diverged step or round is rolled back, counted and noted; nothing non-finite is published
    def on_divergence(where: str, msg: str) -> None:
        node.m.divergences.labels(where=where).inc()
        node.problems.note("this node (training)", msg)

    node.guard = RoundGuard(learner, node.strategy, on_divergence)
    node._budget_noted = {}
    node.admission = Admission(cfg.limits, on_refused=node._over_budget)
    hooks = DiscoveryHooks(node.strategy, node.network.discovery)  # "whom do you weight?" before the strategy
    node.served = ServedRequests(node.node_id, node.info, node.membership, learner, node.spec,
                                 hooks, node.board, node.cache, node.inbox, node.problems,
                                 node.private, node.serves,
                                 on_refused=lambda kind: node.m.rejected.labels(kind=kind).inc(),
                                 admission=node.admission, push_policy=cfg.limits,
                                 compute_workers=cfg.limits.compute_workers,
                                 revocations=CrlExchange(revocation, node.node_id) if revocation is not None else None)
