"""Byte and latency accounting of the peer plane: into Prometheus, and per-round tallies that go
into each round's history record.

A node keeps serving after its last round (peers that started later still pull its model), and
those bytes belong to no round record: ``pending()`` gives them (and anything of a round still
running) so that a run's totals — the sum of every node's round records plus its pending tallies
— add up, every byte received counted as sent by someone."""

from __future__ import annotations

from collections import defaultdict

from ..metrics import Metrics


class TrafficStats:
    def __init__(self, metrics: Metrics):
        self.sent = metrics.counter("coterie_sent_bytes_total", "Bytes sent to peers", ("kind",))
        self.received = metrics.counter("coterie_received_bytes_total", "Bytes received from peers", ("kind",))
        self.lat = metrics.histogram(
            "coterie_request_duration_seconds",
            "Peer request duration",
            ("kind", "side"),
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
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

    def pending(self) -> dict[str, dict[str, int]]:
        """Bytes since the last ``take_round`` (in no round record yet), by direction and kind."""
        return {"sent": dict(self.round_sent), "received": dict(self.round_received)}

    def take_round(self) -> tuple[dict[str, int], dict[str, int]]:
        out = dict(self.round_sent), dict(self.round_received)
        self.round_sent.clear()
        self.round_received.clear()
        return out
