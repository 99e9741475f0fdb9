"""Which codec a snapshot travels in, and the versions both ends keep for deltas.

``CodecPolicy``: a node's ``snapshots.codecs`` (preferred first) and ``snapshots.delta``.

``ServedVersions`` (the serving side): encodes its published snapshot in the codec a requester
negotiated — whole, or as a delta against a version the requester says it holds — and keeps
what the payload last sent to each reader decodes to (its *reconstruction*: what that reader
will name as its base next time; at most ``history`` of them in all). A delta is computed
against that reconstruction, exactly what the requester decoded, never against the exact old
model: else each q8 delta's rounding error would stay in the requester's copy and the next delta
would not remove it, so errors would add up round after round. Payloads are cached by (version,
codec, base), so peers that hold the same base share one encoding — and one reconstruction: in a
network in step that is one model-sized copy, not ``history`` (a 21 MB model: 21 MB, not 62).
A reader that names a base no longer kept (its last answer was lost, or it lags behind another
stream of its own) gets a whole snapshot, never a delta against a wrong base.

``HeldVersions`` (the requesting side): per peer, the version it last decoded, the digest of the
payload it came in (what a delta names as its base) and the tensors — the base the next delta
is added to."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from ..offload import OFF_LOOP_BYTES
from ..wire import codecs
from ..wire.codec import Groups, encoded_size
from .chunks import sha256

# Decoded bases a requester keeps by default (``snapshots.bases_mb``): small models keep a base for
# every peer (S1's 24k-parameter CNN: 11 peers in 1 MB); a model over 16 MiB none (in an 8-node D-PSGD
# network of a 21 MB MLP they were 7 x 21 MB of ~400 at rest: bench/results/memory.md). A peer without
# one gets whole q8 snapshots: the same bytes, and no accuracy lost measurably on S1 and S3
# (bench/results/codecs.md).
DEFAULT_BASES_BYTES = 16 << 20


@dataclass(frozen=True)
class CodecPolicy:
    codecs: tuple[str, ...] = (codecs.FP32,)  # preferred first; fp32 is always understood
    delta: bool = False
    history: int = 3  # reconstructions a server keeps to send deltas against
    bases_bytes: int = DEFAULT_BASES_BYTES  # decoded peer bases a requester keeps for deltas

    def __post_init__(self) -> None:
        for c in self.codecs:
            codecs.check_codec(c)

    @property
    def advertised(self) -> tuple[str, ...]:
        """What this node decodes and serves (its list, plus fp32 which every node speaks)."""
        return self.codecs if codecs.FP32 in self.codecs else (*self.codecs, codecs.FP32)


@dataclass(frozen=True)
class Payload:
    """A snapshot as sent: its bytes, their sha256 (the commitment), the codec, and for a delta
    the (version, payload digest) of its base."""

    data: Any  # bytes or memoryview
    digest: str
    codec: str
    base: tuple[int, str] | None = None


class ServedVersions:
    def __init__(self, policy: CodecPolicy):
        self.policy = policy
        self._payloads: OrderedDict[tuple[int, str, str], asyncio.Future[Payload]] = OrderedDict()
        self._recon: OrderedDict[str, tuple[int, Groups]] = OrderedDict()  # payload digest -> (version, decoded)
        self._sent: dict[Hashable, str] = {}  # reader -> digest of the payload it was sent last
        self._newest = 0  # the newest version encoded (its reconstructions wait for their readers)
        self._decoding: dict[str, asyncio.Future] = {}  # payload digest -> its reconstruction being made
        self.deltas = self.wholes = 0  # payloads encoded, by kind

    def choose(self, wanted: list[str] | tuple[str, ...]) -> str:
        """The first of the requester's codecs this node serves; fp32 if none (an old peer)."""
        return codecs.negotiate(list(wanted), self.policy.advertised)

    async def payload(
        self,
        snap: Any,
        wanted: list[str] | tuple[str, ...],
        *,
        delta: bool = False,
        have_version: int = 0,
        have_sha256: str = "",
        reader: Hashable | None = None,
    ) -> Payload:
        """``snap`` (a ``LocalSnapshot``, ready) encoded for a requester that accepts ``wanted``
        and holds ``have_version`` as the payload ``have_sha256`` (a delta if asked for, this node
        sends them, the codec is lossy and that reconstruction is still here; else whole).
        ``reader``: who will hold what is returned (a peer's stream: its pull or its watch); the
        reconstruction of the payload each reader was sent last is kept for its next delta, and
        one no reader was sent last is dropped once a newer version is encoded. A requester that
        takes no deltas (``delta`` false: it will keep no base of this node, its budget being
        full) costs no reconstruction: a whole payload's is made only for a reader that will
        name it."""
        codec = self.choose(wanted)
        if codec == codecs.FP32:
            return Payload(snap.encoded, snap.digest, codec)  # today's bytes: exact, shared by all
        wants = delta and self.policy.delta  # the reader may name this payload as its next base
        base_key, base = "", None
        if wants and have_version and have_sha256:
            held = self._recon.get(have_sha256)
            if held is not None and held[0] == have_version and have_version < snap.version:
                base_key, base = have_sha256, held  # (taken now: it may be evicted before the encode runs)
                self._recon.move_to_end(have_sha256)
        key = (snap.version, codec, base_key)
        task = self._payloads.get(key)
        if task is None:  # encoded once, in a task of its own: a requester that gives up stops nothing
            task = self._payloads[key] = asyncio.ensure_future(self._encode(snap, codec, base_key, base, wants))
            task.add_done_callback(functools.partial(self._failed, key))
            # a superseded version's payloads are not asked for again (requests are answered with
            # the current snapshot; one that raced a publish re-encodes): a 21 MB model's q8
            # payloads of past versions held 7 x 5.4 MB per node at rest (bench/results/memory.md)
            for old in [k for k in self._payloads if k[0] < snap.version]:
                del self._payloads[old]  # (a requester awaiting it keeps its task)
            while len(self._payloads) > 4 * self.policy.history:
                self._payloads.popitem(last=False)
        else:
            self._payloads.move_to_end(key)
        made = await asyncio.shield(task)
        if wants and made.base is None and made.digest not in self._recon:
            await self._reconstruct(snap, made)  # first asked for by a reader that took no deltas
        if reader is not None:
            if wants and made.digest in self._recon:
                self._sent[reader] = made.digest  # what it will name as its base next time
                self._recon.move_to_end(made.digest)
            else:
                self._sent.pop(reader, None)  # it names none: nothing kept for it
        self._forget()
        return made

    def _forget(self) -> None:
        """Keep the reconstructions some reader was sent last, and those of the newest version
        (made for a reader still awaiting its payload); at most ``history`` in all, the least
        recently used dropped first (their readers get whole snapshots)."""
        wanted = set(self._sent.values())
        for digest in [d for d, (v, _) in self._recon.items() if d not in wanted and v < self._newest]:
            del self._recon[digest]
        while len(self._recon) > max(1, self.policy.history):
            self._recon.popitem(last=False)
        for reader in [r for r, d in self._sent.items() if d not in self._recon]:
            del self._sent[reader]  # (nothing kept for it: its next base gets a whole snapshot anyway)

    def _failed(self, key: tuple[int, str, str], task: asyncio.Future) -> None:
        if (task.cancelled() or task.exception() is not None) and self._payloads.get(key) is task:
            del self._payloads[key]  # the next requester tries again

    async def _reconstruct(self, snap: Any, made: Payload) -> None:
        """What a whole payload decodes to, kept for the reader that will name it (a large one
        decoded off the loop, once however many readers ask at a time)."""
        decode = functools.partial(codecs.decode, made.data)
        if encoded_size(snap.groups) <= OFF_LOOP_BYTES:
            recon, _ = decode()
        else:
            task = self._decoding.get(made.digest)
            if task is None:
                task = self._decoding[made.digest] = asyncio.ensure_future(asyncio.to_thread(decode))
                task.add_done_callback(functools.partial(self._decoded, made.digest))
            recon, _ = await asyncio.shield(task)
        if made.digest not in self._recon:
            self._recon[made.digest] = (snap.version, recon)
            self._newest = max(self._newest, snap.version)

    def _decoded(self, digest: str, task: asyncio.Future) -> None:
        if self._decoding.get(digest) is task:
            del self._decoding[digest]

    async def _encode(
        self, snap: Any, codec: str, base_key: str, base: tuple[int, Groups] | None, wants: bool = True
    ) -> Payload:
        meta = {"node_id": snap.node_id, "version": snap.version, "round": snap.round}

        def make() -> tuple[Payload, Groups | None]:
            data = codecs.encode(
                snap.groups,
                codec,
                meta,
                base=base[1] if base else None,
                base_ref={"version": base[0], "sha256": base_key} if base else None,
            )
            made = Payload(data, sha256(data), codec, (base[0], base_key) if base else None)
            if not (self.policy.delta and (wants or base)):
                return made, None
            recon, _ = codecs.decode(data, base=base[1] if base else None)  # what the requester will hold
            return made, recon

        big = encoded_size(snap.groups) > OFF_LOOP_BYTES
        made, recon = await asyncio.to_thread(make) if big else make()
        if base:
            self.deltas += 1
        else:
            self.wholes += 1
        # newer than every reconstruction kept, made or not: one no reader names goes at the next
        # ``_forget`` (with only payloads for readers that take no deltas, a 21 MB one stayed for life)
        self._newest = max(self._newest, snap.version)
        if recon is None:
            return made
        self._recon[made.digest] = (snap.version, recon)
        self._newest = max(self._newest, snap.version)
        return made


