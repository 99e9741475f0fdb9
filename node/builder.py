"""The builder: wires one node's peer plane — membership, privacy, the ``NodeNetwork`` its strategy
sees, the strategy, admission and the served side — and returns it as a ``PeerPlane``, from what
the node hands it (``PlaneHost``: its identity, transport, state and metrics).
``Node.__init__`` calls it once and holds the plane; the node owns the lifecycle and the loops."""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import NodeConfig
from .learning.guard import RoundGuard
from .learning.learner import Learner
from .node_metrics import NodeMetrics
from .peering.admission import Admission
from .peering.calls import PeerCalls
from .peering.deadlines import Deadlines
from .peering.discovery import Discovery, DiscoverySettings
from .peering.inbox import PushInbox
from .peering.interfaces import PeerTransport, TransportFactory
from .peering.loop_lag import LoopLag
from .peering.membership import Membership, Observers, Settings, full_membership
from .peering.messages import NodeInfo
from .peering.network import NetworkSettings, NodeNetwork
from .peering.overlay import Overlay
from .peering.partial_view import PartialView, ViewSettings
from .peering.peer_table import PeerTable
from .peering.problems import ProblemLog
from .peering.served import ServedRequests, ServedSettings
from .peering.snapshots import PublishBoard, SnapshotCache
from .peering.traffic import TrafficStats
from .peering.versions import VIEWS
from .peering.view_scope import ViewScope
from .persistence import Checkpoint, StateStore
from .privacy.ledger import PrivacyLedger
from .privacy.mechanisms import PrivateData
from .privacy.purposes import purpose, purposes_of
from .revocations import Revocations
from .security.crl_gossip import CrlExchange
from .strategies.base import Strategy
from .strategies.registry import get_strategy


@dataclass
class PlaneHost:
    """What the node gives the builder: its identity, transport, state and metrics, and what its
    heartbeats and handshakes say of it (``info``, ``position``)."""

    node_id: str
    transport: TransportFactory
    traffic: TrafficStats
    metrics: NodeMetrics
    store: StateStore
    checkpoint: Checkpoint | None  # the verified checkpoint to restore, if any (the ledger must cover it)
    spec: Any  # the learner's ParamSpec
    labels: dict[str, str]
    info: Callable[[], NodeInfo]
    position: Callable[[], tuple[int, int]]


@dataclass
class PeerPlane:
    """One node's peer plane, as ``build_peer_plane`` wires it."""

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
    admission: Admission
    served: ServedRequests


