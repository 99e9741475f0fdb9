"""Collaborator discovery: the candidate peers a node's strategy evaluates each round, in a
network too large to evaluate everyone (T-Man, Jelasity & Babaoglu 2005, applied to learning).

Each round the strategy gets ``settings.candidates`` peers (``NodeNetwork.peers()`` returns them
past the size threshold; what a strategy does within its candidate set is unchanged):

- *keep*: the peers it weights clearly (a running score per peer, fed from the strategy's own
  weights after each round; ``collaborators``), so a found collaborator stays found;
- *explore*: never-scored peers in the other slots (at least ``settings.explore`` a round):
  recommendations first, then a uniform draw from the node's view (the partial view past the
  threshold, else membership).

Recommendations answer "whom do you weight?" (its own peer RPC, ``api.RECOMMEND``: the answer
lists ids with addresses, only peers the answerer can call now): once a round the node asks a few
of its best collaborators for their best-weighted peers — a cluster mate's collaborators are
mostly cluster mates, so a node that found one finds the rest in a few rounds; and a peer that
asked me is a hint for me (``on_contacted``), so a link found from one side is tried from the
other. They are *hints*: a hint only takes an exploring slot, so the node evaluates the peer itself before its strategy can weight
it; a peer recommends only when asked, never itself, at most ``settings.recommend`` ids an
answer, of which at most ``per_recommender`` wait at once and at most one is explored per
round — an insider cannot fill the candidates with itself or a clique. State is bounded
(``max_scored`` scores, ``max_hints`` hints): O(1) in the network's size.

``ranking="evidence"`` ranks peers on how often the strategy's weight for them stood out of the
noise rather than on a running score, for strategies that weight a true collaborator in only a
minority of their evaluations (``DiscoverySettings.ranking``; figures in bench/results/scale.md).
``reexplore_after`` (default 0.2) gives a peer scored low on few evaluations its second look only
once the node has met about that share of the network (``coverage``, estimated from its view and
the peers new in it).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .coverage import Coverage
from .standouts import StandOuts


@dataclass(frozen=True)
class DiscoverySettings:
    candidates: int = 5  # peers offered to the strategy per round
    explore: int = 3  # of which never-scored peers, at most
    recommend: int = 5  # ids one "whom do you weight?" answer carries, at most
    per_recommender: int = 2  # hints from one peer waiting at once (insider bound)
    hints_per_recommender_round: int = 1  # hints from one peer explored per round (insider bound)
    max_hints: int = 32
    max_scored: int = 256  # peers whose score is remembered (lowest forgotten first)
    memory: float = 0.5  # weight of the past in a peer's running score
    ask_among: int = 3  # whom I ask: among my this many best collaborators ...
    asks: int = 2  # ... this many a round
    relative: float = 0.5  # a collaborator: scored at least this share of my best one ...
    standout: float = 3.0  # ... and this many standard deviations above my mean score ...
    standout_after: int = 10  # ... once this many peers are scored (fewer: too few to tell)
    fence: float = 20.0  # ... or this many interquartile ranges above the upper quartile (``_standout``) ...
    fence_after: int = 30  # ... once this many peers are scored
    fans: int = 8  # recent askers remembered, recommended after my collaborators
    # a peer is a collaborator (asked, recommended, and so the peers that ask me) only once I
    # evaluated it at least this many times and it still stands out: one evaluation's best of
    # noise passed the gate, and at 1,000 nodes 88% of the hints explored were strangers — slots a
    # blind draw could have used (bench/results/scale.md, "the ceiling"); 1: at once (the old rule)
    collaborator_after: int = 2
    # a peer I do not weight is written off only after this many evaluations: one evaluation is
    # noisy (FedFomo weighted a true mate in 19% of them on 100 daemons); 0: written off at once
    confirm: int = 3
    reexplore: int = 1  # exploring slots a round for such not-yet-confirmed peers, at most
    # ... spent (and such peers accepted again as hints) only once I have evaluated about this
    # share of the network (``coverage``), or my view holds no peer I never evaluated: while most
    # of the network is unmet a blind draw meets more mates than a second look (1,000 nodes, clean
    # signal: the fixed slot cost ~40% of them), once much is met a second look is what finds a
    # mate weighted rarely (100 nodes; bench/results/scale.md). 0.0: always (a fixed slot). 0.2:
    # at 100 nodes on from round ~7, as good as the fixed slot; at 1,000 hardly on in 30 rounds
    # (a node meets ~10% of the network there; a bar of 0.1 turned it on for 42% by round 20)
    reexplore_after: float = 0.2
    coverage_window: int = 30  # peers newly in my view the coverage estimate runs over
    # how peers are ranked (``best``, asked, recommended; kept are those whose running score
    # stands out, either way): "running" — the running score (``memory``); "evidence" — the count
    # of evaluations in which the peer's weight stood out of the noise against the count it did
    # not, a sequential likelihood ratio: a mate weighted in a minority of its evaluations keeps
    # its rare clear weights where a running score decays them back to noise, and a stranger's one
    # lucky weight is outweighed by its misses
    ranking: str = "running"
    hit_rate: float = 0.2  # evidence: the least share of evaluations a collaborator stands out in ...
    false_hit_rate: float = 0.02  # ... and the share a useless peer stands out in by chance
    noise_window: int = 100  # evidence: weights the noise estimate runs over (exponential memory)
    noise_after: int = 30  # evidence: ... and takes before it is used (fewer: the bar wavered)


RANKINGS = ("running", "evidence")


@dataclass
class DiscoveryCounters:
    rounds: int = 0
    explored: int = 0
    hinted: int = 0  # explored because recommended
    hints_received: int = 0
    hints_dropped: int = 0  # refused by the caps, or unsolicited
    reexplored: int = 0  # explored again: scored low on fewer than ``confirm`` evaluations
    asks: int = 0


class Discovery:
    """One node's candidate source. ``view()``: the ids the node currently knows of (its sample
    of the network); ``usable(peer)``: whether it can be called now (alive, responsive)."""

    def __init__(
        self,
        me: str,
        view: Callable[[], Sequence[str]],
        *,
        usable: Callable[[str], bool] = lambda p: True,
        settings: DiscoverySettings | None = None,
        rng: random.Random | None = None,
    ):
        self.me = me
        self.view = view
        self.usable = usable
        self.s = settings or DiscoverySettings()
        self.rng = rng or random.Random()
        if self.s.ranking not in RANKINGS:
            raise ValueError(f"discovery ranking {self.s.ranking!r}: expected one of {', '.join(RANKINGS)}")
        if self.s.collaborator_after < 1:
            raise ValueError(
                f"discovery collaborator_after {self.s.collaborator_after}: expected at least 1 evaluation"
            )
        self.scores: dict[str, float] = {}
        self.evaluations: dict[str, int] = {}  # per scored peer (same keys: O(max_scored))
        self.standouts = StandOuts.of(self.s)  # evidence ranking's counts and noise bar
        self.hits = self.standouts.hits  # evaluations that stood out of the noise (same keys)
        self._blind: set[str] = set()  # this round's candidates drawn blindly from the view
        self._collab: set[str] = set()  # collaborators as of the last round or observation
        # recommended peers: re-explored only if recommended again (bounded per recommender), never by the blind slot
        self._recommended: set[str] = set()
        self.hints: deque[tuple[str, str]] = deque()  # (recommender, peer), oldest first
        self.counters = DiscoveryCounters()
        self._current: list[str] = []
        self._asked: set[str] = set()  # peers asked this round: answers accepted from them
        self.met = Coverage(me, self.s.reexplore_after, self.s.coverage_window)  # the share of the network met
        self.fans: deque[str] = deque(maxlen=self.s.fans)  # who asked me lately: they weight me

    # --- a round ---
    def begin_round(self) -> list[str]:
        """Pick this round's candidates (kept stable until the next call: ``current``)."""
        self.counters.rounds += 1
        self.met.on_round(self.view(), self.scores)
        collab = self.collaborators(len(self.scores))
        self._collab = set(collab)
        best = [p for p in self._standing_out() if self.usable(p)]
        keep = best[: self.s.candidates - min(self.s.explore, self.s.candidates)]
        n_explore = self.s.candidates - len(keep)  # slots nothing good is kept in explore too
        picked = list(keep)
        explore = self._from_hints(n_explore, set(picked))
        explore += self._doubtful_again(min(self.s.reexplore, n_explore - len(explore)), set(picked) | set(explore))
        self._blind = set(self._from_view(n_explore - len(explore), set(picked) | set(explore)))
        explore += sorted(self._blind)
        picked += explore
        # exploring found nothing new: the slots go back to kept peers
        picked += [p for p in best if p not in picked][: self.s.candidates - len(picked)]
        self.counters.explored += len(explore)
        self._current = sorted(picked)
        return self._current

    def current(self) -> list[str]:
        return list(self._current)

    def observe(self, weights: dict[str, float], evaluated: Iterable[str] = ()) -> None:
        """After a round: the strategy's weights of the peers it evaluated (a peer evaluated and
        not weighted scores 0)."""
        seen = {p: float(weights.get(p, 0.0)) for p in evaluated if p != self.me}
        seen.update({p: float(w) for p, w in weights.items() if p != self.me})
        for p, w in seen.items():
            old = self.scores.get(p)
            self.scores[p] = w if old is None else self.s.memory * old + (1 - self.s.memory) * w
            self.evaluations[p] = self.evaluations.get(p, 0) + 1
        # a blind draw's first weight: a cluster mate about as often as chance, so noise
        fresh = [w for p, w in seen.items() if p in self._blind and self.evaluations[p] == 1]
        self._blind.clear()
        self.standouts.judge(seen, fresh)
        if len(self.scores) > self.s.max_scored:
            for p in sorted(self.scores, key=self._rank_key)[: len(self.scores) - self.s.max_scored]:
                for table in (self.scores, self.evaluations):
                    del table[p]
                self.standouts.forget(p)
                self._recommended.discard(p)
        self._recommended &= self.scores.keys()  # bounded as the scores are
        self.met.on_scores()
        self._collab = set(self.collaborators(len(self.scores)))

    def evidence(self, p: str) -> float:
        """Log likelihood ratio that ``p`` is a collaborator rather than noise (``StandOuts``)."""
        return self.standouts.evidence(self.hits.get(p, 0), self.evaluations.get(p, 0))

    def _rank_key(self, p: str) -> tuple[float, float, float]:
        """Higher is better. Evidence ranking: positive evidence first, then the running score (by
        evidence alone, 4.3 of 9 mates found against 9.0: 100 nodes, clean signal)."""
        if self.s.ranking == "evidence":
            e = self.evidence(p)
            return (1.0, e, self.scores[p]) if e > 0 else (0.0, self.scores[p], 0.0)
        return (self.scores[p], 0.0, 0.0)

    def reexploring(self) -> bool:
        """Whether peers scored low on few evaluations get another look now (``written_off``)."""
        return self.met.reexploring(self.view, self.scores)

    def written_off(self, p: str) -> bool:
        """Scored, not a collaborator, and evaluated ``confirm`` times, or once while most of the
        network is unmet (``reexploring``; fewer looks may have missed a mate): not worth another."""
        if p not in self.scores or p in self._collab or not self.reexploring():
            return p in self.scores
        # evidence ranking: each time it stood out buys it ``confirm`` more evaluations (a mate
        # weighted in 20% of them stands out again within 3 about half the time)
        more = self.hits[p] if self.s.ranking == "evidence" else 0
        return self.evaluations[p] >= self.s.confirm * (1 + more)

    def _doubtful(self, p: str) -> bool:
        return p in self.scores and not self.written_off(p)

    def best(self, k: int) -> list[str]:
        """My ``k`` best-ranked peers (positive score, or — evidence ranking — stood out once),
        best first."""
        evidence = self.s.ranking == "evidence"
        ranked = [p for p, s in self.scores.items() if s > 0 or (evidence and self.hits[p] > 0)]
        ranked.sort(key=lambda p: (*(-x for x in self._rank_key(p)), p))
        return ranked[:k]

    def collaborators(self, k: int) -> list[str]:
        """My best ``k`` that I weight clearly, evaluated ``collaborator_after`` times (a kept mate
        is confirmed the next round, a stranger's lucky weight is not). Running ranking: a score at
        least ``relative`` × my best one's and standing out of the others' (``_standing_out``).
        Evidence ranking: positive evidence, and stood out twice or stands out now."""
        top = self.best(len(self.scores))
        if self.s.ranking == "evidence" and self.standouts.noise_known():
            # asked and recommended: stood out twice (a stranger's lucky weight stands out once
            # in ~50 evaluations; asked on one, strangers' answers filled the hints), or once and
            # its running score still stands out; stood out once and since faded: ranked, and
            # re-explored to be confirmed (``_doubtful_again``)
            now = set(self._standing_out(top))
            top = [p for p in top if self.evidence(p) > 0 and (self.hits[p] >= 2 or p in now)]
        else:
            top = self._standing_out(top)
        return [p for p in top if self.evaluations[p] >= self.s.collaborator_after][:k]

    def _standing_out(self, top: list[str] | None = None) -> list[str]:
        """Of ``top`` (default: every scored peer), best running score first, those whose running
        score is at least ``relative`` × the best one's and stands out of the others': what the
        strategy weights now — the peers kept among the candidates (either ranking: keeping a
        mate the strategy weights in one evaluation of five took a slot from exploring; measured
        at 100 nodes, clean signal: 8.85 of 9 mates found against 9.0)."""
        if top is None:
            top = sorted((p for p, s in self.scores.items() if s > 0), key=lambda p: (-self.scores[p], p))
        if not top:
            return []
        floor = max(
            self.s.relative * max(self.scores[p] for p in top), standout_bar(list(self.scores.values()), self.s)
        )
        return [p for p in top if self.scores[p] >= floor]

    # --- recommendations ---
    def whom_to_ask(self) -> list[str]:
        """Some of my best collaborators, to ask "whom do you weight?" this round."""
        top = [p for p in self.collaborators(self.s.ask_among) if self.usable(p)]
        picked = self.rng.sample(top, min(self.s.asks, len(top)))
        self._asked.update(picked)
        self.counters.asks += len(picked)
        return picked

    def recommend(self, asker: str, count: int | None = None) -> list[str]:
        """My answer to ``asker``: at most ``count`` (and ``recommend``) of the peers I weight
        most that I can call now (never the asker itself)."""
        n = self.s.recommend if count is None else max(0, min(count, self.s.recommend))
        mine = self.collaborators(len(self.scores))
        # then those who asked me (they weight me: likely my cluster's, though I may not have
        # evaluated them yet) — spreads a mate two hops in one answer
        fans = [p for p in reversed(self.fans) if p not in mine]
        return [p for p in mine + fans if p != asker and self.usable(p)][:n]

    def on_recommendations(self, sender: str, peers: Sequence[str]) -> list[str]:
        """Hints from ``sender``'s answer; returns those kept. Unasked answers, ids
        beyond ``recommend``, the sender itself and peers already scored are dropped; at most
        ``per_recommender`` from one sender wait at once."""
        if sender not in self._asked:
            self.counters.hints_dropped += len(peers)
            return []
        self._asked.discard(sender)
        waiting = sum(1 for src, _ in self.hints if src == sender)
        queued = {p for _, p in self.hints}
        kept: list[str] = []
        for p in list(dict.fromkeys(peers))[: self.s.recommend]:
            self.counters.hints_received += 1
            if p in (self.me, sender) or self.written_off(p) or p in queued or waiting >= self.s.per_recommender:
                self.counters.hints_dropped += 1
                continue
            self.hints.append((sender, p))
            waiting += 1
            kept.append(p)
        while len(self.hints) > self.s.max_hints:
            self.hints.popleft()
        return kept

    def on_contacted(self, peer: str) -> bool:
        """``peer`` (authenticated) evaluated me — pulled my model, asked whom I weight: it may be
        a collaborator, a hint for me too (links found from one side become two-sided). A peer can
        only put itself forward this way, once until it is scored."""
        if peer == self.me:
            return False
        if peer in self.fans:
            self.fans.remove(peer)
        self.fans.append(peer)
        if peer in self.scores or any(p == peer for _, p in self.hints):
            return False
        self.hints.append((peer, peer))
        while len(self.hints) > self.s.max_hints:
            self.hints.popleft()
        return True

    # --- internals ---
    def _from_hints(self, n: int, taken: set[str]) -> list[str]:
        """Up to ``n`` hints: one peer that evaluated me (reciprocity finds mates fastest), then
        recommendations, then the other such peers; at most ``hints_per_recommender_round`` from
        one source."""
        out: list[str] = []
        per: dict[str, int] = {}
        for recommended, most in ((False, 1), (True, n), (False, n)):
            took = 0
            for src, p in self.hints:
                if len(out) >= n or took >= most:
                    break
                if (src != p) != recommended or p in taken or self.written_off(p) or not self.usable(p):
                    continue
                if src == p and p in self.scores:  # a peer puts itself forward once until scored
                    continue
                if per.get(src, 0) >= self.s.hints_per_recommender_round:
                    continue
                per[src] = per.get(src, 0) + 1
                if recommended:
                    self._recommended.add(p)
                took += 1
                out.append(p)
                taken.add(p)
        self.hints = deque(
            (src, p)
            for src, p in self.hints
            if p not in taken and not self.written_off(p) and not (src == p and p in self.scores)
        )
        self.counters.hinted += len(out)
        return out

    def _doubtful_again(self, n: int, taken: set[str]) -> list[str]:
        """Up to ``n`` peers scored low on fewer than ``confirm`` evaluations, fewest first (a
        random one among equals): a mate one noisy evaluation missed gets another look."""
        if n <= 0:
            return []
        pool = [p for p in self.scores if p not in taken and p not in self._recommended and self._doubtful(p)]
        self.rng.shuffle(pool)
        # those that stood out once first (evidence ranking: a second time confirms them)
        pool.sort(key=lambda p: (-self.hits[p] if self.s.ranking == "evidence" else 0, self.evaluations[p]))
        out = [p for p in pool if self.usable(p)][:n]
        self.counters.reexplored += len(out)
        return out

    def _from_view(self, n: int, taken: set[str]) -> list[str]:
        if n <= 0:
            return []
        pool = [p for p in self.view() if p != self.me and p not in taken and p not in self.scores]
        if len(pool) < n:  # everyone in view already scored: re-explore the ones scored lowest
            pool += [p for p in self.view() if p != self.me and p not in taken and p not in pool]
        self.rng.shuffle(pool)
        out: list[str] = []
        for p in pool:
            if len(out) >= n:
                break
            if self.usable(p):
                out.append(p)
        return out