@dataclass(frozen=True)
class Held:
    version: int
    digest: str  # sha256 of the payload it came in
    groups: Groups


class HeldVersions:
    """The snapshots decoded from each peer that its next delta may be against: the newest, plus
    any a request in flight named as its base (``pin``). A pull and a watch of the same peer run
    side by side, so a pull's delta may be against the version held when it was asked for while
    the watch has brought the next, and a watch's next delta is against the last it delivered —
    which a pull may have brought too, in another payload (a delta against another base: other
    bytes, another digest), so copies are told apart by (version, payload digest). Between rounds
    that is one copy a peer (it was always two: with a 21 MB model and three D-PSGD peers, 62 MB
    a node held for nothing).

    ``max_bytes`` bounds the newest copies of all peers together, so the bases do not grow with
    the neighbours. A peer whose base is not kept
    names none in its next request and gets a whole snapshot. Which peers keep one: those that
    hold a slot keep it while they are pulled again (D-PSGD pulls every neighbour each round, in
    which order least-recently-used eviction would drop every base before its next use); a peer's
    new base takes a slot that is free, or one unused for ``2 x`` as many decodes as peers were
    seen. Copies pinned by a request in flight are never dropped (a delta may be against them);
    older ones than a peer's newest are not counted (they go when the request ends)."""

    def __init__(self, max_bytes: int = DEFAULT_BASES_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"bases budget must be >= 0 bytes, got {max_bytes}")
        self.budget = max_bytes  # bytes of newest copies kept at most (pinned ones may be more)
        self._largest = 0  # the largest decoded model seen (whether the next would fit)
        self._by_peer: dict[str, list[Held]] = {}
        self._pins: Counter[tuple[str, int, str]] = Counter()
        self._used: dict[str, int] = {}  # peer -> the decode count when it last brought a copy
        self._decodes = 0
        self.not_kept = 0  # decoded copies not kept for lack of room (their peer's next pull is whole)

    def get(self, peer: str) -> Held | None:
        """The newest version held of ``peer`` (what a request says it has)."""
        held = self._by_peer.get(peer)
        return held[-1] if held else None

    def find(self, peer: str, version: int, digest: str) -> Held | None:
        """The held copy a delta against (``version``, ``digest``) needs, if still kept."""
        return next((h for h in self._by_peer.get(peer, ()) if h.version == version and h.digest == digest), None)

    def put(self, peer: str, held: Held, *, pin: bool = False) -> None:
        """Keep ``held`` as ``peer``'s newest copy if the budget has room (``pin``: pinned first,
        so kept whatever the budget: a watch's next delta is against it)."""
        if pin:
            self.pin(peer, held.version, held.digest)
        self._decodes += 1
        self._used[peer] = self._decodes
        self._largest = max(self._largest, encoded_size(held.groups))
        kept = [h for h in self._by_peer.get(peer, ()) if (h.version, h.digest) != (held.version, held.digest)]
        kept.append(held)
        kept.sort(key=lambda h: h.version)  # stable: of two copies of one version, the last put is the newest
        self._by_peer[peer] = self._trimmed(peer, kept)
        self._fit(peer)

    def not_keeping(self, peer: str, nbytes: int) -> None:
        """A copy of ``peer`` of ``nbytes`` (decoded size) that ``room_for`` said would not be kept,
        and was not decoded: counted as ``put`` counts a copy it drops."""
        self._decodes += 1
        self._used[peer] = self._decodes
        self._largest = max(self._largest, nbytes)
        self.not_kept += 1

    def pin(self, peer: str, version: int, digest: str) -> None:
        """Keep that copy of ``peer`` (once held) until as many ``unpin``s: a delta in flight may
        be against it."""
        self._pins[(peer, version, digest)] += 1

    def unpin(self, peer: str, version: int, digest: str) -> None:
        key = (peer, version, digest)
        self._pins[key] -= 1
        if self._pins[key] <= 0:
            del self._pins[key]
            if peer in self._by_peer:
                self._by_peer[peer] = self._trimmed(peer, self._by_peer[peer])
                self._fit(peer)

    @contextlib.contextmanager
    def keeping(self, peer: str, held: Held | None) -> Iterator[None]:
        """``pin`` ``held`` for the duration (nothing if None)."""
        if held is None:
            yield
            return
        self.pin(peer, held.version, held.digest)
        try:
            yield
        finally:
            self.unpin(peer, held.version, held.digest)

    def room_for(self, peer: str, nbytes: int = 0) -> bool:
        """Whether a copy of ``peer`` decoded now (``nbytes`` when known) would be kept (as ``put``
        would decide it)."""
        if peer in self._by_peer or self.counted() + max(self._largest, nbytes) <= self.budget:
            return True
        stale_after = 2 * max(len(self._used), 1)
        return any(self._decodes - self._used.get(p, 0) > stale_after for p in self._by_peer)

    def _trimmed(self, peer: str, held: list[Held]) -> list[Held]:
        return [h for h in held[:-1] if (peer, h.version, h.digest) in self._pins] + held[-1:]

    def counted(self) -> int:
        """Bytes of the newest copy of every peer: what the budget bounds."""
        return sum(encoded_size(held[-1].groups) for held in self._by_peer.values() if held)

    def _fit(self, newcomer: str) -> None:
        """Back under the budget: first slots unused for two rounds of every peer seen, then
        ``newcomer``'s own copy, then (if that one is pinned) the least recently used others.
        A pinned copy stays."""
        if self.counted() <= self.budget:
            return
        stale_after = 2 * max(len(self._used), 1)
        others = sorted((p for p in self._by_peer if p != newcomer), key=lambda p: self._used.get(p, 0))
        stale = [p for p in others if self._decodes - self._used.get(p, 0) > stale_after]
        fresh = [p for p in others if p not in stale]
        for peer in [*stale, newcomer, *fresh]:
            if self.counted() <= self.budget:
                return
            self._evict(peer)

    def _evict(self, peer: str) -> None:
        """Drop ``peer``'s copies that no request in flight pinned."""
        held = self._by_peer.get(peer, [])
        kept = [h for h in held if (peer, h.version, h.digest) in self._pins]
        if len(kept) < len(held):
            self.not_kept += 1
        if kept:
            self._by_peer[peer] = kept
        else:
            self._by_peer.pop(peer, None)

    def copies(self, peer: str) -> int:
        """How many decoded copies of ``peer`` are held (1 between rounds; more while pinned)."""
        return len(self._by_peer.get(peer, ()))

    def drop(self, peer: str) -> None:
        self._by_peer.pop(peer, None)
        self._used.pop(peer, None)

    def __len__(self) -> int:
        return len(self._by_peer)
