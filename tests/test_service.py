"""A node run as a service: the systemd unit's fields (deploy/systemd/coterie-node.service), the
sd_notify protocol against a real unix datagram socket, and a real daemon process under it:
READY=1 once up, WATCHDOG=1 periodically, SIGHUP reloading what can change live and refusing a
bad config while it keeps running.

systemd itself does not run on the machines these tests run on (PID 1 is not systemd in CI's
containers), so start/stop under systemd is not exercised here: the daemon's side of the protocol
is, with the test standing in for the manager's socket, and ``systemd-analyze verify`` checks the
unit where the tool is installed (docs/running-a-node.md)."""

from __future__ import annotations

import configparser
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomli_w
import tomllib

from coterie.node.config import NodeConfig
from coterie.node.peering.admission import Admission
from coterie.node.peering.errors import Refusal
from coterie.node.reload import LIVE, changed, flatten
from coterie.node.sd_notify import Notifier
from tests.nodeproc import NodeProc, tiny_learner, wait_for

UNIT = Path(__file__).resolve().parents[1] / "deploy" / "systemd" / "coterie-node.service"


# ------------------------------------------------------------------------------- the unit
def _unit() -> configparser.ConfigParser:
    p = configparser.ConfigParser(interpolation=None, strict=True)
    p.optionxform = str  # type: ignore[assignment,method-assign] # systemd keys are case-sensitive
    p.read_string(UNIT.read_text())
    return p


def test_the_unit_is_hardened_and_supervised():
    u = _unit()
    svc = u["Service"]
    # the daemon speaks the notify protocol, from its main process, and pings the watchdog
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "main"
    assert int(svc["WatchdogSec"].rstrip("s")) >= 10
    assert svc["Restart"] == "on-failure"
    assert svc["ExecReload"] == "/bin/kill -HUP $MAINPID"
    # its own user, a read-only system, writable: the state dir only (and the dataset cache)
    assert svc["User"] == "coterie" and svc["Group"] == "coterie"
    assert svc["ProtectSystem"] == "strict"
    start = svc["ExecStart"].split()
    state_dir = start[start.index("--state-dir") + 1]
    assert svc["ReadWritePaths"].split() == [state_dir] == ["/var/lib/" + svc["StateDirectory"]]
    for key in ("PrivateTmp", "NoNewPrivileges", "ProtectHome", "PrivateDevices", "RestrictSUIDSGID"):
        assert svc[key] == "yes", key
    assert svc["CapabilityBoundingSet"] == ""  # no capability at all
    assert svc["RestrictAddressFamilies"].split() == ["AF_UNIX", "AF_INET", "AF_INET6"]
    assert "node start" in svc["ExecStart"] and "--config /etc/coterie/node.toml" in svc["ExecStart"]
    # stopping waits for the checkpoints a SIGTERM writes (Checkpointer.close: 60 s)
    assert int(svc["TimeoutStopSec"]) > 60
    assert u["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    """systemd's own parser: no unknown key, no misplaced one; its exposure score stays low. The
    ExecStart binary is pointed at this install (verify checks it exists)."""
    coterie = shutil.which("coterie")
    assert coterie is not None
    unit = tmp_path / "coterie-node.service"
    unit.write_text(UNIT.read_text().replace("/opt/coterie/bin/coterie", coterie))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "coterie-node.service" not in r.stderr, r.stderr
    # exposure on systemd's 0-10 scale (threshold in tenths): 1.7 today; "OK" ends at 4.9
    r = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--threshold=25", str(unit)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr


# ------------------------------------------------------------------------------- sd_notify
@pytest.fixture
def manager() -> Iterator[tuple[socket.socket, str]]:
    """A socket standing in for systemd's: bound by the test, as $NOTIFY_SOCKET names it (a short
    path: unix socket paths end at 107 bytes)."""
    d = tempfile.mkdtemp(prefix="sdn-")
    path = f"{d}/notify"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    yield s, path
    s.close()
    shutil.rmtree(d, ignore_errors=True)


def receive(s: socket.socket, until: str, timeout: float, seen: list[str] | None = None) -> list[str]:
    """Datagrams' lines until one equals ``until``; fails naming what arrived instead."""
    seen = [] if seen is None else seen
    deadline = time.monotonic() + timeout
    while until not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {until} within {timeout}s; received {seen[-12:]}")
        s.settimeout(left)
        try:
            seen.extend(s.recv(4096).decode().splitlines())
        except TimeoutError:
            continue
    return seen


