import itertools
import math

from coterie.node.clusters import block_order, diagonal, in_block_mass, off_diagonal


def _matrix(truth, own=0.6, same=0.15, other=0.01):
    return [
        [own if i == j else (same if ci == cj else other) for j, cj in enumerate(truth)] for i, ci in enumerate(truth)
    ]


def test_block_order_groups_interleaved_clusters():
    truth = [0, 1, 0, 1, 0, 1, 2, 2]
    order = block_order(_matrix(truth))
    seq = [truth[i] for i in order]
    # each cluster is one contiguous run, whatever the node ids
    assert sum(1 for a, b in itertools.pairwise(seq) if a != b) == 2 and sorted(order) == list(range(8))


def test_diagonal_apart_and_block_mass():
    m = _matrix([0, 0, 1])
    off = off_diagonal(m)
    assert all(math.isnan(off[i, i]) for i in range(3)) and off[0, 1] == 0.15
    assert diagonal(m) == [0.6, 0.6, 0.6]
    assert in_block_mass(m, [0, 0, 1]) == (0.15 * 2) / (0.15 * 2 + 0.01 * 4)
    assert block_order([[1.0, 0.0], [0.0, 1.0]]) == [0, 1]
    assert block_order(_matrix([0, 0, 0], same=0.2, other=0.2)) == [0, 1, 2]  # nothing to find
