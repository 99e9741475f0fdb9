"""Publishing a node's model: the snapshot peers pull, one version per publish.

At the end of a round a large model is copied, checked for finiteness and encoded in a worker
thread (model-sized passes must not hold the event loop); the strategy then holds the published
views instead of its own copy (``Strategy.on_published``), so the model it shares lives once, in
the buffer peers are served from.

A strategy may publish the live model during its round instead (``Strategy.publish_now``, which
the node sets to ``publish_now`` here): D-PSGD publishes its trained model before it exchanges, so
that model is encoded once, straight into the buffer peers are served from, and held as that
buffer's views through the exchange — not as a copy beside the old snapshot and then encoded
again beside both (issue 34). The round's end then has nothing new to publish."""

from __future__ import annotations

import asyncio
import functools
import math
from typing import Any

from .learning.guard import all_finite
from .offload import OFF_LOOP_BYTES
from .peering.messages import LocalSnapshot


def publish(node: Any) -> None:
    """Publish now, on the loop (at start; small models). From then on the strategy may publish
    during its rounds (``publish_now``)."""
    node.strategy.publish_now = functools.partial(publish_now, node)
    _publish(node, _snapshot_of(node, node.guard.publishable(_to_publish(node))))


async def publish_round(node: Any) -> None:
    """Publish at the end of a round; a large model's copy, check and encoding in a thread."""
    groups = _to_publish(node, copy_live=False)
    if _published_already(node, groups):  # (``publish_now``): no second encoding of the same model
        node.guard.round_published()  # the round is over: the guard lets its round-start copy go
        node.guard.published(None, None)  # (what is published is not the live model)
        return
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


async def publish_now(node: Any) -> dict[str, Any] | None:
    """Publish the live model now, as the snapshot of the round in progress (``node.round + 1``:
    the round loop counts a round only once it ends), with the strategy's extras; the published
    tensors (read-only views of the one buffer peers are served from), or None when the live model
    or an extra is not finite (nothing non-finite leaves the node: the round's end publishes then)."""
    big = 4 * sum(math.prod(shape) for shape, _ in node.learner.param_spec().values()) > OFF_LOOP_BYTES  # ~float32

    def build() -> LocalSnapshot | None:
        # the live tensors, encoded from where they are: nothing changes the model while its
        # strategy waits for this (a copy first would be the model held twice)
        groups = {"params": node.learner.live_params() if big else node.learner.get_params()}
        for name, tensors in node.strategy.published_extras().items():
            groups[f"x:{name}"] = tensors
        if not all(all_finite(tensors) for tensors in groups.values()):
            return None
        snap = LocalSnapshot(node.node_id, node.version + 1, node.round + 1, groups)
        snap.prepare()  # its groups are now views of the buffer: none is the live model's
        return snap

    snap = await asyncio.to_thread(build) if big else build()
    if snap is None:
        return None
    _publish(node, snap)
    return snap.groups["params"]


def _published_already(node: Any, groups: dict[str, Any]) -> bool:
    """Whether the strategy's shared model is the snapshot it published during this round."""
    current = node.board.current
    return groups["params"] is not None and current is not None and current.groups.get("params") is groups["params"]


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
