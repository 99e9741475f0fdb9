"""A node's state directory: one owner, verified checkpoints, an append-only round history.

    LOCK                       flock'ed by the one process that owns the directory (holds its pid)
    identity.json              node id, kept for the node's lifetime
    ckpt-000012.safetensors    the last checkpoint, one file: every tensor (model, optimizer,
                               sampler, strategy) plus, in its metadata, a JSON ``state`` (round,
                               version, node id, learner and strategy state, peers) and a sha256
                               over that JSON and every tensor
    history.jsonl              one JSON line per recent round; the checkpoint pins its first N
                               bytes (length + sha256), so lines are checked against the
                               checkpoint. Kept under ``history_max_bytes``: older rounds are
                               folded into summary blocks pinned in the checkpoint (history.py)

A commit appends the rounds' history lines, writes ``.ckpt-N.tmp``, fsyncs both (one batch),
renames it into place, fsyncs the directory and deletes the older checkpoint: after ``kill -9``
at any moment the newest ``ckpt-*.safetensors`` is complete and the history is at most a few
uncommitted lines ahead of it (dropped on restart). A commit that rotates the history writes the
new file as ``.history-<segment>.jsonl.pending`` (fsynced with the checkpoint) and renames it
into place after the checkpoint's rename: a restart finds the pending file of the checkpoint's
segment and finishes the rotation, or one of an older segment and drops it. Anything that does not verify raises
``StateError`` naming the file; a directory with history or identity but no checkpoint is
refused unless the node is started with ``reset`` (which moves the old state aside).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from safetensors.torch import save_file as st_save_file

from . import history as summaries
from .fsutil import atomic_write_json, fsync_dir, read_json

log = logging.getLogger("coterie.state")

FORMAT = "coterie-checkpoint/2"
HISTORY_TAIL = 1000  # rounds of history kept in memory; the file keeps the recent ones in full
HISTORY_MAX_BYTES = 16 << 20  # default cap of history.jsonl (config history.max_bytes)
_PENDING = re.compile(r"^\.history-(\d{6,})\.jsonl\.pending$")
_CKPT = re.compile(r"^ckpt-(\d{6,})\.safetensors$")
_LEGACY = ("CURRENT",)  # the pre-v2 layout: CURRENT -> ckpt-N/ directories
# not round state: kept where they are by --reset (the privacy ledger counts what this data has
# already released, whatever model is trained on it next; the admin token is the operator's)
_NOT_STATE = {"LOCK", "node.json", "privacy-ledger.json", "crl.pem", "admin.token"}


class StateError(RuntimeError):
    """State on disk that cannot be used; the message names the file."""


# ---------------------------------------------------------------------------------- strategy state
def flatten_state(obj: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a strategy state (nested dicts/lists of scalars, strings, tensors, ndarrays, bytes)
    into a JSON-able skeleton and a flat dict of tensors keyed ``prefix/<n>``."""
    tensors: dict[str, torch.Tensor] = {}

    def put(t: torch.Tensor) -> str:
        key = f"{prefix}/{len(tensors)}"
        t = t.detach().cpu()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
            t = t.contiguous().clone()  # a view into a larger buffer: store just its own bytes
        tensors[key] = t
        return key

    def strip(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return {"__tensor__": put(x)}
        if isinstance(x, np.ndarray):
            return {"__ndarray__": put(torch.from_numpy(np.ascontiguousarray(x)))}
        if isinstance(x, (bytes, bytearray)):
            return {
                "__bytes__": put(
                    torch.frombuffer(bytearray(x), dtype=torch.uint8) if x else torch.zeros(0, dtype=torch.uint8)
                )
            }
        if isinstance(x, dict):
            return {str(k): strip(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [strip(v) for v in x]
        if isinstance(x, (np.floating, np.integer, np.bool_)):
            return x.item()
        return x

    skeleton = strip(obj)
    seen: dict[int, str] = {}
    for k, t in tensors.items():  # safetensors refuses tensors sharing memory
        if t.numel() and t.data_ptr() in seen:
            tensors[k] = t.clone()
        seen[tensors[k].data_ptr()] = k
    return skeleton, tensors


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of ``flatten_state``; raises KeyError for a tensor the skeleton names but lacks."""

    def fill(x: Any) -> Any:
        if isinstance(x, dict):
            if len(x) == 1:
                ((tag, key),) = x.items()
                if tag == "__tensor__":
                    return tensors[key]
                if tag == "__ndarray__":
                    return tensors[key].numpy()
                if tag == "__bytes__":
                    return tensors[key].numpy().tobytes()
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, list):
            return [fill(v) for v in x]
        return x

    return fill(skeleton)


def pack_state(obj: Any) -> bytes:
    """A strategy state as bytes, in the checkpoint's encoding (safetensors + JSON skeleton)."""
    skeleton, tensors = flatten_state(obj, "s")
    return st_save(tensors, metadata={"skeleton": json.dumps(skeleton)})


def unpack_state(data: bytes) -> Any:
    tensors = st_load(data)
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    return unflatten_state(json.loads(header["__metadata__"]["skeleton"]), tensors)


# ---------------------------------------------------------------------------------- checkpoints
def _digest(state_json: bytes, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the state JSON and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(FORMAT.encode() + b"\0")
    h.update(len(state_json).to_bytes(8, "little"))
    h.update(state_json)
    for k in sorted(tensors):
        t = tensors[k].contiguous()
        h.update(f"{k}|{tuple(t.shape)}|{t.dtype}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


@dataclass
class Snapshot:
    """A consistent in-memory copy of a node's state at the end of a round, ready to write.
    ``tensors`` are private copies (nothing else mutates them); ``state`` is JSON-able."""

    round: int
    version: int
    tensors: dict[str, torch.Tensor]
    state: dict[str, Any]
    record: dict[str, Any] | None = None  # this round's history line (None for round 0)
    prepare: Callable[[], None] | None = None  # runs in the writer thread first (work the loop skips)
    learner_tensors: dict[str, torch.Tensor] | None = None  # reusable by the next export once written
    # ``tensors`` include the live model's and optimizer's own (no staging copies): the round loop
    # waits until they are written, or copied by ``detach`` after a failed write (checkpointing.py)
    live: bool = False

    def detach(self) -> None:
        """Private copies of every tensor from now on (a live snapshot whose write failed: the
        retries must write this round's state, while the model moves on)."""
        self.tensors = {k: t.clone() for k, t in self.tensors.items()}
        self.learner_tensors = None
        self.live = False


def _mixture_state(
    mixture: list[tuple[str, float, dict[str, torch.Tensor]]], held: dict[str, torch.Tensor]
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The mixture's skeleton and its own tensors. A member's tensor that *is* one the snapshot
    already holds (a live checkpoint's model or twin, the members of a prediction-space blend) is
    named by that tensor's key instead of being stored again: no copy of it is made to write it,
    and the file holds it once (``unflatten_state`` resolves any key of the file)."""

    def same(t: torch.Tensor) -> tuple:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    by_view = {same(t): k for k, t in held.items() if t.numel() and t.device.type == "cpu"}
    skeleton, own = flatten_state([{"node_id": k, "weight": float(w), "params": p} for k, w, p in mixture], "mixture")

    def point(x: Any) -> Any:
        if isinstance(x, dict) and set(x) == {"__tensor__"}:
            key = by_view.get(same(own[x["__tensor__"]]))
            if key is None:
                return x
            del own[x["__tensor__"]]
            return {"__tensor__": key}
        if isinstance(x, dict):
            return {k: point(v) for k, v in x.items()}
        if isinstance(x, list):
            return [point(v) for v in x]
        return x

    return point(skeleton), own


def make_snapshot(
    *,
    round: int,
    version: int,
    node_id: str,
    learner_state: tuple[dict[str, torch.Tensor], dict[str, Any]],
    strategy_state: Any,
    peers: list[dict[str, Any]],
    meta: dict[str, Any],
    record: dict[str, Any] | None,
    prepare: Callable[[], None] | None = None,
    mixture: list[tuple[str, float, dict[str, torch.Tensor]]] | None = None,
    reference: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None,
    live: bool = False,
) -> Snapshot:
    """``mixture``: the members a strategy predicts with (``Strategy.prediction_members``), kept
    as ``state["mixture"]`` (node id, weight, params → tensors ``mixture/<n>``) for the export.
    ``reference``: the local-only reference's state (``local_reference.py``): tensors
    ``reference/<k>``, meta ``state["reference"]``. ``live``: the learner's and reference's
    tensors are their own, not copies (``Snapshot.live``)."""
    ltensors, lmeta = learner_state
    skeleton, stensors = flatten_state(strategy_state, "strategy")
    tensors = {f"learner/{k}": v for k, v in ltensors.items()}
    tensors.update(stensors)
    state = {
        **meta,
        "round": round,
        "version": version,
        "node_id": node_id,
        "learner": lmeta,
        "strategy_state": skeleton,
        "peers": peers,
    }
    if reference is not None:
        tensors.update({f"reference/{k}": v for k, v in reference[0].items()})
        state["reference"] = reference[1]
    if mixture:
        mskel, mtensors = _mixture_state(mixture, tensors)
        tensors.update(mtensors)
        state["mixture"] = mskel
    if live:  # the live tensors are never a buffer to copy the next export into
        return Snapshot(round, version, tensors, state, record, prepare, None, live=True)
    return Snapshot(round, version, tensors, state, record, prepare, ltensors)


@dataclass
class Checkpoint:
    """A checkpoint read back from disk and verified against its checksum."""

    path: Path
    state: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    history: list[dict[str, Any]] = field(default_factory=list)  # the last HISTORY_TAIL rounds
    summary: list[dict[str, Any]] = field(default_factory=list)  # older rounds, folded (history.py)

    @property
    def round(self) -> int:
        return int(self.state["round"])

    @property
    def version(self) -> int:
        return int(self.state["version"])

    @property
    def node_id(self) -> str:
        return str(self.state["node_id"])

    def learner_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return (
            {k[len("learner/") :]: v for k, v in self.tensors.items() if k.startswith("learner/")},
            self.state["learner"],
        )

    def reference_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The local-only reference's tensors and meta (``make_snapshot``); None if it kept none."""
        meta = self.state.get("reference")
        if not isinstance(meta, dict):
            return None
        return {k[len("reference/") :]: v for k, v in self.tensors.items() if k.startswith("reference/")}, meta

    def mixture(self) -> list[dict[str, Any]] | None:
        """The mixture members the node predicted with (``make_snapshot``), None if it used its
        own model."""
        if not self.state.get("mixture"):
            return None
        try:
            return unflatten_state(self.state["mixture"], self.tensors)
        except KeyError as e:
            raise StateError(f"{self.path} is corrupt: its mixture names tensor {e} it lacks") from None

    def strategy_state(self) -> Any:
        try:
            return unflatten_state(self.state["strategy_state"], self.tensors) or {}
        except KeyError as e:
            raise StateError(f"{self.path} is corrupt: strategy state names tensor {e} it lacks") from None


def read_checkpoint(path: Path) -> Checkpoint:
    """Read and verify one checkpoint file; any problem raises StateError naming it."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise StateError(f"{path} cannot be read: {e.strerror or e}") from None
    try:
        tensors = st_load(data)
        hlen = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + hlen])["__metadata__"]
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        state_json = meta["state"].encode()
        if _digest(state_json, tensors) != meta["sha256"]:
            raise ValueError("checksum mismatch: the file changed after it was written")
        state = json.loads(state_json)
        for key in ("round", "version", "node_id", "learner", "peers"):
            state[key]  # noqa: B018 - present, or KeyError below
        int(state["round"]), int(state["version"])
    except (SafetensorError, ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
        what = f"missing {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise StateError(f"{path} is corrupt ({what})") from None
    return Checkpoint(path, state, tensors)


def checkpoint_files(directory: Path) -> list[Path]:
    """The ``ckpt-N.safetensors`` files of a state dir, oldest first."""
    found = []
    for p in Path(directory).iterdir():
        m = _CKPT.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def read_latest(directory: str | Path, attempts: int = 5) -> Checkpoint:
    """The newest verified checkpoint of a state dir, for readers (``coterie model export``):
    no lock taken and nothing repaired, so the node that owns the directory may be running. A
    commit that replaces the file between listing and reading is met by listing again."""
    directory = Path(directory)
    if not directory.is_dir():
        raise StateError(f"state dir {directory} does not exist")
    for _ in range(attempts):
        ckpts = checkpoint_files(directory)
        if not ckpts:
            raise StateError(
                f"{directory} holds no checkpoint (ckpt-NNNNNN.safetensors): not a "
                "node's state dir, or its node has not started yet"
            )
        try:
            return read_checkpoint(ckpts[-1])
        except StateError:
            if ckpts[-1].exists():
                raise
    raise StateError(f"{directory}: the newest checkpoint kept being replaced while read ({attempts} tries)")


def last_record(ckpt: Checkpoint, directory: str | Path) -> dict[str, Any] | None:
    """The history line of the checkpoint's own round (its eval), read from the end of the bytes
    the checkpoint pins; None when there is none (round 0) or it cannot be found."""
    covered = int((ckpt.state.get("history") or {}).get("bytes") or 0)
    if not covered:
        return None
    try:
        with open(Path(directory) / "history.jsonl", "rb") as f:
            start = max(0, covered - (1 << 20))
            f.seek(start)
            tail = f.read(covered - start)
    except OSError:
        return None
    try:
        row = json.loads(tail.rstrip(b"\n").rsplit(b"\n", 1)[-1])
    except ValueError:
        return None
    return row if isinstance(row, dict) and row.get("round") == ckpt.round else None


def _parse_line(path: Path, lineno: int, line: bytes) -> dict[str, Any]:
    try:
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("round"), int):
            raise ValueError("not a round record")
        return row
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise StateError(f"{path} line {lineno} is corrupt ({type(e).__name__}: {e})") from None


def verify_history(path: Path, ckpt: Checkpoint) -> tuple[list[dict[str, Any]], int, int, Any]:
    """Check the history at ``path`` against the checkpoint (its first N bytes hash to the
    pinned sha256); return the tail of rounds, the file's size (more: lines a crash left), and
    the bytes covered with their running sha256 (what the next commit extends)."""
    pinned = ckpt.state.get("history") or {}
    try:
        covered, want = int(pinned["bytes"]), str(pinned["sha256"])
    except (KeyError, TypeError, ValueError):
        raise StateError(f"{ckpt.path} is corrupt (no history pin)") from None
    h, pos, lineno = hashlib.sha256(), 0, 0
    tail: deque[tuple[int, bytes]] = deque(maxlen=HISTORY_TAIL)  # (line number, line)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            for line in f:
                if pos >= covered:
                    break
                lineno += 1
                if pos + len(line) > covered:
                    raise StateError(
                        f"{path} does not match {ckpt.path.name}: line {lineno} "
                        f"crosses the {covered} bytes the checkpoint covers"
                    )
                h.update(line)
                pos += len(line)
                tail.append((lineno, line))
    except FileNotFoundError:
        if covered:
            raise StateError(
                f"{path} is missing, but {ckpt.path.name} covers {covered} bytes ({ckpt.round} rounds) of it"
            ) from None
        size = 0
    except OSError as e:
        raise StateError(f"{path} cannot be read: {e.strerror or e}") from None
    if pos < covered:
        raise StateError(
            f"{path} is shorter ({pos} bytes) than the {covered} bytes {ckpt.path.name} covers: truncated or rewritten"
        )
    if h.hexdigest() != want:
        raise StateError(
            f"{path} does not match {ckpt.path.name}: its first {covered} bytes changed after they were written"
        )
    rows = [_parse_line(path, n, line) for n, line in tail]
    if ckpt.round and (not rows or rows[-1]["round"] != ckpt.round):
        raise StateError(
            f"{path} ends at round {rows[-1]['round'] if rows else 0}, {ckpt.path.name} at round {ckpt.round}"
        )
    return rows, size, covered, h


def rotated_history(
    path: Path, covered: int, lines: bytes, summary: list[dict[str, Any]], max_bytes: int
) -> tuple[list[dict[str, Any]], bytearray]:
    """A rotation of the history at ``path`` (its first ``covered`` bytes, then ``lines``): the
    summary with the oldest rounds folded in, and the newest rounds (half the cap) in full.

    Two passes over the file rather than one read of it: the first measures the lines, the second
    folds the oldest ones a row at a time and reads the kept bytes as one block. Holding the
    file's lines and their parsed rows at once cost a daemon ~20 MB of small objects at its
    first rotation, which stayed resident after (bench/results/soak.md)."""
    new = lines.splitlines(keepends=True)
    lengths: list[int] = []
    if covered:
        with open(path, "rb") as f:
            pos = 0
            for line in f:
                if pos + len(line) > covered:
                    break
                lengths.append(len(line))
                pos += len(line)
        if pos != covered:
            raise StateError(
                f"{path} is shorter ({pos} bytes) than the {covered} bytes committed: changed under this node"
            )
    old_count = len(lengths)
    lengths += [len(x) for x in new]
    n = summaries.split_for_rotation(lengths, max_bytes // 2)
    folded_old = min(n, old_count)
    cut = sum(lengths[:folded_old])  # bytes of the file folded away

    def oldest() -> Iterator[dict[str, Any]]:
        if folded_old:
            with open(path, "rb") as f:
                for i, line in enumerate(f):
                    if i >= folded_old:
                        break
                    yield _parse_line(path, i + 1, line)
        for j, line in enumerate(new[: n - folded_old]):
            yield _parse_line(path, old_count + j + 1, line)

    kept_new = b"".join(new[n - folded_old :])
    content = bytearray(covered - cut + len(kept_new))  # one buffer, no second copy of the kept bytes
    if covered > cut:
        with open(path, "rb") as f:
            f.seek(cut)
            got = f.readinto(memoryview(content)[: covered - cut])
        if got != covered - cut:
            raise StateError(f"{path} changed under this node during a rotation")
    content[covered - cut :] = kept_new
    return (summaries.add_block(summary, summaries.fold(oldest())) if n else summary), content


def state_leftovers(directory: Path) -> list[str]:
    """The round state in a directory that has no checkpoint (what a fresh start would shadow)."""
    names = []
    for p in sorted(directory.iterdir()):
        if p.name in _NOT_STATE or p.name.startswith(("reset-", ".")):
            continue
        if p.name in ("identity.json", "history.jsonl", *_LEGACY) or p.name.startswith("ckpt-"):
            names.append(p.name + ("/" if p.is_dir() else ""))
    return names


def _pending_name(segment: int) -> str:
    return f".history-{segment:06d}.jsonl.pending"


def history_pin(ckpt: Checkpoint) -> tuple[int, list[dict[str, Any]]]:
    """The history segment a checkpoint pins and its summary of older rounds (0 and none for a
    checkpoint written before rotation)."""
    pinned = ckpt.state.get("history") or {}
    try:
        segment = int(pinned.get("segment", 0))
        return segment, summaries.check(pinned.get("summary", []), ckpt.path.name)
    except (TypeError, ValueError, AttributeError) as e:
        raise StateError(f"{ckpt.path} is corrupt ({e})") from None


def settle_rotation(directory: Path, segment: int) -> None:
    """Finish or drop a rotation a crash interrupted: the pending file of the checkpoint's own
    segment was complete before that checkpoint's rename (so it becomes history.jsonl); any other
    belongs to a checkpoint that never landed."""
    for p in sorted(Path(directory).iterdir()):
        m = _PENDING.match(p.name)
        if not m:
            continue
        if int(m.group(1)) == segment:
            log.warning("%s: finishing the history rotation a crash interrupted (segment %d)", directory, segment)
            os.replace(p, Path(directory) / "history.jsonl")
        else:
            p.unlink(missing_ok=True)
        fsync_dir(directory)


class StateStore:
    def __init__(self, directory: str | Path, history_max_bytes: int = HISTORY_MAX_BYTES):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.history_path = self.dir / "history.jsonl"
        self.identity_path = self.dir / "identity.json"
        self._lock: Any = None  # the LOCK file, flock'ed while this process owns the dir
        self._node_id: str | None = None
        self._identity_ok = False
        self._hist_bytes = 0  # history bytes covered by the last commit
        self._hist_hash = hashlib.sha256()
        self.round = -1  # round of the last commit (-1: none yet)
        self._dir_unsynced = False
        self.history_max_bytes = history_max_bytes
        self._segment = 0  # history.jsonl's generation: each rotation writes the next one
        self.summary: list[dict[str, Any]] = []  # rounds folded out of history.jsonl (history.py)
        self._rotation_pending: Path | None = None  # committed, not yet renamed into place
        self._swap = threading.Lock()  # history readers vs a rotation swapping the file

    # --- ownership ---
    def lock(self) -> None:
        """Take the directory for this process (released by ``unlock`` or process exit); a
        second owner fails with StateError naming the holder's pid."""
        path = self.dir / "LOCK"
        # a read-only descriptor (it never blocks a read-only remount), in a file object so that
        # a Node that fails half-way through its constructor releases it when collected
        held = os.fdopen(os.open(path, os.O_RDONLY | os.O_CREAT, 0o644), "rb")
        try:
            fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.close()
            try:
                holder = path.read_text().strip() or "unknown"
            except OSError:
                holder = "unknown"
            raise StateError(
                f"state dir {self.dir} is in use by another coterie node (pid {holder}; "
                f"lock {path}): one process per state dir"
            ) from None
        try:
            path.write_text(f"{os.getpid()}\n")
        except OSError:
            pass  # the lock is what counts; the pid is for the message above
        self._lock = held

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # --- opening ---
    def checkpoints(self) -> list[Path]:
        return checkpoint_files(self.dir)

    def _read_identity(self) -> str | None:
        try:
            stored = read_json(self.identity_path)["node_id"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            what = f"missing {e}" if isinstance(e, KeyError) else str(e)
            raise StateError(f"{self.identity_path} is corrupt or unreadable ({what})") from None
        if not isinstance(stored, str) or not stored:
            raise StateError(f"{self.identity_path} is corrupt (node_id {stored!r})")
        return stored

    def _reset(self) -> str | None:
        """Move all state into ``reset-<time>/``; returns the old node id if it was readable."""
        try:
            old_id = self._read_identity()
        except StateError:
            old_id = None
        moved = [p for p in self.dir.iterdir() if p.name not in _NOT_STATE and not p.name.startswith("reset-")]
        if moved:
            dest = self.dir / time.strftime("reset-%Y%m%d-%H%M%S")
            n = 0
            while dest.exists():
                n += 1
                dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
            dest.mkdir()
            for p in moved:
                p.rename(dest / p.name)
            fsync_dir(self.dir)
            log.warning("reset: moved %s from %s into %s", ", ".join(sorted(p.name for p in moved)), self.dir, dest)
        return old_id

    def open(self, wanted: str | None = None, reset: bool = False) -> tuple[str, Checkpoint | None]:
        """Verify the directory and return (node id, last checkpoint or None when fresh).

        Fresh means empty: identity or history without a checkpoint is refused (unless
        ``reset``). A fresh node's identity is written by its first commit."""
        old_id = self._reset() if reset else None
        for p in self.dir.glob(".ckpt-*.tmp"):  # an interrupted commit
            p.unlink(missing_ok=True)
        ckpts = self.checkpoints()
        if not ckpts:
            settle_rotation(self.dir, -1)
        identity = self._read_identity()
        if not ckpts:
            left = state_leftovers(self.dir)
            if left:
                raise StateError(
                    f"{self.dir} holds {', '.join(left)} but no checkpoint "
                    "(ckpt-NNNNNN.safetensors): refusing to start fresh over that state. "
                    "Restore the checkpoint, or start with --reset to move the old state "
                    "aside and begin at round 0"
                )
            self._node_id = wanted or old_id or f"node-{uuid.uuid4().hex[:8]}"
            return self._node_id, None
        ckpt = read_checkpoint(ckpts[-1])
        if wanted and wanted != ckpt.node_id:
            raise StateError(f"{ckpt.path} belongs to node {ckpt.node_id!r}, but the config says {wanted!r}")
        if identity is not None and identity != ckpt.node_id:
            raise StateError(
                f"{self.identity_path} says node {identity!r} but {ckpt.path} belongs to node {ckpt.node_id!r}"
            )
        self._segment, self.summary = history_pin(ckpt)
        settle_rotation(self.dir, self._segment)
        ckpt.history, size, self._hist_bytes, self._hist_hash = verify_history(self.history_path, ckpt)
        ckpt.summary = self.summary
        # verified: now the repairs a crash calls for (nothing is written before this point)
        if identity is None:
            log.warning("%s was missing; node id %r restored from %s", self.identity_path, ckpt.node_id, ckpt.path.name)
            atomic_write_json(self.identity_path, {"node_id": ckpt.node_id})
        if size > self._hist_bytes:
            log.warning(
                "%s: dropping %d bytes past round %d (written before a crash, never checkpointed)",
                self.history_path,
                size - self._hist_bytes,
                ckpt.round,
            )
            try:
                os.truncate(self.history_path, self._hist_bytes)
            except OSError as e:  # the next commit truncates too; a read-only dir shows up there
                log.warning("could not trim %s now: %s", self.history_path, e)
        for older in ckpts[:-1]:  # a crash between a commit's rename and its cleanup
            older.unlink(missing_ok=True)
        self._identity_ok = True
        self._node_id = ckpt.node_id
        self.round = ckpt.round
        return ckpt.node_id, ckpt

    # --- writing ---
    def commit(self, snap: Snapshot, records: list[dict[str, Any]]) -> Path:
        """Make ``snap`` durable together with the history lines of ``records`` (the rounds
        since the last commit, in order), rotating the history when they would take it past
        ``history_max_bytes``. Safe to retry after any failure, with the same or a longer batch:
        rounds an earlier try committed are skipped."""
        if self._rotation_pending is not None:  # an earlier try committed a rotation, not its rename
            self._finish_rotation()
        if self._dir_unsynced:  # an earlier try renamed its file but could not fsync the directory
            fsync_dir(self.dir)
            self._dir_unsynced = False
        if snap.round <= self.round:
            return self.dir / f"ckpt-{self.round:06d}.safetensors"
        records = [r for r in records if r["round"] > self.round]
        lines = b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in records)
        segment, summary = self._segment, self.summary
        content: bytes | bytearray
        if self._hist_bytes + len(lines) > self.history_max_bytes:
            summary, content = rotated_history(
                self.history_path, self._hist_bytes, lines, self.summary, self.history_max_bytes
            )
            segment = self._segment + 1
            hasher, covered = hashlib.sha256(content), len(content)
            pending: Path | None = self.dir / _pending_name(segment)
        else:
            hasher = self._hist_hash.copy()
            hasher.update(lines)
            covered, content, pending = self._hist_bytes + len(lines), lines, None
        pin = {"bytes": covered, "sha256": hasher.hexdigest(), "segment": segment, "summary": summary}
        state = {**snap.state, "format": FORMAT, "history": pin}
        state_json = json.dumps(state, sort_keys=True).encode()
        meta = {"format": FORMAT, "state": state_json.decode(), "sha256": _digest(state_json, snap.tensors)}
        name = f"ckpt-{snap.round:06d}.safetensors"
        tmp, final = self.dir / f".{name}.tmp", self.dir / name
        try:
            if pending is not None:  # the rotated file, complete, under a name nothing reads yet
                hist: Any = open(pending, "wb")
            else:
                hist = open(self.history_path, "ab") if lines or self.history_path.exists() else None
            try:
                if hist is not None:
                    if pending is None:
                        hist.truncate(self._hist_bytes)  # drop what a failed try or a crash left
                    hist.write(content)
                    hist.flush()
                st_save_file(snap.tensors, str(tmp), metadata=meta)
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)  # the batch: checkpoint data and history lines together
                    if hist is not None and content:
                        os.fsync(hist.fileno())
                finally:
                    os.close(fd)
            finally:
                if hist is not None:
                    hist.close()
            os.replace(tmp, final)
        except BaseException:
            for p in (tmp, pending):
                try:
                    if p is not None:
                        p.unlink(missing_ok=True)
                except OSError:
                    pass
            raise
        # the new file is in place: its history prefix must never be truncated again
        with self._swap:  # a reader sees the old segment and its bytes, or the new and its
            self._hist_bytes, self._hist_hash, self.round = covered, hasher, snap.round
            self._segment, self.summary, self._rotation_pending = segment, summary, pending
            if pending is not None:  # failing here, the next commit (or open) finishes it
                os.replace(pending, self.history_path)
                self._rotation_pending = None
        self._dir_unsynced = True
        fsync_dir(self.dir)
        self._dir_unsynced = False
        for older in self.checkpoints():
            if older != final:
                try:
                    older.unlink(missing_ok=True)
                except OSError as e:  # committed all the same; the next open() removes it
                    log.warning("could not remove %s: %s", older, e)
        if not self._identity_ok:  # after the first checkpoint: identity never exists without one
            atomic_write_json(self.identity_path, {"node_id": snap.state["node_id"]})
            self._identity_ok = True
        return final

    def _finish_rotation(self) -> None:
        """Rename the committed rotation's file into place (after its checkpoint's rename)."""
        with self._swap:
            if self._rotation_pending is None:
                return
            os.replace(self._rotation_pending, self.history_path)
            self._rotation_pending = None
        fsync_dir(self.dir)

    # --- history ---
    def history_since(self, since: int) -> Iterator[dict[str, Any]]:
        """Committed rounds after ``since``, streamed from the file."""
        with self._swap:  # the file and the bytes it covers, of one segment
            covered, pos = self._hist_bytes, 0
            try:  # a rotation committed but not yet renamed into place: its file is the history
                f = open(self._rotation_pending or self.history_path, "rb")
            except FileNotFoundError:
                return
        with f:
            for n, line in enumerate(f, 1):
                pos += len(line)
                if pos > covered:
                    return
                row = _parse_line(self.history_path, n, line)
                if row["round"] > since:
                    yield row