def standout_bar(scores: list[float], s: DiscoverySettings) -> float:
    """The score a peer must beat to count as found (``Discovery._standing_out``): in a network
    of many clusters most peers I evaluate are of no use and score about noise, so the best of
    them is noise too; keeping, asking or recommending it spends slots on chance (measured:
    bench/overlay_cost.py). The lower of two bars: ``standout`` standard deviations above the
    crowd's mean, and a fence ``fence`` interquartile ranges above its upper quartile (Tukey's
    far-out fence is at 3; far higher here: it is for noise that is mostly one value, below)."""
    if len(scores) < s.standout_after:
        return 0.0
    # the crowd's spread without my best peer: one mate among few noise-scored peers would
    # otherwise widen the spread it has to beat
    values = sorted(scores)[:-1]
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    # but several found mates widen it too, and where strangers score ~0 (FedFomo: 98% of
    # them) they are the whole spread: 7 mates at ~0.25 among 33 scored peers set the bar at
    # ~0.3, above every one of them (100 daemons, run 5: 41 of 100 nodes ended with no mate
    # among their candidates). Quartiles do not move while mates are under a quarter of the
    # peers scored: strangers at 0 put the fence at 0. Where the noise is spread it must not
    # undercut the mean's bar: on clipped Gaussian noise (the in-process figures) fences at 3
    # and 6 IQRs (~2.7 and ~4.7 sd of the noise) did at times, and found fewer mates at 1,000
    # nodes (bench/results/scale.md, "runs 5 and 6"); at 20 (~14 sd) it acts where the crowd's middle
    # half scores alike. Not on fewer than ``fence_after`` peers: in a dozen noise scores
    # three quarters at 0 is chance, and every positive one would stand out
    bar = mean + s.standout * var**0.5
    if len(scores) < s.fence_after:
        return bar
    ordered = sorted(scores)
    q1, q3 = _quantile(ordered, 0.25), _quantile(ordered, 0.75)
    return min(bar, q3 + s.fence * (q3 - q1))


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted ``ordered`` (linear between the two nearest ranks)."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])
