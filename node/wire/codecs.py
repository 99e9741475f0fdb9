"""Snapshot codecs: how a model's tensors are packed into bytes — pure functions, tensors in,
bytes out, no transport knowledge.

- ``fp32``: tensors as they are (today's ``codec.encode``, byte for byte: a peer that knows no
  codec reads it).
- ``fp16`` / ``bf16``: floating tensors cast to 16 bits (half the bytes).
- ``q8``: blockwise 8-bit quantisation (as bitsandbytes' and hivemind's blockwise codecs): each
  floating tensor is cut into blocks of ``Q8_BLOCK`` values; each block is sent as int8 codes in
  [-127, 127] plus one fp32 scale, its absolute maximum. Decoding gives code × scale / 127, so
  every value is off by at most half a step, scale / 254, within its block (a quarter of the
  bytes plus 4 per block).

Integer and bool tensors always travel raw. Any codec can also encode a **delta**: the difference
between the current tensors and a base the receiver holds (``base=``); the receiver adds the
decoded difference to its base (``apply_delta``). Quantising the difference rather than the
model keeps q8's error relative to how much the model moved, not to its size. The encoder must
diff against the base *as the receiver decoded it*, not the exact one, or the quantisation errors
of successive deltas add up (the caller keeps those reconstructions: ``transport/served_versions.py``).

Every message is a ``codec.py`` tensor message (same preamble, header and length checks); the
codec, its block size, the original dtype and shape of every tensor and, for a delta, the base's
version and digest are in its header, so a decoder never guesses. ``decode`` refuses what does not
add up (unknown codec, missing or misshapen scales, a NaN or negative scale, a code of -128,
truncated blocks) with a ``WireError`` naming the tensor and the problem."""

from __future__ import annotations

import math
from typing import Any

import torch

from .codec import _NAME_TORCH, _TORCH_NAMES, Groups, WireError
from .codec import decode as decode_raw
from .codec import encode as encode_raw
from .folding import Encoded

FP32, FP16, BF16, Q8 = "fp32", "fp16", "bf16", "q8"
CODECS = (FP32, FP16, BF16, Q8)
Q8_BLOCK = 256  # values per scale: 4 bytes of scale per 256 codes (1.6 % overhead)
MAX_BLOCK = 1 << 20
_CAST = {FP16: torch.float16, BF16: torch.bfloat16}
_SCALES = "#scales"  # suffix of the group holding a q8 group's block scales
META_KEY = "codec"  # this module's part of the message meta


def check_codec(name: str) -> str:
    if name not in CODECS:
        raise WireError(f"unknown codec {str(name)[:40]!r} (this node knows {list(CODECS)})")
    return name


def negotiate(preferred: list[str] | tuple[str, ...], supported: list[str] | tuple[str, ...]) -> str:
    """The first codec of the requester's ``preferred`` list the other side ``supported`` —
    fp32 when they share none (every node speaks fp32; an old peer advertises nothing)."""
    for c in preferred:
        if c in supported and c in CODECS:
            return c
    return FP32


def is_plain(codec: str, base: Any) -> bool:
    """Whether ``encode`` produces exactly today's format (``codec.encode``)."""
    return codec == FP32 and base is None


def encode(
    groups: Groups,
    codec: str,
    meta: dict[str, Any] | None = None,
    *,
    base: Groups | None = None,
    base_ref: dict[str, Any] | None = None,
    block: int = Q8_BLOCK,
) -> bytes:
    """``groups`` packed with ``codec``; with ``base`` (what the receiver holds, as it decoded it)
    the difference ``groups - base`` of floating tensors instead, marked as a delta against
    ``base_ref`` (``{"version": v, "sha256": digest}``, checked by the receiver)."""
    check_codec(codec)
    meta = dict(meta or {})
    if is_plain(codec, base):
        return encode_raw(groups, meta)
    out: Groups = {}
    table: dict[str, dict[str, list[Any]]] = {}
    for g, ts in groups.items():
        if _SCALES in g:
            raise WireError(f"group name {g!r} is reserved")
        enc: dict[str, torch.Tensor] = {}
        scales: dict[str, torch.Tensor] = {}
        entries: dict[str, list[Any]] = {}
        for name, t in ts.items():
            t = t.detach().to("cpu")
            dt = _TORCH_NAMES.get(t.dtype)
            if dt is None:
                raise WireError(f"dtype {t.dtype} cannot travel on the wire")
            entries[name] = [dt, list(t.shape)]
            if not t.is_floating_point():
                enc[name] = t  # ints and bools: raw, also in a delta (counters, masks)
                continue
            if base is not None:
                b = _base_tensor(base, g, name, t)
                if codec == Q8 and b.dtype == t.dtype and _work(t.dtype) == torch.float32:
                    # the difference taken in quantize's working copy: no model-sized t - b
                    enc[name], scales[name] = quantize(t, block, minus=b)
                    continue
                t = t.to(_work(t.dtype)) - b.to(_work(t.dtype))
            if codec == FP32:
                enc[name] = t.to(torch.float64 if t.dtype == torch.float64 else torch.float32).reshape(-1)
            elif codec in _CAST:
                enc[name] = t.to(_CAST[codec]).reshape(-1)
            else:
                enc[name], scales[name] = quantize(t, block)
        out[g] = enc
        if scales:
            out[g + _SCALES] = scales
        table[g] = entries
    meta[META_KEY] = {
        "name": codec,
        "block": block,
        "tensors": table,
        **({"base": dict(base_ref or {})} if base is not None else {}),
    }
    return encode_raw(out, meta)


