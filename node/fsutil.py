"""Crash-safe file writes: a reader sees the old file or the new one, never a torn one."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """temp file in the same directory + fsync + rename + fsync of the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def fsync_dir(path: str | Path) -> None:
    """Make renames and new names in ``path`` durable."""
    dfd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, sort_keys=True).encode())


def read_json(path: str | Path) -> Any:
    """Read a JSON file; a corrupt one raises ValueError naming the file (never silently reset).
    OSErrors (missing, a directory, unreadable) propagate: they carry the file name."""
    path = Path(path)
    try:
        return json.loads(path.read_bytes())
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is corrupt (not UTF-8: {e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is corrupt (not valid JSON: {e})") from None


def json_safe(obj: Any) -> Any:
    """JSON has no NaN/Inf: turn them into null so browsers and strict parsers agree."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
