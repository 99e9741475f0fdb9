"""Splitting payloads into stream chunks and reassembling them with size and hash checks."""
from __future__ import annotations

import hashlib
from typing import AsyncIterator, Iterator

from .errors import invalid


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split(data: bytes, chunk_bytes: int) -> Iterator[bytes]:
    mv = memoryview(data)
    for i in range(0, len(data), chunk_bytes):
        yield bytes(mv[i:i + chunk_bytes])


class Assembler:
    """Collects chunks of an announced size; refuses anything larger than the limit or the
    announcement, and any hash mismatch. ``who`` names the sender in every error."""

    def __init__(self, who: str, total: int, digest: str, limit: int):
        if total > limit:
            raise invalid(f"{who}: announced payload of {total} bytes exceeds the limit of {limit}")
        self.who, self.total, self.digest = who, total, digest
        self.parts: list[bytes] = []
        self.size = 0
        self.hasher = hashlib.sha256()  # hashed as chunks arrive, overlapping the transfer

    def add(self, chunk: bytes) -> None:
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
        return self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)


async def collect(it: AsyncIterator, asm: Assembler, field: str = "data") -> bytes:
    async for msg in it:
        if msg.WhichOneof("body") != field:
            raise invalid(f"{asm.who}: unexpected {msg.WhichOneof('body')} frame inside payload")
        asm.add(getattr(msg, field))
    return asm.finish()