def _work(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _base_tensor(base: Groups, g: str, name: str, t: torch.Tensor) -> torch.Tensor:
    b = base.get(g, {}).get(name)
    if b is None or tuple(b.shape) != tuple(t.shape):
        raise WireError(f"delta base lacks tensor {g}/{name} of shape {list(t.shape)}")
    return b


def quantize(
    t: torch.Tensor, block: int = Q8_BLOCK, minus: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes (flat, ``t.numel()`` of them) and one fp32 absmax scale per ``block`` values;
    of ``t - minus`` if given (``minus`` of ``t``'s shape and dtype: the difference in float32,
    as ``t.float() - minus.float()`` computes it)."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    blocks = math.ceil(n / block)
    # one model-sized working copy, padded, scaled and rounded in place (``pad``, ``abs``, ``*``
    # and ``round`` each made one: four 21 MB temporaries per big tensor, per payload encoded)
    work = torch.empty(blocks * block, dtype=torch.float32)
    work[:n].copy_(flat)
    if minus is not None:
        work[:n].sub_(minus.detach().reshape(-1))
    work[n:].zero_()
    padded = work.view(blocks, block)
    # the largest |value| of each block, without a model-sized |padded| (abs_: -0.0 as abs gives it)
    scales = torch.maximum(padded.amax(dim=1), padded.amin(dim=1).neg_()).abs_()
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = padded.mul_(127.0 / safe[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return codes.reshape(-1)[:n].contiguous(), scales.contiguous()


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """The float32 values of ``codes``, in one new tensor: the codes widened into a padded
    buffer and scaled there (as ``pad(codes.float()) * scale`` computes them, without its two
    model-sized temporaries: a pulled 21 MB model decoded with 63 MB more alive)."""
    n = codes.numel()
    blocks = scales.numel()
    out = torch.empty(blocks * block, dtype=torch.float32)
    out[:n].copy_(codes)
    out[n:].zero_()
    out.view(blocks, block).mul_(scales[:, None] / 127.0)
    return out[:n]


def codec_of(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The codec section of a decoded message's meta (None: a plain fp32 message)."""
    c = meta.get(META_KEY)
    return c if isinstance(c, dict) else None


def delta_base(meta: dict[str, Any]) -> tuple[int, str] | None:
    """(version, digest) of the base a delta message applies to; None if it is not a delta."""
    c = codec_of(meta)
    if c is None or "base" not in c:
        return None
    b = c["base"]
    if not (isinstance(b, dict) and type(b.get("version")) is int and isinstance(b.get("sha256"), str)):
        raise WireError(f"delta base is malformed: {str(b)[:100]}")
    return b["version"], b["sha256"]


def decode(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int | None = None,
    base: Groups | None = None,
    lazy: bool = False,
) -> tuple[Groups, dict[str, Any]]:
    """The tensors a message carries, in their original dtypes and shapes (a delta added to
    ``base``, which the caller has matched to the message's ``delta_base``). Plain messages
    decode as ``codec.decode`` does (zero-copy over a writable buffer). ``lazy``: a tensor whose
    values need computing (q8, a 16-bit cast, a delta) is left ``folding.Encoded``, checked
    like the others but decoded only where it is used, a chunk at a time."""
    raw, meta = decode_raw(data, max_bytes=max_bytes)
    c = codec_of(meta)
    if c is None:
        if META_KEY in meta:
            raise WireError(f"codec section is not a map: {str(meta[META_KEY])[:80]}")
        return raw, meta
    name = c.get("name")
    if not isinstance(name, str):
        raise WireError("codec section names no codec")
    check_codec(name)
    block = c.get("block")
    if type(block) is not int or not 1 <= block <= MAX_BLOCK:
        raise WireError(f"{name}: block size {str(block)[:40]} is not in 1..{MAX_BLOCK}")
    table = c.get("tensors")
    if not isinstance(table, dict):
        raise WireError(f"{name}: no tensor table")
    is_delta = delta_base(meta) is not None
    if is_delta and base is None:
        raise WireError(f"{name}: a delta, but no base to apply it to")
    if max_bytes is not None:  # q8 codes decode to 4-8 bytes each: bound what they expand to
        size = sum(
            math.prod(e[1]) * _itemsize(e[0])
            for es in table.values()
            if isinstance(es, dict)
            for e in es.values()
            if isinstance(e, list)
            and len(e) == 2
            and isinstance(e[1], list)
            and all(type(s) is int and 0 <= s < 1 << 40 for s in e[1])
        )
        if size > max_bytes:
            raise WireError(f"{name}: decodes to {size} bytes, over the limit of {max_bytes}")
    expected = set(table) | {g + _SCALES for g in table}
    if not set(raw) <= expected:
        raise WireError(f"{name}: unexpected groups {sorted(set(raw) - expected)[:5]}")
    out: Groups = {}
    for g, entries in table.items():
        if not isinstance(g, str) or not isinstance(entries, dict):
            raise WireError(f"{name}: malformed tensor table")
        sent, scales = raw.get(g, {}), raw.get(g + _SCALES, {})
        if set(sent) != set(entries):
            raise WireError(f"{name}: group {g[:100]!r} tensors do not match its table")
        ts: dict[str, Any] = {}  # tensors (or, lazy, ``Encoded`` ones)
        for tname, e in entries.items():
            ts[tname] = _one(name, g, tname, e, sent[tname], scales.get(tname), block, base if is_delta else None, lazy)
        if set(scales) - {k for k in entries if ts[k].is_floating_point()}:
            raise WireError(f"{name}: scales for tensors of group {g[:100]!r} that have none")
        out[g] = ts
    return out, meta


def _itemsize(dt: Any) -> int:
    t = _NAME_TORCH.get(dt) if isinstance(dt, str) else None
    return t.itemsize if t is not None else 0


def _one(
    codec: str,
    g: str,
    name: str,
    entry: Any,
    t: torch.Tensor,
    scales: torch.Tensor | None,
    block: int,
    base: Groups | None,
    lazy: bool = False,
) -> torch.Tensor | Encoded:
    what = f"{codec} tensor {g[:100]}/{name[:100]}"
    if not (
        isinstance(entry, list)
        and len(entry) == 2
        and isinstance(entry[0], str)
        and isinstance(entry[1], list)
        and all(type(s) is int and 0 <= s < 1 << 40 for s in entry[1])
    ):
        raise WireError(f"{what}: malformed entry {str(entry)[:100]}")
    dt, shape = entry
    dtype = _NAME_TORCH.get(dt)
    if dtype is None:
        raise WireError(f"{what}: unknown dtype {dt[:40]!r}")
    n = math.prod(shape)
    if not dtype.is_floating_point:
        if t.dtype != dtype or list(t.shape) != shape:
            raise WireError(f"{what}: sent as {t.dtype}{list(t.shape)}, announced {dt}{shape}")
        return t
    if t.dim() != 1 or t.numel() != n:
        raise WireError(f"{what}: {t.numel()} values sent, {n} announced for shape {shape} (truncated blocks?)")
    fresh = codec == Q8  # values in a tensor of their own (else views of the received buffer)
    if fresh:
        if t.dtype != torch.int8:
            raise WireError(f"{what}: codes are {t.dtype}, expected int8")
        blocks = math.ceil(n / block)
        if scales is None or scales.dtype != torch.float32 or scales.dim() != 1 or scales.numel() != blocks:
            got = "none" if scales is None else f"{scales.dtype}{list(scales.shape)}"
            raise WireError(f"{what}: expected {blocks} float32 block scales, got {got}")
        if not bool(torch.isfinite(scales).all()):
            raise WireError(f"{what}: a block scale is NaN or infinite")
        if bool((scales < 0).any()):
            raise WireError(f"{what}: a block scale is negative")
        if n and int(t.min()) < -127:
            raise WireError(f"{what}: code -128 is outside the symmetric range [-127, 127]")
    else:
        if scales is not None:
            raise WireError(f"{what}: block scales sent with codec {codec}")
        want = _CAST.get(codec, torch.float64 if dtype == torch.float64 else torch.float32)
        if t.dtype != want:
            raise WireError(f"{what}: values are {t.dtype}, codec {codec} sends {want}")
    b = None
    if base is not None:
        b = base.get(g, {}).get(name)
        if b is None or list(b.shape) != shape or b.dtype != dtype:
            raise WireError(f"{what}: the delta's base has no {dt}{shape} tensor here")
    if lazy and (fresh or b is not None or t.dtype != dtype):  # else its values are the buffer's views
        return Encoded(what, shape, dtype, t, scales if fresh else None, block, b)
    values = (dequantize(t, scales, block) if scales is not None else t).reshape(shape)  # (q8: scales checked)
    if b is not None:
        if fresh and dtype == torch.float32:  # added in place: no second model-sized tensor
            return values.add_(b)  # (the same sums: float addition commutes exactly)
        return (b.to(_work(dtype)) + values.to(_work(dtype))).to(dtype)
    return values.to(dtype)
