"""A failing disk on real daemons: the failure is logged with its cause, /healthz and gRPC health
go NOT_SERVING, /status and `coterie status` show it, and the node recovers by itself when the
disk takes writes again; SIGTERM while it is failing exits non-zero. One owner per state dir.

Disk full and read-only use a small tmpfs mounted over the state dir (needs CAP_SYS_ADMIN, as
root in CI); without it, disk full falls back to RLIMIT_FSIZE on the running process and
read-only to chmod (non-root only)."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coterie.node.persistence import StateError, StateStore
from tests.nodeproc import NodeProc, node_certs, tiny_learner, wait_for

pytestmark = pytest.mark.slow


def _try_mount(path: Path, size: str = "4m") -> bool:
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def _remount(path: Path, mode: str) -> bool:
    return subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], capture_output=True).returncode == 0


@pytest.fixture
def disk(tmp_path):
    """A node whose state dir sits on its own small tmpfs (or a plain dir if that cannot be)."""
    state = tmp_path / "n1" / "state"
    state.mkdir(parents=True)
    mounted = _try_mount(state)
    node = NodeProc(tmp_path, "n1", {"strategy": "local", "round_interval_s": 0.1, "learner": tiny_learner(1, 0)})
    try:
        yield node, mounted
    finally:
        node.kill()
        if mounted:
            _remount(state, "rw")
            subprocess.run(["umount", "-l", str(state)], capture_output=True)
        else:
            state.chmod(0o755)


def _healthz(node: NodeProc) -> int:
    try:
        with urllib.request.urlopen(node.admin + "/healthz", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _grpc_health(node: NodeProc) -> int:
    """The standard health check, over mTLS as any peer (or a k8s probe with a certificate) asks."""
    from coterie.node.security.pki import load_credentials
    from coterie.node.transport.tls import TLS

    tls = TLS(load_credentials(node_certs(node.dir.parent, "prober")))
    with grpc.secure_channel(
        node.address, tls.channel_credentials(), options=[("grpc.ssl_target_name_override", tls.target_name(None))]
    ) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _cli_status(node: NodeProc) -> str:
    return subprocess.run(
        [sys.executable, "-m", "coterie.cli.main", "status", "--admin", node.admin, "--state-dir", str(node.state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "400"},
    ).stdout


def _assert_failing(node: NodeProc, cause: str) -> int:
    """The failure shows everywhere an operator looks; returns the checkpointed round."""
    wait_for(
        lambda: cause in node.log_tail(400) and "checkpoint failed" in node.log_tail(400),
        60,
        f"a log line naming the checkpoint failure ({cause})",
    )
    wait_for(lambda: _healthz(node) == 503, 30, "/healthz to answer 503")
    wait_for(lambda: _grpc_health(node) == health_pb2.HealthCheckResponse.NOT_SERVING, 30, "gRPC health NOT_SERVING")
    st = node.status()
    assert st["health"] == "failing" and st["failures"][0]["component"] == "checkpoint"
    assert cause in st["failures"][0]["error"]
    assert any("checkpoint failing" in p["message"] and cause in p["message"] for p in st["problems"])
    out = _cli_status(node)
    assert "failing" in out and cause in out
    return st["round"]


def _assert_recovers(node: NodeProc, stuck_at: int) -> None:
    wait_for(lambda: _healthz(node) == 200, 60, "/healthz to recover")
    wait_for(lambda: _grpc_health(node) == health_pb2.HealthCheckResponse.SERVING, 30, "gRPC SERVING again")
    wait_for(lambda: node.status()["round"] >= stuck_at + 2, 60, "checkpointed rounds to advance again")
    assert "checkpoint recovered" in node.log_tail(400)
    assert node.status()["failures"] == []


def _fill(directory: Path) -> Path:
    """Write zeros until the filesystem is full."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(bytes(1 << 16))
                f.flush()
        except OSError:
            pass
    return filler


