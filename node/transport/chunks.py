"""Splitting payloads into stream chunks and reassembling them with size and hash checks."""
from __future__ import annotations

import hashlib
from typing import AsyncIterator, Iterator

from ..peering.errors import invalid


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split(data: bytes, chunk_bytes: int) -> Iterator[bytes]:
    mv = memoryview(data)
    for i in range(0, len(data), chunk_bytes):
        yield bytes(mv[i:i + chunk_bytes])


_DATA_TAG = 0x12  # field 2 ("data"), wire type 2 (length-delimited) of every *Chunk/*Frame oneof


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


class Assembler:
    """Collects chunks of an announced size; refuses anything larger than the limit or the
    announcement, and any hash mismatch. ``who`` names the sender in every error."""

    def __init__(self, who: str, total: int, digest: str, limit: int):
        if total > limit:
            raise invalid(f"{who}: announced payload of {total} bytes exceeds the limit of {limit}")
        self.who, self.total, self.digest = who, total, digest
        self.parts: list[bytes | memoryview] = []
        self.size = 0
        self.hasher = hashlib.sha256()  # hashed as chunks arrive, overlapping the transfer

    def add(self, chunk: bytes | memoryview) -> None:
        if self.size + len(chunk) > self.total:
            raise invalid(f"{self.who}: sent more than the announced {self.total} bytes")
        self.parts.append(chunk)
        self.size += len(chunk)
        self.hasher.update(chunk)

    def finish(self) -> bytes:
        if self.size != self.total:
            raise invalid(f"{self.who}: payload truncated ({self.size} of {self.total} bytes)")
        if self.hasher.hexdigest() != self.digest:
            raise invalid(f"{self.who}: sha256 mismatch (payload corrupted in transit or forged)")
        if len(self.parts) == 1 and isinstance(self.parts[0], bytes):
            return self.parts[0]
        return b"".join(self.parts)


async def collect(it: AsyncIterator, asm: Assembler, field: str = "data") -> bytes:
    async for msg in it:
        if msg.WhichOneof("body") != field:
            raise invalid(f"{asm.who}: unexpected {msg.WhichOneof('body')} frame inside payload")
        asm.add(getattr(msg, field))
    return asm.finish()
