"""A stand-in for the daemon's Node with the surface the admin plane and the CLI rely on."""

from __future__ import annotations

from typing import Any

from coterie.node.metrics import Metrics


class FakeNode:
    def __init__(self, node_id: str = "n0"):
        self.node_id = node_id
        self.metrics = Metrics()
        self.metrics.counter("coterie_rounds_total", "Completed rounds").inc(3)
        self.metrics.counter("coterie_sent_bytes_total", "Bytes sent", ("kind",)).labels(kind="snapshot").inc(4096)
        self.history: list[dict[str, Any]] = [
            {
                "round": r,
                "t": 1000.0 + r,
                "train_loss": 1.0 / r,
                "eval": {"test_acc": 0.5 + r / 10, "test_loss": 1.0 / r},
                "weights": {node_id: 0.5, "n1": 0.5},
            }
            for r in (1, 2, 3)
        ]
        self.is_healthy = True

    def status(self) -> dict:
        return {
            "node_id": self.node_id,
            "round": 3,
            "model_version": 4,
            "strategy": "fedfomo",
            "device": "cpu",
            "peers_alive": 2,
            "uptime_s": 12.5,
            "done": False,
            "last_eval": {"test_acc": 0.8, "test_loss": 0.4},
            "strategy_state": {"eps": 0.2},
        }

    def peers_table(self) -> list[dict]:
        return [
            {
                "node_id": "n1",
                "address": "127.0.0.1:5001",
                "state": "alive",
                "last_seen_s": 0.3,
                "snapshot_version": 3,
                "weight": 0.5,
            },
            {
                "node_id": "n2",
                "address": "127.0.0.1:5002",
                "state": "dead",
                "last_seen_s": 42.0,
                "snapshot_version": None,
                "weight": 0.0,
            },
        ]

    def weights_view(self) -> dict:
        return {
            "node_id": self.node_id,
            "round": 3,
            "weights": {self.node_id: 0.5, "n1": 0.5},
            "strategy_state": {"P": {"n1": 0.1}, "loss": float("nan")},
        }

    def history_view(self, since: int | None) -> list[dict]:
        return [e for e in self.history if since is None or e["round"] > since]

    def healthy(self) -> bool:
        return self.is_healthy

    def export_model(self) -> tuple[bytes, dict]:
        return b"model bytes of " + self.node_id.encode(), {"node_id": self.node_id, "round": 3}
