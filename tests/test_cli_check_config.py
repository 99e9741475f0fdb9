"""`coterie node check-config CONFIG`: what `node start` would refuse, found without joining a
network: the config, the strategy, the data (loaded) and model (built), the certificates, the
state dir. Exit 0 with a summary, else 2 with every problem named."""

from __future__ import annotations

import os
import socket

import pytest
import tomli_w
from typer.testing import CliRunner

from coterie.cli.main import app
from tests.nodeproc import NodeProc, node_certs, tiny_learner, wait_for

runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_node_env(monkeypatch):
    for k in [k for k in os.environ if k.startswith("COTERIE_") and k != "COTERIE_CACHE_DIR"]:
        monkeypatch.delenv(k)


def _config(tmp_path, **fields) -> str:
    cfg = {"node_id": "n1", "state_dir": str(tmp_path / "state"), "learner": tiny_learner(1, 0), **fields}
    path = tmp_path / "node.toml"
    path.write_text(tomli_w.dumps(cfg))
    return str(path)


def test_a_good_config_passes_with_a_summary(tmp_path):
    with socket.socket() as held:  # a running node holds its ports: no problem for a check
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        path = _config(tmp_path, listen=f"127.0.0.1:{port}", security={"cert_dir": str(node_certs(tmp_path, "n1"))})
        r = runner.invoke(app, ["node", "check-config", path])
    assert r.exit_code == 0, r.output
    assert "certificates: node n1, issued by the CA" in r.stdout
    assert "data mnist1d (node 0 of 1): train " in r.stdout and "model mlp: " in r.stdout
    assert "ok: the node can start" in r.stdout
    assert not (tmp_path / "state").exists()  # checked, not created: nothing was started


def test_every_problem_is_named_not_only_the_first(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    learner = {**tiny_learner(1, 0), "data": str(tmp_path / "missing.csv")}
    path = _config(
        tmp_path,
        strategy="nope",
        state_dir=str(blocker / "state"),
        security={"cert_dir": str(tmp_path / "no-certs")},
        learner=learner,
    )
    r = runner.invoke(app, ["node", "check-config", path])
    assert r.exit_code == 2, r.output
    err = r.stderr
    assert "unknown strategy 'nope'" in err
    assert f"{tmp_path / 'no-certs' / 'ca.pem'} does not exist" in err
    assert f"state_dir {blocker / 'state'}: {blocker} is not a directory" in err
    assert "learner: DataError" in err and "missing.csv" in err
    assert "4 problem(s)" in err


def test_a_key_that_is_not_the_certificates_is_refused(tmp_path):
    n1, n2 = node_certs(tmp_path, "n1"), node_certs(tmp_path, "n2")
    path = _config(
        tmp_path,
        security={"ca": str(n1 / "ca.pem"), "cert": str(n1 / "node.pem"), "key": str(n2 / "node.key")},
    )
    r = runner.invoke(app, ["node", "check-config", path])
    assert r.exit_code == 2, r.output
    assert f"{n2 / 'node.key'} is not the private key of the certificate {n1 / 'node.pem'}" in r.stderr


def test_an_unreadable_or_invalid_config_is_named(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[limits\n")
    r = runner.invoke(app, ["node", "check-config", str(bad)])
    assert r.exit_code == 2 and f"config file {bad} is not valid TOML" in r.stderr
    r = runner.invoke(app, ["node", "check-config", _config(tmp_path, log_level="LOUD", limits={"max_rpcs": 1})])
    assert r.exit_code == 2
    assert "log_level: Value error, unknown log level 'LOUD'" in r.stderr and "limits.max_rpcs" in r.stderr
    r = runner.invoke(app, ["node", "check-config", str(tmp_path / "absent.toml")])
    assert r.exit_code == 2 and "does not exist" in r.stderr


def test_a_state_dir_the_config_cannot_resume_is_named(tmp_path):
    """A state dir a real node wrote (mTLS, strategy local): its own config resumes it; another
    strategy, another model or another node's certificate is what the node would refuse at
    start. Read without the node's lock: here the node is still running."""
    import tomllib

    node = NodeProc(tmp_path, "n1", {"strategy": "local", "learner": tiny_learner(1, 0), "round_interval_s": 0.5})
    node.start(timeout=120)
    try:
        wait_for(lambda: node.status()["round"] >= 1, 60, "a checkpointed round")
        r = runner.invoke(app, ["node", "check-config", str(node.config_path)])
        assert r.exit_code == 0, r.output
        assert f"state dir {node.state_dir}: resumes node n1 at round " in r.stdout
        cfg = tomllib.loads(node.config_path.read_text())
        for change, problem in (
            ({"strategy": "dpsgd"}, "was written by strategy 'local', not 'dpsgd'"),
            ({"learner": {**cfg["learner"], "model": "linear"}}, "is for another model architecture"),
            (
                {"node_id": "n2", "security": {"cert_dir": str(node_certs(tmp_path, "n2"))}},
                "belongs to node 'n1', this config runs node 'n2'",
            ),
        ):
            other = tmp_path / "other.toml"
            other.write_text(tomli_w.dumps({**cfg, **change}))
            r = runner.invoke(app, ["node", "check-config", str(other)])
            assert r.exit_code == 2 and problem in r.stderr, r.output
    finally:
        node.stop()
