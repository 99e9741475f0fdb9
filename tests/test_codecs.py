"""Snapshot codecs (``wire/codecs.py``) and the server's delta history
(``transport/served_versions.py``), without a network: q8's per-block error bound, every codec's
round trip, negotiation, refusals of malformed payloads, and deltas that do not accumulate error."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch

from coterie.node.peering.messages import LocalSnapshot
from coterie.node.transport.served_versions import CodecPolicy, ServedVersions
from coterie.node.wire import codec as raw_codec
from coterie.node.wire import codecs as C
from coterie.node.wire.codec import WireError


def _model(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "params": {
            "w": torch.randn(37, 101, generator=g) * 3,  # not a multiple of the block size
            "tiny": torch.randn(5, generator=g) * 1e-6,
            "mixed": torch.cat([torch.randn(300, generator=g) * 100, torch.randn(300, generator=g) * 1e-3]),
            "d": torch.randn(17, generator=g, dtype=torch.float64),
            "h": torch.randn(9, generator=g).to(torch.float16),
            "zeros": torch.zeros(700),
            "steps": torch.tensor([3, 1, 4], dtype=torch.int64),
            "mask": torch.tensor([True, False]),
        }
    }


@pytest.mark.parametrize("block", [64, 256, 4096])
def test_q8_error_is_bounded_per_block_by_half_a_step_of_its_scale(block):
    for seed in range(5):
        t = _model(seed)["params"]["mixed"] if seed % 2 else _model(seed)["params"]["w"]
        codes, scales = C.quantize(t, block)
        back = C.dequantize(codes, scales, block)
        flat = t.reshape(-1)
        for b in range(scales.numel()):
            part = flat[b * block : (b + 1) * block]
            assert float(scales[b]) == float(part.abs().max())  # the scale is the block's absmax
            err = float((back[b * block : (b + 1) * block] - part).abs().max())
            assert err <= float(scales[b]) / 254 * (1 + 1e-5) + 1e-12  # half a step...
            assert err <= float(scales[b]) / 127  # ...so well within one step
    # per block: the small values of "mixed" are not drowned by the large ones (a per-tensor
    # scale would quantise every one of them to 0)
    t = _model()["params"]["mixed"]
    codes, scales = C.quantize(t, 64)
    small = C.dequantize(codes, scales, 64)[320:]
    assert float((small - t[320:]).abs().max()) < 1e-4 and bool((small != 0).any())


@pytest.mark.parametrize("codec,tol", [("fp32", 0.0), ("fp16", 1e-3), ("bf16", 8e-3), ("q8", 1 / 127)])
def test_every_codec_round_trips_dtypes_shapes_and_raw_integers(codec, tol):
    m = _model()
    data = C.encode(m, codec, {"version": 3})
    out, meta = C.decode(data)
    assert meta["version"] == 3
    assert list(out["params"]) == list(m["params"])
    for k, t in m["params"].items():
        got = out["params"][k]
        assert got.dtype == t.dtype and got.shape == t.shape, k
        if not t.is_floating_point():
            assert torch.equal(got, t), k  # ints and bools travel raw
        else:
            scale = float(t.abs().max()) or 1.0
            floor = 6e-8 if codec == "fp16" else 1e-9  # fp16's subnormal spacing: "tiny" underflows
            assert float((got.double() - t.double()).abs().max()) <= tol * scale + floor, (codec, k)
    sizes = {c: len(C.encode(m, c)) for c in C.CODECS}
    assert sizes["q8"] < sizes["fp16"] < sizes["fp32"]


def test_fp32_is_todays_format_byte_for_byte():
    m = _model()
    assert C.encode(m, "fp32", {"version": 1}) == raw_codec.encode(m, {"version": 1})


def test_negotiation_takes_the_requesters_first_codec_the_server_speaks():
    assert C.negotiate(["q8", "fp16", "fp32"], ["fp16", "fp32"]) == "fp16"
    assert C.negotiate(["fp16", "q8"], ["q8", "fp16", "fp32"]) == "fp16"  # the requester's order
    assert C.negotiate(["q8"], ()) == "fp32"  # an old peer advertises nothing: fp32
    assert C.negotiate(["q8", "bogus"], ["bogus"]) == "fp32"  # a name this node does not know: never
    assert CodecPolicy(("q8",)).advertised == ("q8", "fp32")
    with pytest.raises(WireError, match="unknown codec 'zip'"):
        CodecPolicy(("zip",))


def _rewrite(data: bytes, edit) -> bytes:
    """A q8 message with its groups/meta edited by ``edit(groups, meta)`` (re-encoded: valid framing)."""
    groups, meta = raw_codec.decode(data, copy=True)
    edit(groups, meta)
    return raw_codec.encode(groups, meta)


def _q8() -> bytes:
    return C.encode({"params": {"w": torch.randn(1000)}}, "q8", {"version": 1})


def _set_scale(value):
    def edit(groups, meta):
        groups["params#scales"]["w"][1] = value

    return edit


@pytest.mark.parametrize(
    "edit,problem",
    [
        (_set_scale(float("nan")), "block scale is NaN or infinite"),
        (_set_scale(float("inf")), "block scale is NaN or infinite"),
        (_set_scale(-1.0), "block scale is negative"),
        (lambda g, m: g["params#scales"].__setitem__("w", torch.ones(2)), "expected 4 float32 block scales, got"),
        (lambda g, m: g["params#scales"].__setitem__("w", torch.ones(4, dtype=torch.float64)), "expected 4 float32"),
        (lambda g, m: g["params#scales"].pop("w"), "expected 4 float32 block scales, got none"),
        (lambda g, m: g["params"].__setitem__("w", g["params"]["w"][:999]), "999 values sent, 1000 announced"),
        (lambda g, m: g["params"]["w"].__setitem__(0, -128), "code -128"),
        (lambda g, m: g["params"].__setitem__("w", g["params"]["w"].to(torch.int16)), "codes are torch.int16"),
        (lambda g, m: m["codec"].__setitem__("name", "q4"), "unknown codec 'q4'"),
        (lambda g, m: m["codec"].__setitem__("name", 7), "names no codec"),
        (lambda g, m: m["codec"].__setitem__("block", 0), "block size 0"),
        (lambda g, m: m["codec"].__setitem__("block", True), "block size True"),
        (
            lambda g, m: m["codec"]["tensors"]["params"].__setitem__("w", ["float32", [10, 10, 100]]),
            "1000 values sent, 10000 announced",
        ),
        (lambda g, m: m["codec"]["tensors"]["params"].__setitem__("w", ["complex", [1000]]), "unknown dtype"),
        (lambda g, m: m["codec"].__setitem__("base", {"version": 1, "sha256": "ab"}), "a delta, but no base"),
        (lambda g, m: m["codec"].__setitem__("base", [1]), "delta base is malformed"),
        (lambda g, m: g.__setitem__("extra", {"x": torch.ones(1)}), "unexpected groups"),
        (lambda g, m: m.__setitem__("codec", "q8"), "codec section is not a map"),
    ],
)
def test_malformed_q8_payloads_are_refused_naming_the_problem(edit, problem):
    with pytest.raises(WireError, match=problem.replace("(", r"\(")):
        C.decode(_rewrite(_q8(), edit))


def test_truncated_and_oversized_payloads_are_refused():
    data = _q8()
    with pytest.raises(WireError, match="truncated"):
        C.decode(data[:-10])
    # a small message announcing huge float64 tensors behind few codes: refused before decoding
    bomb = _rewrite(data, lambda g, m: m["codec"]["tensors"]["params"].__setitem__("w", ["float64", [1 << 30]]))
    with pytest.raises(WireError, match="decodes to 8589934592 bytes, over the limit"):
        C.decode(bomb, max_bytes=1 << 20)


def test_a_delta_needs_the_base_it_was_made_against():
    a, b = _model(0), _model(1)
    d = C.encode(b, "q8", base=a, base_ref={"version": 1, "sha256": "x"})
    assert C.delta_base(raw_codec.decode(d)[1]) == (1, "x")
    wrong = {"params": {k: v for k, v in a["params"].items() if k != "w"}}
    with pytest.raises(WireError, match="base has no float32\\[37, 101\\] tensor"):
        C.decode(d, base=wrong)
    out, _ = C.decode(d, base=a)
    assert torch.equal(out["params"]["steps"], b["params"]["steps"])  # ints: the new value, raw


def _drift(steps: int, *, fixed: bool) -> list[float]:
    """Max reconstruction error after each of ``steps`` published versions pulled as q8 deltas.
    ``fixed``: the server diffs against what the requester decoded (``ServedVersions``);
    otherwise against its exact previous version (the naive way)."""

    async def go():
        torch.manual_seed(0)
        served = ServedVersions(CodecPolicy(("q8",), delta=True))
        w = torch.randn(4096) * 0.1
        held, held_version, held_digest, exact_prev = None, 0, "", None
        errors = []
        for v in range(1, steps + 1):
            # a training step: mostly small moves, some larger, always in one direction a little
            w = w + 1e-3 * torch.randn(4096) + 2e-4
            snap = LocalSnapshot("p", v, v, {"params": {"w": w.clone()}})
            snap.prepare()
            if fixed or held is None:
                p = await served.payload(snap, ["q8"], delta=True, have_version=held_version, have_sha256=held_digest)
                base = held if p.base is not None else None
                out, _ = C.decode(p.data, base=base)
                held, held_version, held_digest = out, v, p.digest
            else:
                data = C.encode(snap.groups, "q8", base=exact_prev, base_ref={"version": v - 1, "sha256": ""})
                held, _ = C.decode(data, base=held)
            exact_prev = {"params": {"w": w.clone()}}
            errors.append(float((held["params"]["w"] - w).abs().max()))
        assert not fixed or served.deltas == steps - 1
        return errors

    return asyncio.run(go())


def test_fifty_q8_deltas_keep_the_error_bounded_where_naive_deltas_drift():
    fixed = _drift(50, fixed=True)
    naive = _drift(50, fixed=False)
    first = fixed[0]  # the whole q8 snapshot's error
    # each delta's error is bounded by half a step of the *move* (a few 1e-3 / 254), far below the
    # whole snapshot's, and stays there however many deltas follow
    assert max(fixed[1:]) < first
    assert max(fixed[-10:]) <= 2 * max(fixed[1:11])
    # without diffing against the decoded copy, every delta's rounding error stays: it grows
    assert naive[-1] > 3 * max(fixed[1:]) and naive[-1] > naive[5]


def test_the_server_keeps_what_each_reader_was_sent_last_and_sends_a_whole_snapshot_for_a_forgotten_base():
    async def go():
        served = ServedVersions(CodecPolicy(("q8",), delta=True, history=2))
        snaps = []
        digests = []
        held_v, held_d = 0, ""
        for v in range(1, 6):
            snap = LocalSnapshot("p", v, v, {"params": {"w": torch.full((10,), float(v))}})
            snap.prepare()
            snaps.append(snap)
            reader = "slow" if v == 4 else "fast"  # the slow reader takes v4 only
            p = await served.payload(snap, ["q8"], delta=True, have_version=held_v, have_sha256=held_d, reader=reader)
            assert (p.base is None) == (v == 1)
            digests.append(p.digest)
            held_v, held_d = v, p.digest
        # kept: what each reader was sent last (fast: v5, slow: v4); v1..v3 went
        assert sorted(v for v, _ in served._recon.values()) == [4, 5] and len(served._payloads) <= 8
        # the slow reader, holding v4, gets a delta (the same payload as before: encoded once)
        p = await served.payload(snaps[-1], ["q8"], delta=True, have_version=4, have_sha256=digests[3], reader="slow")
        assert p.base == (4, digests[3]) and p.digest == digests[4]
        assert sorted(v for v, _ in served._recon.values()) == [5]  # both were sent v5's one payload
        # one still holding v1 (forgotten): whole
        p = await served.payload(snaps[-1], ["q8"], delta=True, have_version=1, have_sha256=digests[0])
        assert p.base is None
        # a wrong digest for a version the server has: whole, never a delta against the wrong base
        p = await served.payload(snaps[-1], ["q8"], delta=True, have_version=5, have_sha256="0" * 64)
        assert p.base is None
        # a requester speaking only fp32 gets today's bytes, whatever it holds
        p = await served.payload(snaps[-1], [], delta=True, have_version=4, have_sha256=digests[3])
        assert p.codec == "fp32" and p.data is snaps[-1].encoded and p.digest == snaps[-1].digest

    asyncio.run(go())


def test_the_codec_section_survives_msgpack_only_as_plain_types():
    # the header is data, never code: a codec section is msgpack maps, lists, ints and strings
    _, meta = raw_codec.decode(_q8())
    assert msgpack.unpackb(msgpack.packb(meta["codec"]), raw=False) == meta["codec"]
