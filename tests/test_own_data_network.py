"""Networks on their own files: a scenario whose nodes each read their own .npz (`coterie run`,
in-process backend), a node with too few samples for privacy that still runs but releases nothing,
and `coterie node start --data` on a bad file (one line, no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tomli_w

from coterie.lab.scenario import load_scenario, parse_scenario
from coterie.node.config import ConfigError

CLASSES = ["cat", "dog", "eel"]


def write_node_file(path, n: int, seed: int, names: bool = False) -> None:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    x = rng.normal(0, 0.5, (n, 4)).astype(np.float32)
    x[np.arange(n), y] += 3.0
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x=x, y=np.array(CLASSES)[y] if names else y)


def scenario(tmp_path, strategies, sizes=(240, 240, 240), **extra) -> dict:
    for i, n in enumerate(sizes):
        write_node_file(tmp_path / "files" / f"n{i}.npz", n, seed=i, names=i % 2 == 1)
    return {
        "name": "own-files",
        "seed": 1,
        "nodes": len(sizes),
        "rounds": 3,
        "strategy": strategies,
        "learner": {
            "data": "files/{node}.npz",
            "classes": CLASSES,
            "model": "linear",
            "lr": 0.2,
            "local_steps": 5,
            "device": "cpu",
        },
        "node": {"heartbeat_interval_s": 0.3, "start_timeout_s": 60, "log_level": "WARNING"},
        **extra,
    }


@pytest.mark.slow
def test_coterie_run_on_each_nodes_own_file(tmp_path):
    from typer.testing import CliRunner

    from coterie.cli.main import app

    toml = tmp_path / "own.toml"
    toml.write_text(tomli_w.dumps(scenario(tmp_path, ["local", "fedfomo"])))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", str(toml), "--out", str(out), "--backend", "inproc"])
    assert result.exit_code == 0, result.output
    res = json.loads((out / "results.json").read_text())
    assert res["true_clusters"] is None and any("own files" in n for n in res["notes"])
    for s in ("local", "fedfomo"):
        nodes = res["strategies"][s]["nodes"]
        for i in range(3):
            node = nodes[f"n{i}"]
            assert node["rounds"] == [1, 2, 3] and node["test_acc"][-1] > 0.8
            # each node read exactly its own file, found from the scenario's folder
            data = res["strategies"][s]["node_configs"][f"n{i}"]["learner"]["data"]
            assert data == str(tmp_path / "files" / f"n{i}.npz")
    assert res["strategies"]["fedfomo"]["summary"]["bytes_received_total"] > 0  # peers' models moved


def test_scenario_paths_and_data_checks_before_any_node_starts(tmp_path):
    from coterie.lab.launch.common import check_data

    d = scenario(tmp_path, ["local", "oracle"])
    toml = tmp_path / "s.toml"
    toml.write_text(tomli_w.dumps(d))
    sc = load_scenario(toml)
    assert sc.learner["data"] == str(tmp_path / "files" / "{node}.npz")
    with pytest.raises(ConfigError, match="node n0: strategy oracle needs a true cluster"):
        check_data(sc)
    # with labels.cluster the oracle has its truth
    d["overrides"] = [{"nodes": [0, 1], "labels": {"cluster": "0"}}, {"nodes": [2], "labels": {"cluster": "1"}}]
    toml.write_text(tomli_w.dumps(d))
    assert check_data(load_scenario(toml)) == []
    (tmp_path / "files" / "n2.npz").write_bytes(b"PK\x03\x04 torn")
    with pytest.raises(ConfigError, match=r"node n2: data: .*n2\.npz: cannot read it as \.npz"):
        check_data(load_scenario(toml))


@pytest.mark.slow
def test_a_node_with_too_few_samples_runs_but_releases_nothing(tmp_path):
    """SCool asks every peer for the loss of its model on their training data (a cross-loss);
    n2 holds 30 training samples < min_batch 64: it learns, refuses those requests, says why."""
    from coterie.lab.launch import inproc

    sc = parse_scenario(
        {
            **scenario(tmp_path, ["scool-sbm"], sizes=(300, 300, 50)),
            "learner": {
                **scenario(tmp_path, [], sizes=(300, 300, 50))["learner"],
                "data": str(tmp_path / "files" / "{node}.npz"),
            },
        }
    )
    run = inproc.run_strategy(sc, "scool-sbm", tmp_path / "out")
    small, big = run.final_status["n2"], run.final_status["n0"]
    assert small["round"] == 3 and big["round"] == 3
    assert "train split holds 30 samples, fewer than privacy.min_batch = 64" in small["privacy"]["withheld"]
    assert big["privacy"]["withheld"] is None and small["data"]["samples"]["train"] == 30
    assert small["privacy"]["releases"] == 0 and big["privacy"]["releases"] > 0  # nothing on n2's data left
    # n0 asked n2 and was refused, with the reason
    assert any(p["peer"] == "n2" and "fewer than privacy.min_batch" in p["message"] for p in big["problems"]), big[
        "problems"
    ]


@pytest.mark.slow
def test_privacy_off_still_needs_min_batch_and_a_run_that_mixed_nothing_says_why(tmp_path):
    """Issue 33: every node on its own file with 30 training samples < privacy.min_batch 64 and
    privacy off. The refusal stands (an exact answer over a few samples gives them away) but names
    the setting that lifts it; SCool-attention mixes nothing, and /status and results.json say so,
    with the reason. Lowering min_batch to the node's size lifts it: the nodes mix."""
    from coterie.lab.launch import inproc
    from coterie.lab.results import strategy_results

    def run(min_batch: int, out: str):
        d = scenario(tmp_path, ["scool-attention"], sizes=(50, 50, 50))
        d["learner"]["data"] = str(tmp_path / "files" / "{node}.npz")
        d["node"]["privacy"] = {"enabled": False, "min_batch": min_batch}
        sc = parse_scenario(d)
        r = inproc.run_strategy(sc, "scool-attention", tmp_path / out)
        return r, strategy_results(sc, r, None)

    r, res = run(64, "off")
    for nid in ("n0", "n1", "n2"):
        st = r.final_status[nid]
        assert st["round"] == 3 and st["privacy"]["releases"] == 0
        assert "with privacy on or off; privacy.min_batch = 30 or lower lifts this" in st["privacy"]["withheld"]
        collab = st["collaboration"]
        assert collab["peer_answers"] == 0 and collab["privacy_refusals"] > 0, collab
        assert "no peer released anything computed on its data" in collab["note"]
        assert res["nodes"][nid]["mixed_nothing"] is True
        assert any(
            n.startswith(f"scool-attention {nid}: mixed nothing for the whole run") and "privacy.min_batch" in n
            for n in res["notes"]
        ), res["notes"]

    r, res = run(30, "lifted")
    for nid in ("n0", "n1", "n2"):
        collab = r.final_status[nid]["collaboration"]
        assert r.final_status[nid]["privacy"]["withheld"] is None
        assert collab["peer_answers"] > 0 and collab["privacy_refusals"] == 0 and collab["note"] is None
        assert res["nodes"][nid]["mixed_nothing"] is False
    assert not any("mixed nothing" in n for n in res["notes"])


