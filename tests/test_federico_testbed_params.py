"""FedeRiCo with the container testbed's parameters (read from docker-compose.yml, so the two
cannot drift apart) collaborates: every node puts more weight on its same-cluster peers than
uniform weights would. The docker testbed takes 10+ minutes; this runs the same strategy
parameters, dataset, partition, model and optimiser on the in-process backend (real daemons,
real TorchLearners) with fewer nodes, samples and rounds.

Before the fix the own model's loss was Alg. 1's constant prior ℓ_ii = 0: at the testbed's
temperature 0.2 a same-cluster peer with validation loss ~1.2 got exp(−6) of the own weight,
w_ii ≈ 0.99, and this test failed (same-cluster weight ~0.003 against chance 1/6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from coterie.lab.launch import run_scenario
from coterie.lab.scenario import parse_scenario

ROOT = Path(__file__).resolve().parents[1]


def compose_env() -> dict[str, str]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["x-learner-env"]


def compose_scenario(nodes: int, rounds: int, samples: int) -> dict:
    env = compose_env()
    assert env["COTERIE_STRATEGY"].endswith(":-federico}")  # the testbed's default strategy
    learner = {
        "dataset": env["COTERIE_LEARNER__DATASET"],
        "dataset_params": {**json.loads(env["COTERIE_LEARNER__DATASET_PARAMS"]), "num_samples": samples},
        "partition": env["COTERIE_LEARNER__PARTITION"],
        "partition_params": json.loads(env["COTERIE_LEARNER__PARTITION_PARAMS"]),
        "model": env["COTERIE_LEARNER__MODEL"],
        "model_params": json.loads(env["COTERIE_LEARNER__MODEL_PARAMS"]),
        "optimizer": env["COTERIE_LEARNER__OPTIMIZER"],
        "lr": float(env["COTERIE_LEARNER__LR"]),
        "local_steps": int(env["COTERIE_LEARNER__LOCAL_STEPS"]),
        "device": "cpu",
    }
    return {
        "name": "testbed-federico",
        "seed": 0,
        "nodes": nodes,
        "rounds": rounds,
        "strategy": ["federico"],
        "strategy_params": {"federico": json.loads(env["COTERIE_STRATEGY_PARAMS"])},
        "learner": learner,
        "node": {"heartbeat_interval_s": 0.3, "start_timeout_s": 120, "log_level": "WARNING"},
    }


@pytest.mark.slow
@pytest.mark.timeout(600)  # 6 CNN nodes × 15 rounds in one process: ~2-3 min on this box, more under load
def test_testbed_federico_weights_its_same_cluster_peers_above_chance(tmp_path):
    sc = compose_scenario(nodes=6, rounds=15, samples=6000)
    assert sc["strategy_params"]["federico"]["temperature"] == 0.2  # the setting that exposed the bug
    res = run_scenario(parse_scenario(sc), tmp_path / "run", backend="inproc")
    r = res["strategies"]["federico"]
    cluster = [r["nodes"][f"n{i}"]["true_cluster"] for i in range(6)]
    assert len(set(cluster)) == 3
    for i, row in enumerate(r["final_weights"]):
        assert row is not None, f"n{i} reported no weights"
        same = [j for j in range(6) if j != i and cluster[j] == cluster[i]]
        chance = len(same) / 6  # what uniform weights give them
        mass = sum(row[j] for j in same)
        assert mass > chance, f"n{i}: weight on same-cluster peers {mass:.3f} (chance {chance:.3f}), row {row}"
        # and what it gives away goes mostly to its own cluster
        others = sum(row[j] for j in range(6) if j != i and j not in same)
        assert mass > others, f"n{i}: same-cluster {mass:.3f} vs other clusters {others:.3f}"
