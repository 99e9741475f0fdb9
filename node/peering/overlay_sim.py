"""Many nodes' partial views and discovery in one process, messages delivered through memory —
for tests and ``bench/scale.py``, as ``transport/inproc.py`` is for the peer RPCs. Counts what
each node sends (``partial_view.message_bytes``) and lets a test kill nodes or plant insiders.

``simulate_discovery`` runs discovery among nodes in clusters whose evaluation of each other is
a noisy "same cluster or not" (the label-permutation setting: only cluster mates help), against
the baseline a strategy has without discovery: a uniform sample of the network each round."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .discovery import Discovery, DiscoverySettings
from .partial_view import Message, PartialView, ViewSettings, message_bytes, view_components

PROBE_BYTES = 2 * 24  # a ping and its ack


class SimOverlay:
    def __init__(
        self,
        ids: list[str],
        settings: ViewSettings,
        seed: int = 0,
        view_factory: Callable[[str, ViewSettings, random.Random], PartialView] | None = None,
    ):
        make = view_factory or (lambda i, s, r: PartialView(i, s, r))
        self.rng = random.Random(seed)
        self.views: dict[str, PartialView] = {i: make(i, settings, random.Random(f"{seed}-{i}")) for i in ids}
        self.alive: set[str] = set(ids)
        self.sent_bytes: Counter[str] = Counter()
        self.messages = 0
        self._busy: set[str] = set()  # nodes that may have something to send

    def join_all(self, ids: Iterable[str] | None = None) -> None:
        """Each node (in order) joins through a random node that joined before it."""
        joined: list[str] = []
        for i in ids if ids is not None else list(self.views):
            if joined:
                self.views[i].join(self.rng.choice(joined))
                self._busy.add(i)
                self.deliver()
            joined.append(i)

    def deliver(self, max_waves: int = 50) -> None:
        for _ in range(max_waves):
            busy, self._busy = sorted(self._busy & self.alive), set()
            batch = [(src, dst, m) for src in busy for dst, m in self.views[src].take_outbox()]
            if not batch:
                return
            for src, dst, msg in batch:
                self._deliver(src, dst, msg)

    def _deliver(self, src: str, dst: str, msg: Message) -> None:
        self.messages += 1
        self.sent_bytes[src] += message_bytes(msg)
        if dst in self.alive:
            self.views[dst].on_message(src, msg)
            self._busy.add(dst)
        else:
            self.views[src].on_failed(dst)  # the connection is refused: the sender learns at once
            self._busy.add(src)

    def round(self) -> None:
        """One period everywhere: each node probes one active neighbour and shuffles."""
        for n in sorted(self.alive):
            v = self.views[n]
            target = v.next_probe()
            if target is not None:
                self.sent_bytes[n] += PROBE_BYTES
                if target not in self.alive:
                    v.on_failed(target)
            v.tick()
        self._busy |= self.alive
        self.deliver()

    def kill(self, nodes: Iterable[str]) -> None:
        self.alive -= set(nodes)

    def components(self) -> list[set[str]]:
        """The alive nodes' active views as an undirected graph: its connected components."""
        return view_components({n: self.views[n].active for n in self.alive})


# ------------------------------------------------------------------------------ discovery
@dataclass
class DiscoveryResult:
    mates_found: dict[int, float]  # round -> mean cluster mates among a node's top-weighted peers
    evaluations_per_round: int
    late_mates_found: dict[int, float] = field(default_factory=dict)  # late joiners, by rounds since joining
    mates_evaluated: dict[int, float] = field(default_factory=dict)  # round -> mean distinct mates evaluated


def cluster_of(node: str, size: int) -> int:
    return int(node.rsplit("-", 1)[1]) // size


