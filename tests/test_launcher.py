import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from coterie.lab import launcher
from coterie.lab.launcher import LauncherError, Network, prepare, run_scenario, run_strategy
from coterie.lab.scenario import builtin_scenario, load_scenario, parse_scenario
from coterie.node.config import ConfigError, load_config

FAKE = str(Path(__file__).with_name("fake_daemon.py"))
REPO = Path(__file__).resolve().parents[1]

BASE = {
    "name": "t",
    "seed": 7,
    "nodes": 4,
    "rounds": 3,
    "strategy": "local",
    "learner": {"dataset": "mnist1d", "partition": "label_permutation", "partition_params": {"num_clusters": 2}},
}


def scen(**kw):
    d = json.loads(json.dumps(BASE))
    d.update(kw)
    return parse_scenario(d)


def fake(mode):
    return lambda spec: [sys.executable, FAKE, str(spec.config_path), mode]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead (init reaps it later)


def assert_all_gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return
        time.sleep(0.05)
    raise AssertionError(f"processes survived the launcher: {left}")


def grandchildren(out: Path, strategy: str, n: int) -> list[int]:
    pids = []
    for i in range(n):
        f = out / strategy / "nodes" / f"n{i}" / "grandchild.pid"
        if f.exists():
            pids.append(int(f.read_text()))
    return pids


# ------------------------------------------------------------------------------- parsing
def test_scenario_defaults_and_strategy_forms():
    sc = scen()
    assert sc.strategy == ["local"] and sc.bootstrap == "chain"
    assert scen(strategy="local, dpsgd").strategy == ["local", "dpsgd"]
    assert scen(strategy=["local", "oracle"]).strategy == ["local", "oracle"]
    sc = parse_scenario(BASE, strategies=["dpsgd"], seed=3, rounds=9, nodes=5)
    assert (sc.strategy, sc.seed, sc.rounds, sc.nodes) == (["dpsgd"], 3, 9, 5)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"nodes": 0}, "nodes"),
        ({"rounds": None}, "rounds"),
        ({"bogus": 1}, "bogus"),
        ({"bootstrap": "ring"}, "bootstrap"),
        ({"strategy": ["local", "local"]}, "strategy"),
        ({"learner": {"lr": -1}}, "learner.lr"),
        ({"learner": {"num_nodes": 3}}, "learner.num_nodes"),
        ({"node": {"listen": "127.0.0.1:1"}}, "node.listen"),
        ({"node": {"heartbeat_interval_s": 0}}, "heartbeat_interval_s"),
        ({"overrides": [{"nodes": [9], "delay_ms": 5}]}, "overrides[0].nodes"),
        ({"overrides": [{"delay_ms": 5}]}, "overrides[0].nodes"),
        ({"overrides": [{"nodes": [1], "peers": []}]}, "overrides[0].peers"),
        ({"overrides": [{"nodes": [1], "learner": {"lr": 0}}]}, "learner.lr"),
        ({"strategy_params": {"fedfomo": {"eps": 1}}}, "strategy_params.fedfomo"),
    ],
)
def test_scenario_errors_name_the_field(change, field):
    d = json.loads(json.dumps(BASE))
    for k, v in change.items():
        if v is None:
            d.pop(k)
        else:
            d[k] = v
    with pytest.raises(ConfigError) as e:
        parse_scenario(d)
    assert field in str(e.value)


