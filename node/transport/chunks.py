"""Splitting payloads into stream chunks and reassembling them with size and hash checks.

Received chunks are copied once, straight into one buffer of the announced size (allocated when
the first chunk shows where the tensor bytes begin, so that they start aligned and decode as
zero-copy views), and hashed as they arrive. Sent chunks are framed with one copy each."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from ..peering.errors import invalid
from ..wire.codec import aligned_buffer, data_offset


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def split(data: bytes | memoryview, chunk_bytes: int) -> Iterator[bytes]:
    mv = memoryview(data)
    for i in range(0, len(mv), chunk_bytes):
        yield bytes(mv[i : i + chunk_bytes])


_DATA_TAG = 0x12  # field 2 ("data"), wire type 2 (length-delimited) of every *Chunk/*Frame oneof


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def data_frames(data: bytes | memoryview, chunk_bytes: int) -> Iterator[bytes]:
    """``data`` as serialised ``{data: part}`` chunk messages (what protobuf would produce for a
    SnapshotChunk/GradientChunk/ComputeFrame data frame), one copy per part, built as sent."""
    mv = memoryview(data)
    for i in range(0, len(mv), chunk_bytes):
        part = mv[i : i + chunk_bytes]
        yield b"".join((bytes((_DATA_TAG,)), _varint(len(part)), part))


def data_field(raw: bytes) -> memoryview:
    """The ``data`` payload of a serialised chunk message, as a zero-copy view.

    A data chunk is exactly: tag 0x12, varint length, payload. Anything else (a second header,
    a malformed message) is refused rather than guessed at."""
    if not raw or raw[0] != _DATA_TAG:
        raise invalid("expected a data chunk, got another frame")
    n = shift = 0
    i = 1
    while True:
        if i >= len(raw) or shift > 63:
            raise invalid("malformed chunk length")
        b = raw[i]
        n |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            break
        shift += 7
    if i + n != len(raw):
        raise invalid(f"chunk length {n} does not match the message ({len(raw) - i} bytes)")
    return memoryview(raw)[i:]


_HASHER: ThreadPoolExecutor | None = None
HASH_IN_THREAD_BYTES = 8 << 20  # larger payloads are hashed by a worker thread as chunks arrive


def _hasher() -> ThreadPoolExecutor:
    global _HASHER
    if _HASHER is None:  # one worker: a payload's chunks are hashed in the order they came
        _HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coterie-sha256")
    return _HASHER


class Assembler:
    """Collects chunks of an announced size into one buffer; refuses anything larger than the
    limit or the announcement, and any hash mismatch. ``who`` names the sender in every error.
    ``align_at(first_chunk)``: the payload offset that should land on an aligned address. A
    large payload is hashed by a worker thread (sha256 releases the GIL) while the next chunks
    arrive, instead of on the receiving event loop."""

    def __init__(
        self, who: str, total: int, digest: str, limit: int, align_at: Callable[[memoryview], int] | None = data_offset
    ):
        if total > limit:
            raise invalid(f"{who}: announced payload of {total} bytes exceeds the limit of {limit}")
        self.who, self.total, self.digest = who, total, digest
        self.align_at = align_at
        self.buf: memoryview | None = None  # allocated on the first chunk
        self.size = 0
        self.hasher = hashlib.sha256()  # hashed as chunks arrive, overlapping the transfer
        self._pending: Future | None = None  # the last chunk handed to the hashing thread

    def add(self, chunk: bytes | memoryview) -> None:
        n = len(chunk)
        if self.size + n > self.total:
            raise invalid(f"{self.who}: sent more than the announced {self.total} bytes")
        if self.buf is None:
            first = memoryview(chunk)
            self.buf = aligned_buffer(self.total, self.align_at(first) if self.align_at else 0)
        part = self.buf[self.size : self.size + n]
        part[:] = chunk
        self.size += n
        if self.total >= HASH_IN_THREAD_BYTES:
            self._pending = _hasher().submit(self.hasher.update, part)
        else:
            self.hasher.update(part)

    def finish(self) -> memoryview:
        """The payload: one writable buffer (decode over it is zero-copy)."""
        if self.size != self.total:
            raise invalid(f"{self.who}: payload truncated ({self.size} of {self.total} bytes)")
        if self._pending is not None:
            self._pending.result()  # the hashing thread is at most a chunk or two behind
        if self.hasher.hexdigest() != self.digest:
            raise invalid(f"{self.who}: sha256 mismatch (payload corrupted in transit or forged)")
        return self.buf if self.buf is not None else aligned_buffer(0)


async def collect(it: AsyncIterator, asm: Assembler, field: str = "data") -> memoryview:
    async for msg in it:
        if msg.WhichOneof("body") != field:
            raise invalid(f"{asm.who}: unexpected {msg.WhichOneof('body')} frame inside payload")
        asm.add(getattr(msg, field))
    return asm.finish()
