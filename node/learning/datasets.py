"""Data pools: the whole dataset every node derives its own shard from (see ``partition``).

Everything is generated procedurally or read from local files; nothing is ever downloaded.
A pool is a pure function of ``(name, params, seed)``, so every node computes the same pool
alone. Generated pools are generated once per machine: kept on disk (``cache_dir()``) as plain
``.npy`` files and memory-mapped read-only, so the daemons of a machine share one copy in the
page cache and each touches only its own rows (``partition.node_data`` copies just the node's
shard). In-process they are cached too (many nodes of one process share one pool); their arrays
are read-only so a consumer cannot corrupt the cache. The generators' libraries (mnist1d, which
brings matplotlib, scipy, PIL and requests; scikit-learn for ``digits``) are imported only to
generate, and where the pool is cached on disk in a child process that writes the cache and
exits: a daemon that imported them would hold their ~74 MB (mnist1d) for its whole life, though
it needs them once (issue 34 item 2; bench/results/memory.md).

Datasets and their ``dataset_params``:

- ``mnist1d``: the procedural MNIST-1D generator (never the download). ``num_samples``
  (default 4000); any other key of ``mnist1d.data.get_dataset_args`` (except ``url``/``seed``)
  is passed through. Train and test are merged into one pool; inputs shape ``(40,)``.
- ``digits``: scikit-learn's bundled 8×8 digits (1797 samples), shape ``(1, 8, 8)`` in [0, 1].
- ``sine``: FedeRiCo Fig. 1 regression, ``x ~ U(x_range)``, ``y = sin(x) + N(0, noise²)``.
  ``num_samples`` (2000), ``x_range`` ([-π, π]: centred, so plain SGD on a
  linear model stays stable), ``noise`` (0.1). Inputs shape ``(1,)``.
- ``gaussian``: Gaussian clusters, one per class. ``num_samples`` (4000), ``dim`` (10),
  ``num_classes`` (4), ``separation`` (3.0: std of the class means), ``cluster_std`` (1.0).
- ``cifar10`` / ``cifar100``: the standard *binary* releases in ``data_dir`` (the folder
  ``cifar-10-batches-bin`` / ``cifar-100-binary`` itself or its parent). Train and test are
  merged; inputs ``(3, 32, 32)`` in [0, 1]. ``cifar100`` takes ``label`` = ``"fine"`` (100
  classes, default) or ``"coarse"`` (20). ``max_samples`` keeps only the first N records.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import os
import random
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..fsutil import atomic_write_bytes

DATASETS = ("mnist1d", "digits", "sine", "gaussian", "cifar10", "cifar100")


@dataclass(frozen=True)
class Pool:
    x: np.ndarray  # float32, (N, *input_shape)
    y: np.ndarray  # int64 class labels (classification) or float32 targets (regression)
    num_classes: int  # 0 for regression
    input_shape: tuple[int, ...]
    task: Literal["classification", "regression"]
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. x_range for "sine"

    def __len__(self) -> int:
        return len(self.y)


def dataset_num_classes(name: str, params: dict | None = None) -> int:
    """Number of classes of a dataset without loading it (0 for regression)."""
    params = params or {}
    if name in ("mnist1d", "digits", "cifar10"):
        return 10
    if name == "cifar100":
        return 20 if _cifar100_label(params) == "coarse" else 100
    if name == "gaussian":
        return int(params.get("num_classes", 4))
    if name == "sine":
        return 0
    raise ValueError(f"unknown dataset {name!r}; available: {', '.join(DATASETS)}")


def load_pool(name: str, params: dict | None = None, seed: int = 0) -> Pool:
    params = dict(params or {})
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(DATASETS)}")
    if name in ("cifar10", "cifar100"):
        # Not cached: a float32 CIFAR pool is ~0.7 GB and every daemon only keeps its shard.
        return _load_cifar(name, params)
    key = json.dumps(params, sort_keys=True, default=str)
    return _cached_pool(name, key, int(seed))


def cache_dir() -> Path | None:
    """Where generated pools are kept between processes (COTERIE_CACHE_DIR; "off" disables).
    Every daemon of a network regenerates the same pool otherwise: seconds of CPU each."""
    raw = os.environ.get("COTERIE_CACHE_DIR")
    if raw == "off":
        return None
    return Path(raw) if raw else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "coterie"


_CACHE_FORMAT = "v2"  # x.npy + y.npy, memory-mapped; the .json written last commits them


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def _cache_paths(name: str, params_key: str, seed: int) -> tuple[Path, Path] | None:
    directory = cache_dir()
    if directory is None:
        return None
    digest = hashlib.sha256(f"{name}|{params_key}|{seed}|{_CACHE_FORMAT}".encode()).hexdigest()[:24]
    base = directory / f"pool-{name}-{digest}"
    return base, base.with_suffix(".json")


def _disk_cached(name: str, params_key: str, seed: int, make) -> Pool:
    """The pool from the machine's cache, memory-mapped read-only; generated (and cached) once."""
    paths = _cache_paths(name, params_key, seed)
    if paths is None:
        return make()
    base, committed = paths
    pool = _read_cached(base, committed)
    if pool is not None:
        return pool
    if name in _GENERATED_APART and _generate_in_child(name, params_key, seed):
        pool = _read_cached(base, committed)
        if pool is not None:
            return pool
    pool = make()  # no child (or it failed): generate here, the libraries stay loaded
    if not _store(base, committed, pool):
        return pool  # a read-only home only costs the regeneration
    return _read_cached(base, committed) or pool  # the mapped copy: the generated one can go


