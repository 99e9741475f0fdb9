"""The round history kept under a size cap: recent rounds in full, older ones summarised.

``history.jsonl`` holds the newest rounds, one JSON line each. When a commit would take it past
``history.max_bytes``, the oldest lines are folded into summary blocks and the file is rewritten
with the newest half of the cap (a *rotation*); the file's size stays between half the cap and the
cap, so a start reads at most ``max_bytes``. The blocks live in the checkpoint's (checksummed)
state next to the history pin, so a rotation becomes durable in the same rename as its checkpoint
(``persistence.StateStore.commit``). At most ``MAX_BLOCKS`` blocks are kept: past that the two
adjacent blocks with the fewest rounds between them merge, so older stretches get coarser and the
summary never grows with the rounds.

A block: ``{"rounds": [first, last], "count": n, "t": [first, last], "fields": {name: [n, sum,
min, max, last]}}`` over the numeric fields of the rows (``duration_s``, ``train_loss``,
``peers_alive``, ``eval.<metric>``, ``sent``/``received``: bytes over all peers)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

MAX_BLOCKS = 16
_TOP = ("duration_s", "train_loss", "peers_alive")


def _numeric(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def _values(row: dict[str, Any]) -> Iterable[tuple[str, float | None]]:
    for k in _TOP:
        yield k, _numeric(row.get(k))
    for k, v in (row.get("eval") or {}).items():
        yield f"eval.{k}", _numeric(v)
    for key, name in (("bytes_sent", "sent"), ("bytes_received", "received")):
        per_peer = row.get(key)
        if isinstance(per_peer, dict):
            yield name, _numeric(sum(v for v in per_peer.values() if _numeric(v) is not None))
        else:
            yield name, _numeric(per_peer)


def fold(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One summary block over ``rows`` (oldest first, at least one), in one pass: a rotation
    streams its rows through here, so it never holds them all (tens of MB of dicts at once)."""
    fields: dict[str, list[float]] = {}
    first: dict[str, Any] | None = None
    last: dict[str, Any] = {}
    count = 0
    for row in rows:
        if first is None:
            first = row
        last = row
        count += 1
        for name, v in _values(row):
            if v is None:
                continue
            f = fields.get(name)
            if f is None:
                fields[name] = [1, v, v, v, v]
            else:
                f[0] += 1
                f[1] += v
                f[2], f[3], f[4] = min(f[2], v), max(f[3], v), v
    if first is None:
        raise ValueError("a summary block needs at least one round")
    return {
        "rounds": [first["round"], last["round"]],
        "count": count,
        "t": [first.get("t"), last.get("t")],
        "fields": fields,
    }


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The block over ``a``'s rounds then ``b``'s (``a`` older)."""
    fields = {k: list(v) for k, v in a["fields"].items()}
    for k, (n, s, lo, hi, last) in b["fields"].items():
        f = fields.get(k)
        fields[k] = [n, s, lo, hi, last] if f is None else [f[0] + n, f[1] + s, min(f[2], lo), max(f[3], hi), last]
    return {
        "rounds": [a["rounds"][0], b["rounds"][1]],
        "count": a["count"] + b["count"],
        "t": [a["t"][0], b["t"][1]],
        "fields": fields,
    }


def add_block(blocks: list[dict[str, Any]], block: dict[str, Any]) -> list[dict[str, Any]]:
    """``blocks`` with ``block`` appended, merged down to at most ``MAX_BLOCKS``."""
    out = [*blocks, block]
    while len(out) > MAX_BLOCKS:
        i = min(range(len(out) - 1), key=lambda j: out[j]["count"] + out[j + 1]["count"])
        out[i : i + 2] = [merge(out[i], out[i + 1])]
    return out


def split_for_rotation(lengths: list[int], keep_bytes: int) -> int:
    """How many of the oldest lines (given their ``lengths`` in bytes, oldest first) to fold so
    the rest fit in ``keep_bytes`` (the newest line is always kept)."""
    i, kept = len(lengths), 0
    while i > 0 and kept + lengths[i - 1] <= keep_bytes:
        kept += lengths[i - 1]
        i -= 1
    return min(i, len(lengths) - 1)


def view(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The blocks as ``/status`` shows them: per field the mean, min, max and last value."""
    return [
        {
            "rounds": b["rounds"],
            "count": b["count"],
            "t": b["t"],
            **{
                k: {"mean": s / n, "min": lo, "max": hi, "last": last}
                for k, (n, s, lo, hi, last) in sorted(b["fields"].items())
                if n
            },
        }
        for b in blocks
    ]


def check(blocks: Any, where: str) -> list[dict[str, Any]]:
    """The summary as pinned in a checkpoint, or ValueError saying what is wrong."""
    if not isinstance(blocks, list):
        raise ValueError(f"history summary in {where} is not a list")
    prev = None
    for b in blocks:
        try:
            first, last = int(b["rounds"][0]), int(b["rounds"][1])
            int(b["count"]), dict(b["fields"])
        except (KeyError, TypeError, ValueError, IndexError):
            raise ValueError(f"history summary in {where} has a malformed block: {json.dumps(b)[:200]}") from None
        if first > last or (prev is not None and first <= prev):
            raise ValueError(f"history summary in {where} is out of order at rounds {first}-{last}")
        prev = last
    return blocks
