"""``coterie predict``: an exported model's answers for a file of inputs, as CSV.

Inputs, in the model's input space (what the node's learner trained on):
  - ``.npz`` with an array ``x`` (n, *input_shape) (or n rows of as many numbers);
  - a ``.csv`` / ``.parquet`` table of numeric feature columns, in the order the model was
    trained on; the label column (``--label-column``, default the model's learner.data_label)
    is ignored if present;
  - a folder of images (png, jpg, ...; searched recursively), or one image file, each converted
    to the model's channels (1: grey, 3: RGB), resized to its H×W and scaled to [0, 1].
Output: one row per input: ``index`` (row number) or ``file`` (an image's path in the folder),
then ``score_<class>`` per class (softmax probabilities) and ``predicted`` (the class name),
or ``value`` for a regression model.

Tables and images are read by the functions training reads them with (node/learning/tables.py,
images.py), so a deployed model sees the numbers and pixels it trained on.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from .learning.tables import TABLE_SUFFIXES, read_features

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
BATCH = 1024


def _images(folder: Path, shape: tuple[int, ...]) -> tuple[np.ndarray, list[str]]:
    """The images of a folder (named by their path in it), or one image file (named by its name)."""
    from .learning.images import load_image

    if len(shape) != 3 or shape[0] not in (1, 3):
        raise ValueError(f"{folder} is an image, but the model's input is {list(shape)} (images need (1 or 3, H, W))")
    if folder.is_file():
        files, folder = [folder], folder.parent
    else:
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"{folder}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))})")
    out = np.empty((len(files), *shape), dtype=np.float32)
    for i, f in enumerate(files):  # preprocessed exactly as the node's training images were
        out[i] = load_image(f, (shape[0], shape[1], shape[2]))
    return out, [str(f.relative_to(folder)) for f in files]


def read_inputs(
    path: str | Path, input_shape: tuple[int, ...], label_column: str = "label"
) -> tuple[np.ndarray, list[str], str]:
    """(x shaped (n, *input_shape), one id per input, the id column's name)."""
    path = Path(path)
    if path.is_dir() or (path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES):
        x, ids = _images(path, input_shape)
        return x, ids, "file"
    suffix = path.suffix.lower()
    if suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            if "x" not in z.files:
                raise ValueError(f"{path}: no array 'x' (it holds {sorted(z.files)})")
            x = np.asarray(z["x"], dtype=np.float32)
    elif suffix in TABLE_SUFFIXES:
        x = read_features(path, TABLE_SUFFIXES[suffix], label_column)
    elif not path.exists():
        raise ValueError(f"{path} does not exist")
    else:
        raise ValueError(f"{path}: unknown input kind {suffix!r} (npz, csv, parquet, an image or a folder of images)")
    want = int(np.prod(input_shape)) if input_shape else None
    if x.ndim == 0 or len(x) == 0:
        raise ValueError(f"{path}: no inputs")
    if tuple(x.shape[1:]) != tuple(input_shape):
        per = int(np.prod(x.shape[1:]))
        if want is None or per != want:
            raise ValueError(
                f"{path}: each input has shape {list(x.shape[1:])} ({per} numbers); the "
                f"model takes {list(input_shape)} ({want} numbers)"
            )
        x = x.reshape(len(x), *input_shape)  # the same numbers in the model's layout (flat rows)
    return x, [str(i) for i in range(len(x))], "index"


def scores(loaded: Any, x: np.ndarray) -> np.ndarray:
    """Softmax probabilities (n, classes), or the regression value (n,)."""
    outs = []
    with torch.no_grad():
        for i in range(0, len(x), BATCH):
            out = loaded.model(torch.from_numpy(np.ascontiguousarray(x[i : i + BATCH])))
            outs.append(out.softmax(1) if loaded.class_names is not None else out.reshape(-1))
    return torch.cat(outs).numpy()


def predict_csv(loaded: Any, inputs: str | Path, out: IO[str], label_column: str | None = None) -> int:
    """Write the predictions for ``inputs`` as CSV to ``out``; returns the number of rows."""
    label = label_column or (loaded.card.get("learner") or {}).get("data_label") or "label"
    x, ids, id_name = read_inputs(inputs, loaded.input_shape, label)
    s = scores(loaded, x)
    w = csv.writer(out, lineterminator="\n")
    names = loaded.class_names
    if names is None:
        w.writerow([id_name, "value"])
        for i, v in zip(ids, s, strict=True):
            w.writerow([i, f"{float(v):.6g}"])
    else:
        w.writerow([id_name, *(f"score_{c}" for c in names), "predicted"])
        for i, row in zip(ids, s, strict=True):
            w.writerow([i, *(f"{float(p):.6f}" for p in row), names[int(row.argmax())]])
    return len(ids)
