"""What this node's peers released to it: answers computed on their data (cross-losses and
-gradients) against refusals on privacy grounds (a spent privacy budget, or own files with fewer
samples than the peer's ``privacy.min_batch``). A strategy whose evidence is such answers
(SCool's, COBO's alignment) mixes nothing when every peer refuses, and with no trace but WARNING
lines that looked like a quiet network; ``/status`` → ``collaboration`` says so instead, and the
lab copies it into results.json."""

from __future__ import annotations

from typing import Any

# the phrases a privacy refusal's message carries (privacy/ledger.py, privacy/mechanisms.py)
PRIVACY_REFUSAL_MARKERS = ("privacy budget", "privacy.min_batch")


def is_privacy_refusal(message: str) -> bool:
    return any(m in message for m in PRIVACY_REFUSAL_MARKERS)


class PeerReleases:
    """Counts of answers received and, per peer, the last privacy refusal (bounded by the peer
    table: one entry per peer that ever refused)."""

    def __init__(self) -> None:
        self.answers = 0
        self.refusals = 0
        self.refused_by: dict[str, str] = {}

    def answered(self, peer: str) -> None:
        self.answers += 1

    def refused(self, peer: str, message: str) -> None:
        self.refusals += 1
        self.refused_by[peer] = message[:300]

    def view(self) -> dict[str, Any]:
        note = None
        if self.refusals and not self.answers:
            peer, why = next(iter(sorted(self.refused_by.items())))
            note = (
                f"no peer released anything computed on its data: {self.refusals} requests refused on "
                f"privacy grounds by {len(self.refused_by)} peer(s) (e.g. {peer}: {why}); a strategy that "
                f"weighs peers by such answers had nothing to mix"
            )
        return {
            "peer_answers": self.answers,
            "privacy_refusals": self.refusals,
            "refused_by": dict(self.refused_by),
            "note": note,
        }