# generators whose libraries cost a daemon tens of MB resident if imported in it
_GENERATED_APART = frozenset({"mnist1d", "digits"})


def _generate_in_child(name: str, params_key: str, seed: int) -> bool:
    """Generate and cache the pool in a fresh interpreter; True when it did."""
    code = "import sys; from coterie.node.learning.datasets import _generate_and_store as g; g(*sys.argv[1:])"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, name, params_key, str(seed)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=600,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _generate_and_store(name: str, params_key: str, seed: str) -> None:
    """The child's side of ``_generate_in_child``: exits non-zero unless the cache was written."""
    s = int(seed)
    pool = _GENERATORS[name](json.loads(params_key), s)
    paths = _cache_paths(name, params_key, s)
    if paths is None or not _store(*paths, pool):
        raise SystemExit(1)


def _store(base: Path, committed: Path, pool: Pool) -> bool:
    try:
        atomic_write_bytes(f"{base}.x.npy", _npy(pool.x))
        atomic_write_bytes(f"{base}.y.npy", _npy(pool.y))
        atomic_write_bytes(
            committed,
            json.dumps(
                {
                    "n": len(pool.y),
                    "num_classes": pool.num_classes,
                    "input_shape": list(pool.input_shape),
                    "task": pool.task,
                    "meta": pool.meta,
                }
            ).encode(),
        )
    except OSError:
        return False
    return True


def _read_cached(base: Path, committed: Path) -> Pool | None:
    try:
        info = json.loads(committed.read_text())
        x = np.load(f"{base}.x.npy", mmap_mode="r", allow_pickle=False)  # plain arrays only, never objects
        y = np.load(f"{base}.y.npy", mmap_mode="r", allow_pickle=False)
        n, shape = int(info["n"]), tuple(int(v) for v in info["input_shape"])
        if (
            len(x) != n
            or len(y) != n
            or tuple(x.shape[1:]) != shape
            or info["task"] not in ("classification", "regression")
        ):
            return None
        meta = {k: tuple(v) if isinstance(v, list) else v for k, v in dict(info.get("meta") or {}).items()}
        return Pool(x, y, int(info["num_classes"]), shape, info["task"], meta)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent, torn or foreign: regenerate and replace it


@functools.lru_cache(maxsize=16)
def _cached_pool(name: str, params_key: str, seed: int) -> Pool:
    params = json.loads(params_key)
    make = functools.partial(_GENERATORS[name], params, seed)
    pool = _disk_cached(name, params_key, seed, make)
    pool.x.setflags(write=False)
    pool.y.setflags(write=False)
    return pool


def _check_keys(name: str, params: dict, allowed: set[str]) -> None:
    unknown = set(params) - allowed
    if unknown:
        raise ValueError(f"dataset {name!r}: unknown dataset_params {sorted(unknown)}; allowed: {sorted(allowed)}")


_MNIST1D_LOCK = threading.Lock()  # the generator reseeds the global random/np.random state


def _mnist1d(params: dict, seed: int) -> Pool:
    from mnist1d.data import get_dataset_args, make_dataset

    _check_keys("mnist1d", params, set(get_dataset_args(as_dict=True)) - {"url", "seed"})
    args = get_dataset_args()
    args.num_samples = int(params.get("num_samples", 4000))
    for k, v in params.items():
        if k != "num_samples":
            setattr(args, k, v)
    args.seed = seed
    with _MNIST1D_LOCK:
        py_state, np_state = random.getstate(), np.random.get_state()
        try:
            d = make_dataset(args)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
    x = np.concatenate([d["x"], d["x_test"]]).astype(np.float32)
    y = np.concatenate([d["y"], d["y_test"]]).astype(np.int64)
    return Pool(x, y, 10, tuple(x.shape[1:]), "classification")


