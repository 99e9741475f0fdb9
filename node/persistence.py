"""A node's state directory: identity, checkpoints, round history.

    identity.json          node id (kept for the node's lifetime)
    CURRENT                name of the last complete checkpoint
    ckpt-000012/           model + optimizer (learner), strategy.bin, peers.json, meta.json
    history.jsonl          one JSON line per completed round

A checkpoint is written into ``ckpt-N.tmp``, fsynced, renamed, and only then named in
``CURRENT`` (itself replaced atomically): after ``kill -9`` at any moment ``CURRENT`` names a
complete checkpoint. Anything unreadable raises ``StateError`` naming the file — a node never
silently starts fresh over state it cannot read.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from .fsutil import atomic_write_bytes, atomic_write_json, read_json
from .wire.codec import WireError, pack_state, unpack_state

KEEP_CHECKPOINTS = 2


class StateError(RuntimeError):
    """State on disk that cannot be used; the message names the file."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StateStore:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.history_path = self.dir / "history.jsonl"

    # --- identity ---
    def node_id(self, wanted: str | None) -> str:
        """The node id kept in the state dir; a configured id must agree with it."""
        path = self.dir / "identity.json"
        if path.exists():
            try:
                stored = read_json(path)["node_id"]
            except (ValueError, KeyError, TypeError) as e:
                raise StateError(f"{path} is corrupt: {e}") from None
            if wanted and wanted != stored:
                raise StateError(f"{path} belongs to node {stored!r}, but the config says {wanted!r}")
            return stored
        node_id = wanted or f"node-{uuid.uuid4().hex[:8]}"
        atomic_write_json(path, {"node_id": node_id})
        return node_id

    # --- checkpoints ---
    def current(self) -> Path | None:
        pointer = self.dir / "CURRENT"
        if not pointer.exists():
            stray = sorted(p.name for p in self.dir.glob("ckpt-*") if not p.name.endswith(".tmp"))
            if stray:
                raise StateError(f"{pointer} is missing but checkpoints exist ({', '.join(stray)}); "
                                 "refusing to start fresh over them")
            return None
        name = pointer.read_text().strip()
        path = self.dir / name
        if not name.startswith("ckpt-") or not path.is_dir():
            raise StateError(f"{pointer} names {name!r}, which is not a checkpoint directory")
        return path

    def save(self, round: int, version: int, learner: Any, strategy_state: dict[str, Any],
             peers: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
        name = f"ckpt-{round:06d}"
        tmp = self.dir / f"{name}.tmp"
        final = self.dir / name
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        learner.save(str(tmp))
        atomic_write_bytes(tmp / "strategy.bin", pack_state(strategy_state))
        atomic_write_json(tmp / "peers.json", peers)
        atomic_write_json(tmp / "meta.json", {**meta, "round": round, "version": version})
        _fsync_dir(tmp)
        if final.exists():  # same round written again (e.g. after a restart): replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.dir)
        atomic_write_bytes(self.dir / "CURRENT", name.encode())
        self._prune(keep=name)
        return final

    def _prune(self, keep: str) -> None:
        ckpts = sorted(p for p in self.dir.glob("ckpt-*") if p.is_dir() and not p.name.endswith(".tmp"))
        for p in ckpts[:-KEEP_CHECKPOINTS]:
            if p.name != keep:
                shutil.rmtree(p, ignore_errors=True)
        for p in self.dir.glob("ckpt-*.tmp"):
            shutil.rmtree(p, ignore_errors=True)

    def load(self, learner: Any) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]] | None:
        """Restore the learner in place; return (meta, strategy_state, peers) or None if fresh."""
        path = self.current()
        if path is None:
            return None
        meta_path = path / "meta.json"
        try:
            meta = read_json(meta_path)
            peers = read_json(path / "peers.json")
        except FileNotFoundError as e:
            raise StateError(f"checkpoint {path} is incomplete: {e.filename} is missing") from None
        except ValueError as e:
            raise StateError(str(e)) from None
        try:
            learner.load(str(path))
        except (ValueError, OSError) as e:
            raise StateError(f"checkpoint {path}: {e}") from None
        strategy_path = path / "strategy.bin"
        try:
            strategy_state = unpack_state(strategy_path.read_bytes())
        except (WireError, OSError) as e:
            raise StateError(f"{strategy_path} is corrupt: {e}") from None
        return meta, strategy_state or {}, peers

    # --- history ---
    def append_history(self, record: dict[str, Any]) -> None:
        with open(self.history_path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read_history(self, upto_round: int | None = None) -> list[dict[str, Any]]:
        """History up to the checkpointed round; a torn last line (kill -9 mid-append) is dropped."""
        if not self.history_path.exists():
            return []
        rows = []
        lines = self.history_path.read_text().splitlines()
        for i, line in enumerate(lines):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    break
                raise StateError(f"{self.history_path} line {i + 1} is corrupt") from None
        if upto_round is not None:
            rows = [r for r in rows if r.get("round", 0) <= upto_round]
        return rows

    def rewrite_history(self, rows: list[dict[str, Any]]) -> None:
        atomic_write_bytes(self.history_path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode())
