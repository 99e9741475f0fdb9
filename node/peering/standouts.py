"""Evidence ranking's bookkeeping for collaborator discovery (``discovery.ranking = "evidence"``):
which evaluations of a peer stood out of the noise, and the noise bar they are judged against.

A strategy like FedFomo weights a true collaborator in only a minority of its evaluations (19% on
100 daemons); a running score decays those rare clear weights back to noise. Counting the
evaluations that stood out against those that did not, as a sequential likelihood ratio, keeps
them, and a stranger's one lucky weight is outweighed by its misses. State is O(1) per scored
peer (the caller forgets peers as it forgets their scores)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StandOutSettings:  # DiscoverySettings' fields of the same names
    hit_rate: float
    false_hit_rate: float
    standout: float
    noise_window: int
    noise_after: int


class StandOuts:
    def __init__(self, s: StandOutSettings):
        if not 0 < s.false_hit_rate < s.hit_rate < 1:
            raise ValueError(
                f"discovery hit_rate {s.hit_rate} and false_hit_rate {s.false_hit_rate}:"
                " expected 0 < false_hit_rate < hit_rate < 1"
            )
        self.s = s
        self.hits: dict[str, int] = {}  # per peer: evaluations that stood out of the noise
        # evidence a stand-out evaluation adds, and a plain one takes away (log likelihood ratios)
        self._hit_llr = math.log(s.hit_rate / s.false_hit_rate)
        self._miss_llr = math.log((1 - s.hit_rate) / (1 - s.false_hit_rate))
        # evaluated before enough weights were seen to tell noise: judged once they are
        self._unjudged: dict[str, deque[float]] = {}  # their weights, the last few
        self._first_weights: list[float] = []
        self._noise_n = 0  # blind draws' first weights seen, their mean and variance (running)
        self._noise_mean = 0.0
        self._noise_var = 0.0

    @classmethod
    def of(cls, settings: object) -> StandOuts:
        """From discovery's settings (``DiscoverySettings``: fields of the same names)."""
        names = StandOutSettings.__dataclass_fields__
        return cls(StandOutSettings(**{f: getattr(settings, f) for f in names}))

    def judge(self, seen: dict[str, float], fresh: list[float]) -> None:
        """Count the evaluations in ``seen`` (peer → weight) that stand out of the noise: a weight
        more than ``standout`` standard deviations above the mean of the noise — estimated from
        ``fresh``, the first evaluations of peers drawn blindly from the view (running, over the
        last ~``noise_window``: O(1)). A blind draw is a cluster mate about as often as chance, so
        found mates hardly raise the bar; estimating it from all weights, kept mates' raised it
        above a mate's weight, and leaving out the weights that stood out cut the noise's own
        tail, which lowered the bar, which cut more of it (measured: a bar of 0.2 for noise of
        sd 0.2). Until ``noise_after`` such weights are in, the weights wait (the last few a
        peer), then are judged."""
        for p in seen:
            self.hits.setdefault(p, 0)
        if not self.noise_known():
            for p, w in seen.items():
                self._unjudged.setdefault(p, deque(maxlen=8)).append(w)
            self._first_weights += fresh
            if len(self._first_weights) < self.s.noise_after:
                return
            values = self._first_weights
            self._noise_mean = sum(values) / len(values)
            self._noise_var = sum((v - self._noise_mean) ** 2 for v in values) / len(values)
            self._noise_n = len(values)
            self._first_weights = []
            floor = self.noise_floor()
            for p, ws in self._unjudged.items():
                if p in self.hits:  # not forgotten meanwhile
                    self.hits[p] += sum(w > floor for w in ws)
            self._unjudged.clear()
            return
        floor = self.noise_floor()
        for p, w in seen.items():
            self.hits[p] += w > floor
        for w in fresh:
            self._noise_n += 1
            a = 1 / min(self._noise_n, self.s.noise_window)
            d = w - self._noise_mean
            self._noise_mean += a * d
            self._noise_var = (1 - a) * (self._noise_var + a * d * d)

    def noise_known(self) -> bool:
        return self._noise_n >= self.s.noise_after

    def noise_floor(self) -> float:
        """The weight an evaluation must beat to stand out; inf until the noise is known."""
        if not self.noise_known():
            return math.inf
        return self._noise_mean + self.s.standout * self._noise_var**0.5

    def evidence(self, hits: int, evaluations: int) -> float:
        """Log likelihood ratio that a peer with ``hits`` stand-outs in ``evaluations`` is a
        collaborator (stands out in ``hit_rate`` of its evaluations) rather than noise
        (``false_hit_rate``): > 0 once it stood out and was not outweighed by misses since (at
        the defaults one stand-out outweighs ~11 plain ones)."""
        return hits * self._hit_llr + (evaluations - hits) * self._miss_llr

    def forget(self, p: str) -> None:
        self.hits.pop(p, None)
        self._unjudged.pop(p, None)
