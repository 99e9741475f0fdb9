"""Own data: a node learns from exactly the samples in its own files (``learner.data``), nothing
partitioned, generated or shared. docs/own-data.md is the user's guide.

Formats (``learner.data_format``, "auto" detects them from the path):

- ``npz``: arrays ``x``, ``y`` and optionally ``x_val``/``y_val``, ``x_test``/``y_test``; read
  with ``allow_pickle=False`` (object arrays are refused).
- ``csv`` / ``parquet``: numeric feature columns and a label column (``learner.data_label``,
  default "label"); a file, or a folder with ``train.csv``/``val.csv``/``test.csv`` (or
  ``*_train.csv``, ...; the same for ``.parquet``).
- ``images``: ``PATH/<class name>/*.png|*.jpg`` (or ``PATH/train/<class name>/...``,
  ``val/``, ``test/``) read with Pillow (``images.py`` says how they are resized).
- the name of an entry point in group ``coterie.datasets`` (below).

Loader contract (group ``coterie.datasets``, ``name = "pkg.module:loader"``)::

    loader(path: str | None, **data_params) -> Mapping[str, np.ndarray]

with keys ``x``, ``y`` and optionally ``x_val``, ``y_val``, ``x_test``, ``y_test``. ``path`` is
``learner.data`` (None when unset), ``data_params`` is ``learner.data_params``. ``y`` holds class
names as strings or integer labels (an integer k means ``classes[k]``), or numbers for
regression.

Splits: the ones the files give (npz arrays, train/val/test files or folders, the loader's
keys); a split they do not give is drawn from the train samples, deterministically from
``learner.data_seed`` and ``learner.node_index`` (``val_fraction``/``test_fraction`` of them).

Labels mean the same on every node: ``learner.classes`` (a list of names, or N for "0".."N-1")
is what the network agrees on, and output i is ``classes[i]`` whatever order a node's folders
are in or which labels it happens to hold. Text labels are matched by name, integer labels
(npz, loaders) are indices into ``classes``; anything else is a ``DataError`` naming the file and
row. Without ``classes`` the node does regression on float targets (an image folder needs
``classes``). Every problem — unreadable file, NaN/Inf, ragged or non-numeric columns, unknown
label, empty split — is a ``DataError`` (a ValueError) naming the file and row or image.
"""

from __future__ import annotations

import functools
import importlib.metadata
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .config import LearnerConfig
from .images import has_images, image_files, image_shape, read_images
from .partition import Splits
from .samples import DataError, Part, concat
from .tables import TABLE_SUFFIXES, read_table

SPLITS = ("train", "val", "test")
LOADER_GROUP = "coterie.datasets"
_SALT = 0x0DA7A  # the split stream, apart from the learner's other seeded streams


@dataclass
class OwnData(Splits):
    """A node's own samples, split, labels as output indices (or float targets)."""

    input_shape: tuple[int, ...]
    class_names: list[str] | None  # None: regression
    source: str  # what was read, for /status
    given_splits: tuple[str, ...]  # the splits the files gave (the others were drawn from train)

    @property
    def task(self) -> str:
        return "regression" if self.class_names is None else "classification"

    def summary(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "task": self.task,
            "input_shape": list(self.input_shape),
            "classes": self.class_names,
            "given_splits": list(self.given_splits),
            "samples": {s: int(len(getattr(self, f"y_{s}"))) for s in SPLITS},
        }


def class_names(classes: list[str] | int | None) -> list[str] | None:
    """``learner.classes`` as the list of names output i stands for (None: none given)."""
    if classes is None:
        return None
    if isinstance(classes, int):
        if classes < 1:
            raise DataError(f"learner.classes = {classes}: need at least 1 class")
        return [str(i) for i in range(classes)]
    names = [str(c) for c in classes]
    if not names:
        raise DataError("learner.classes is empty")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DataError(f"learner.classes names {dup} more than once")
    return names


# ----------------------------------------------------------------------------- format detection
def loader_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=LOADER_GROUP)}


def detect_format(path: Path | None, fmt: str) -> str:
    """The format to read ``path`` with: ``fmt`` itself unless it is "auto"."""
    if fmt != "auto":
        if fmt in ("npz", "csv", "parquet", "images") or fmt in loader_entry_points():
            return fmt
        raise DataError(
            f"learner.data_format {fmt!r}: not a format (npz, csv, parquet, images) "
            f"nor an entry point in group {LOADER_GROUP!r} (installed: "
            f"{sorted(loader_entry_points()) or 'none'})"
        )
    if path is None:
        raise DataError("learner.data_format 'auto' needs learner.data (a path)")
    if not path.exists():
        raise DataError(f"{path}: no such file or folder (learner.data)")
    if path.is_file():
        if path.suffix.lower() == ".npz":
            return "npz"
        if path.suffix.lower() in TABLE_SUFFIXES:
            return TABLE_SUFFIXES[path.suffix.lower()]
        raise DataError(
            f"{path}: cannot tell its format from the suffix {path.suffix!r}; "
            f"set learner.data_format (npz, csv, parquet, images or a loader)"
        )
    for suffix, kind in TABLE_SUFFIXES.items():
        if any(path.glob(f"*{suffix}")):
            return kind
    if has_images(path) or any(has_images(path / s) for s in SPLITS):
        return "images"
    raise DataError(
        f"{path}: a folder with no .csv/.parquet files and no <class>/*.png|*.jpg "
        f"images; set learner.data_format if it holds something else"
    )