def test_node_start_with_bad_data_fails_in_one_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("f0,f1,label\n1,2,cat\n1,nan,dog\n")
    env = {**os.environ, "COTERIE_CACHE_DIR": "off"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "coterie.cli.main",
            "node",
            "start",
            "--insecure",
            "--state-dir",
            str(tmp_path / "st"),
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--data",
            str(bad),
            "--set",
            'learner.classes=["cat","dog"]',
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in p.stderr, p.stderr
    assert lines[-1] == f"coterie: cannot start node: {bad} line 3: features hold NaN or Inf (or a missing value)"


def test_learner_data_from_toml_environment_and_flags(tmp_path):
    from coterie.cli.main import build_overrides  # noqa: F401  (the flags go through load_config too)
    from coterie.node.config import load_config

    toml = tmp_path / "n.toml"
    toml.write_text('[learner]\ndata = "/from/toml.csv"\nclasses = 3\n')
    assert load_config(toml, environ={}).learner.data == "/from/toml.csv"
    cfg = load_config(toml, environ={"COTERIE_LEARNER__DATA": "/from/env.npz", "COTERIE_LEARNER__DATA_FORMAT": "npz"})
    assert (cfg.learner.data, cfg.learner.data_format, cfg.learner.classes) == ("/from/env.npz", "npz", 3)


def test_node_start_refuses_oracle_on_own_files(tmp_path):
    from typer.testing import CliRunner

    from coterie.cli.main import app

    write_node_file(tmp_path / "d.npz", 60, 0)
    r = CliRunner().invoke(
        app,
        [
            "node",
            "start",
            "--insecure",
            "--state-dir",
            str(tmp_path / "st"),
            "--strategy",
            "oracle",
            "--data",
            str(tmp_path / "d.npz"),
            "--data-format",
            "npz",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ],
    )
    assert r.exit_code == 2 and "oracle: a node on its own files (learner.data) has no true cluster" in r.stderr


def test_two_daemons_whose_classes_differ_never_become_peers(tmp_path):
    """Same files, same architecture, the class list in another order: a real daemon refuses the
    other's handshake, says what differs, and both learn alone."""
    import asyncio
    import time

    from coterie.node.config import validate_config
    from coterie.node.daemon import Node
    from coterie.node.transport.inproc import InProcNetwork

    write_node_file(tmp_path / "d.npz", 120, 0, names=True)

    def config(i, peers, classes):
        return validate_config(
            {
                "node_id": f"n{i}",
                "state_dir": str(tmp_path / f"n{i}"),
                "strategy": "local",
                "peers": peers,
                "heartbeat_interval_s": 0.2,
                "rounds": 0,
                "learner": {"data": str(tmp_path / "d.npz"), "classes": classes, "model": "linear", "device": "cpu"},
            }
        )

    async def go():
        hub = InProcNetwork()
        ca = config(0, [], CLASSES)
        a = Node(ca, transport=hub.transport_for(ca), admin=False)
        await a.start()
        cb = config(1, [a.address], ["dog", "cat", "eel"])
        b = Node(cb, transport=hub.transport_for(cb), admin=False)
        await b.start()
        try:
            deadline = time.monotonic() + 30
            while not any("task differs" in p["message"] for p in a.problems.recent(50)):
                assert time.monotonic() < deadline, "n0 never refused n1"
                await asyncio.sleep(0.05)
            why = next(p["message"] for p in a.problems.recent(50) if "task differs" in p["message"])
            assert why == (
                "handshake: peer 'n1''s task differs from node 'n0''s: classes ['dog', 'cat', 'eel'] "
                "vs ['cat', 'dog', 'eel']"
            )
            assert a.peers.alive() == [] and b.peers.alive() == []
            assert a.status()["data"]["classes"] == CLASSES and b.status()["data"]["classes"] == ["dog", "cat", "eel"]
        finally:
            await b.stop()
            await a.stop()

    asyncio.run(go())