def simulate_discovery(
    n: int,
    cluster_size: int,
    rounds: int,
    *,
    mode: str,
    seed: int = 0,
    settings: DiscoverySettings | None = None,
    checkpoints: Iterable[int] = (10, 20, 30),
    noise: float = 0.2,
    view_settings: ViewSettings | None = None,
    late: float = 0.0,
    late_round: int = 10,
    mate_signal: float = 1.0,
    watch: Callable[[int, str, list[str], set[str], Discovery], None] | None = None,
) -> DiscoveryResult:
    """``mode``: "discovery" (partial views + recommendations) or "uniform" (each round a uniform
    sample of ``settings.candidates`` of all others, the strategies' draw without discovery).
    A node's weight for a peer it evaluated: 1 for a cluster mate, 0 otherwise, plus Gaussian
    noise (clipped at 0) — with ``mate_signal`` < 1 a mate's 1 comes only with that probability
    (else 0 + noise: the strategy missed it, as FedFomo did in 81% of its evaluations of a mate
    on 100 daemons, bench/results/daemons_discovery_run2.json); its top-weighted peers: its ``cluster_size - 1`` best running scores.
    ``late``: this share of the nodes (spread over the clusters) joins at ``late_round``;
    ``mates_found`` counts the others, ``late_mates_found`` them at each checkpoint after joining
    (run ``late_round`` + the last checkpoint rounds to see them all). ``watch(round, node,
    candidates, blind, discovery)``, if given, is called after each node's evaluations are observed
    (``blind``: the candidates drawn blindly from its view; in "uniform" mode all of them): for
    diagnostics (``bench/discovery_ceiling.py``)."""
    s = settings or DiscoverySettings()
    rng = random.Random(seed)
    ids = [f"node-{i:05d}" for i in range(n)]
    stride = round(1 / late) if late > 0 else 0
    latecomers = {i for k, i in enumerate(ids) if stride and k % stride == stride // 2}
    overlay = SimOverlay(ids, view_settings or ViewSettings.for_network(n), seed=seed)
    overlay.join_all([i for i in ids if i not in latecomers])
    overlay.kill(latecomers)  # not there yet
    for _ in range(5):
        overlay.round()
    disc = {i: Discovery(i, overlay.views[i].members, settings=s, rng=random.Random(f"d{seed}-{i}")) for i in ids}
    found: dict[int, float] = {}
    late_found: dict[int, float] = {}
    marks = set(checkpoints)
    present = [i for i in ids if i not in latecomers]
    met: dict[str, set[str]] = {i: set() for i in ids}  # mates each node has evaluated
    evaluated: dict[int, float] = {}

    def mates(group: list[str]) -> float:
        hits = sum(
            cluster_of(p, cluster_size) == cluster_of(i, cluster_size)
            for i in group
            for p in disc[i].best(cluster_size - 1)
        )
        return hits / max(1, len(group))

    for r in range(1, rounds + 1):
        if latecomers and r == late_round + 1:
            overlay.alive |= latecomers
            for i in sorted(latecomers):  # each through a random node already there
                overlay.views[i].join(overlay.rng.choice(present))
                overlay._busy.add(i)
                overlay.deliver()
            present = list(ids)
        for i in present:
            d = disc[i]
            if mode == "uniform":
                cands = rng.sample([p for p in present if p != i], s.candidates)
            else:
                cands = d.begin_round()
            blind = set(cands) if mode == "uniform" else set(d._blind)
            mine = cluster_of(i, cluster_size)
            mates_now = [p for p in cands if cluster_of(p, cluster_size) == mine]
            met[i].update(mates_now)
            w = {
                p: max(0.0, (1.0 if p in mates_now and rng.random() < mate_signal else 0.0) + rng.gauss(0, noise))
                for p in cands
            }
            d.observe(w, cands)
            if watch is not None:
                watch(r, i, cands, blind, d)
        if mode != "uniform":
            # as on a daemon: asking "whom do you weight?" is what tells a peer of me
            # (``on_contacted``); serving my evaluation does not
            for i in present:
                for asked in disc[i].whom_to_ask():
                    disc[asked].on_contacted(i)
                    disc[i].on_recommendations(asked, disc[asked].recommend(i))
            overlay.round()
        if r in marks:
            others = [i for i in ids if i not in latecomers]
            found[r] = mates(others)
            evaluated[r] = sum(len(met[i]) for i in others) / max(1, len(others))
        if latecomers and r - late_round in marks:
            late_found[r - late_round] = mates(sorted(latecomers))
    return DiscoveryResult(found, s.candidates, late_found, evaluated)
