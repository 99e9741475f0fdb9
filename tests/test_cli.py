import asyncio
import json
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

import coterie.node.daemon as daemon
from coterie.cli.main import app
from coterie.node import launcher
from coterie.node.admin import start_admin
import socket
from fake_node import FakeNode

FAKE = str(Path(__file__).with_name("fake_daemon.py"))
runner = CliRunner()


@pytest.fixture
def captured(monkeypatch):
    """Replace the daemon entry point: record the config `node start` built."""
    seen = {}

    def fake_run_node(cfg):
        seen["cfg"] = cfg
        return 0

    monkeypatch.setattr(daemon, "run_node", fake_run_node)
    for k in [k for k in __import__("os").environ if k.startswith("COTERIE_")]:
        monkeypatch.delenv(k)
    return seen


# ----------------------------------------------------------------------------- node start
def test_node_start_precedence_flags_env_toml(tmp_path, monkeypatch, captured):
    cfg = tmp_path / "node.toml"
    cfg.write_text('strategy = "dpsgd"\nrounds = 3\nlisten = "127.0.0.1:7000"\n'
                   '[learner]\nlr = 0.2\nbatch_size = 8\n')
    monkeypatch.setenv("COTERIE_ROUNDS", "5")
    monkeypatch.setenv("COTERIE_LEARNER__BATCH_SIZE", "16")
    r = runner.invoke(app, ["node", "start", "--config", str(cfg), "--rounds", "7",
                            "--peers", "127.0.0.1:1,127.0.0.1:2", "--node-id", "alpha",
                            "--set", "learner.lr=0.5", "--set", "labels.zone=eu",
                            "--admin-listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "st")])
    assert r.exit_code == 0, r.output
    c = captured["cfg"]
    assert c.rounds == 7  # flag beats env beats TOML
    assert c.learner.batch_size == 16  # env beats TOML
    assert c.strategy == "dpsgd" and c.listen == "127.0.0.1:7000"  # TOML kept
    assert c.learner.lr == 0.5 and c.labels == {"zone": "eu"}
    assert c.peers == ["127.0.0.1:1", "127.0.0.1:2"] and c.node_id == "alpha"
    assert c.state_dir == tmp_path / "st"


def test_node_start_exit_code_is_run_nodes(monkeypatch, captured):
    monkeypatch.setattr(daemon, "run_node", lambda cfg: 3)
    assert runner.invoke(app, ["node", "start"]).exit_code == 3


@pytest.mark.parametrize("args, env, field", [
    (["--set", "learner.lr=-1"], {}, "learner.lr"),
    (["--listen", "nohostport"], {}, "listen"),
    (["--peers", "a:1,b"], {}, "peers"),
    (["--rounds", "-2"], {}, "rounds"),
    (["--set", "no_such_field=1"], {}, "no_such_field"),
    (["--set", "novalue"], {}, "--set"),
    ([], {"COTERIE_HEARTBEAT_INTERVAL_S": "0"}, "heartbeat_interval_s"),
    ([], {"COTERIE_LEARNER__OPTIMIZER": "lbfgs"}, "learner.optimizer"),
])
def test_node_start_bad_config_exits_nonzero_naming_field(monkeypatch, captured, args, env, field):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    r = runner.invoke(app, ["node", "start", *args])
    assert r.exit_code == 2, r.output
    assert field in r.stderr
    assert "cfg" not in captured  # the daemon never started


def test_node_start_missing_or_broken_file(tmp_path, captured):
    r = runner.invoke(app, ["node", "start", "--config", str(tmp_path / "nope.toml")])
    assert r.exit_code == 2 and "does not exist" in r.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("strategy = ")
    r = runner.invoke(app, ["node", "start", "--config", str(bad)])
    assert r.exit_code == 2 and "not valid TOML" in r.stderr


# -------------------------------------------------------------------- status / peers / weights
@pytest.fixture(scope="module")
def admin_url():
    """A real admin server with a fake node, on loopback, in a background event loop."""
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    runner_, port = asyncio.run_coroutine_threadsafe(
        start_admin(FakeNode("n5"), "127.0.0.1", 0), loop).result(timeout=10)
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner_.cleanup(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(timeout=10)


def test_status_table_and_json(admin_url):
    r = runner.invoke(app, ["status", "--admin", admin_url])
    assert r.exit_code == 0, r.output
    assert "n5" in r.stdout and "fedfomo" in r.stdout and "test_acc=0.8" in r.stdout
    r = runner.invoke(app, ["status", "--admin", admin_url.removeprefix("http://"), "--json"])
    assert r.exit_code == 0
    st = json.loads(r.stdout)
    assert st["node_id"] == "n5" and st["round"] == 3


def test_peers_table_and_json(admin_url):
    r = runner.invoke(app, ["peers", "--admin", admin_url])
    assert r.exit_code == 0, r.output
    assert "127.0.0.1:5001" in r.stdout and "alive" in r.stdout and "dead" in r.stdout
    peers = json.loads(runner.invoke(app, ["peers", "--admin", admin_url, "--json"]).stdout)
    assert [p["node_id"] for p in peers] == ["n1", "n2"]


def test_weights_table_and_json(admin_url):
    r = runner.invoke(app, ["weights", "--admin", admin_url])
    assert r.exit_code == 0, r.output
    assert "n5" in r.stdout and "0.5" in r.stdout
    w = json.loads(runner.invoke(app, ["weights", "--admin", admin_url, "--json"]).stdout)
    assert w["weights"] == {"n5": 0.5, "n1": 0.5}


def test_unreachable_admin_is_a_clear_error():
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        for cmd in ("status", "peers", "weights", "history"):
            r = runner.invoke(app, [cmd, "--admin", f"http://127.0.0.1:{port}"])
            assert r.exit_code == 1
            assert "cannot reach" in r.stderr and str(port) in r.stderr
            assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1


def test_admin_http_error_reported(admin_url):
    r = runner.invoke(app, ["status", "--admin", admin_url + "/nowhere"])
    assert r.exit_code == 1 and "404" in r.stderr


def test_strategies_lists_registry():
    r = runner.invoke(app, ["strategies"])
    assert r.exit_code == 0
    lines = {l.split()[0]: l for l in r.stdout.splitlines() if l.strip()}
    assert lines["local"].split()[1] == "ok" and "dpsgd" in lines


# ---------------------------------------------------------------------------- run / demo
def test_run_bad_scenario_exits_2(tmp_path):
    sc = tmp_path / "s.toml"
    sc.write_text('nodes = 3\nrounds = 2\n[learner]\nbatch_size = 0\n')
    r = runner.invoke(app, ["run", str(sc), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "learner.batch_size" in r.stderr
    sc.write_text('nodes = 3\nrounds = 2\n')
    r = runner.invoke(app, ["run", str(sc), "--out", str(tmp_path / "o"), "--strategy", "local,nope"])
    assert r.exit_code == 2 and "nope" in r.stderr
    assert not (tmp_path / "o" / "results.json").exists()


@pytest.fixture
def fake_nodes(monkeypatch):
    monkeypatch.setattr(launcher, "node_command",
                        lambda spec: [sys.executable, FAKE, str(spec.config_path), "ok"])


def test_run_with_overrides_prints_table(tmp_path, fake_nodes):
    sc = tmp_path / "s.toml"
    sc.write_text('name = "tiny"\nnodes = 2\nrounds = 2\nstrategy = "local"\n'
                  '[learner]\npartition_params = { num_clusters = 2 }\n')
    out = tmp_path / "o"
    r = runner.invoke(app, ["run", str(sc), "--out", str(out), "--strategy", "local,dpsgd",
                            "--rounds", "4", "--seed", "9"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert res["scenario"]["rounds"] == 4 and res["scenario"]["seed"] == 9
    assert list(res["strategies"]) == ["local", "dpsgd"]
    assert res["strategies"]["dpsgd"]["nodes"]["n1"]["rounds"] == [1, 2, 3, 4]
    assert "final test accuracy per node" in r.stdout and "dpsgd" in r.stdout
    assert (out / "weights.png").exists() and (out / "accuracy.png").exists()


def test_run_reports_dead_node(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "node_command",
                        lambda spec: [sys.executable, FAKE, str(spec.config_path), "crash_n1"])
    sc = tmp_path / "s.toml"
    sc.write_text('nodes = 2\nrounds = 1\n[learner]\npartition_params = { num_clusters = 2 }\n')
    r = runner.invoke(app, ["run", str(sc), "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "node n1 exited with code 3" in r.stderr and "boom" in r.stderr


def test_demo_shows_heatmap_and_saves_png(tmp_path, fake_nodes):
    out = tmp_path / "demo"
    r = runner.invoke(app, ["demo", "--out", str(out), "--rounds", "2"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    names = list(res["strategies"])
    assert names[0] == "local" and len(names) == 2
    assert f"clusters found by {names[1]}" in r.stdout  # the terminal heatmap
    ids = res["node_ids"]
    rows = {l.split()[0]: l.split() for l in r.stdout.splitlines()
            if l.split()[:1] and l.split()[0] in ids and l.split()[1].startswith("c")}
    assert list(rows) == ids  # uniform peer weights: no blocks to find, the nodes' own order
    # fake nodes keep 0.5 for themselves: shown apart as a number, the diagonal as a dot
    assert all(row[2 + 8] == "0.50" for row in rows.values())
    assert rows["n0"][2:10] == ["·"] + ["██"] * 7  # every peer weight is the largest: full blocks
    assert rows["n0"][11:] == ["··", "██", "██", "██"]  # the true clusters: n0 with n1-n3
    assert (out / "weights.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(res["node_ids"]) == 8 and len(set(res["true_clusters"])) >= 2
