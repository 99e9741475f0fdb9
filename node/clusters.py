"""Seeing the coterie: the collaborator-weight matrix without its diagonal, rows and columns
ordered so that nodes which weight each other show as blocks.

Self-weights are usually the largest entries (a node trusts its own model most); drawn on one
colour scale with the rest they wash the cluster structure out, so views show them apart and
scale the peers' weights on their own. The order comes from average-linkage clustering of the
symmetrised peer weights (scipy, optimal leaf ordering), which puts mutually weighting nodes next
to each other whatever their ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Matrix = Sequence[Sequence[float] | None]


def as_array(matrix: Matrix) -> np.ndarray:
    """Rows of None (a node that reported nothing) become NaN rows."""
    n = len(matrix)
    return np.array(
        [[math.nan] * n if row is None else [float(v) for v in row] for row in matrix], dtype=float
    ).reshape(n, n)


def off_diagonal(matrix: Matrix) -> np.ndarray:
    """The matrix with NaN on the diagonal (and for unknown rows)."""
    a = as_array(matrix)
    np.fill_diagonal(a, math.nan)
    return a


def diagonal(matrix: Matrix) -> list[float | None]:
    a = as_array(matrix)
    return [None if math.isnan(v) else float(v) for v in np.diag(a)]


def block_order(matrix: Matrix) -> list[int]:
    """A permutation of the nodes that puts clusters of mutually weighting nodes together."""
    n = len(matrix)
    if n <= 2:
        return list(range(n))
    from scipy.cluster.hierarchy import leaves_list, linkage
    from scipy.spatial.distance import squareform

    a = np.nan_to_num(off_diagonal(matrix), nan=0.0)
    off = a[~np.eye(n, dtype=bool)]
    if off.max() - off.min() < 1e-12:  # no structure to show: keep the nodes' own order
        return list(range(n))
    a = a / a.max() if a.max() > 0 else a
    affinity = (a + a.T) / 2  # i and j belong together when either weights the other
    dist = 1.0 - affinity
    np.fill_diagonal(dist, 0.0)
    z = linkage(squareform(dist, checks=False), method="average", optimal_ordering=True)
    return [int(i) for i in leaves_list(z)]


def in_block_mass(matrix: Matrix, clusters: Sequence[object]) -> float | None:
    """Share of the peers' weight (diagonal excluded) that stays inside the true clusters."""
    a = np.nan_to_num(off_diagonal(matrix), nan=0.0)
    total = a.sum()
    if total <= 0:
        return None
    same = np.array([[ci == cj for cj in clusters] for ci in clusters])
    return float(a[same].sum() / total)
