"""The peer server's stream deadlines (``server.PeerService`` and its upload part,
``compute_rpcs.py``; ``config.LimitsConfig`` carries the configured values)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamLimits:
    """Server-side deadlines (``config.LimitsConfig`` carries the configured values)."""

    upload_timeout_s: float = 60.0
    upload_idle_s: float = 10.0
    send_timeout_s: float = 120.0
    min_bytes_per_s: float = 64 * 1024  # deadlines stretch by size / this
    max_watches: int = 64  # snapshot subscriptions open at once (one per peer)

    def upload_deadline(self, size: int) -> float:
        return self.upload_timeout_s + size / self.min_bytes_per_s

    def send_deadline(self, size: int) -> float:
        return self.send_timeout_s + size / self.min_bytes_per_s
