"""A received tensor left encoded until it is added into another (issue 34 item 2: D-PSGD's
memory while it exchanges).

A strategy that only adds a pulled model into its own (D-PSGD's running sum) needs no decoded
copy of it: ``Encoded`` holds what the payload carries for one tensor (q8 codes and block scales
as views of the received buffer, or 16-bit values, and for a delta the base it applies to) and
``add_to`` decodes it a chunk at a time straight into the tensor it is added to. Each chunk is
computed with the same operations, in the same order, as ``codecs.decode`` computes the whole
tensor, so the sum is bit for bit the one the decoded copy gave (a 21 MB MLP: one 4 MiB scratch
chunk alive instead of a 21 MB model per pull in flight).

Everything a decoded tensor is checked for is checked before anything is added: ``codecs``
checks shapes, codes, scales and the delta's base when it makes one; ``all_finite`` (what
``codec.check_finite`` asks of it) proves every value finite — for a whole q8 tensor from its
scales alone (finite and at most ``MAX_SAFE_SCALE``: |code × scale / 127| <= scale then stays
finite), otherwise by decoding it chunk by chunk and looking."""

from __future__ import annotations

import math
from typing import Any

import torch

# values decoded at a time (a multiple of any q8 block up to it): 4 MiB of float32 scratch
FOLD_CHUNK = 1 << 20
# a q8 block scale up to 2^127 decodes to values of magnitude <= 2^127 (1 + 2^-23) < float32's max
MAX_SAFE_SCALE = 2.0**127


def _work(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class Encoded:
    """One floating tensor of a received payload, checked but not decoded (``codecs.decode(...,
    lazy=True)`` makes them). ``shape``, ``dtype``, ``numel`` and ``element_size`` are the
    decoded tensor's."""

    def __init__(
        self,
        what: str,
        shape: list[int],
        dtype: torch.dtype,
        sent: torch.Tensor,
        scales: torch.Tensor | None,
        block: int,
        base: torch.Tensor | None,
    ):
        """``sent``: the flat codes (int8, with ``scales``: q8) or values as sent; ``base``: the
        tensor a delta applies to (of ``shape`` and ``dtype``), None for a whole tensor."""
        self.what, self.shape, self.dtype = what, torch.Size(shape), dtype
        self._sent, self._scales, self._block, self._base = sent, scales, block, base
        self._finite: bool | None = None

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def is_floating_point(self) -> bool:
        return True

    def dim(self) -> int:
        return len(self.shape)

    def _chunk(self) -> int:
        return max(self._block, FOLD_CHUNK // self._block * self._block)

    def _values(self, a: int, e: int, scratch: torch.Tensor | None) -> torch.Tensor:
        """Flat values ``a:e`` (``a`` on a block boundary) as ``codecs._one`` computes them for
        the whole tensor; a q8 chunk is dequantized into ``scratch`` (float32, padded size)."""
        if self._scales is not None:
            m, block = e - a, self._block
            nb = math.ceil(m / block)
            out = scratch[: nb * block] if scratch is not None else torch.empty(nb * block, dtype=torch.float32)
            out[:m].copy_(self._sent[a:e])
            out[m:].zero_()
            out.view(nb, block).mul_(self._scales[a // block : a // block + nb, None] / 127.0)
            values = out[:m]
        else:
            values = self._sent[a:e]
        if self._base is not None:
            b = self._base.reshape(-1)[a:e]
            if self._scales is not None and self.dtype == torch.float32:
                return values.add_(b)
            return (b.to(_work(self.dtype)) + values.to(_work(self.dtype))).to(self.dtype)
        return values.to(self.dtype)

    def _chunks(self):
        """(start, values) of every chunk, one float32 scratch reused for them all."""
        n, step = self.numel(), self._chunk()
        scratch = torch.empty(step, dtype=torch.float32) if self._scales is not None else None
        for a in range(0, n, step):
            yield a, self._values(a, min(a + step, n), scratch)

    def all_finite(self) -> bool:
        """Whether every decoded value is finite (worked out once)."""
        if self._finite is None:
            s = self._scales
            proven = (
                s is not None
                and self._base is None
                and self.dtype in (torch.float32, torch.float64)
                and (s.numel() == 0 or float(s.max()) <= MAX_SAFE_SCALE)
            )  # else look at every value
            self._finite = proven or all(bool(torch.isfinite(v).all()) for _, v in self._chunks())
        return self._finite

    def add_to(self, dst: torch.Tensor) -> None:
        """``dst += `` this tensor's values, decoded a chunk at a time (``dst`` contiguous, of
        this shape; on any device, of any floating dtype: each chunk is converted as
        ``dst.add_(decoded.to(dst.device, dst.dtype))`` would convert the whole)."""
        if tuple(dst.shape) != tuple(self.shape):
            raise ValueError(f"{self.what}: cannot add {list(self.shape)} values into {list(dst.shape)}")
        flat = dst.view(-1)
        for a, values in self._chunks():
            flat[a : a + values.numel()].add_(values.to(dst.device, dst.dtype))

    def decode(self) -> torch.Tensor:
        """The whole decoded tensor (what ``codecs.decode`` without ``lazy`` gives)."""
        n = self.numel()
        scratch = torch.empty(math.ceil(n / self._block) * self._block) if self._scales is not None else None
        return self._values(0, n, scratch).reshape(self.shape)


def decoded(groups: dict[str, dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
    """``groups`` with every ``Encoded`` tensor decoded (for a caller that keeps them)."""
    return {g: {k: t.decode() if isinstance(t, Encoded) else t for k, t in ts.items()} for g, ts in groups.items()}
