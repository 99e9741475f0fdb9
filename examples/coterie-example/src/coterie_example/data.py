"""``sensors``: one device's readings, from its own parameter file (group ``coterie.datasets``).

Contract: ``loader(path, **data_params) -> Mapping[str, np.ndarray]`` with ``x``, ``y`` and
optionally ``x_val``, ``y_val``, ``x_test``, ``y_test``; ``y`` holds class names (strings) or
integer labels. Coterie calls it with ``learner.data`` as ``path`` and ``learner.data_params``
as keyword arguments (``learner.data_format = "sensors"``).

The file (JSON) describes a device: which activity classes it sees, how its sensor is mounted,
how noisy it is and its own seed. The readings are generated from it deterministically, so a
node restarted on the same file learns from exactly the same samples::

    {"classes": ["idle", "walk", "run"], "features": 8, "mounting": 0, "noise": 0.6,
     "seed": 11, "samples": {"train": 240, "val": 120, "test": 240}}

Every device shares the activities' signatures (``prototype_seed``, default 0); ``mounting``
permutes which channel reads what (0: as designed), so devices mounted alike form a cluster
that does better learning together than with the others.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

_FIELDS = {"classes", "features", "mounting", "noise", "seed", "samples", "prototype_seed"}
_SPLITS = {"train": ("x", "y"), "val": ("x_val", "y_val"), "test": ("x_test", "y_test")}


def _device(path: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    if path is None:
        raise ValueError("sensors: learner.data must name the device's parameter file (JSON)")
    p = Path(path)
    try:
        spec = json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"sensors: {p} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"sensors: {p} is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"sensors: {p} must hold a JSON object")
    spec.update(overrides)
    unknown = set(spec) - _FIELDS
    if unknown:
        raise ValueError(f"sensors: {p}: unknown field(s) {sorted(unknown)}; known: {sorted(_FIELDS)}")
    spec.setdefault("prototype_seed", 0)
    spec.setdefault("mounting", 0)
    spec.setdefault("noise", 0.5)
    spec.setdefault("samples", {"train": 200, "val": 100, "test": 200})
    for need in ("classes", "features", "seed"):
        if need not in spec:
            raise ValueError(f"sensors: {p}: field {need!r} is missing")
    classes = spec["classes"]
    if not (isinstance(classes, list) and len(classes) >= 2 and all(isinstance(c, str) for c in classes)):
        raise ValueError(f"sensors: {p}: classes must be a list of at least two names")
    if not (isinstance(spec["features"], int) and spec["features"] >= 1):
        raise ValueError(f"sensors: {p}: features must be a positive integer")
    bad = set(spec["samples"]) - set(_SPLITS)
    if bad or "train" not in spec["samples"]:
        raise ValueError(
            f"sensors: {p}: samples must give train (and may give val, test), got {sorted(spec['samples'])}"
        )
    return spec


def load_sensors(path: str | None, **data_params: Any) -> dict[str, np.ndarray]:
    """The device's train/val/test readings (float32, shape (n, features)) and activity names."""
    spec = _device(path, data_params)
    classes, f = list(spec["classes"]), int(spec["features"])
    # the activities' signatures are the same on every device (same prototype seed)...
    prototypes = np.random.default_rng(int(spec["prototype_seed"])).normal(0.0, 1.5, (len(classes), f))
    # ...but a device mounted differently reads them on permuted channels
    m = int(spec["mounting"])
    channels = np.arange(f) if m == 0 else np.random.default_rng(10_000 + m).permutation(f)
    rng = np.random.default_rng(int(spec["seed"]))
    out: dict[str, np.ndarray] = {}
    for split, (xk, yk) in _SPLITS.items():
        n = int(spec["samples"].get(split, 0))
        if n <= 0:
            continue
        labels = rng.integers(len(classes), size=n)
        x = prototypes[labels] + float(spec["noise"]) * rng.normal(size=(n, f))
        out[xk] = x[:, channels].astype(np.float32)
        out[yk] = np.asarray(classes, dtype=object)[labels].astype(str)
    return out