def build_peer_plane(host: PlaneHost, cfg: NodeConfig, learner: Learner) -> PeerPlane:
    m = host.metrics
    seed = int(hashlib.sha256(f"{cfg.seed}:{host.node_id}".encode()).hexdigest()[:8], 16)
    # the peer plane: who is out there, what this node publishes, what it pulled and was pushed
    mcfg = cfg.membership
    loop_lag = LoopLag()  # how late the event loop runs: stalls show per round
    peers = PeerTable(
        host.node_id,
        cfg.suspect_after_s,
        cfg.dead_after_s,
        reconnect_min_s=mcfg.reconnect_min_s,
        reconnect_max_s=mcfg.reconnect_max_s,
    )
    revocation = getattr(getattr(host.transport, "tls", None), "revocation", None)
    revocations = (
        None
        if revocation is None  # a node the network CA revoked leaves membership for good
        else Revocations(revocation, host.node_id, peers, cfg.request_timeout_s)
    )
    problems = ProblemLog(on_rejected=lambda: m.rejected.labels(kind="input").inc())
    board = PublishBoard()
    cache = SnapshotCache(cfg.snapshot_cache_bytes)
    inbox = PushInbox()
    client = host.transport.connect(host.node_id, host.traffic)
    if revocations is not None:
        revocations.client = client
    observers = Observers(
        on_gauges=m.peer_counts,
        loop_lag=loop_lag,
        on_claim_struck=lambda: m.rejected.labels(kind="membership_claim").inc(),
    )
    membership = full_membership(
        host.info,
        host.position,
        peers,
        client,
        problems,
        bootstrap=cfg.peers,
        period=cfg.heartbeat_interval_s,
        settings=Settings.from_config(mcfg),
        link_delay_s=cfg.delay_ms / 1000,
        rng=random.Random(seed),
        observers=observers,
    )
    deadlines = Deadlines(
        cfg.request_timeout_s + 2 * cfg.delay_ms / 1000, floor_s=cfg.deadline_floor_s, mult=cfg.deadline_mult
    )
    # privacy: everything computed on my data that leaves (served or sent) goes through one door
    ledger = PrivacyLedger(
        host.store.dir,
        delta=cfg.privacy.delta,
        budget=cfg.privacy.budget_epsilon,
        peer_budget=cfg.privacy.peer_budget_epsilon,
        expected_peers=cfg.privacy.expected_peers,
        peer_rate=cfg.privacy.peer_release_rate,
        peer_burst=cfg.privacy.peer_release_burst,
        on_change=lambda peer, purpose: m.privacy(ledger, peer, purpose),
    )
    if host.checkpoint is not None:  # the ledger is verified state: it must cover the checkpoint's pin
        ledger.verify(
            host.checkpoint.state.get("privacy_ledger"),
            checkpoint=host.checkpoint.path.name,
            reset=cfg.reset_privacy_ledger,
        )
    m.privacy(ledger)
    private = PrivateData(learner, cfg.privacy, ledger)
    serves = tuple(cfg.privacy.serve_purposes) if cfg.privacy.serve_purposes is not None else purposes_of(cfg.strategy)
    # own files too small for privacy.min_batch: the node learns, but nothing on its data leaves
    withheld = private.withheld(tuple({purpose(p).split for p in purposes_of(cfg.strategy) + serves}))
    if withheld:
        problems.note("this node (data)", withheld)
    calls = PeerCalls(  # every call of the requesting side runs under these deadlines
        peers,
        deadlines,
        request_timeout_s=cfg.request_timeout_s,
        exchange_timeout_s=cfg.exchange_timeout_s,
        on_call_failed=membership.suspect_hint,
    )
    network = NodeNetwork(
        NetworkSettings(host.node_id, host.spec, labels=host.labels, watch=cfg.watch_snapshots),
        client,
        calls,
        cache,
        inbox,
        lambda: board.current,
        private,
        problems,
    )
    d = cfg.discovery
    # past the threshold, partial views (sized for a network twice the threshold) sample the
    # network for discovery, and membership runs on them (view_scope.py, docs/membership.md)
    overlay = Overlay(
        PartialView(host.node_id, ViewSettings.for_network(max(2 * d.above, 8)), random.Random(f"views-{seed}")),
        client,
        lambda: host.info().address,
        timeout_s=cfg.request_timeout_s,
        # a member whose handshake did not name the feature (0.1.0) is never called
        known_address=lambda p: network._address(p) if VIEWS in getattr(peers.records.get(p), "features", ()) else None,
    )
    network.overlay = overlay
    network.discovery = Discovery(
        host.node_id,
        lambda: overlay.members() if overlay.view.active else peers.alive(),
        usable=lambda p: network._address(p) is not None,
        settings=DiscoverySettings(
            candidates=d.candidates,
            explore=d.explore,
            recommend=d.recommend,
            per_recommender=d.per_recommender,
            ranking=d.ranking,
        ),
        rng=random.Random(f"discovery-{seed}"),
    )
    network.discovery_above = d.above
    # past the threshold membership runs on the views (probes, table, no push-pull), keeping
    # also the peers a strategy is exchanging with: this round's candidates, the collaborators
    disc = network.discovery
    scope = ViewScope(
        overlay,
        peers,
        membership.handshakes,
        above=d.above,
        also_keep=lambda: [*disc.current(), *disc.collaborators(2 * d.candidates)],
        hold_s=lambda: 2 * network.pace.period_s(),  # a peer pulling me once a round stays known
    )
    membership.state.scope = scope
    peers.on_forget.append(calls.deadlines.forget)  # a member the views dropped: its latencies too
    network.partial = scope.partial

    async def reintroduce(peer: str, timeout: float) -> bool:
        """A peer refused a call as from a stranger: handshake it again (its address as known)."""
        rec = peers.records.get(peer)
        return rec is not None and await scope.introduce(peer, rec.address, timeout)

    calls.reintroduce = reintroduce

    def introduce(recommender: str, node_id: str, address: str) -> None:
        """A recommended peer not known yet: a membership candidate (bounded per recommender)."""
        membership.pending.add(address, source=recommender, node_id=node_id)

    network.introduce = introduce
    strategy = get_strategy(cfg.strategy)(host.node_id, learner, network, cfg.strategy_params, seed=seed)
    strategy.plan_run(cfg.rounds)  # a schedule the paper gives as a share of the run fits this one

    # a diverged step or round is rolled back, counted and noted; nothing non-finite is published
    def on_divergence(where: str, msg: str) -> None:
        m.divergences.labels(where=where).inc()
        problems.note("this node (training)", msg)

    guard = RoundGuard(learner, strategy, on_divergence)
    admission = Admission(cfg.limits, on_refused=_over_budget_noter(m, problems))
    lim = cfg.limits
    served = ServedRequests(
        ServedSettings(
            host.node_id,
            host.spec,
            serves,
            max_push_lag=lim.max_push_lag,
            push_norm_factor=lim.push_norm_factor,
            compute_workers=lim.compute_workers,
        ),
        host.info,
        membership,
        learner,
        strategy,
        private,
        board,
        cache,
        inbox,
        problems,
        admission=admission,
        on_refused=lambda kind: m.rejected.labels(kind=kind).inc(),
        revocations=CrlExchange(revocation, host.node_id) if revocation is not None else None,
        discovery=network.discovery,  # answers "whom do you weight?" (api.RECOMMEND)
        overlay=overlay,  # answers shuffles and link requests (api.SHUFFLE, api.LINK)
    )
    return PeerPlane(
        loop_lag,
        peers,
        revocations,
        problems,
        board,
        cache,
        inbox,
        client,
        membership,
        ledger,
        private,
        serves,
        withheld,
        network,
        strategy,
        guard,
        admission,
        served,
    )


def _over_budget_noter(m: NodeMetrics, problems: ProblemLog) -> Callable[[str, str], None]:
    """What a refusal over a peer's budget does: counted each time, noted once per 10 s per peer
    and budget (a flood is one problem, not 50)."""
    noted: dict[tuple[str, str], float] = {}

    def over_budget(peer: str, why: str) -> None:
        m.rejected.labels(kind=f"limit_{why}").inc()
        now = time.monotonic()
        if now - noted.get((peer, why), -1e9) >= 10.0:
            noted[(peer, why)] = now
            problems.note(peer, f"over its {why} budget: requests refused (RESOURCE_EXHAUSTED)")

    return over_budget