def test_notifier_sends_states_to_the_managers_socket(manager):
    s, path = manager
    n = Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
    assert n is not None and n.watchdog_s == 2.0
    assert n.notify("READY=1", "STATUS=up")
    s.settimeout(5)
    assert s.recv(4096) == b"READY=1\nSTATUS=up"
    n.reloading()
    lines = s.recv(4096).decode().splitlines()
    assert lines[0] == "RELOADING=1" and lines[1].startswith("MONOTONIC_USEC=")


def test_notifier_abstract_socket_and_what_it_refuses(tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(f"\0coterie-test-{time.monotonic_ns()}")
    name = "@" + s.getsockname()[1:].decode()
    try:
        n = Notifier.from_env({"NOTIFY_SOCKET": name})
        assert n is not None and n.watchdog_s is None  # no WATCHDOG_USEC: no pings expected
        assert n.notify("READY=1")
        s.settimeout(5)
        assert s.recv(64) == b"READY=1"
    finally:
        s.close()
    assert Notifier.from_env({}) is None  # not under a manager: nothing is sent, nothing fails
    # a watchdog meant for another process (WATCHDOG_PID) is not this one's to ping
    assert Notifier.from_env({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_s is None
    with pytest.raises(ValueError, match="NOTIFY_SOCKET"):
        Notifier.from_env({"NOTIFY_SOCKET": "relative/path"})
    gone = Notifier(str(tmp_path / "no-such-socket"))
    assert gone.notify("WATCHDOG=1") is False and gone.notify("WATCHDOG=1") is False  # logged once, no raise


# ------------------------------------------------------------------------------- reload, in parts
def test_changed_fields_are_named_by_their_dotted_path():
    a = NodeConfig(security={"insecure": True})
    b = NodeConfig(
        security={"insecure": True}, log_level="DEBUG", peers=["h:1"], limits={"request_burst": 9}, learner={"lr": 0.3}
    )
    fields = changed(flatten(a), flatten(b))
    assert fields == ["learner.lr", "limits.request_burst", "log_level", "peers"]
    assert [f for f in fields if f not in LIVE] == ["learner.lr"]


def test_retuned_admission_binds_peers_already_metered():
    """A reload that lowers the per-peer budget must bind a peer that already holds a full burst
    of the old one (without ``retune`` updating its buckets, it keeps 80 requests of credit)."""
    now = [0.0]
    adm = Admission(NodeConfig().limits, clock=lambda: now[0])
    with adm.admit("p", "snapshot"):
        pass
    adm.retune(NodeConfig(limits={"request_burst": 2, "requests_per_s": 1}).limits)
    for _ in range(2):  # the new burst, and no more
        with adm.admit("p", "snapshot"):
            pass
    with pytest.raises(Refusal, match="over 1 requests per second"):
        with adm.admit("p", "snapshot"):
            pass


# ------------------------------------------------------------------------------- a real daemon
def _rewrite(node: NodeProc, **changes) -> dict:
    cfg = tomllib.loads(node.config_path.read_text())
    for key, value in changes.items():
        section, _, field = key.rpartition("__")
        (cfg.setdefault(section, {}) if section else cfg)[field] = value
    node.config_path.write_text(tomli_w.dumps(cfg))
    return cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_daemon_under_a_notify_socket_reloads_on_sighup(tmp_path, manager, monkeypatch):
    s, path = manager
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")  # a ping every 0.5 s
    node = NodeProc(
        tmp_path,
        "n1",
        {"strategy": "local", "learner": tiny_learner(1, 0), "round_interval_s": 0.2, "log_level": "WARNING"},
    )
    node.start(timeout=120)
    try:
        seen = receive(s, "READY=1", 30)
        assert any(line.startswith("STATUS=node n1 at 127.0.0.1:") for line in seen), seen
        # the watchdog keeps coming, from the daemon's loop
        t0 = time.monotonic()
        for _ in range(4):
            receive(s, "WATCHDOG=1", 10)
        assert time.monotonic() - t0 < 15  # 4 pings at 0.5 s, with room for a loaded machine
        assert node.status()["reload"] is None  # no reload yet

        # live: log level, seed peers, a peer budget; not live: the learner
        seed = f"127.0.0.1:{_free_port()}"  # nobody there: the node says it cannot reach its new seed
        _rewrite(node, log_level="DEBUG", peers=[seed], limits__requests_per_s=10.0, learner__lr=0.2)
        node.proc.send_signal(signal.SIGHUP)
        receive(s, "READY=1", 30, receive(s, "RELOADING=1", 30))
        reload = node.status()["reload"]
        assert reload["error"] is None
        assert set(reload["applied"]) == {"log_level", "peers", "limits.requests_per_s"}, reload
        assert reload["needs_restart"] == ["learner.lr"], reload
        wait_for(lambda: f"cannot reach bootstrap peer at {seed}" in node.log_tail(400), 30, "the new seed dialled")
        wait_for(lambda: " DEBUG " in node.log_tail(400), 30, "DEBUG lines once the level is DEBUG")

        # a bad config is refused whole, named; the node keeps running on the one it has
        _rewrite(node, log_level="LOUD", peers=[])
        node.proc.send_signal(signal.SIGHUP)
        receive(s, "READY=1", 30, receive(s, "RELOADING=1", 30))
        reload = node.status()["reload"]
        assert "log_level" in reload["error"] and "LOUD" in reload["error"], reload
        assert reload["applied"] == [] and node.proc.poll() is None
        node.config_path.write_text(node.config_path.read_text() + "\nlog_level = = 1\n")  # not TOML at all
        node.proc.send_signal(signal.SIGHUP)
        receive(s, "READY=1", 30, receive(s, "RELOADING=1", 30))
        assert "is not valid TOML" in node.status()["reload"]["error"]
        assert "refused, the node keeps running" in node.log_tail(400)
        before = node.status()["round"]
        wait_for(lambda: node.status()["round"] > before, 30, "rounds going on after refused reloads")

        node.proc.send_signal(signal.SIGTERM)
        receive(s, "STOPPING=1", 60)
        assert node.proc.wait(timeout=60) == 0
    finally:
        node.stop()


def test_seed_peers_swap_live():
    """New seeds become pinned candidates; a dropped seed nobody answered at is no longer retried."""
    from types import SimpleNamespace

    from coterie.node.peering.handshakes import Handshakes
    from coterie.node.peering.membership_state import Candidates

    state = SimpleNamespace(pending=Candidates())
    h = Handshakes(state, None, None, ["a:1", "b:2"])  # type: ignore[arg-type]
    h.set_bootstrap(["b:2", "c:3"])
    assert list(state.pending) == ["b:2", "c:3"] and h.bootstrap == {"b:2", "c:3"}
    assert all(state.pending._c[a].pinned for a in ("b:2", "c:3"))


def test_relay_budget_retunes_live_unless_relaying_is_switched():
    from coterie.node.transport.grpc_transport import GrpcTransport
    from coterie.node.transport.relay_service import RelayBudget, RelayService

    cfg = NodeConfig(security={"insecure": True})
    t = GrpcTransport.from_config(cfg, tls=None)
    lower = NodeConfig(security={"insecure": True}, relay={"max_bytes_per_s": 1e3, "max_reservations": 2})
    assert t.retune_relay(lower) and t.relay_budget == RelayBudget(2, 16, 1e3, 5.0)
    assert not t.retune_relay(NodeConfig(security={"insecure": True}, relay={"serve": False}))  # a restart
    relay = RelayService(None, RelayBudget())  # type: ignore[arg-type] # (retune needs no TLS)
    bucket = relay._bucket("p")
    relay.retune(RelayBudget(max_bytes_per_s=1e3))
    assert bucket.rate == 1e3 and bucket.tokens <= 1e3 and relay.budget.max_bytes_per_s == 1e3


def test_sigusr1_dumps_thread_stacks_and_sigusr2_task_stacks_and_the_node_runs_on(tmp_path):
    """A stuck daemon can say where it is stuck: SIGUSR1 writes every thread's stack (faulthandler,
    even with the event loop blocked), SIGUSR2 logs every asyncio task's stack; neither stops it."""
    node = NodeProc(tmp_path, "n0", {"learner": tiny_learner(1, 0), "round_interval_s": 0.2}).start()
    try:
        node.proc.send_signal(signal.SIGUSR1)
        wait_for(
            lambda: "Current thread" in node.log_tail(400) or "Thread 0x" in node.log_tail(400), 30, "thread stacks"
        )
        node.proc.send_signal(signal.SIGUSR2)
        wait_for(lambda: "asyncio tasks (" in node.log_tail(400), 30, "task stacks")
        tail = node.log_tail(400)
        assert "on SIGUSR2" in tail and "--- rounds\n" in tail and "rounds.py" in tail, tail[-3000:]
        rounds = node.status()["round"]
        wait_for(lambda: node.status()["round"] > rounds, 30, "rounds to go on")
        assert node.proc.poll() is None
    finally:
        node.stop()
