"""An image folder as samples: ``<folder>/<class name>/*.png|*.jpg|*.jpeg`` read with Pillow.

Every image is converted and resized to one input shape ``(C, H, W)``, pixel values scaled to
[0, 1]: ``data_params.image_size`` ([C, H, W], C = 1 grey or 3 RGB) when given, else the first
image's (in sorted path order: grey images give C = 1, any other mode C = 3). The class of an
image is the name of its folder; which output that is, is ``learner.classes`` (never the folder
order). A file that is not a readable image (truncated, not an image) is a ``DataError`` naming it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .samples import DataError, Part

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def image_files(folder: Path) -> list[tuple[str, Path]]:
    """(class folder name, file) for every image one level below ``folder``, sorted."""
    out = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        for f in sorted(sub.iterdir()):
            if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES:
                out.append((sub.name, f))
    return out


def has_images(folder: Path) -> bool:
    return folder.is_dir() and any(
        f.suffix.lower() in IMAGE_SUFFIXES for sub in folder.iterdir() if sub.is_dir() for f in sub.iterdir()
    )


def image_shape(files: list[Path], params: dict) -> tuple[int, int, int]:
    """The input shape every image is brought to (see the module docstring)."""
    if "image_size" in params:
        size = params["image_size"]
        if (
            not isinstance(size, (list, tuple))
            or len(size) != 3
            or int(size[0]) not in (1, 3)
            or any(int(s) < 1 for s in size)
        ):
            raise DataError(f"data_params.image_size must be [C, H, W] with C 1 or 3, got {size!r}")
        return int(size[0]), int(size[1]), int(size[2])
    first = files[0]
    with _open(first) as im:
        return (1 if im.mode in ("1", "L", "I", "I;16", "F") else 3), im.height, im.width


def read_images(folder: Path, shape: tuple[int, int, int]) -> Part:
    """Every image under ``folder`` (one level of class folders) as (n, C, H, W) float32."""

    files = image_files(folder)
    if not files:
        raise DataError(f"{folder}: no images (expected {folder}/<class name>/*.png or *.jpg)")
    x = np.empty((len(files), *shape), dtype=np.float32)
    for i, (_, f) in enumerate(files):
        x[i] = load_image(f, shape)
    labels = np.asarray([name for name, _ in files], dtype=object)
    return Part(x, labels, str(folder), lambda i: str(files[i][1]))


def load_image(path: Path, shape: tuple[int, int, int]) -> np.ndarray:
    """One image as the network sees it, in training and in ``coterie predict`` alike: grey (C=1)
    or RGB (C=3), resized bilinearly to H×W when it differs, (C, H, W) float32 in [0, 1]."""
    from PIL import Image

    c, h, w = shape
    with _open(path) as im:
        try:
            im = im.convert("L" if c == 1 else "RGB")
            if im.size != (w, h):
                im = im.resize((w, h), Image.Resampling.BILINEAR)
            a = np.asarray(im, dtype=np.float32) / 255.0
        except (OSError, ValueError) as e:  # truncated pixel data surfaces at decode time
            raise DataError(f"{path}: not a readable image: {e}") from None
    return a[None] if c == 1 else a.transpose(2, 0, 1)


def _open(path: Path):
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(path)
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"{path}: not a readable image: {e}") from None