def test_disk_full_is_reported_and_the_node_recovers_when_space_returns(disk):
    node, mounted = disk
    node.start()
    wait_for(lambda: node.status()["round"] >= 2, 60, "two checkpointed rounds")
    if mounted:
        filler = _fill(node.state_dir)
        stuck = _assert_failing(node, "No space left on device")
        assert node.status()["unsaved_rounds"] <= 1  # the round loop waits for the disk
        filler.unlink()
    else:  # no tmpfs: cap the file size of the running process below a checkpoint's
        resource.prlimit(node.proc.pid, resource.RLIMIT_FSIZE, (16 << 10, resource.RLIM_INFINITY))
        stuck = _assert_failing(node, "File too large")
        resource.prlimit(node.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    _assert_recovers(node, stuck)
    assert node.stop() == 0
    node.start()  # the state written across the outage resumes
    assert node.status()["round"] >= stuck + 2


def test_read_only_disk_is_reported_recovers_and_sigterm_while_failing_exits_nonzero(disk):
    node, mounted = disk
    if not mounted and os.geteuid() == 0:
        pytest.skip("cannot mount a tmpfs here, and chmod does not stop root")
    node.start()
    wait_for(lambda: node.status()["round"] >= 2, 60, "two checkpointed rounds")

    def make_read_only():
        if mounted:  # EBUSY while a commit holds a file open for writing: try again
            return wait_for(lambda: _remount(node.state_dir, "ro"), 30, "a read-only remount")
        node.state_dir.chmod(0o555)

    def make_writable():
        if mounted:
            assert _remount(node.state_dir, "rw")
        else:
            node.state_dir.chmod(0o755)

    cause = "Read-only file system" if mounted else "Permission denied"
    make_read_only()
    stuck = _assert_failing(node, cause)
    make_writable()
    _assert_recovers(node, stuck)

    make_read_only()
    _assert_failing(node, cause)
    shown = node.status()["round"]
    node.proc.send_signal(signal.SIGTERM)
    rc = node.proc.wait(timeout=60)
    assert rc != 0, "SIGTERM while checkpoints fail must not exit 0"
    assert "unresolved failures" in node.log_tail(20) and cause in node.log_tail(20)
    make_writable()
    node.start()  # resumes at the last checkpoint it did write: never behind what it showed, and
    # at most the one round ahead whose commit may have finished between the read and the signal
    assert shown <= node.status()["round"] <= shown + 1


def test_a_second_process_on_the_same_state_dir_exits_naming_the_holder(tmp_path):
    first = NodeProc(
        tmp_path, "one", {"strategy": "local", "round_interval_s": 0.1, "learner": tiny_learner(1, 0)}
    ).start()
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "coterie.cli.main",
                "node",
                "start",
                "--config",
                str(first.config_path),
                "--strategy",
                "dpsgd",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode != 0
        assert f"in use by another coterie node (pid {first.proc.pid}" in r.stderr
        # the owner is untouched: still healthy, still checkpointing rounds, the lock still its own
        start = first.status()["round"]
        wait_for(lambda: first.status()["round"] >= start + 2, 60, "the owner to keep going")
        assert first.status()["health"] == "ok" and first.status()["strategy"] == "local"
        with pytest.raises(StateError, match="in use by another coterie node"):
            StateStore(first.state_dir).lock()
    finally:
        assert first.stop() == 0
    StateStore(first.state_dir).lock()  # released when the owner exits


async def test_a_round_that_raises_is_reported_retried_and_recovers(tmp_path):
    """In process: a strategy whose rounds raise flips health and says why, the loop backs off and
    retries, and once the cause goes away the round runs again and health comes back."""
    from coterie.node.config import validate_config
    from coterie.node.daemon import Node

    node = Node(
        validate_config(
            {
                "node_id": "solo",
                "state_dir": str(tmp_path / "solo"),
                "strategy": "local",
                "rounds": 3,
                "security": {"insecure": True},  # one node: the state dir is under test, not the peer port
                "min_peers": 0,
                "round_interval_s": 0.0,
                "listen": "127.0.0.1:0",
                "admin_listen": "127.0.0.1:0",
                "learner": {
                    "dataset": "mnist1d",
                    "dataset_params": {"num_samples": 600},
                    "partition": "iid",
                    "num_nodes": 1,
                    "model": "linear",
                    "local_steps": 2,
                },
            }
        )
    )
    broken = {"on": True}
    real = node.strategy.run_round

    async def run_round(rnd):
        if broken["on"] and rnd == 2:
            raise RuntimeError("peer table exploded")
        return await real(rnd)

    node.strategy.run_round = run_round
    await node.start()
    try:

        async def until(cond, what):
            deadline = asyncio.get_running_loop().time() + 60
            while not cond():
                assert asyncio.get_running_loop().time() < deadline, what
                await asyncio.sleep(0.02)

        await until(lambda: node.failures.active.get("rounds", {}).get("attempts", 0) >= 2, "two failed attempts")
        assert not node.healthy() and node.status()["health"] == "failing" and node.saved["round"] == 1
        assert "RuntimeError: peer table exploded" in node.status()["failures"][0]["error"]
        assert node.health.serving is False
        broken["on"] = False
        await until(lambda: node.done, "the rounds to finish once the cause is gone")
        assert node.healthy() and node.health.serving and node.saved["round"] == 3
        assert [h["round"] for h in node.history] == [1, 2, 3]
    finally:
        assert await node.stop()
