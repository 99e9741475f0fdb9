"""What the q8 codec holds while it works (issue 34 item 2: a D-PSGD node's peak while it
exchanges). Encoding a snapshot and decoding a pulled delta each made several model-sized
temporaries per tensor (``pad``, ``abs``, ``*``, ``round``; the widened codes, their padded copy,
the scaled values, the sum with the base): measured below, a delta decoded with 2 model sizes
alive at once and a tensor quantized with 3 (a pulled 21 MB model: +21 MB, an encode: +42 MB, and
up to ``big_pulls`` decode at once). Now each makes one working tensor. The values are bit for
bit those of the old formulas (kept here as the reference)."""

from __future__ import annotations

import math

import pytest
import torch

from coterie.node.wire import codecs as C
from tests.peak_probe import run_peak_probe


def _old_quantize(t: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = t.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    blocks = math.ceil(n / block)
    padded = torch.nn.functional.pad(flat, (0, blocks * block - n)).view(blocks, block)
    scales = padded.abs().amax(dim=1)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded * (127.0 / safe[:, None])).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(-1)[:n].contiguous(), scales.contiguous()


def _old_dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    n = codes.numel()
    blocks = scales.numel()
    padded = torch.nn.functional.pad(codes.to(torch.float32), (0, blocks * block - n)).view(blocks, block)
    return (padded * (scales[:, None] / 127.0)).reshape(-1)[:n]


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    zeros_signed = torch.zeros(600)
    zeros_signed[256:512] = -0.0  # a block of negative zeros: its scale is +0.0, as abs gave it
    return [
        torch.randn(1000, generator=g),  # a partial last block
        torch.randn(37, 101, generator=g) * 1e-3,
        torch.randn(4, 256, generator=g),  # whole blocks only
        torch.randn(300, generator=g).to(torch.float16),
        torch.randn(300, generator=g).to(torch.bfloat16),
        zeros_signed,
        torch.tensor([0.0, -1e-30, 1e30, -3.0]),
        torch.randn(5, generator=g) * torch.tensor([1.0, float("inf"), 1.0, -float("inf"), 1.0]),
    ]


@pytest.mark.parametrize("i", range(len(_cases())))
def test_q8_values_are_bit_for_bit_those_of_the_old_formulas(i):
    t = _cases()[i]
    for block in (1, 7, 256):
        codes, scales = C.quantize(t, block)
        old_codes, old_scales = _old_quantize(t, block)
        assert torch.equal(codes, old_codes)
        assert torch.equal(scales.view(torch.int32), old_scales.view(torch.int32))  # (signed zeros too)
        if torch.isfinite(scales).all():
            assert torch.equal(
                C.dequantize(codes, scales, block).view(torch.int32),
                _old_dequantize(codes, scales, block).view(torch.int32),
            )


def test_a_decoded_delta_is_bit_for_bit_what_it_was():
    g = torch.Generator().manual_seed(4)
    base = {"params": {"w": torch.randn(3000, generator=g), "h": torch.randn(70, generator=g).half()}}
    new = {"params": {k: v + (0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in base["params"].items()}}
    data = C.encode(new, "q8", base=base, base_ref={"version": 1, "sha256": "x"})
    out, _ = C.decode(data, base=base)
    raw, _ = C.decode_raw(data)
    for name, b in base["params"].items():
        values = _old_dequantize(raw["params"][name], raw["params#scales"][name], C.Q8_BLOCK).reshape(b.shape)
        expected = (b.to(torch.float32) + values).to(b.dtype)
        assert torch.equal(out["params"][name], expected), name
    assert torch.equal(base["params"]["w"], base["params"]["w"].clone())  # the base is not written to


def test_an_encoded_delta_is_bit_for_bit_what_it_was():
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        base = {"params": {"w": torch.randn(3001, generator=g).to(dtype)}}
        new = {"params": {"w": (base["params"]["w"].float() + 0.01 * torch.randn(3001, generator=g)).to(dtype)}}
        kept = base["params"]["w"].clone()
        data = C.encode(new, "q8", base=base, base_ref={"version": 1, "sha256": "x"})
        raw, _ = C.decode_raw(data)
        codes, scales = _old_quantize(new["params"]["w"].float() - base["params"]["w"].float(), C.Q8_BLOCK)
        assert torch.equal(raw["params"]["w"], codes), dtype
        assert torch.equal(raw["params#scales"]["w"].view(torch.int32), scales.view(torch.int32)), dtype
        assert torch.equal(base["params"]["w"], kept)  # the base is not written to


_PEAK = """
import sys
import torch
from coterie.node.wire import codecs as C

n = 25_000_003  # 100 MB of float32, a partial last block
base = {"params": {"w": torch.randn(n)}}
new = {"params": {"w": base["params"]["w"] + 0.01 * torch.randn(n)}}
data = C.encode(new, "q8", base=base, base_ref={"version": 1, "sha256": "x"})
work = {
    "decode": lambda: C.decode(data, base=base),
    "quantize": lambda: C.quantize(new["params"]["w"]),
    "encode a delta": lambda: C.encode(new, "q8", base=base, base_ref={"version": 1, "sha256": "x"}),
}
work[sys.argv[1]]()  # once, to warm up
print(peak_over(work[sys.argv[1]]) / (4 * n))
"""


@pytest.mark.parametrize("what, most", [("decode", 1.3), ("quantize", 1.5), ("encode a delta", 1.8)])
def test_q8_work_holds_one_working_copy_of_a_tensor(what, most):
    """Peak RSS over the call, in model sizes (a fresh interpreter; tensors this large are mmapped
    and given back when freed, so the peak is what was alive at once). Decoding a delta: its
    result, 1.00 (the old code: 2.00); quantizing: its working copy, 1.00 (the old code: 3.00);
    encoding a delta: the working copy and the q8 message, 1.25 (the old code: 4.01, with a
    model-sized ``t - base`` before quantizing)."""
    copies = float(run_peak_probe(_PEAK, what))
    assert copies <= most, f"{what}: peak {copies:.2f} model sizes over the call"
