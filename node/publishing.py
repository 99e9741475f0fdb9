"""Publishing a node's model: the snapshot peers pull, one version per publish.

At the end of a round a large model is copied, checked for finiteness and encoded in a worker
thread (model-sized passes must not hold the event loop); the strategy then holds the published
views instead of its own copy (``Strategy.on_published``), so the model it shares lives once, in
the buffer peers are served from."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from .offload import OFF_LOOP_BYTES
from .peering.messages import LocalSnapshot


def publish(node: Any) -> None:
    """Publish now, on the loop (at start; small models)."""
    _publish(node, _snapshot_of(node, node.guard.publishable(_to_publish(node))))


async def publish_round(node: Any) -> None:
    """Publish at the end of a round; a large model's copy, check and encoding in a thread."""
    groups = _to_publish(node, copy_live=False)
    big = 4 * sum(math.prod(shape) for shape, _ in node.learner.param_spec().values()) > OFF_LOOP_BYTES  # ~float32

    def build() -> LocalSnapshot:
        read_at = None  # the learner's change count when the live model was read, if it was
        if groups.get("params") is None:
            read_at = getattr(node.learner, "changes", None)  # read first: a change after it voids it
            # a large model is encoded below, from the live tensors (nothing changes the model while
            # the round loop publishes): a copy first would be one more model alive (issue 34)
            groups["params"] = node.learner.live_params() if big else node.learner.get_params()
        read = groups["params"]
        checked = node.guard.publishable(groups)  # nothing non-finite leaves the node
        snap = _snapshot_of(node, checked)
        if big:
            snap.prepare()  # encoded here: its groups become views of the one buffer it serves
        # the live model as published: the next round's start, while the model stays as it was
        as_read = read_at is not None and checked.get("params") is read
        node.guard.published((lambda: snap.groups.get("params")) if as_read else None, read_at)
        return snap

    _publish(node, await asyncio.to_thread(build) if big else build())


def _to_publish(node: Any, copy_live: bool = True) -> dict[str, Any]:
    """The strategy's shared model (or the live one: copied now, or left None for the caller to
    copy where it runs) and its extras."""
    shared = node.strategy.shared_params()
    groups: dict[str, Any] = {
        "params": shared if shared is not None else (node.learner.get_params() if copy_live else None)
    }
    for name, tensors in node.strategy.published_extras().items():
        groups[f"x:{name}"] = tensors
    return groups


def _snapshot_of(node: Any, groups: dict[str, Any]) -> LocalSnapshot:
    return LocalSnapshot(node.node_id, node.version + 1, node.round, groups)


def _publish(node: Any, snap: LocalSnapshot) -> None:
    node.version = snap.version
    node.board.publish(snap)
    if "params" in snap.groups:
        node.strategy.on_published(snap.groups["params"])
