"""`coterie run --backend ray`: groups of in-process nodes as Ray actors on a real multi-node Ray
cluster — two raylets on loopback (``ray.cluster_utils.Cluster``), one group pinned to each —
memory inside a group, gRPC between them, the same results.json as the other backends.

The cluster test is skipped only where Ray is not installed (``pip install -e '.[ray]'``;
``.ci/run`` installs it). Placement and the no-Ray paths are tested without a cluster."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import tomli_w
import tomllib

from coterie.lab.launch import check_backend
from coterie.lab.launch.common import LauncherError
from coterie.lab.scenario import parse_scenario
from coterie.node.config import ConfigError

SCENARIO = {
    "name": "ray",
    "seed": 5,
    "nodes": 4,
    "rounds": 3,
    "strategy": ["dpsgd"],
    "bootstrap": "chain",
    "timeout_s": 300,
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
    "node": {"heartbeat_interval_s": 0.3, "start_timeout_s": 120},
}


def _ray_node(node_id: str, cpus: float = 1.0, alive: bool = True, ip: str = "10.0.0.1") -> dict:
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": ip, "Resources": {"CPU": cpus}}


# ---------------------------------------------------------------------------------- no cluster
def test_plan_cuts_contiguous_groups_one_per_ray_node():
    from coterie.lab.launch.ray import plan

    nodes = [
        _ray_node("b", 2, ip="10.0.0.2"),
        _ray_node("a", 2),
        _ray_node("dead", 8, alive=False),
        _ray_node("head", 0),
    ]
    groups = plan(7, nodes)
    assert [g.nodes for g in groups] == [[0, 1, 2, 3], [4, 5, 6]]  # every bootstrap peer in this or an earlier group
    assert [g.ray_node for g in groups] == ["a", "b"]  # alive nodes with CPUs only, in a stable order
    assert [g.ray_node for g in plan(5, nodes, groups=4)] == ["a", "b", "a", "b"]
    assert [len(g.nodes) for g in plan(5, nodes, groups=4)] == [2, 1, 1, 1]
    assert len(plan(1, nodes, groups=4)) == 1  # never an empty group
    with pytest.raises(LauncherError, match="do not fit: Ray node 10.0.0.1 has 2 CPUs for 3"):
        plan(6, nodes, groups=6)
    assert [g.ray_node for g in plan(6, nodes, cpus=2)] == ["a", "b"]
    with pytest.raises(LauncherError, match="no alive Ray node has 4 CPU"):
        plan(6, nodes, cpus=4)


def test_without_ray_the_backend_is_one_clear_line(tmp_path, monkeypatch):
    """sys.modules["ray"] = None is what Python does for a module that cannot be imported."""
    from typer.testing import CliRunner

    from coterie.cli.main import app

    monkeypatch.setitem(sys.modules, "ray", None)
    sc = parse_scenario(SCENARIO)
    with pytest.raises(ConfigError, match=r"needs Ray.*pip install 'coterie\[ray\]'"):
        check_backend(sc, "ray")
    scenario = tmp_path / "s.toml"
    scenario.write_text(tomli_w.dumps(SCENARIO))
    result = CliRunner().invoke(app, ["run", str(scenario), "--out", str(tmp_path / "o"), "--backend", "ray"])
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "pip install 'coterie[ray]'" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "o").exists()


def test_ray_options_belong_to_the_ray_backend(tmp_path):
    from typer.testing import CliRunner

    from coterie.cli.main import app

    scenario = tmp_path / "s.toml"
    scenario.write_text(tomli_w.dumps(SCENARIO))
    result = CliRunner().invoke(app, ["run", str(scenario), "--out", str(tmp_path / "o"), "--address", "auto"])
    assert result.exit_code == 2 and "options of --backend ray" in result.output


def test_coterie_imports_without_ray():
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import coterie.cli.main, coterie.lab.launcher, coterie.lab.launch.ray, coterie.node.transport.routing\n"
        "from coterie.lab.launch.ray import ray_problem; print(ray_problem())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'coterie[ray]'" in out.stdout


# ----------------------------------------------------------------------------- a Ray cluster
@pytest.fixture(scope="module")
def ray_cluster():
    pytest.importorskip("ray", reason="the ray extra is not installed: pip install -e '.[ray]'")
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    # Ray gives every raylet the machine's outward address unless it is told this is a
    # one-machine cluster (an env var it reads at import: set for the raylets and workers it
    # starts, and patched here, where it is already imported): then raylets, actors and so every
    # node's gRPC server are on loopback.
    # Ray's sessions, sockets and logs go to a directory of this test's own (short: socket paths
    # have a length limit), not the machine-wide /tmp/ray another user's Ray may be using.
    temp = tempfile.mkdtemp(prefix="cray")
    cluster, problems = None, []
    with pytest.MonkeyPatch.context() as mp:
        # Cluster.add_node also writes the head's address to <default temp>/ray/ray_current_cluster,
        # whatever temp_dir says: /tmp/ray/..., which fails where no Ray has run before (no
        # /tmp/ray) and elsewhere overwrites another Ray's. RAY_TMPDIR points that default here too.
        os.makedirs(os.path.join(temp, "ray"), exist_ok=True)
        mp.setenv("RAY_TMPDIR", temp)
        mp.setenv(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "0")
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        try:
            # A raylet aborts when its Python agent has not written its port file within 15 s;
            # on an overloaded machine starting the agent alone can take that long. That is
            # Ray's start-up, not ours: give it three tries before failing.
            for _ in range(3):
                cluster = Cluster(initialize_head=False)
                try:
                    cluster.add_node(num_cpus=1, include_dashboard=False, temp_dir=temp)
                    cluster.add_node(num_cpus=1, temp_dir=temp)
                    cluster.wait_for_nodes()
                    break
                except Exception as e:
                    problems.append(f"{type(e).__name__}: {e}")
                    cluster.shutdown()
                    cluster = None
            if cluster is None:
                pytest.fail("a 2-raylet Ray cluster did not start: " + " | ".join(problems))
            assert cluster.address.startswith("127.0.0.1:"), cluster.address
            yield cluster
        finally:
            if cluster is not None:
                cluster.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_coterie_run_on_two_raylets(ray_cluster, tmp_path):
    import ray
    from typer.testing import CliRunner

    from coterie.cli.main import app
    from coterie.node.learning.config import LearnerConfig
    from coterie.node.learning.torch_learner import build_learner

    scenario = tmp_path / "s.toml"
    scenario.write_text(tomli_w.dumps(SCENARIO))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["run", str(scenario), "--out", str(out), "--backend", "ray", "--address", ray_cluster.address]
    )
    assert result.exit_code == 0, result.output
    assert not ray.is_initialized()  # the run's own connection is closed again; the cluster stays up

    res = json.loads((out / "results.json").read_text())
    assert res["backend"] == "ray" and res["format"] == "coterie-results/1"
    run = res["strategies"]["dpsgd"]
    ids = ["n0", "n1", "n2", "n3"]

    # one group per raylet, each its own process, neither of them this one
    groups = run["placement"]["groups"]
    assert [g["nodes"] for g in groups] == [["n0", "n1"], ["n2", "n3"]]
    raylets = {n.node_id for n in ray_cluster.list_all_nodes()}
    assert {g["ray_node"] for g in groups} == raylets and len(raylets) == 2
    assert len({g["pid"] for g in groups}) == 2 and os.getpid() not in {g["pid"] for g in groups}

    # every node finished every round, served real gRPC on loopback, wrote real checkpoints
    for g in groups:
        for n in g["nodes"]:
            node = run["nodes"][n]
            assert node["rounds"] == [1, 2, 3] and all(0.0 <= a <= 1.0 for a in node["test_acc"])
            assert node["address"].startswith("127.0.0.1:") and node["pid"] == g["pid"]
            assert list((out / "dpsgd" / "nodes" / n).glob("ckpt-*.safetensors"))  # its checkpoint
    # the configs next to the results are what the nodes ran with: n1 bootstrapped from n0's address
    n1 = tomllib.loads((out / "dpsgd" / "configs" / "n1.toml").read_text())
    assert n1["peers"] == [run["nodes"]["n0"]["address"]] and n1["listen"] == "127.0.0.1:0"

    # memory inside a group, gRPC across: every node took at least one whole model from the
    # other group over gRPC, and talked to its group mate through memory
    model_bytes = sum(
        t.numel() * t.element_size()
        for t in build_learner(LearnerConfig.model_validate(run["node_configs"]["n0"]["learner"])).get_params().values()
    )
    for n in ids:
        routes = run["placement"]["routes"][n]
        assert routes["bytes_received"]["grpc"] >= model_bytes, (n, routes, model_bytes)
        assert routes["calls"]["memory"] > 0 and routes["bytes_received"]["memory"] > 0, (n, routes)
    # and learned from it: D-PSGD mixed a model of the other group into every node's
    other = {n: [m for g in groups if n not in g["nodes"] for m in g["nodes"]] for n in ids}
    assert all(any(run["final_weights"][i][ids.index(m)] > 0 for m in other[n]) for i, n in enumerate(ids))
    log = (out / "dpsgd" / "logs" / "ray-g1.log").read_text()
    assert log.count("finished its 3 rounds") == 2
