"""Tables (CSV, Parquet) as samples: numeric feature columns and one label column, read with
pyarrow. Every problem is a ``DataError`` naming the file (and the line or row).

A CSV's data row ``i`` (0-based) is reported as its line in the file (``line i + 2``: the header
is line 1); a Parquet row as ``row i + 1``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .samples import DataError, Part

TABLE_SUFFIXES = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}


def read_table(path: Path, fmt: str, label: str, regression: bool) -> Part:
    """The file's features (float32, one row per sample) and labels (text for classification,
    float for regression)."""
    import pyarrow as pa

    table, where = _open(path, fmt)
    if label not in table.column_names:
        raise DataError(
            f"{path}: no label column {label!r} (columns: {table.column_names}); learner.data_label names it"
        )
    x = _features(table, path, label, where)
    ycol = table.column(label)
    if ycol.null_count:
        i = next(i for i, v in enumerate(ycol.to_pylist()) if v is None)
        raise DataError(f"{where(i)}: no label (column {label!r} is empty there)")
    if regression:
        if not (pa.types.is_integer(ycol.type) or pa.types.is_floating(ycol.type)):
            raise DataError(
                f"{path}: label column {label!r} is {ycol.type}: regression (no learner.classes) needs numbers"
            )
        y = ycol.to_numpy(zero_copy_only=False).astype(np.float32)
    else:  # class names: the column's values as text, matched against learner.classes
        y = np.asarray([_text(v) for v in ycol.to_pylist()], dtype=object)
    return Part(x, y, str(path), where)


def read_features(path: Path, fmt: str, label: str) -> np.ndarray:
    """A table's feature columns (float32 rows) for prediction: the label column is skipped
    if present, never required. Read, and refused, exactly as training reads its tables."""
    table, where = _open(path, fmt)
    x = _features(table, path, label, where)
    bad = ~np.isfinite(x).all(axis=1)
    if bad.any():  # as training refuses them (own_data): a prediction of NaN helps nobody
        raise DataError(f"{where(int(np.argmax(bad)))}: features hold NaN or Inf (or a missing value)")
    return x.astype(np.float32)


def _open(path: Path, fmt: str):
    import pyarrow as pa

    try:
        if fmt == "csv":
            import pyarrow.csv as pcsv

            table = pcsv.read_csv(path)
        else:
            import pyarrow.parquet as pq

            table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:  # ragged rows, a truncated or foreign file
        raise DataError(f"{path}: cannot read it as {fmt}: {str(e).strip().splitlines()[0]}") from None
    where = (lambda i: f"{path} line {i + 2}") if fmt == "csv" else (lambda i: f"{path} row {i + 1}")
    return table, where


def _features(table, path: Path, label: str, where) -> np.ndarray:
    import pyarrow as pa

    features = [c for c in table.column_names if c != label]
    if not features:
        raise DataError(f"{path}: no feature columns besides the label column {label!r}")
    if table.num_rows == 0:
        raise DataError(f"{path}: no rows")
    cols = []
    for name in features:
        col = table.column(name)
        t = col.type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t)):
            # a text column's cells are all str: the first that does not read as a number
            bad = next((i for i, v in enumerate(col.to_pylist()) if v is not None and not _is_number(v)), 0)
            raise DataError(
                f"{path}: feature column {name!r} is not numeric ({t}; first "
                f"non-number at {where(bad).removeprefix(str(path) + ' ')})"
            )
        cols.append(col.to_numpy(zero_copy_only=False).astype(np.float64))  # nulls become NaN
    return np.stack(cols, axis=1)


def _is_number(v) -> bool:
    if isinstance(v, (int, float, bool)):
        return True
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


def _text(v) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))  # 3.0 in a float column names class "3"
    return str(v)
