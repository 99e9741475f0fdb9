"""In-process networks of real learners for the paper reproductions.

Every node is a real ``TorchLearner`` on its shard of a real partition (the same code a daemon
runs), with its strategy; the peer calls go through the strategy test harness's in-process network
(``tests/strategy_harness.py``: direct calls, msgpack round trips for gossip, ``pull`` with
``min_round``/``wait_s``), not gRPC. Rounds run either behind a global barrier (``synchronous``:
every node sees everyone's previous round, as the papers' synchronous algorithms assume) or one
node after the other. One process: CPU only, one torch thread.

``Run`` records per round the weight matrix, each node's test metrics and the strategies'
``public_state``; ``write`` puts the full config next to the results.
"""

from __future__ import annotations

import asyncio
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the in-process network lives with the strategy tests

from strategy_harness import Hub, InProcessNetwork, Node, run_rounds  # noqa: E402

from coterie.node.learning.config import LearnerConfig  # noqa: E402
from coterie.node.learning.datasets import load_pool  # noqa: E402
from coterie.node.learning.partition import partition, true_clusters  # noqa: E402
from coterie.node.learning.torch_learner import TorchLearner  # noqa: E402
from coterie.node.strategies.registry import get_strategy  # noqa: E402

RESULTS = ROOT / "bench" / "results"
torch.set_num_threads(1)


def build(
    strategy: str, params: dict[str, Any] | None, learner: dict[str, Any], nodes: int, seed: int, own_init: bool = False
) -> Hub:
    """A hub of ``nodes`` real learners (node i: ``learner`` with node_index i, data/init seed
    ``seed``; ``own_init``: init seed ``seed + i``, each node its own θ⁰), each with its
    ``strategy``; every node has published its θ⁰ (round 0)."""
    hub = Hub()
    base = LearnerConfig(**{**learner, "num_nodes": nodes, "data_seed": seed, "init_seed": seed, "device": "cpu"})
    pool = load_pool(base.dataset, base.dataset_params, base.data_seed)
    shards = partition(pool, base)
    from coterie.node.learning.partition import node_data

    for i in range(nodes):
        cfg = base.model_copy(update={"node_index": i, **({"init_seed": seed + i} if own_init else {})})
        lrn = TorchLearner(cfg, pool=pool, data=node_data(pool, cfg, shards))
        hub.nodes[f"n{i}"] = Node(f"n{i}", int(shards[i].cluster), lrn)
    cls = get_strategy(strategy)
    for i, (nid, node) in enumerate(hub.nodes.items()):
        node.strategy = cls(nid, node.learner, InProcessNetwork(hub, nid), params, seed=seed + i)
        hub.publish(nid, 0)
    return hub


def weight_matrix(hub: Hub) -> np.ndarray:
    ids = list(hub.nodes)
    W = np.zeros((len(ids), len(ids)))
    for i, nid in enumerate(ids):
        w = hub.nodes[nid].strategy.weights()
        for j, m in enumerate(ids):
            W[i, j] = float(w.get(m, 0.0))
    return W


def in_cluster_mass(W: np.ndarray, clusters: list[int]) -> float:
    """Mean over nodes of the share of their peer weight on true-cluster peers."""
    c = np.asarray(clusters)
    off = ~np.eye(len(c), dtype=bool)
    same = (c[:, None] == c[None, :]) & off
    peer = (W * off).sum(1)
    ok = peer > 0
    return float(np.mean((W * same).sum(1)[ok] / peer[ok])) if ok.any() else float("nan")


@dataclass
class Run:
    name: str
    config: dict[str, Any]
    rounds: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    claims: list[dict[str, str]] = field(default_factory=list)  # {"paper": ..., "we": ...}
    wall_s: float = 0.0

    def claim(self, paper: str, we: str) -> None:
        self.claims.append({"paper": paper, "we": we})
        print(f"  paper says: {paper}\n  we get:     {we}", flush=True)

    def write(self) -> Path:
        # seed 0 keeps the plain name (the page's worked example); other seeds sit beside it
        seed = self.config.get("seed", 0)
        suffix = "" if not seed or self.name.endswith(f"_s{seed}") else f"_s{seed}"
        path = RESULTS / f"papers_{self.name}{suffix}.json"
        path.write_text(
            json.dumps(
                {
                    "name": self.name,
                    "config": self.config,
                    "summary": self.summary,
                    "claims": self.claims,
                    "rounds": self.rounds,
                    "wall_s": self.wall_s,
                    "machine": platform.platform(),
                    "torch": torch.__version__,
                },
                indent=1,
                default=float,
            )
        )
        return path


def record(hub: Hub, rnd: int, metric: str = "test_acc", state: Callable[[Any], Any] | None = None) -> dict:
    evals = {nid: n.strategy.evaluate() for nid, n in hub.nodes.items()}
    out = {
        "round": rnd,
        "W": weight_matrix(hub).round(5).tolist(),
        metric: {nid: e.get(metric, e.get("test_loss")) for nid, e in evals.items()},
    }
    if state is not None:
        out["state"] = {nid: state(n.strategy) for nid, n in hub.nodes.items()}
    return out


def drive(
    hub: Hub,
    rounds: int,
    synchronous: bool = True,
    every: int = 1,
    metric: str = "test_acc",
    state: Callable[[Any], Any] | None = None,
    start: int = 1,
) -> list[dict]:
    """Run ``rounds`` rounds, recording after every ``every``-th one (and the last)."""
    out = []
    for r in range(start, start + rounds):
        asyncio.run(run_rounds(hub, 1, start=r, synchronous=synchronous))
        if (r - start + 1) % every == 0 or r == start + rounds - 1:
            out.append(record(hub, r, metric, state))
    return out


def clusters_of(learner: dict[str, Any], nodes: int, seed: int) -> list[int]:
    return true_clusters(LearnerConfig(**{**learner, "num_nodes": nodes, "data_seed": seed}))


def timer() -> Callable[[], float]:
    t0 = time.time()
    return lambda: time.time() - t0