def _digits(params: dict, seed: int) -> Pool:
    from sklearn.datasets import load_digits

    _check_keys("digits", params, set())
    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = d.target.astype(np.int64)
    return Pool(x, y, 10, (1, 8, 8), "classification")


def _sine(params: dict, seed: int) -> Pool:
    _check_keys("sine", params, {"num_samples", "x_range", "noise"})
    n = int(params.get("num_samples", 2000))
    lo, hi = (float(v) for v in params.get("x_range", [-math.pi, math.pi]))
    if not hi > lo:
        raise ValueError(f"sine: x_range must be [lo, hi] with hi > lo, got {[lo, hi]}")
    noise = float(params.get("noise", 0.1))
    rng = np.random.default_rng([seed, 0x5111E])
    x = rng.uniform(lo, hi, size=n)
    y = np.sin(x) + noise * rng.standard_normal(n)
    return Pool(x.astype(np.float32).reshape(-1, 1), y.astype(np.float32), 0, (1,), "regression", {"x_range": (lo, hi)})


def _gaussian(params: dict, seed: int) -> Pool:
    _check_keys("gaussian", params, {"num_samples", "dim", "num_classes", "separation", "cluster_std"})
    n = int(params.get("num_samples", 4000))
    dim = int(params.get("dim", 10))
    c = int(params.get("num_classes", 4))
    if c < 2 or dim < 1:
        raise ValueError(f"gaussian: need num_classes >= 2 and dim >= 1, got {c}, {dim}")
    rng = np.random.default_rng([seed, 0x6A055])
    means = rng.standard_normal((c, dim)) * float(params.get("separation", 3.0))
    y = np.arange(n) % c  # balanced classes
    rng.shuffle(y)
    x = means[y] + float(params.get("cluster_std", 1.0)) * rng.standard_normal((n, dim))
    return Pool(x.astype(np.float32), y.astype(np.int64), c, (dim,), "classification")


_GENERATORS = {"mnist1d": _mnist1d, "digits": _digits, "sine": _sine, "gaussian": _gaussian}


# ----------------------------------------------------------------------------- CIFAR (binary)

_CIFAR10_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
_CIFAR100_FILES = ["train.bin", "test.bin"]
_IMG = 3 * 32 * 32


def _cifar100_label(params: dict) -> str:
    label = params.get("label", "fine")
    if label not in ("fine", "coarse"):
        raise ValueError(f"cifar100: label must be 'fine' or 'coarse', got {label!r}")
    return label


def _cifar_dir(name: str, params: dict) -> Path:
    if "data_dir" not in params:
        raise ValueError(
            f"dataset {name!r} needs dataset_params.data_dir (a local folder with the "
            f"binary release; nothing is downloaded)"
        )
    base = Path(params["data_dir"]).expanduser()
    sub = "cifar-10-batches-bin" if name == "cifar10" else "cifar-100-binary"
    first = (_CIFAR10_FILES if name == "cifar10" else _CIFAR100_FILES)[0]
    if not (base / first).exists() and (base / sub / first).exists():
        return base / sub
    return base


def _load_cifar(name: str, params: dict) -> Pool:
    _check_keys(name, params, {"data_dir", "max_samples"} | ({"label"} if name == "cifar100" else set()))
    folder = _cifar_dir(name, params)
    if name == "cifar10":
        files, label_bytes, label_off, num_classes = _CIFAR10_FILES, 1, 0, 10
    else:
        coarse = _cifar100_label(params) == "coarse"
        files, label_bytes, label_off = _CIFAR100_FILES, 2, (0 if coarse else 1)
        num_classes = 20 if coarse else 100
    rec = label_bytes + _IMG
    xs, ys = [], []
    for fname in files:
        path = folder / fname
        if not path.is_file():
            raise FileNotFoundError(
                f"{name}: missing {path} (expected the binary release files {', '.join(files)} in {folder})"
            )
        raw = np.fromfile(path, dtype=np.uint8)
        if raw.size == 0 or raw.size % rec:
            raise ValueError(
                f"{name}: {path} is not a CIFAR binary file "
                f"(size {raw.size} is not a multiple of the {rec}-byte record)"
            )
        raw = raw.reshape(-1, rec)
        ys.append(raw[:, label_off].astype(np.int64))
        xs.append(raw[:, label_bytes:])
    y = np.concatenate(ys)
    if y.max() >= num_classes:
        raise ValueError(f"{name}: label {int(y.max())} out of range in {folder}")
    xb = np.concatenate(xs)
    if "max_samples" in params:
        m = int(params["max_samples"])
        xb, y = xb[:m], y[:m]
    x = (xb.astype(np.float32) / 255.0).reshape(-1, 3, 32, 32)
    return Pool(x, y, num_classes, (3, 32, 32), "classification")