# ----------------------------------------------------------------------------- reading
def _split_of(name: str) -> str | None:
    stem = name.lower()
    for s in SPLITS:
        if stem == s or stem.endswith("_" + s) or stem.endswith("-" + s):
            return s
    return None


def _read_tables(path: Path, fmt: str, label: str, regression: bool) -> dict[str, Part]:
    if path.is_file():
        return {"all": read_table(path, fmt, label, regression)}
    suffixes = [s for s, k in TABLE_SUFFIXES.items() if k == fmt]
    files = sorted(f for s in suffixes for f in path.glob(f"*{s}"))
    if not files:
        raise DataError(f"{path}: no {fmt} files")
    by_split: dict[str, list[Path]] = {}
    for f in files:
        by_split.setdefault(_split_of(f.stem) or "all", []).append(f)
    if "all" in by_split and len(by_split) > 1:
        raise DataError(
            f"{path}: some files name a split (train/val/test) and some do not "
            f"({[f.name for f in by_split['all']]}); name them all or none"
        )
    return {s: concat([read_table(f, fmt, label, regression) for f in fs]) for s, fs in by_split.items()}


def _read_images(path: Path, params: dict) -> dict[str, Part]:
    split_dirs = {s: path / s for s in SPLITS if has_images(path / s)}
    folders = split_dirs or {"all": path}
    files = [f for d in folders.values() for _, f in image_files(d)]
    if not files:
        raise DataError(f"{path}: no images (expected {path}/<class name>/*.png or *.jpg)")
    shape = image_shape(files, params)
    return {s: read_images(d, shape) for s, d in folders.items()}


def _read_npz(path: Path) -> dict[str, Part]:
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        # ValueError: an object array (pickle refused) or a truncated member
        raise DataError(f"{path}: cannot read it as .npz: {e}") from None
    return _from_arrays(arrays, str(path), lambda key, i: f"{path} {key}[{i}]")


def _from_arrays(arrays: Mapping[str, Any], source: str, where) -> dict[str, Part]:
    known = {"x", "y", "x_val", "y_val", "x_test", "y_test"}
    unknown = sorted(set(arrays) - known)
    if unknown:
        raise DataError(
            f"{source}: unexpected arrays {unknown}; expected x, y and optionally x_val/y_val, x_test/y_test"
        )
    out = {}
    for split, suffix in (("train", ""), ("val", "_val"), ("test", "_test")):
        xk, yk = "x" + suffix, "y" + suffix
        if xk not in arrays and yk not in arrays:
            if split == "train":
                raise DataError(f"{source}: no arrays x and y")
            continue
        if xk not in arrays or yk not in arrays:
            raise DataError(f"{source}: {xk} and {yk} come together; only {xk if xk in arrays else yk} is there")
        try:
            x, y = np.asarray(arrays[xk]), np.asarray(arrays[yk])
        except ValueError as e:  # a ragged list from a loader
            raise DataError(f"{source}: {xk}/{yk} are not rectangular arrays: {e}") from None
        if x.dtype == object or x.dtype.kind not in "biuf":
            raise DataError(f"{source}: {xk} holds {x.dtype}, not numbers (a ragged or object array?)")
        if x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
            raise DataError(f"{source}: {xk} must be (n, features...) and {yk} (n,); got {x.shape} and {y.shape}")
        out[split] = Part(x, y, source, functools.partial(where, xk))
    return out


def _read_loader(name: str, path: str | None, params: dict) -> dict[str, Part]:
    ep = loader_entry_points()[name]
    loader = ep.load()
    try:
        arrays = loader(path, **params)
    except TypeError as e:
        raise DataError(f"data loader {name!r} ({ep.value}): bad data_params {sorted(params)}: {e}") from None
    if not isinstance(arrays, Mapping):
        raise DataError(f"data loader {name!r} returned {type(arrays).__name__}, not a mapping of arrays")
    return _from_arrays(arrays, f"data loader {name!r}", lambda key, i: f"data loader {name!r} {key}[{i}]")


# ----------------------------------------------------------------------------- checking
def _features(part: Part, shape: tuple[int, ...] | None) -> np.ndarray:
    x = part.x.astype(np.float32) if part.x.dtype != np.float32 else part.x
    bad = ~np.isfinite(x).reshape(len(x), -1).all(axis=1) if x.size else np.zeros(0, bool)
    if bad.any():
        i = int(np.argmax(bad))
        raise DataError(f"{part.where(i)}: features hold NaN or Inf (or a missing value)")
    if shape is not None and tuple(x.shape[1:]) != shape:
        raise DataError(f"{part.source}: samples shaped {tuple(x.shape[1:])}, other splits {shape}")
    return x


