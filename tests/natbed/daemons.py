"""Real ``coterie node start`` daemons, each inside its own network namespace (``ip netns exec``),
with certificates from ``coterie ca init`` / ``coterie cert issue``; their admin APIs, on each
namespace's own loopback, are read from a thread inside that namespace (netns.Topology.in_netns)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w

from .netns import Topology

ADMIN = "127.0.0.1:8000"  # every namespace has its own loopback, so all nodes can use the same
PEER_PORT = 7000


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    """Poll ``cond`` until truthy; fail naming ``what`` (and the last error) after ``timeout``."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            if value := cond():
                return value
        except Exception as e:  # noqa: BLE001 - not observable yet (node starting, file half written)
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last: {last!r})" if last else ""))


def coterie(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "coterie.cli.main", *args], check=True, capture_output=True)


def make_pki(root: Path, node_ids: list[str]) -> Path:
    """A throwaway CA and one certificate per node, by the ``coterie`` CLI as an operator would."""
    pki = root / "pki"
    coterie("ca", "init", str(pki / "ca"), "--name", "coterie NAT testbed CA (throwaway)")
    for nid in node_ids:
        coterie("cert", "issue", "--ca", str(pki / "ca"), "--node-id", nid, "--out", str(pki / nid))
    return pki


class NsNode:
    """One daemon in namespace ``topo.ns(host)``; its node id is the host name."""

    def __init__(self, topo: Topology, root: Path, host: str, config: dict[str, Any], args: list[str]):
        self.topo, self.host, self.args = topo, host, args
        self.dir = root / host
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.dir / "state"
        self.config_path = self.dir / "node.toml"
        self.config_path.write_text(
            tomli_w.dumps(
                {
                    "node_id": host,
                    "state_dir": str(self.state_dir),
                    "admin_listen": ADMIN,
                    "security": {"cert_dir": str(root / "pki" / host)},
                    "log_level": "INFO",
                    **config,
                }
            )
        )
        self.proc: subprocess.Popen | None = None

    def start(self) -> NsNode:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(self.dir / "node.log", "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *self.topo.exec_prefix(self.host),
                    sys.executable,
                    "-m",
                    "coterie.cli.main",
                    "node",
                    "start",
                    "--config",
                    str(self.config_path),
                    *self.args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        return self

    def ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.host} exited with {self.proc.returncode}:\n{self.log_tail()}")
        info = json.loads((self.state_dir / "node.json").read_text())
        return info.get("pid") == self.proc.pid and self.get_text("/healthz") == "ok"  # ip netns exec execs

    @property
    def token(self) -> str:
        from coterie.node.admin_token import token_for_state_dir

        return token_for_state_dir(self.state_dir) or ""

    def get_text(self, path: str) -> str:
        def fetch() -> str:
            req = urllib.request.Request(f"http://{ADMIN}{path}", headers={"Authorization": f"Bearer {self.token}"})
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.read().decode()

        return self.topo.in_netns(self.host, fetch)

    def get(self, path: str) -> Any:
        return json.loads(self.get_text(path))

    def log_tail(self, n: int = 30) -> str:
        p = self.dir / "node.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-n:]) if p.exists() else ""

    def terminate(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
