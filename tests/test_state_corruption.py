"""Every state file damaged every way: a node either refuses to start with an error naming the
file, or resumes exactly the checkpointed state — never a silent change. A refused start leaves
the directory as it was."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coterie.node.config import validate_config
from coterie.node.daemon import Node
from coterie.node.persistence import StateError
from tests.nodeproc import wait_for

FILES = ["identity.json", "ckpt-000002.safetensors", "history.jsonl"]
FLIPS = [0, 1, 8, 9, 20, 0.25, 0.5, 0.75, -2, -1]


def _cfg(state_dir: Path, **extra):
    return validate_config(
        {
            "node_id": extra.pop("node_id", "solo"),
            "state_dir": str(state_dir),
            "strategy": "fedfomo",
            "rounds": 2,
            "min_peers": 0,
            "security": {"insecure": True},  # one node: no peer port in play
            "round_interval_s": 0.0,
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            **extra,
            "learner": {
                "dataset": "mnist1d",
                "dataset_params": {"num_samples": 600},
                "partition": "iid",
                "num_nodes": 1,
                "model": "mlp",
                "model_params": {"hidden": [8]},
                "optimizer": "adam",
                "local_steps": 2,
            },
        }
    )


def _resume(state_dir: Path, **extra):
    """Open the dir as a node would and return everything it resumed with."""
    node = Node(_cfg(state_dir, **extra))
    try:
        node._restore()
        tensors, meta = node.learner.export_state()
        strat = node.strategy.state_dict()
        return {
            "node_id": node.node_id,
            "round": node.round,
            "version": node.version,
            "learner": tensors,
            "learner_meta": meta,
            "strategy": strat,
            "history": list(node.history),
            "peers": node.peers.to_json(),
        }
    finally:
        node.store.unlock()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (a != a and b != b)  # NaN == NaN here


def _snapshot_files(d: Path) -> dict[str, bytes | None]:
    return {
        p.name: (p.read_bytes() if p.is_file() else None)
        for p in d.iterdir()
        if p.name not in ("LOCK", "node.json", "admin.token")
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")

    async def run():
        node = Node(_cfg(root / "state"))
        await node.start()
        try:
            while not node.done:
                await asyncio.sleep(0.05)
        finally:
            assert await node.stop()

    asyncio.run(run())
    state = root / "state"
    assert sorted(p.name for p in state.iterdir() if p.name not in ("LOCK", "node.json", "admin.token")) == sorted(
        FILES
    )
    return state, _resume(state)


def _damages(size: int):
    yield "delete", None
    yield "empty", lambda b: b""
    yield "truncate-half", lambda b: b[: len(b) // 2]
    yield "truncate-1", lambda b: b[:-1]
    yield "zero", lambda b: bytes(len(b))
    yield "bad-utf8", lambda b: b[: len(b) // 2] + b"\xff\xfe" + b[len(b) // 2 :]
    yield "append", lambda b: b + b"\x00garbage\n"
    for mask in (0x01, 0xFF):
        for at in FLIPS:

            def flip(b, at=at, mask=mask):
                i = int(at * len(b)) if isinstance(at, float) else at % len(b)
                return b[:i] + bytes([b[i] ^ mask]) + b[i + 1 :]

            yield f"flip{mask:02x}@{at}", flip
    yield "directory", "dir"


@pytest.mark.parametrize("fname", FILES)
def test_every_damage_is_refused_naming_the_file_or_resumed_exactly(pristine, tmp_path, fname):
    state, reference = pristine
    outcomes = {}
    for i, (damage, fn) in enumerate(_damages((state / fname).stat().st_size)):
        d = tmp_path / f"case{i}"
        shutil.copytree(state, d)
        target = d / fname
        if fn is None:
            target.unlink()
        elif fn == "dir":
            target.unlink()
            target.mkdir()
        else:
            target.write_bytes(fn(target.read_bytes()))
        before = _snapshot_files(d)
        try:
            got = _resume(d)
        except StateError as e:
            msg = str(e)
            named = fname in msg or (damage == "delete" and "checkpoint" in msg)
            assert named, f"{fname} {damage}: the error does not name the file: {msg}"
            assert _snapshot_files(d) == before, f"{fname} {damage}: a refused start changed the state dir"
            outcomes[damage] = "refused"
            continue
        assert _same(got, reference), f"{fname} {damage}: resumed, but not the checkpointed state"
        outcomes[damage] = "exact"
    # the only damages that can resume are the ones a checkpoint makes good again
    resumable = {"identity.json": {"delete"}, "history.jsonl": {"append"}, "ckpt-000002.safetensors": set()}[fname]
    assert {d for d, o in outcomes.items() if o == "exact"} <= resumable, outcomes


def test_missing_checkpoint_with_history_or_identity_is_refused_unless_reset(pristine, tmp_path):
    state, reference = pristine
    for keep in (["identity.json"], ["history.jsonl"], ["identity.json", "history.jsonl"]):
        d = tmp_path / "-".join(keep)
        d.mkdir()
        for name in keep:
            shutil.copy(state / name, d / name)
        with pytest.raises(StateError, match="refusing to start fresh.*--reset"):
            _resume(d)
    fresh = _resume(d, reset=True)  # reset: round 0, the node keeps its id, old state moved aside
    assert fresh["round"] == 0 and fresh["node_id"] == "solo" and fresh["history"] == []
    archived = [p for p in d.iterdir() if p.name.startswith("reset-")]
    assert len(archived) == 1 and sorted(p.name for p in archived[0].iterdir()) == ["history.jsonl", "identity.json"]


def test_the_old_layout_another_strategy_another_id_are_refused(pristine, tmp_path):
    state, _ = pristine
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "CURRENT").write_text("ckpt-000003")
    (legacy / "ckpt-000003").mkdir()
    with pytest.raises(StateError, match="CURRENT.*ckpt-000003/"):
        _resume(legacy)
    d = tmp_path / "copy"
    shutil.copytree(state, d)
    with pytest.raises(StateError, match=r"ckpt-000002\.safetensors was written by strategy 'fedfomo'"):
        _resume(d, strategy="local")
    with pytest.raises(StateError, match="belongs to node 'solo'"):
        _resume(d, node_id="other")
    (d / "identity.json").write_text('{"node_id": "other"}')
    with pytest.raises(StateError, match="identity.json says node 'other'"):
        _resume(d)


def test_cli_refuses_then_reset_starts_fresh_and_moves_the_old_state_aside(pristine, tmp_path):
    state, _ = pristine
    d = tmp_path / "state"
    d.mkdir()
    shutil.copy(state / "history.jsonl", d / "history.jsonl")
    cmd = [
        sys.executable,
        "-m",
        "coterie.cli.main",
        "node",
        "start",
        "--state-dir",
        str(d),
        "--rounds",
        "0",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--insecure",
        "--set",
        "learner.dataset=digits",
        "--set",
        "learner.partition=iid",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "history.jsonl" in r.stderr and "--reset" in r.stderr
    p = subprocess.Popen(cmd + ["--reset"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:

        def started():
            assert p.poll() is None, "the reset node exited"
            return list(d.glob("ckpt-000000.safetensors")) and (d / "node.json").exists()

        wait_for(started, 120, "the reset node to write its round-0 checkpoint")
    finally:
        p.terminate()
        out = p.communicate(timeout=60)[0]
    assert p.returncode == 0, out
    archived = [x for x in d.iterdir() if x.name.startswith("reset-")]
    assert len(archived) == 1 and (archived[0] / "history.jsonl").read_bytes() == (state / "history.jsonl").read_bytes()