def test_load_scenario_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_scenario(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("nodes = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_scenario(bad)


def test_shipped_demo_scenario_is_valid_and_packaged():
    packaged = builtin_scenario("demo")
    assert packaged.read_text() == (REPO / "scenarios" / "demo.toml").read_text()
    sc = load_scenario(packaged)
    assert sc.nodes >= 6 and "local" in sc.strategy and len(sc.strategy) >= 2
    assert sc.learner["dataset"] == "mnist1d"
    for p in (REPO / "scenarios").glob("*.toml"):
        load_scenario(p)  # every public scenario parses


# ------------------------------------------------------------------------- config generation
def test_prepare_writes_complete_configs(tmp_path):
    sc = scen(
        nodes=5,
        strategy_params={"local": {}},
        node={"round_interval_s": 0.1},
        overrides=[
            {"nodes": [3], "learner": {"label_noise": 1.0}},
            {"nodes": [4], "round_interval_s": 2.0, "delay_ms": 50},
        ],
    )
    specs = prepare(sc, "local", tmp_path)
    cfgs = [load_config(s.config_path, environ={}) for s in specs]  # the files load as NodeConfig
    assert [c.node_id for c in cfgs] == [f"n{i}" for i in range(5)]
    # every node binds free ports itself (port 0) and reports them in node.json
    assert all(c.listen == "127.0.0.1:0" and c.admin_listen == "127.0.0.1:0" for c in cfgs)
    # chain: every node but n0 bootstraps from the node before it, via its node.json
    assert [s.bootstrap_from for s in specs] == [None] + [specs[i].state_dir / "node.json" for i in range(4)]
    assert all(c.peers == [] for c in cfgs)
    assert launcher.node_command(specs[2])[-2:] == ["--bootstrap-from", str(specs[1].state_dir / "node.json")]
    assert len({str(c.state_dir) for c in cfgs}) == 5
    assert cfgs[2].state_dir == (tmp_path / "local" / "nodes" / "n2").resolve()
    for i, c in enumerate(cfgs):
        assert (c.learner.num_nodes, c.learner.node_index) == (5, i)
        assert c.learner.data_seed == 7 and c.learner.init_seed == 7
        assert c.rounds == 3 and c.strategy == "local" and c.min_peers == 4
    assert [c.learner.label_noise for c in cfgs] == [0, 0, 0, 1.0, 0]
    assert [c.round_interval_s for c in cfgs] == [0.1, 0.1, 0.1, 0.1, 2.0]
    assert cfgs[4].delay_ms == 50 and cfgs[3].delay_ms == 0
    assert len({c.seed for c in cfgs}) == 5  # strategy randomness differs per node


def test_star_topology_and_min_peers_override(tmp_path):
    specs = prepare(scen(bootstrap="star", node={"min_peers": 1}), "local", tmp_path)
    hub = specs[0].state_dir / "node.json"
    assert [s.bootstrap_from for s in specs] == [None, hub, hub, hub]
    assert all(s.config.min_peers == 1 for s in specs)


def test_bootstrap_addresses_come_from_node_json(tmp_path):
    """Nodes bind port 0; a node's bootstrap peer is the address its bootstrap node wrote to its
    node.json, so no port is picked (and raced for) by the launcher."""
    sc = scen(nodes=3)
    run = run_strategy(
        sc,
        "local",
        tmp_path,
        poll_interval_s=0.05,
        stop_timeout_s=2,
        command=lambda s: fake("ok")(s) + ([str(s.bootstrap_from)] if s.bootstrap_from else []),
    )
    infos = [json.loads((tmp_path / "local" / "nodes" / f"n{i}" / "node.json").read_text()) for i in range(3)]
    assert len({i["address"] for i in infos}) == 3 and all(not i["address"].endswith(":0") for i in infos)
    assert infos[0]["peers"] == [] and infos[1]["peers"] == [infos[0]["address"]]
    assert infos[2]["peers"] == [infos[1]["address"]]
    assert run.specs[2].config.peers == [infos[1]["address"]]  # what results.json records


def test_prepare_clears_stale_state(tmp_path):
    stale = tmp_path / "local" / "nodes" / "n0" / "model.safetensors"
    stale.parent.mkdir(parents=True)
    stale.write_text("old")
    keep = tmp_path / "mine.txt"
    keep.write_text("user data")
    prepare(scen(), "local", tmp_path)
    assert not stale.exists() and keep.exists()


def test_children_do_not_inherit_coterie_env(monkeypatch):
    monkeypatch.setenv("COTERIE_STRATEGY", "dpsgd")
    env = launcher._child_env()
    assert not any(k.startswith("COTERIE_") for k in env)


def test_resolve_strategies():
    assert launcher.resolve_strategies(["local"], fallback=False) == (["local"], [])
    with pytest.raises(ConfigError, match="nope"):
        launcher.resolve_strategies(["local", "nope"], fallback=False)
    names, notes = launcher.resolve_strategies(["local", "nope"], fallback=True)
    assert names[0] == "local" and len(names) == 2 and names[1] != "nope"
    assert "nope" in notes[0]


# ---------------------------------------------------------------------- processes (fake node)
def test_run_collects_results_and_leaves_no_process(tmp_path, monkeypatch):
    sc = scen(
        nodes=3,
        strategy=["local", "dpsgd"],
        learner={"dataset": "mnist1d", "partition": "label_permutation", "partition_params": {"num_clusters": 3}},
    )
    seen = []
    orig = Network.start

    def spy(self):
        orig(self)
        seen.extend(self.pids)

    monkeypatch.setattr(Network, "start", spy)
    res = run_scenario(sc, tmp_path, command=fake("ok"), poll_interval_s=0.05, stop_timeout_s=5)
    assert_all_gone(seen + grandchildren(tmp_path, "local", 3) + grandchildren(tmp_path, "dpsgd", 3))
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk == res
    assert res["node_ids"] == ["n0", "n1", "n2"] and res["true_clusters"] == [0, 1, 2]
    assert res["scenario"]["strategy"] == ["local", "dpsgd"]
    for s in ("local", "dpsgd"):
        r = res["strategies"][s]
        assert r["wall_time_s"] > 0
        assert set(r["node_configs"]) == {"n0", "n1", "n2"}
        assert r["node_configs"]["n1"]["strategy"] == s
        n1 = r["nodes"]["n1"]
        assert n1["rounds"] == [1, 2, 3]
        assert n1["test_acc"] == pytest.approx([0.11, 0.21, 0.31])
        assert n1["final_test_acc"] == pytest.approx(0.31)
        assert n1["bytes_sent"] == {"gossip": 3, "snapshot": 300}
        assert n1["bytes_received"] == {"snapshot": 600}
        assert n1["pid"] and n1["address"].startswith("127.0.0.1:")
        assert r["weights"]["rounds"] == [1, 2, 3]
        m = r["weights"]["matrices"][2]
        assert m[1] == [0.25, 0.5, 0.25] and len(m) == 3
        assert r["final_weights"][0] == [0.5, 0.25, 0.25]
        assert r["mean_weights"][2] == [0.25, 0.25, 0.5]
        assert r["summary"]["bytes_sent_total"] == 3 * 303
        assert r["summary"]["mean_test_acc_by_cluster"]["2"] == pytest.approx(0.32)
        assert (tmp_path / s / "logs" / "n0.log").exists()


def test_early_death_names_node_and_log_tail(tmp_path):
    sc = scen(nodes=3)
    pids = []
    with pytest.raises(LauncherError) as e:
        run_strategy(
            sc,
            "local",
            tmp_path,
            command=fake("crash_n1"),
            poll_interval_s=0.05,
            stop_timeout_s=5,
            on_start=lambda net: pids.extend(net.pids),
        )
    msg = str(e.value)
    assert "node n1 exited with code 3" in msg and "boom: fake node failed on purpose" in msg
    assert_all_gone(pids + grandchildren(tmp_path, "local", 3))


def test_timeout_kills_nodes_that_ignore_sigterm(tmp_path):
    sc = scen(nodes=2, timeout_s=0.5)
    pids = []
    with pytest.raises(LauncherError, match="timed out.*n0@0"):
        run_strategy(
            sc,
            "local",
            tmp_path,
            command=fake("hang"),
            poll_interval_s=0.05,
            stop_timeout_s=0.5,
            on_start=lambda net: pids.extend(net.pids),
        )
    assert_all_gone(pids + grandchildren(tmp_path, "local", 2))


def test_ctrl_c_stops_everything(tmp_path):
    sc = scen(nodes=3)
    pids = []

    def interrupt(net):
        pids.extend(net.pids)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_strategy(
            sc, "local", tmp_path, command=fake("hang"), poll_interval_s=0.05, stop_timeout_s=0.5, on_start=interrupt
        )
    assert len(pids) == 3
    assert_all_gone(pids)


# ------------------------------------------------------------------ end to end (real daemon)
@pytest.mark.slow
def test_coterie_run_three_real_nodes(tmp_path):
    """`coterie run` of a 3-node scenario with the real daemon writes a complete results.json."""
    from typer.testing import CliRunner

    from coterie.cli.main import app

    scenario = tmp_path / "three.toml"
    scenario.write_text("""
name = "three"
seed = 1
nodes = 3
rounds = 3
strategy = ["local", "dpsgd"]
timeout_s = 240

[learner]
dataset = "mnist1d"
dataset_params = { num_samples = 1500 }
partition = "label_permutation"
partition_params = { num_clusters = 2 }
model = "mlp"
model_params = { hidden = [16] }
local_steps = 3
device = "cpu"

[node]
heartbeat_interval_s = 0.3
start_timeout_s = 60
""")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", str(scenario), "--out", str(out)])
    assert result.exit_code == 0, result.output
    res = json.loads((out / "results.json").read_text())
    assert res["true_clusters"] == [0, 0, 1]
    for s in ("local", "dpsgd"):
        r = res["strategies"][s]
        for n in ("n0", "n1", "n2"):
            node = r["nodes"][n]
            assert node["rounds"] == [1, 2, 3]
            assert all(0.0 <= a <= 1.0 for a in node["test_acc"])
            assert all(v is not None for v in node["test_loss"])
            assert r["node_configs"][n]["learner"]["node_index"] == int(n[1:])
        mats = r["weights"]["matrices"]
        assert len(mats) == 3 and all(row is not None and len(row) == 3 for row in mats[-1])
        assert all(abs(sum(row) - 1.0) < 1e-6 for row in mats[-1])
    local_w = res["strategies"]["local"]["final_weights"]
    assert local_w == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    assert res["strategies"]["dpsgd"]["summary"]["bytes_sent_total"] > 0
    assert res["strategies"]["local"]["summary"]["bytes_sent_total"] >= 0
    assert (out / "weights.png").stat().st_size > 0
    for s in ("local", "dpsgd"):  # every node stopped: their pids are gone
        for n in ("n0", "n1", "n2"):
            pid = res["strategies"][s]["nodes"][n]["pid"]
            assert pid and not alive(pid)


def test_strategy_subset_from_the_command_line_drops_params_of_the_others():
    from coterie.lab.scenario import parse_scenario

    data = {
        "name": "x",
        "nodes": 2,
        "rounds": 1,
        "strategy": ["local", "fedfomo"],
        "strategy_params": {"fedfomo": {"num_models": 2}},
    }
    assert parse_scenario(data, strategies=["local"]).strategy_params == {}
    assert parse_scenario(data).strategy_params == {"fedfomo": {"num_models": 2}}


@pytest.mark.slow
def test_daemons_are_forked_from_the_preloaded_server_and_share_its_memory(tmp_path):
    """The default processes backend forks each daemon from a fork server that imported torch
    once: the daemon is the server's child, and most of what it maps stays shared with it."""
    sc = scen(
        nodes=2,
        rounds=1,
        learner={
            "dataset": "mnist1d",
            "dataset_params": {"num_samples": 1200},
            "partition": "label_permutation",
            "partition_params": {"num_clusters": 2},
            "model": "mlp",
            "local_steps": 2,
            "device": "cpu",
        },
        node={"heartbeat_interval_s": 0.3},
    )
    specs = prepare(sc, "local", tmp_path)
    with Network(specs) as net:

        def up():
            return all((s.state_dir / "node.json").exists() for s in specs) and all(
                json.loads((s.state_dir / "node.json").read_text())["pid"] == p
                for s, p in zip(specs, net.pids, strict=True)
            )

        deadline = time.monotonic() + 180
        while not up():
            assert time.monotonic() < deadline, "forked daemons did not come up"
            assert all(p.poll() is None for p in net.procs), [launcher.log_tail(s.log_path) for s in specs]
            time.sleep(0.1)
        for pid in net.pids:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            assert parent != os.getpid()  # forked by the server, not by this process
            assert "libtorch" in Path(f"/proc/{parent}/maps").read_text()  # which has torch loaded
            mem = {k: 0 for k in ("Rss", "Private")}
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                key, _, rest = line.partition(":")
                if key == "Rss":
                    mem["Rss"] = int(rest.split()[0])
                elif key.startswith("Private_"):
                    mem["Private"] += int(rest.split()[0])
            assert mem["Private"] < mem["Rss"] / 2, mem  # a fresh interpreter holds ~2/3 of it privately
    assert_all_gone(net.pids)


def test_oversized_partition_fails_before_any_process_starts(tmp_path, monkeypatch):
    """The pool and the partition are checked first: an oversized partition names the node and
    the sizes, and no node process is ever started."""
    started = []
    monkeypatch.setattr(Network, "start", lambda self: started.append(self))
    sc = scen(
        nodes=4,
        learner={
            "dataset": "digits",
            "partition": "label_permutation",
            "partition_params": {"num_clusters": 2, "samples_per_node": 600},
        },
    )
    with pytest.raises(ConfigError, match=r"node n0: data: .*needs 2400 samples in all but the pool has only 1797"):
        run_scenario(sc, tmp_path, command=fake("ok"))
    assert not started and not (tmp_path / "results.json").exists()


def test_oracle_without_meaning_is_warned(tmp_path):
    sc = scen(
        nodes=3,
        strategy=["local", "oracle"],
        learner={"dataset": "digits", "partition": "dirichlet", "partition_params": {"alpha": 0.5}},
    )
    assert any("oracle has no meaning" in w for w in launcher.check_data(sc))
    assert launcher.check_data(scen(nodes=3, strategy=["local", "oracle"])) == []  # 2 clusters: fine
    res = run_scenario(sc, tmp_path, command=fake("ok"), poll_interval_s=0.05, stop_timeout_s=5)
    assert any("oracle has no meaning" in n for n in res["notes"])


def test_rerunning_a_subset_keeps_the_other_strategies(tmp_path):
    sc = scen(nodes=3, strategy=["local", "dpsgd"])
    first = run_scenario(sc, tmp_path, command=fake("ok"), poll_interval_s=0.05, stop_timeout_s=5)
    again = run_scenario(
        scen(nodes=3, strategy=["dpsgd"]), tmp_path, command=fake("ok"), poll_interval_s=0.05, stop_timeout_s=5
    )
    assert set(again["strategies"]) == {"local", "dpsgd"}
    assert again["strategies"]["local"] == first["strategies"]["local"]
    assert (
        again["strategies"]["dpsgd"]["wall_time_s"] != first["strategies"]["dpsgd"]["wall_time_s"]
        or again["strategies"]["dpsgd"]["nodes"]["n0"]["pid"] != first["strategies"]["dpsgd"]["nodes"]["n0"]["pid"]
    )
    assert any("kept earlier results of ['local']" in n for n in again["notes"])
    assert json.loads((tmp_path / "results.json").read_text()) == again
    # another scenario configuration (other seed): the earlier entries are not mixed in
    other = run_scenario(
        scen(nodes=3, seed=8, strategy=["dpsgd"]), tmp_path, command=fake("ok"), poll_interval_s=0.05, stop_timeout_s=5
    )
    assert set(other["strategies"]) == {"dpsgd"}
    assert any("another scenario configuration" in n for n in other["notes"])


def test_results_carry_the_true_mixture(tmp_path):
    from coterie.node.learning.partition import true_mixture

    sc = scen(
        nodes=3,
        learner={"dataset": "digits", "partition": "mixture", "partition_params": {"num_components": 2, "alpha": 1.0}},
    )
    res = run_scenario(sc, tmp_path, command=fake("ok"), poll_interval_s=0.05, stop_timeout_s=5)
    lc = prepare(sc, "local", tmp_path / "x")[0].config.learner
    assert np.allclose(res["true_mixture"], true_mixture(lc))
    assert res["true_clusters"] == [int(max(range(2), key=lambda k: r[k])) for r in res["true_mixture"]]
    assert "true_mixture" not in run_scenario(
        scen(nodes=3), tmp_path / "y", command=fake("ok"), poll_interval_s=0.05, stop_timeout_s=5
    )
