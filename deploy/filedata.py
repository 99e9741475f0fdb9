"""The files the testbed's `files` profile learns from (service `filedata` in docker-compose.yml).

Two sensor devices mounted alike (the same task: 12 readings, the classes idle/walk/run/fall),
their readings generated deterministically by the example package's loader
(examples/coterie-example, `coterie_example.data.load_sensors`) and written in two of the formats
a node reads (docs/own-data.md):

  OUT/filea.npz           x, y (class indices), x_val, y_val, x_test, y_test   -> node filea
  OUT/fileb/{train,val,test}.csv   f0..f11 and `label` (class names)           -> node fileb
  OUT/predict/filea-test.csv       filea's test split as a table, for `coterie predict`

Written into a temporary folder and renamed into place, so a node never sees half the files; a
second run keeps what is there.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from coterie_example.data import load_sensors

CLASSES = ["idle", "walk", "run", "fall"]
DEVICES = {  # same mounting and prototypes (one cluster), own noise and seed
    "filea": {
        "classes": CLASSES,
        "features": 12,
        "mounting": 0,
        "noise": 2.0,
        "seed": 21,
        "samples": {"train": 256, "val": 128, "test": 256},
    },
    "fileb": {
        "classes": CLASSES,
        "features": 12,
        "mounting": 0,
        "noise": 2.0,
        "seed": 22,
        "samples": {"train": 256, "val": 128, "test": 256},
    },
}


def write_csv(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([f"f{i}" for i in range(x.shape[1])] + ["label"])
        for row, label in zip(x.tolist(), y.tolist(), strict=True):
            w.writerow([f"{v:.6g}" for v in row] + [label])


def main(out: Path) -> None:
    if (out / "predict").is_dir():
        print(f"filedata: {out} already holds the files", file=sys.stderr)
        return
    tmp = out / ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "devices").mkdir(parents=True)
    data = {}
    for name, spec in DEVICES.items():
        p = tmp / "devices" / f"{name}.json"
        p.write_text(json.dumps(spec))
        data[name] = load_sensors(str(p))
    a = data["filea"]
    idx = {c: i for i, c in enumerate(CLASSES)}
    np.savez(
        tmp / "filea.npz",
        **{k: (np.array([idx[c] for c in v], dtype=np.int64) if k.startswith("y") else v) for k, v in a.items()},
    )
    (tmp / "fileb").mkdir()
    b = data["fileb"]
    for split, (xk, yk) in {"train": ("x", "y"), "val": ("x_val", "y_val"), "test": ("x_test", "y_test")}.items():
        write_csv(tmp / "fileb" / f"{split}.csv", b[xk], b[yk])
    (tmp / "predict").mkdir()
    write_csv(tmp / "predict" / "filea-test.csv", a["x_test"], a["y_test"])
    for entry in sorted(tmp.iterdir()):  # the marker (predict/) goes last
        if entry.name != "predict":
            entry.rename(out / entry.name)
    (tmp / "predict").rename(out / "predict")
    tmp.rmdir()
    print(f"filedata: wrote filea.npz, fileb/*.csv, predict/ into {out}", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/data"))
