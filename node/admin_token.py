"""The admin API's bearer token: where it lives, how a node makes it, how clients find it.

A node keeps one token, in ``security.admin_token_file`` or else ``<state_dir>/admin.token``,
generated on first start (256 random bits, mode 0600, atomic write) and kept across restarts.
Its node.json names the file (``admin_token_file``), so a client that knows the state dir finds
the token wherever the config put it. Stdlib only: the CLI, the launcher, tests and bench
scripts import it without pulling in torch or aiohttp.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
from pathlib import Path

from .fsutil import atomic_write_bytes

TOKEN_FILE = "admin.token"
TOKEN_ENV = "COTERIE_ADMIN_TOKEN"  # the CLI's token when neither --token nor --state-dir is given
MIN_TOKEN_CHARS = 16  # a configured token shorter than this is refused, not trusted


class TokenError(ValueError):
    """The token file is missing, unreadable or unusable; the message names it."""


def token_path(state_dir: str | Path, configured: str | Path | None = None) -> Path:
    return Path(configured) if configured else Path(state_dir) / TOKEN_FILE


def read_token(path: str | Path) -> str:
    """The token in ``path`` (surrounding whitespace ignored: an editor's newline is no part of it)."""
    path = Path(path)
    try:
        token = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise TokenError(f"admin token file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TokenError(f"admin token file {path} cannot be read: {e}") from None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in token):
        raise TokenError(
            f"admin token file {path} does not hold a usable token (one line of at "
            f"least {MIN_TOKEN_CHARS} printable characters, no spaces)"
        )
    return token


def ensure_token(path: str | Path) -> str:
    """The node's token: read from ``path``, or generated there on first start. mkstemp (inside
    atomic_write_bytes) creates the file 0600, and the rename keeps that mode."""
    path = Path(path)
    if path.exists():
        return read_token(path)
    token = secrets.token_urlsafe(32)
    atomic_write_bytes(path, (token + "\n").encode())
    os.chmod(path, 0o600)  # already 0600; said here too so a reader of this code need not know mkstemp
    return token


def token_for_state_dir(state_dir: str | Path) -> str | None:
    """The token of the node that owns ``state_dir``: the file its node.json names, else
    ``<state_dir>/admin.token``; None when neither exists (a node started without auth)."""
    state_dir = Path(state_dir)
    path = state_dir / TOKEN_FILE
    try:
        info = json.loads((state_dir / "node.json").read_text())
        if isinstance(info, dict) and info.get("admin_token_file"):
            path = Path(info["admin_token_file"])
            if not path.is_absolute():
                path = state_dir / path
    except (OSError, ValueError):
        pass
    if not path.exists():
        return None
    return read_token(path)


def bearer(token: str | None) -> dict[str, str]:
    """The request header that carries ``token`` (none for None)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def is_loopback(host: str) -> bool:
    """Whether an admin listen host is reachable from this machine only. Names other than
    localhost count as not loopback (what they resolve to may change)."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
