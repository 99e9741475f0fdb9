"""`coterie run --backend inproc`: the whole network in this process, same configs (but for the
addresses), same partitions and seeds, same results.json as the processes backend."""

from __future__ import annotations

import json
import os

import pytest

from coterie.lab.launch import check_backend, inproc, processes
from coterie.lab.scenario import parse_scenario
from coterie.node.config import ConfigError, validate_config

BASE = {
    "name": "t",
    "seed": 3,
    "nodes": 4,
    "rounds": 3,
    "strategy": ["local", "dpsgd"],
    "learner": {
        "dataset": "mnist1d",
        "dataset_params": {"num_samples": 1200},
        "partition": "label_permutation",
        "partition_params": {"num_clusters": 2},
        "model": "mlp",
        "model_params": {"hidden": [16]},
        "local_steps": 3,
        "device": "cpu",
    },
    "node": {"heartbeat_interval_s": 0.3, "start_timeout_s": 60},
}


def scen(**kw):
    d = json.loads(json.dumps(BASE))
    d.update(kw)
    return parse_scenario(d)


def test_configs_differ_from_the_processes_backend_only_in_addresses(tmp_path):
    sc = scen(bootstrap="star")
    mine = inproc.prepare(sc, "dpsgd", tmp_path / "i")
    theirs = processes.prepare(sc, "dpsgd", tmp_path / "p")
    assert [s.config.listen for s in mine] == ["inproc:1", "inproc:2", "inproc:3", "inproc:4"]
    assert [s.config.peers for s in mine] == [[], ["inproc:1"], ["inproc:1"], ["inproc:1"]]
    addresses = {"listen", "admin_listen", "peers", "state_dir", "security"}
    for a, b in zip(mine, theirs, strict=True):
        assert a.config.model_dump(exclude=addresses) == b.config.model_dump(exclude=addresses)
        # one trusted process without TLS; the daemons each get a certificate from the run's CA
        assert a.config.security.insecure and a.config.security.cert_dir is None
        assert not b.config.security.insecure and (b.config.security.cert_dir / "node.pem").exists()
        assert a.config_path.exists()  # the resolved config is written next to the results


def test_heartbeats_stretch_only_for_large_networks():
    c = validate_config({"heartbeat_interval_s": 0.5, "suspect_after_s": 3.0, "dead_after_s": 10.0})
    # SWIM: one ping per node per period, so thousands of nodes keep the scenario's timing
    assert inproc.membership_timing(c, 12) == {} and inproc.membership_timing(c, 5000) == {}
    big = inproc.membership_timing(c, 50_000)
    assert 50_000 / big["heartbeat_interval_s"] <= inproc.HEARTBEATS_PER_S * 1.0001
    assert big["suspect_after_s"] / big["heartbeat_interval_s"] == pytest.approx(3.0 / 0.5)
    assert big["dead_after_s"] / big["heartbeat_interval_s"] == pytest.approx(10.0 / 0.5)


def test_backend_limits_are_checked_before_launch():
    check_backend(scen(nodes=300), "inproc")
    with pytest.raises(ConfigError, match="nodes=300.*processes backend.*--backend inproc"):
        check_backend(scen(nodes=300), "processes")
    with pytest.raises(ConfigError, match="unknown backend 'dask'"):
        check_backend(scen(), "dask")


@pytest.mark.slow
def test_coterie_run_inproc_writes_results_from_one_process(tmp_path):
    from typer.testing import CliRunner

    from coterie.cli.main import app

    scenario = tmp_path / "four.toml"
    import tomli_w

    scenario.write_text(tomli_w.dumps(BASE))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", str(scenario), "--out", str(out), "--backend", "inproc"])
    assert result.exit_code == 0, result.output
    res = json.loads((out / "results.json").read_text())
    assert res["backend"] == "inproc" and res["format"] == "coterie-results/1"
    assert res["true_clusters"] == [0, 0, 1, 1]
    for s in ("local", "dpsgd"):
        r = res["strategies"][s]
        for i, n in enumerate(("n0", "n1", "n2", "n3")):
            node = r["nodes"][n]
            assert node["rounds"] == [1, 2, 3] and all(0.0 <= a <= 1.0 for a in node["test_acc"])
            assert node["address"] == f"inproc:{i + 1}" and node["pid"] == os.getpid()
            assert list((out / s / "nodes" / n).glob("ckpt-*.safetensors"))  # real checkpoints, per node
        mats = r["weights"]["matrices"]
        assert all(abs(sum(row) - 1.0) < 1e-6 for row in mats[-1])
    assert res["strategies"]["local"]["final_weights"] == [[1.0 if i == j else 0.0 for j in range(4)] for i in range(4)]
    dpsgd = res["strategies"]["dpsgd"]
    assert dpsgd["summary"]["bytes_received_total"] > 0  # snapshots moved, through memory
    assert all(len([w for w in row if w > 0]) > 1 for row in dpsgd["final_weights"])
    assert (out / "dpsgd" / "logs" / "inproc.log").read_text().count("finished its 3 rounds") == 4


def test_cli_refuses_an_unknown_backend_or_too_many_processes(tmp_path):
    import tomli_w
    from typer.testing import CliRunner

    from coterie.cli.main import app

    scenario = tmp_path / "s.toml"
    scenario.write_text(tomli_w.dumps(BASE))
    runner = CliRunner()
    r = runner.invoke(app, ["run", str(scenario), "--out", str(tmp_path / "o"), "--backend", "dask"])
    assert r.exit_code == 2 and "unknown backend 'dask'" in r.stderr
    r = runner.invoke(app, ["run", str(scenario), "--out", str(tmp_path / "o"), "--nodes", "300"])
    assert r.exit_code == 2 and "--backend inproc" in r.stderr
    assert not (tmp_path / "o" / "results.json").exists()


def test_nodes_start_in_batches_that_meet_the_network_first(tmp_path):
    """A batch's nodes start together, and the next batch starts only once each of them (that has
    a bootstrap peer) has met someone."""
    import asyncio

    sc = scen(nodes=5, bootstrap="chain")
    specs = inproc.prepare(sc, "dpsgd", tmp_path)
    events: list[str] = []

    class FakeNode:
        def __init__(self, cfg, transport=None, admin=True):
            self.cfg, self.met, self.node_id = cfg, [], cfg.node_id
            self.peers = self

        def alive(self):
            return self.met

        async def start(self):
            events.append(f"start {self.node_id}")
            await asyncio.sleep(0)

            async def handshake():  # answered a few loop turns later
                for _ in range(3):
                    await asyncio.sleep(0)
                events.append(f"met {self.node_id}")
                self.met = ["someone"]

            if self.cfg.peers:
                asyncio.get_running_loop().create_task(handshake())

    class Board:
        def transport_for(self, cfg):
            return None

    async def go():
        nodes: list = []
        for lo in range(0, 5, 2):
            await inproc._start_batch(FakeNode, Board(), specs[lo : lo + 2], nodes)
            events.append("batch done")
        return nodes

    nodes = asyncio.run(go())
    assert [n.node_id for n in nodes] == ["n0", "n1", "n2", "n3", "n4"]
    # n0 bootstraps from nobody: its batch waits for n1 only; every later batch for both of its nodes
    assert events[:4] == ["start n0", "start n1", "met n1", "batch done"]
    assert events[4:6] == ["start n2", "start n3"] and set(events[6:8]) == {"met n2", "met n3"}
    assert events[8:] == ["batch done", "start n4", "met n4", "batch done"]
