"""The distance between two models (FedFomo's ‖θ_n − θ_base‖, eq. 3): the values of the
whole-tensor formula, without its model-sized temporaries, and off the event loop. Before, each
distance made the difference (1 model), its float64 copy (2) and that copy's absolute value (2)
on the event loop: for the 21 MB MLP ~50 ms and ~100 MB of temporaries per pulled model."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import coterie.node.strategies.fedfomo as fomo
from coterie.node.strategies import common as C
from coterie.node.strategies.fedfomo import FedFomo
from tests.peak_probe import run_peak_probe
from tests.strategy_harness import build_network, run_rounds

torch.set_num_threads(1)


@pytest.mark.parametrize("kind", ["l1", "l2"])
def test_distance_is_the_whole_tensor_formula_across_chunks(monkeypatch, kind):
    monkeypatch.setattr(C, "DISTANCE_CHUNK", 1000)  # tensors of several chunks and a partial one
    g = torch.Generator().manual_seed(3)
    shapes = {"w": (5, 501), "b": (7,), "c": (3, 3, 999)}
    a = {k: torch.randn(s, generator=g) * 1e3 for k, s in shapes.items()}
    b = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    whole = C.l1_norm(C.sub(a, b)) if kind == "l1" else C.l2_norm(C.sub(a, b))
    assert C.distance(a, b, kind) == pytest.approx(whole, rel=1e-12)
    assert C.distance(a, a, kind) == 0.0
    with pytest.raises(ValueError, match="unknown kind 'l3'"):
        C.distance(a, b, "l3")


_PEAK = """
import sys, torch
from coterie.node.strategies import common as C

n = 25_000_003  # 100 MB of float32
a, b = {"w": torch.randn(n)}, {"w": torch.randn(n)}
C.distance(a, b, sys.argv[1])  # warm up
print(peak_over(lambda: C.distance(a, b, sys.argv[1])) / (4 * n))
"""


@pytest.mark.parametrize("kind", ["l1", "l2"])
def test_a_distance_makes_no_model_sized_temporary(kind):
    """Peak RSS over one distance, in model sizes, in a fresh interpreter (buffers this large are
    mapped and given back when freed). The whole-tensor formula: 3 and more; now a chunk's 8 MB."""
    peak = float(run_peak_probe(_PEAK, kind))
    assert peak <= 0.25, f"{kind}: peak {peak:.2f} model sizes over a distance"


def test_fedfomo_measures_and_combines_off_the_event_loop(monkeypatch):
    """The distances and the float64 combination run in a worker thread, as the evaluation does:
    the event loop keeps answering peers while a node weighs large models. Before: both on it."""
    calls: list[tuple[str, bool]] = []

    def watched(name, fn):
        def call(*a, **kw):
            calls.append((name, threading.current_thread() is threading.main_thread()))
            return fn(*a, **kw)

        return call

    monkeypatch.setattr(C, "distance", watched("distance", C.distance))
    monkeypatch.setattr(fomo, "fomo_update", watched("fomo_update", fomo.fomo_update))
    hub = build_network(FedFomo, num_nodes=3, num_clusters=1)
    asyncio.run(run_rounds(hub, 2))
    assert {name for name, _ in calls} == {"distance", "fomo_update"}
    assert [name for name, on_loop in calls if on_loop] == []
