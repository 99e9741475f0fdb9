"""What a node id may look like: it travels in certificates, requests, logs and file names, so
it is short and plain (no crypto imports here: the servicer checks every claimed id with it)."""

from __future__ import annotations

import re

MAX_NODE_ID = 128
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]*")


def node_id_problem(node_id: str) -> str | None:
    """None if ``node_id`` is usable, else why not."""
    if not node_id:
        return "node id is empty"
    if len(node_id) > MAX_NODE_ID:
        return f"node id is {len(node_id)} characters long, the limit is {MAX_NODE_ID}"
    if not _ID_RE.fullmatch(node_id):
        return (
            f"node id {node_id!r} has characters outside letters, digits and . _ : @ + - "
            "(or does not start with a letter or digit)"
        )
    return None
