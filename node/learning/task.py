"""The task a node learns — its input shape and what its outputs mean (the class names, or
regression) — as peers compare it in the handshake. Two nodes whose models have the same shapes
can still learn different things (classes in another order, other names): averaging them would be
silently wrong, so a peer with another task is refused, and the refusal says what differs.

The task travels as canonical JSON: ``{"input_shape": [40], "classes": ["0", ..., "9"]}`` or
``{"input_shape": [1], "classes": "regression"}``. Pure Python: the peering layer uses it."""

from __future__ import annotations

import json
from typing import Any

MAX_SHOWN = 12  # class names shown in a refusal; a long list is cut


def describe_task(input_shape, class_names: list[str] | None) -> str:
    return json.dumps(
        {
            "input_shape": [int(s) for s in input_shape],
            "classes": "regression" if class_names is None else [str(c) for c in class_names],
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def _parse(task: str) -> dict[str, Any] | None:
    try:
        d = json.loads(task)
    except (TypeError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _classes(c: Any) -> str:
    if isinstance(c, list) and len(c) > MAX_SHOWN:
        return f"{c[:MAX_SHOWN]!r}[:{MAX_SHOWN}] of {len(c)}"
    return repr(c)


def task_difference(mine: str, theirs: str, peer: str, me: str = "") -> str | None:
    """None when the tasks match (or the peer announces none: an older build, checked on its
    architecture alone), else one line saying what differs."""
    if not theirs or theirs == mine:
        return None
    a, b = _parse(mine), _parse(theirs)
    if b is None:
        return f"peer {peer!r} announces a malformed task {theirs[:80]!r}"
    if a is None:
        return None
    diffs = []
    if b.get("input_shape") != a.get("input_shape"):
        diffs.append(f"input shape {b.get('input_shape')} vs {a.get('input_shape')}")
    if b.get("classes") != a.get("classes"):
        diffs.append(f"classes {_classes(b.get('classes'))} vs {_classes(a.get('classes'))}")
    if not diffs:
        return None
    # the refused peer reads this too: name both ends
    return (
        f"peer {peer!r}'s task differs from node {me!r}'s: " + "; ".join(diffs)
        if me
        else f"peer {peer!r}'s task differs from this node's: " + "; ".join(diffs)
    )
