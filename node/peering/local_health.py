"""Lifeguard's Local Health Multiplier (Dadgar et al. 2018; memberlist's ``awareness``): how much
this node should distrust its own view of others' health. A node whose own probes fail with no
helper even saying the target did not answer, whose loop stalls during its probes, or which finds
itself suspected, is more likely the slow one than its targets: it probes less often and waits
longer for answers, so a struggling node does not accuse healthy members. Answers lower it again."""

from __future__ import annotations

MAX_SCORE = 8  # memberlist's default: at worst the period and the probe budget are 9x


class LocalHealth:
    def __init__(self, max_score: int = MAX_SCORE):
        self.max_score = max_score
        self.score = 0
        self.raised = 0  # times raised, for /status

    def worse(self) -> None:
        """Evidence that this node itself is slow: a probe whose helpers did not answer (no nack),
        a probe spoiled by this node's stalled loop, a suspicion of itself to refute."""
        if self.score < self.max_score:
            self.score += 1
        self.raised += 1

    def better(self) -> None:
        """A probe answered in time."""
        self.score = max(0, self.score - 1)

    def scale(self, seconds: float) -> float:
        """``seconds`` (the protocol period, a probe's budget) stretched by this node's ill health."""
        return seconds * (1 + self.score)