def _labels(part: Part, names: list[str] | None) -> np.ndarray:
    y = part.y
    if names is None:  # regression
        if y.dtype.kind not in "biuf":
            raise DataError(
                f"{part.where(0)}: labels are {y.dtype}, not numbers; without "
                f"learner.classes the node does regression (set learner.classes "
                f"for classification)"
            )
        t = y.astype(np.float32)
        bad = ~np.isfinite(t)
        if bad.any():
            raise DataError(f"{part.where(int(np.argmax(bad)))}: target is NaN or Inf")
        return t
    index = {n: i for i, n in enumerate(names)}
    if y.dtype.kind in "iu":  # integer labels: indices into the agreed class list
        bad = (y < 0) | (y >= len(names))
        if bad.any():
            i = int(np.argmax(bad))
            raise DataError(
                f"{part.where(i)}: label {int(y[i])} is not a class index 0..{len(names) - 1} "
                f"(learner.classes = {names})"
            )
        return y.astype(np.int64)
    if y.dtype.kind in "fb":
        raise DataError(f"{part.where(0)}: labels are {y.dtype}; classes take integer indices or class names")
    values, inverse = np.unique(
        np.asarray([str(v) for v in y], dtype=object) if y.dtype == object else y.astype(str), return_inverse=True
    )  # one lookup per distinct label
    inverse = inverse.reshape(-1)
    mapping = np.asarray([index.get(str(v), -1) for v in values], dtype=np.int64)
    out = mapping[inverse]
    if (out < 0).any():
        i = int(np.argmax(out < 0))  # the first unknown label in file order
        raise DataError(
            f"{part.where(i)}: unknown label {str(y[i])!r}; the network's classes are {names} (learner.classes)"
        )
    return out


def _draw(n: int, cfg: LearnerConfig, missing: list[str]) -> dict[str, np.ndarray]:
    """Seeded disjoint index sets of the train samples for the missing splits; the rest is train."""
    rng = np.random.default_rng([int(cfg.data_seed) & 0xFFFFFFFF, _SALT, int(cfg.node_index)])
    perm = rng.permutation(n)
    out: dict[str, np.ndarray] = {}
    at = 0
    for s in ("test", "val"):
        if s in missing:
            k = int(round((cfg.test_fraction if s == "test" else cfg.val_fraction) * n))
            out[s], at = np.sort(perm[at : at + k]), at + k
    out["train"] = np.sort(perm[at:])
    return out


def load_own_data(cfg: LearnerConfig) -> OwnData:
    """This node's own samples, read, checked, split and labelled (see the module docstring)."""
    names = class_names(cfg.classes)
    path = Path(cfg.data).expanduser().absolute() if cfg.data is not None else None
    fmt = detect_format(path, cfg.data_format)
    if fmt in ("npz", "csv", "parquet", "images"):
        if path is None or not path.exists():
            raise DataError(f"{path}: no such file or folder (learner.data)")
        if fmt == "npz":
            parts = _read_npz(path)
        elif fmt in ("csv", "parquet"):
            parts = _read_tables(path, fmt, cfg.data_label, names is None)
        else:
            if names is None:
                raise DataError(
                    f"{path}: an image folder needs learner.classes (the class names the "
                    f"network agrees on; output i is classes[i])"
                )
            parts = _read_images(path, cfg.data_params)
    else:
        parts = _read_loader(fmt, cfg.data, dict(cfg.data_params))  # as given: a loader's path may be no file
    given = tuple(s for s in SPLITS if s in parts)
    if "all" in parts:
        base = parts.pop("all")
    elif "train" in parts:
        base = parts["train"]
    else:
        raise DataError(f"{path}: no train split (the files give {list(given)} only)")
    missing = [s for s in ("val", "test") if s not in parts]
    parts.update({s: base.take(idx) for s, idx in _draw(len(base), cfg, missing).items()})
    shape = None
    arrays: dict[str, np.ndarray] = {}
    for s in SPLITS:
        part = parts[s]
        fraction = {"val": cfg.val_fraction, "test": cfg.test_fraction}.get(s, 1.0)
        if len(part) == 0 and (s in given or fraction > 0):
            drawn = (
                ""
                if s in given
                else (f" ({len(base)} samples, val_fraction={cfg.val_fraction}, test_fraction={cfg.test_fraction})")
            )
            raise DataError(f"{part.source}: the {s} split is empty{drawn}")
        x = _features(part, shape)
        shape = tuple(x.shape[1:])
        arrays[f"x_{s}"], arrays[f"y_{s}"] = x, _labels(part, names)
    source = (
        f"{fmt}: {path}"
        if fmt in ("npz", "csv", "parquet", "images")
        else f"loader {fmt}" + (f": {cfg.data}" if cfg.data is not None else "")
    )
    return OwnData(
        **arrays,
        input_shape=tuple(x.shape[1:]),  # (== shape: every split was held to it)
        class_names=names,
        source=source,
        given_splits=given,
    )
