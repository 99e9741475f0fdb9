import asyncio
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

import coterie.node.daemon as daemon
from coterie.cli.main import app
from coterie.lab.launch import processes
from coterie.node.admin import start_admin
from coterie.node.config import ConfigError
from coterie.node.logs import RoundLog, configure_logging
from tests.fake_node import FakeNode

FAKE = str(Path(__file__).with_name("fake_daemon.py"))
runner = CliRunner()


@pytest.fixture
def captured(monkeypatch):
    """Replace the daemon entry point: record the config `node start` built."""
    seen = {}

    def fake_run_node(cfg, reload=None):
        seen["cfg"] = cfg
        seen["reload"] = reload
        return 0

    monkeypatch.setattr(daemon, "run_node", fake_run_node)
    for k in [k for k in __import__("os").environ if k.startswith("COTERIE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("COTERIE_SECURITY__INSECURE", "true")  # no certificates here: not what these test
    return seen


# ----------------------------------------------------------------------------- node start
def test_node_start_precedence_flags_env_toml(tmp_path, monkeypatch, captured):
    cfg = tmp_path / "node.toml"
    cfg.write_text('strategy = "dpsgd"\nrounds = 3\nlisten = "127.0.0.1:7000"\n[learner]\nlr = 0.2\nbatch_size = 8\n')
    monkeypatch.setenv("COTERIE_ROUNDS", "5")
    monkeypatch.setenv("COTERIE_LEARNER__BATCH_SIZE", "16")
    r = runner.invoke(
        app,
        [
            "node",
            "start",
            "--config",
            str(cfg),
            "--rounds",
            "7",
            "--peers",
            "127.0.0.1:1,127.0.0.1:2",
            "--node-id",
            "alpha",
            "--set",
            "learner.lr=0.5",
            "--set",
            "labels.zone=eu",
            "--admin-listen",
            "127.0.0.1:0",
            "--state-dir",
            str(tmp_path / "st"),
        ],
    )
    assert r.exit_code == 0, r.output
    c = captured["cfg"]
    assert c.rounds == 7  # flag beats env beats TOML
    assert c.learner.batch_size == 16  # env beats TOML
    assert c.strategy == "dpsgd" and c.listen == "127.0.0.1:7000"  # TOML kept
    assert c.learner.lr == 0.5 and c.labels == {"zone": "eu"}
    assert c.peers == ["127.0.0.1:1", "127.0.0.1:2"] and c.node_id == "alpha"
    assert c.state_dir == tmp_path / "st"


def test_node_start_reloads_the_same_file_env_and_flags(tmp_path, monkeypatch, captured):
    """What SIGHUP re-reads (node/reload.py): the file as it is now, under the same environment
    and flags, so a flag still beats the file after a reload."""
    cfg = tmp_path / "node.toml"
    cfg.write_text('log_level = "INFO"\nrounds = 3\n')
    r = runner.invoke(app, ["node", "start", "--config", str(cfg), "--rounds", "7"])
    assert r.exit_code == 0, r.output
    cfg.write_text('log_level = "DEBUG"\nrounds = 4\npeers = ["127.0.0.1:9"]\n')
    again = captured["reload"]()
    assert again.log_level == "DEBUG" and again.peers == ["127.0.0.1:9"]
    assert again.rounds == 7 and again.security.insecure  # the flag and the environment still hold
    cfg.write_text('log_level = "LOUD"\n')
    with pytest.raises(ConfigError, match="log_level"):
        captured["reload"]()


def test_node_start_exit_code_is_run_nodes(monkeypatch, captured):
    monkeypatch.setattr(daemon, "run_node", lambda cfg, reload=None: 3)
    assert runner.invoke(app, ["node", "start"]).exit_code == 3


@pytest.mark.parametrize(
    "args, env, field",
    [
        (["--set", "learner.lr=-1"], {}, "learner.lr"),
        (["--listen", "nohostport"], {}, "listen"),
        (["--peers", "a:1,b"], {}, "peers"),
        (["--rounds", "-2"], {}, "rounds"),
        (["--set", "no_such_field=1"], {}, "no_such_field"),
        (["--set", "novalue"], {}, "--set"),
        ([], {"COTERIE_HEARTBEAT_INTERVAL_S": "0"}, "heartbeat_interval_s"),
        ([], {"COTERIE_LEARNER__OPTIMIZER": "lbfgs"}, "learner.optimizer"),
    ],
)
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
ADMIN_TOKEN = "cli-test-admin-token-0123456789"


@pytest.fixture(autouse=True)
def _admin_token(monkeypatch):
    """The inspecting commands here find the fake node's token in COTERIE_ADMIN_TOKEN (--token and
    --state-dir: tests/test_admin_auth.py)."""
    monkeypatch.setenv("COTERIE_ADMIN_TOKEN", ADMIN_TOKEN)


@pytest.fixture(scope="module")
def admin_url():
    """A real admin server with a fake node, on loopback, in a background event loop."""
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    runner_, port = asyncio.run_coroutine_threadsafe(
        start_admin(FakeNode("n5"), "127.0.0.1", 0, token=ADMIN_TOKEN), loop
    ).result(timeout=10)
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
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()}
    assert lines["local"].split()[1] == "ok" and "dpsgd" in lines


# ---------------------------------------------------------------------------- run / demo
def test_run_bad_scenario_exits_2(tmp_path):
    sc = tmp_path / "s.toml"
    sc.write_text("nodes = 3\nrounds = 2\n[learner]\nbatch_size = 0\n")
    r = runner.invoke(app, ["run", str(sc), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "learner.batch_size" in r.stderr
    sc.write_text("nodes = 3\nrounds = 2\n")
    r = runner.invoke(app, ["run", str(sc), "--out", str(tmp_path / "o"), "--strategy", "local,nope"])
    assert r.exit_code == 2 and "nope" in r.stderr
    assert not (tmp_path / "o" / "results.json").exists()


def test_run_oversized_partition_exits_2_before_starting_nodes(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(processes, "default_command", lambda spec: started.append(spec) or ["false"])
    sc = tmp_path / "s.toml"
    sc.write_text(
        'nodes = 3\nrounds = 2\n[learner]\ndataset = "digits"\n'
        "partition_params = { num_clusters = 3, samples_per_node = 900 }\n"
    )
    r = runner.invoke(app, ["run", str(sc), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "needs 2700 samples" in r.stderr and "node n0" in r.stderr
    assert not started and not (tmp_path / "o" / "results.json").exists()


@pytest.fixture
def fake_nodes(monkeypatch):
    monkeypatch.setattr(processes, "default_command", lambda spec: [sys.executable, FAKE, str(spec.config_path), "ok"])


def test_run_with_overrides_prints_table(tmp_path, fake_nodes):
    sc = tmp_path / "s.toml"
    sc.write_text(
        'name = "tiny"\nnodes = 2\nrounds = 2\nstrategy = "local"\n[learner]\npartition_params = { num_clusters = 2 }\n'
    )
    out = tmp_path / "o"
    r = runner.invoke(
        app, ["run", str(sc), "--out", str(out), "--strategy", "local,dpsgd", "--rounds", "4", "--seed", "9"]
    )
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert res["scenario"]["rounds"] == 4 and res["scenario"]["seed"] == 9
    assert list(res["strategies"]) == ["local", "dpsgd"]
    assert res["strategies"]["dpsgd"]["nodes"]["n1"]["rounds"] == [1, 2, 3, 4]
    assert "final test accuracy per node" in r.stdout and "dpsgd" in r.stdout
    assert (out / "weights.png").exists() and (out / "accuracy.png").exists()


def test_run_reports_dead_node(tmp_path, monkeypatch):
    monkeypatch.setattr(
        processes, "default_command", lambda spec: [sys.executable, FAKE, str(spec.config_path), "crash_n1"]
    )
    sc = tmp_path / "s.toml"
    sc.write_text("nodes = 2\nrounds = 1\n[learner]\npartition_params = { num_clusters = 2 }\n")
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
    rows = {
        line.split()[0]: line.split()
        for line in r.stdout.splitlines()
        if line.split()[:1] and line.split()[0] in ids and line.split()[1].startswith("c")
    }
    assert list(rows) == ids  # uniform peer weights: no blocks to find, the nodes' own order
    # fake nodes keep 0.5 for themselves: shown apart as a number, the diagonal as a dot
    assert all(row[2 + 8] == "0.50" for row in rows.values())
    assert rows["n0"][2:10] == ["·"] + ["██"] * 7  # every peer weight is the largest: full blocks
    assert rows["n0"][11:] == ["··", "██", "██", "██"]  # the true clusters: n0 with n1-n3
    assert (out / "weights.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(res["node_ids"]) == 8 and len(set(res["true_clusters"])) >= 2


# ------------------------------------------------------------------ what a new user runs into
def test_version_and_completion():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"coterie {metadata.version('coterie')}"
    assert "--install-completion" in runner.invoke(app, ["--help"]).stdout


def test_admin_url_from_environment(admin_url, monkeypatch):
    monkeypatch.setenv("COTERIE_ADMIN", admin_url)
    r = runner.invoke(app, ["status", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["node_id"] == "n5"
    monkeypatch.delenv("COTERIE_ADMIN")
    r = runner.invoke(app, ["peers"])
    assert r.exit_code == 1 and "COTERIE_ADMIN" in r.stderr and "Traceback" not in r.output


def test_history_table_and_json(admin_url):
    r = runner.invoke(app, ["history", "--admin", admin_url])
    assert r.exit_code == 0, r.output
    assert "3 rounds of n5" in r.stdout and "0.8" in r.stdout and "n1 0.50" in r.stdout
    data = json.loads(runner.invoke(app, ["history", "--admin", admin_url, "--json", "--last", "2"]).stdout)
    assert [e["round"] for e in data] == [2, 3]
    data = json.loads(runner.invoke(app, ["history", "-a", admin_url, "--json", "--since", "2"]).stdout)
    assert [e["round"] for e in data] == [3]


def test_strategies_json():
    rows = json.loads(runner.invoke(app, ["strategies", "--json"]).stdout)
    local = next(r for r in rows if r["name"] == "local")
    assert local == {"name": "local", "ok": True, "problem": None} and len(rows) >= 10


def _ctrl_c_reaches_it() -> None:
    # a command started in the background of a non-interactive shell (`bash .ci/run &`) inherits
    # SIGINT ignored, and Python then installs no KeyboardInterrupt handler: the watch would never
    # see the test's Ctrl-C. A terminal's foreground job always gets it; so does this child
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_status_watch_refreshes_until_interrupted(admin_url):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coterie.cli.main",
            "status",
            "--admin",
            admin_url,
            "--watch",
            "--json",
            "--interval",
            "0.2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ctrl_c_reaches_it,
    )
    try:
        lines = [proc.stdout.readline() for _ in range(3)]  # three refreshes, one JSON line each
        assert all(json.loads(line)["node_id"] == "n5" for line in lines)
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in err


def test_status_watch_waits_for_a_starting_nodes_state_dir(admin_url, tmp_path):
    """`coterie status --watch --state-dir n0` right after `coterie node start ... &` (the README's
    walk-through): the node has not written node.json or its token yet. The watch says so and
    retries, then shows the node once they are there (it used to exit at once)."""
    st = tmp_path / "n0"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COTERIE_ADMIN")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coterie.cli.main",
            "status",
            "--state-dir",
            str(st),
            "--watch",
            "--json",
            "--interval",
            "0.2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ctrl_c_reaches_it,
        env=env,
    )
    try:
        first = json.loads(proc.stdout.readline())
        assert "no node.json" in first["error"] and proc.poll() is None
        st.mkdir()
        (st / "admin.token").write_text(ADMIN_TOKEN + "\n")
        (st / "node.json").write_text(json.dumps({"admin_url": admin_url, "node_id": "n5"}))
        for _ in range(50):  # a refresh every 0.2 s: the node within a few
            line = json.loads(proc.stdout.readline())
            if "node_id" in line:
                break
        assert line["node_id"] == "n5"
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in err


def test_unknown_env_variable_is_warned_about(captured, monkeypatch):
    monkeypatch.setenv("COTERIE_STRATEGIE", "dpsgd")
    r = runner.invoke(app, ["node", "start"])
    assert r.exit_code == 0
    assert "COTERIE_STRATEGIE is not a coterie setting" in r.stderr and "COTERIE_STRATEGY?" in r.stderr
    assert captured["cfg"].strategy == "local"


def test_defaults_pass_preflight(captured):
    """`coterie node start` on defaults: one node, one cluster (this used to fail after seconds:
    label_permutation's 4 clusters do not fit num_nodes=1)."""
    r = runner.invoke(app, ["node", "start"])
    assert r.exit_code == 0, r.output
    cfg = captured["cfg"]
    assert cfg.learner.num_nodes == 1 and cfg.round_interval_s > 0


@pytest.mark.parametrize(
    "args, words",
    [
        (["--strategy", "nope"], ["unknown strategy 'nope'", "fedfomo"]),
        (
            ["--set", "learner.num_nodes=3", "--set", "learner.partition_params.num_clusters=5"],
            ["num_clusters=5", "num_nodes=3"],
        ),
        (["--log-format", "xml"], ["--log-format"]),
    ],
)
def test_node_start_refuses_before_starting(captured, args, words):
    r = runner.invoke(app, ["node", "start", *args])
    assert r.exit_code == 2, r.output
    assert all(w in r.stderr for w in words), r.stderr
    assert "cfg" not in captured and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) <= 2  # one message (rich may wrap it once)


def test_taken_port_is_one_line_before_starting(captured):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = f"127.0.0.1:{s.getsockname()[1]}"
        for flag in ("--listen", "--admin-listen"):
            r = runner.invoke(app, ["node", "start", flag, taken])
            assert r.exit_code == 1 and "already in use" in r.stderr and taken in r.stderr
    assert "cfg" not in captured


async def test_peer_server_bind_failure_is_an_oserror():
    """Past the preflight (a port taken in between): grpc's RuntimeError becomes the OSError that
    run_node reports as one line."""
    from coterie.node.transport.server import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(OSError, match="in use"):
            await serve(object(), object(), f"127.0.0.1:{s.getsockname()[1]}", tls=None)


def test_json_log_format():
    buf = io.StringIO()
    configure_logging("INFO", "json", stream=buf)
    try:
        logging.getLogger("coterie.node").info("round %d done", 4, extra={"round": 4})
    finally:
        configure_logging("WARNING", "text")
    line = json.loads(buf.getvalue().splitlines()[-1])
    assert line["message"] == "round 4 done" and line["level"] == "INFO" and line["round"] == 4
    assert line["logger"] == "coterie.node" and "time" in line


def test_round_log_summarises_fast_rounds():
    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record)

    log = logging.getLogger("test.roundlog")
    log.setLevel(logging.DEBUG)
    log.addHandler(Capture())
    now = [0.0]
    rl = RoundLog(log, slow_s=2.0, summary_s=30.0, clock=lambda: now[0])
    rl.round_done(1, 0.1, {"test_acc": 0.5})  # the first round is always shown
    for r in range(2, 302):  # 300 rounds at 5 per second
        now[0] += 0.2
        rl.round_done(r, 0.1, {"test_acc": 0.5})
    info = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert info[0].startswith("round 1 done")
    assert 1 < len(info) <= 4 and all(m.startswith("rounds ") for m in info[1:])  # a summary per 30 s
    assert "(5.0/s)" in info[1]
    now[0] += 10  # a slow round: shown on its own again, after the pending summary
    rl.round_done(302, 9.0, {"test_acc": 0.6})
    assert records[-1].getMessage().startswith("round 302 done") and records[-1].levelno == logging.INFO


# ------------------------------------------------------------------ a real node, by hand
@pytest.mark.slow
def test_real_node_problems_reflection_and_wrong_port(tmp_path):
    """A hand-started node whose bootstrap peer is down says so (log and /status problems); the
    CLI pointed at its gRPC port gives one line, not a traceback; gRPC reflection lists the
    peer service; a second node on the same peer port fails in one line."""
    import grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    from coterie.node.security.pki import load_credentials
    from coterie.node.transport.tls import TLS
    from tests.nodeproc import NodeProc, node_certs, tiny_learner, wait_for

    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))  # bound, not listening: nobody answers there
        down = f"127.0.0.1:{dead.getsockname()[1]}"
        node = NodeProc(
            tmp_path,
            "solo",
            {
                "peers": [down],
                "learner": tiny_learner(1, 0),
                "heartbeat_interval_s": 0.2,  # reflection is opt-in
                "security": {"cert_dir": str(node_certs(tmp_path, "solo")), "reflection": True},
            },
        ).start()
        try:
            problems = wait_for(
                lambda: [p for p in node.status()["problems"] if down in p["message"]],
                30,
                "the unreachable bootstrap peer in /status problems",
            )
            assert "cannot reach bootstrap peer" in problems[0]["message"]
            assert len(problems) == 1  # reported once, not every heartbeat
            wait_for(
                lambda: "cannot reach bootstrap peer at " + down in node.log_tail(200), 10, "the warning in the log"
            )

            r = runner.invoke(app, ["status", "--admin", f"http://{node.address}"])
            assert r.exit_code == 1 and "Traceback" not in r.output
            assert "does not answer HTTP" in r.stderr and "gRPC" in r.stderr

            tls = TLS(load_credentials(node_certs(tmp_path, "cli")))  # the peer port is mTLS
            with grpc.secure_channel(
                node.address,
                tls.channel_credentials(),
                options=[("grpc.ssl_target_name_override", TLS.target_name("solo"))],
            ) as ch:
                services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
            assert {"coterie.v1.Peer", "grpc.health.v1.Health"} <= services

            second = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "coterie.cli.main",
                    "node",
                    "start",
                    "--listen",
                    node.address,
                    "--state-dir",
                    str(tmp_path / "second"),
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert second.returncode == 1 and "already in use" in second.stderr
            assert "Traceback" not in second.stderr
        finally:
            node.stop()


def test_bootstrap_from_a_running_nodes_node_json(tmp_path, captured):
    """--bootstrap-from waits for another node's node.json (port 0: the address is known only once
    that node is up) and adds its address; a node.json of a process that is gone does not count."""
    st = tmp_path / "n0"
    st.mkdir()
    (st / "node.json").write_text(json.dumps({"address": "127.0.0.1:7123", "pid": os.getpid()}))
    r = runner.invoke(app, ["node", "start", "--peers", "127.0.0.1:9", "--bootstrap-from", str(st)])
    assert r.exit_code == 0, r.output
    assert captured["cfg"].peers == ["127.0.0.1:9", "127.0.0.1:7123"]

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    (st / "node.json").write_text(json.dumps({"address": "127.0.0.1:7123", "pid": int(gone)}))
    del captured["cfg"]
    r = runner.invoke(app, ["node", "start", "--set", "start_timeout_s=0.3", "--bootstrap-from", str(st / "node.json")])
    assert r.exit_code == 1 and "no running node wrote" in r.stderr and "Traceback" not in r.output
    assert "cfg" not in captured
