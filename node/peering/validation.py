"""Tensors that came from a peer: the right architecture and finite, or refused with a reason.

The same checks run whatever carried the tensors (gRPC bytes, or memory in-process)."""

from __future__ import annotations

from ..learning.learner import Params
from ..wire.codec import Groups, WireError, check_finite, check_spec

Spec = dict[str, tuple[tuple[int, ...], str]]


def model_tensors(groups: Groups, group: str, spec: Spec, what: str) -> Params:
    """``groups[group]``: present, this architecture's names/shapes/dtypes, finite."""
    tensors = groups.get(group)
    if tensors is None:
        raise WireError(f"{what}: no {group!r} tensors")
    check_spec(tensors, spec, f"{what} {group}")
    try:
        check_finite({group: tensors})
    except WireError as e:
        raise WireError(f"{what}: {e}") from None
    return tensors


def snapshot_groups(groups: Groups, spec: Spec, what: str) -> tuple[Params, dict[str, Params]]:
    """A published snapshot: "params" plus named extras ("x:<name>"), each of the architecture's
    shapes, all finite. Returns (params, {name: tensors})."""
    params = model_tensors(groups, "params", spec, what)
    extras: dict[str, Params] = {}
    for key in groups:
        if key == "params":
            continue
        if not key.startswith("x:"):
            raise WireError(f"{what}: unexpected tensor group {key!r}")
        extras[key[2:]] = model_tensors(groups, key, spec, f"{what} extra {key[2:]!r}")
    return params, extras
