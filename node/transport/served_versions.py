"""Which codec a snapshot travels in, and the versions both ends keep for deltas.

``CodecPolicy``: a node's ``snapshots.codecs`` (preferred first) and ``snapshots.delta``.

``ServedVersions`` (the serving side): encodes its published snapshot in the codec a requester
negotiated — whole, or as a delta against a version the requester says it holds — and keeps
the last few payloads it sent and what each decodes to (bounded: ``history`` reconstructions).
A delta is computed against that *reconstruction*, exactly what the requester decoded, never
against the exact old model: else each q8 delta's rounding error would stay in the requester's
copy and the next delta would not remove it, so errors would add up round after round. Payloads
are cached by (version, codec, base), so peers that hold the same base share one encoding.

``HeldVersions`` (the requesting side): per peer, the version it last decoded, the digest of the
payload it came in (what a delta names as its base) and the tensors — the base the next delta
is added to."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..offload import OFF_LOOP_BYTES
from ..wire import codecs
from ..wire.codec import Groups, encoded_size
from .chunks import sha256


@dataclass(frozen=True)
class CodecPolicy:
    codecs: tuple[str, ...] = (codecs.FP32,)  # preferred first; fp32 is always understood
    delta: bool = False
    history: int = 3  # reconstructions a server keeps to send deltas against

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
    ) -> Payload:
        """``snap`` (a ``LocalSnapshot``, ready) encoded for a requester that accepts ``wanted``
        and holds ``have_version`` as the payload ``have_sha256`` (a delta if asked for, this node
        sends them, the codec is lossy and that reconstruction is still here; else whole)."""
        codec = self.choose(wanted)
        if codec == codecs.FP32:
            return Payload(snap.encoded, snap.digest, codec)  # today's bytes: exact, shared by all
        base_key, base = "", None
        if delta and self.policy.delta and have_version and have_sha256:
            held = self._recon.get(have_sha256)
            if held is not None and held[0] == have_version and have_version < snap.version:
                base_key, base = have_sha256, held  # (taken now: it may be evicted before the encode runs)
                self._recon.move_to_end(have_sha256)
        key = (snap.version, codec, base_key)
        task = self._payloads.get(key)
        if task is None:  # encoded once, in a task of its own: a requester that gives up stops nothing
            task = self._payloads[key] = asyncio.ensure_future(self._encode(snap, codec, base_key, base))
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
        return await asyncio.shield(task)

    def _failed(self, key: tuple[int, str, str], task: asyncio.Future) -> None:
        if (task.cancelled() or task.exception() is not None) and self._payloads.get(key) is task:
            del self._payloads[key]  # the next requester tries again

    async def _encode(self, snap: Any, codec: str, base_key: str, base: tuple[int, Groups] | None) -> Payload:
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
            if not self.policy.delta:
                return made, None
            recon, _ = codecs.decode(data, base=base[1] if base else None)  # what the requester will hold
            return made, recon

        big = encoded_size(snap.groups) > OFF_LOOP_BYTES
        made, recon = await asyncio.to_thread(make) if big else make()
        if base:
            self.deltas += 1
        else:
            self.wholes += 1
        if recon is None:
            return made
        self._recon[made.digest] = (snap.version, recon)
        while len(self._recon) > max(1, self.policy.history):
            self._recon.popitem(last=False)
        return made


@dataclass(frozen=True)
class Held:
    version: int
    digest: str  # sha256 of the payload it came in
    groups: Groups


class HeldVersions:
    """The snapshots decoded from each peer that a delta may still be added to: the newest (what
    the next request names as its base), and any older one a read in flight named — a pull and a
    subscription, or two pulls, to the same peer can run side by side, so one read's delta may be
    against the version held when it asked while the other has already brought the next.

    Older versions are kept only while pinned (``pinned``): holding a spare decoded copy per peer
    at all times cost a 4-node D-PSGD network on a 21 MB model 3 x 21 MB per node at rest
    (bench/results/memory.md, "D-PSGD's extra")."""

    def __init__(self) -> None:
        self._by_peer: dict[str, list[Held]] = {}
        self._pins: collections.Counter[tuple[str, int]] = collections.Counter()

    def get(self, peer: str) -> Held | None:
        """The newest version held of ``peer`` (what a request says it has)."""
        held = self._by_peer.get(peer)
        return held[-1] if held else None

    def find(self, peer: str, version: int, digest: str) -> Held | None:
        """The held copy a delta against (``version``, ``digest``) needs, if still kept."""
        return next((h for h in self._by_peer.get(peer, ()) if h.version == version and h.digest == digest), None)

    def put(self, peer: str, held: Held) -> None:
        kept = {h.version: h for h in self._by_peer.get(peer, ())}
        kept[held.version] = held
        newest = max(kept)
        self._by_peer[peer] = [kept[v] for v in sorted(kept) if v == newest or self._pins[(peer, v)] > 0]

    @contextlib.contextmanager
    def pinned(self, peer: str, version: int) -> Iterator[None]:
        """Keep ``peer``'s ``version`` (if held) while a read that named it as its base runs."""
        key = (peer, version)
        self._pins[key] += 1
        try:
            yield
        finally:
            self._pins[key] -= 1
            if self._pins[key] <= 0:
                del self._pins[key]
                held = self._by_peer.get(peer)
                if held and len(held) > 1:  # no reader needs it now: only the newest stays
                    self._by_peer[peer] = [h for h in held if h is held[-1] or self._pins[(peer, h.version)] > 0]

    def copies(self, peer: str) -> int:
        """Decoded versions held of ``peer`` (for tests and the memory bench)."""
        return len(self._by_peer.get(peer, ()))

    def drop(self, peer: str) -> None:
        self._by_peer.pop(peer, None)

    def __len__(self) -> int:
        return len(self._by_peer)
