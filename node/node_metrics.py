"""The node's own Prometheus metrics (names and help texts are the public contract: dashboards
and alerts read them). The peer plane's traffic metrics live in ``peering/traffic.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .metrics import Metrics

if TYPE_CHECKING:
    from .privacy.ledger import PrivacyLedger


class NodeMetrics:
    def __init__(self, metrics: Metrics):
        self.rounds = metrics.counter("coterie_rounds_total", "Completed rounds")
        self.round_s = metrics.histogram(
            "coterie_round_duration_seconds", "Round wall time", buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
        )
        self.peers = metrics.gauge("coterie_peers", "Known peers by state", ("state",))
        self.rejected = metrics.counter("coterie_rejected_total", "Peer inputs rejected", ("kind",))
        self.divergences = metrics.counter(
            "coterie_training_divergences_total", "Diverged steps or rounds rolled back", ("where",)
        )
        self.round = metrics.gauge("coterie_round", "Current round")
        self.acc = metrics.gauge("coterie_test_accuracy_ratio", "Test accuracy after the last round (0..1)")
        self.eps = metrics.gauge(
            "coterie_privacy_epsilon", "ε released about this node's data, all peers composed (at privacy.delta)"
        )
        self.eps_peer = metrics.gauge(
            "coterie_privacy_peer_epsilon", "ε released about this node's data to one peer", ("peer",)
        )
        self.eps_budget = metrics.gauge("coterie_privacy_budget_epsilon", "Configured total ε budget")
        self.releases = metrics.counter(
            "coterie_privacy_releases_total", "Answers computed on this node's data that left it", ("purpose",)
        )
        self.ckpt_s = metrics.histogram(
            "coterie_checkpoint_write_seconds",
            "Checkpoint write (background thread)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.ckpt_wait = metrics.histogram(
            "coterie_checkpoint_wait_seconds",
            "Round loop time spent on checkpoints (snapshot + waiting for the writer)",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        # collaborator discovery (peering/discovery.py), set after each round past its threshold
        self.discovery = metrics.gauge(
            "coterie_discovery",
            "Collaborator discovery: candidates offered this round, hints waiting, peers scored",
            ("what",),
        )
        self.discovery_events = metrics.gauge(
            "coterie_discovery_events",
            "Collaborator discovery so far: peers "
            "explored, explored on a recommendation (hits), asks, hints "
            "received and dropped",
            ("what",),
        )
        # partial views past the threshold (peering/partial_view.py), set after each round
        self.view_size = metrics.gauge("coterie_view_size", "Peers in this node's overlay views", ("view",))
        self.overlay_events = metrics.gauge(
            "coterie_overlay_events",
            "Overlay so far: shuffles sent and received, passive peers promoted, failed links, "
            "hearsay entries replaced",
            ("what",),
        )
        self.reintroductions = metrics.gauge(
            "coterie_reintroductions",
            "Calls a peer refused as from a stranger (it forgot this node), so far: made again after "
            "a handshake, the handshake failed, refused again after it",
            ("outcome",),
        )

    def peer_counts(self, counts: dict[str, int]) -> None:
        """Membership's gauges: members by state."""
        for state, n in counts.items():
            self.peers.labels(state=state).set(n)

    def privacy(self, ledger: PrivacyLedger, peer: str | None = None, purpose: str | None = None) -> None:
        """The ledger's ε (in total and for ``peer``, else every peer) and one more release of ``purpose``."""
        self.eps.set(ledger.epsilon())
        self.eps_budget.set(ledger.budget)
        for p in [peer] if peer else list(ledger.peers):
            self.eps_peer.labels(peer=p).set(ledger.epsilon(p))
        if purpose:
            self.releases.labels(purpose=purpose).inc()
