"""Real node daemons as child processes, for integration tests (loopback only)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``cond`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - the condition may not be observable yet
            last_exc = e
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else "")
    )


def http_json(url: str, timeout: float = 5.0, token: str | None = None) -> Any:
    """GET JSON from an admin API, with the node's admin token when given."""
    from coterie.node.admin_token import bearer

    with urllib.request.urlopen(urllib.request.Request(url, headers=bearer(token)), timeout=timeout) as r:
        return json.loads(r.read())


def node_certs(root: Path, node_id: str) -> Path:
    """A certificate for ``node_id`` from the CA of ``root`` (one per test directory, made on
    first use): what a node, or a test playing a peer, presents on the mTLS peer port."""
    from coterie.node.security.pki import CA_KEY, NODE_CERT, init_ca, issue_cert

    pki = Path(root) / "pki"
    if not (pki / "ca" / CA_KEY).exists():
        init_ca(pki / "ca", name="coterie test CA")
    if not (pki / node_id / NODE_CERT).exists():
        issue_cert(pki / "ca", node_id, pki / node_id)
    return pki / node_id


def peer_channel(root: Path, node_id: str, address: str, expect: str | None = None):
    """A grpc.aio channel to a node's peer port presenting ``node_id``'s certificate (from the CA
    of ``root``), as a peer would; ``expect``: the node id the server must prove (default: any
    node of the CA)."""
    import grpc

    from coterie.node.security.pki import load_credentials
    from coterie.node.transport.tls import TLS

    tls = TLS(load_credentials(node_certs(root, node_id)))
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), options=[("grpc.ssl_target_name_override", tls.target_name(expect))]
    )


def tiny_learner(num_nodes: int, index: int, clusters: int = 1, samples: int = 120) -> dict[str, Any]:
    return {
        "dataset": "mnist1d",
        "partition": "label_permutation",
        "num_nodes": num_nodes,
        "node_index": index,
        "model": "mlp",
        "local_steps": 5,
        "dataset_params": {"num_samples": 2000},
        "partition_params": {"num_clusters": clusters, "samples_per_node": samples},
    }


class NodeProc:
    made: list[NodeProc] = []  # every one made, in order: a test's own are reaped after it (tests/conftest.py)

    def __init__(self, root: Path, node_id: str, config: dict[str, Any], env: dict[str, str] | None = None):
        """``env``: added to the daemon's environment (PYTHONPATH: run another release's code)."""
        NodeProc.made.append(self)
        self.node_id = node_id
        self.env = dict(env or {})
        self.dir = root / node_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.dir / "state"
        cfg = {
            "node_id": node_id,
            "state_dir": str(self.state_dir),
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            "heartbeat_interval_s": 0.25,
            "suspect_after_s": 1.0,
            "dead_after_s": 2.5,
            "request_timeout_s": 10.0,
            "log_level": "INFO",
            "round_interval_s": 0.0,
            **config,
        }
        if "security" not in config:  # mTLS like a real network; tests that want plaintext say so
            cfg["security"] = {"cert_dir": str(node_certs(root, node_id))}
        self.config_path = self.dir / "node.toml"
        self.config_path.write_text(tomli_w.dumps(cfg))
        self.proc: subprocess.Popen | None = None
        self._old_pid: int | None = None
        self.info: dict[str, Any] = {}

    def start(self, timeout: float = 120.0, extra_args: list[str] | None = None) -> NodeProc:
        return self.launch(extra_args).wait_ready(timeout)

    def launch(self, extra_args: list[str] | None = None) -> NodeProc:
        """Start the daemon without waiting for it (``wait_ready``): several launched together
        load torch side by side instead of each waiting behind the ones already training."""
        info_path = self.state_dir / "node.json"
        self._old_pid = json.loads(info_path.read_text()).get("pid") if info_path.exists() else None
        log = open(self.dir / "node.log", "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "coterie.cli.main",
                "node",
                "start",
                "--config",
                str(self.config_path),
                *(extra_args or []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        return self

    @classmethod
    def reap(cls, since: int) -> list[str]:
        """Stop the daemons of the NodeProcs made since ``len(made)`` was ``since`` that still run
        (not those of a module's fixture, made before its tests began); returns their ids. A test
        that failed between starting daemons and its ``try`` (a third node not coming up under
        load) left the first two running for good: an hour later they still held CPU."""
        running = [n for n in cls.made[since:] if n.proc is not None and n.proc.poll() is None]
        for n in running:
            n.stop()
        del cls.made[since:]
        return [n.node_id for n in running]

    def wait_ready(self, timeout: float = 120.0) -> NodeProc:
        """Wait until the launched daemon has written its node.json and answers /healthz (a daemon
        that exits fails at once; 60 s was once too short with the box at load 500)."""
        proc, info_path, old_pid = self.proc, self.state_dir / "node.json", self._old_pid
        assert proc is not None, "launch() first"

        def ready():
            if proc.poll() is not None:
                raise RuntimeError(f"{self.node_id} exited with {proc.returncode}:\n{self.log_tail()}")
            info = json.loads(info_path.read_text())
            if info.get("pid") != proc.pid or info.get("pid") == old_pid:
                return None
            with urllib.request.urlopen(info["admin_url"] + "/healthz", timeout=5) as r:
                if r.status != 200:
                    return None
            self.info = info
            return info

        try:
            wait_for(ready, timeout, f"{self.node_id} to come up")
        except AssertionError:
            self.kill()  # no orphan daemon outliving the test that gave up on it
            raise AssertionError(f"{self.node_id} did not come up:\n{self.log_tail()}") from None
        return self

    @property
    def address(self) -> str:
        return self.info["address"]

    @property
    def admin(self) -> str:
        return self.info["admin_url"]

    @property
    def token(self) -> str | None:
        """The node's admin token (node/admin_token.py: from its state dir)."""
        from coterie.node.admin_token import token_for_state_dir

        return token_for_state_dir(self.state_dir)

    def get(self, path: str) -> Any:
        return http_json(self.admin + path, token=self.token)

    def get_text(self, path: str) -> str:
        from coterie.node.admin_token import bearer

        req = urllib.request.Request(self.admin + path, headers=bearer(self.token))
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.read().decode()

    def status(self) -> dict[str, Any]:
        return self.get("/status")

    def log_tail(self, n: int = 40) -> str:
        p = self.dir / "node.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-n:]) if p.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def stop(self) -> int | None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode if self.proc else None


class _NoTraffic:
    def record(self, *a, **k):
        pass

    def latency(self, *a, **k):
        pass


class CertifiedPeer:
    """A peer with a valid certificate of ``root``'s CA speaking to ``target`` through Coterie's
    own client: what the insider and resource-limit attacks are made of."""

    def __init__(self, root, target: NodeProc, node_id: str):
        from coterie.node.security.pki import load_credentials
        from coterie.node.transport.client import PeerClient
        from coterie.node.transport.tls import TLS

        self.target, self.node_id = target, node_id
        self.client = PeerClient(
            node_id,
            _NoTraffic(),
            chunk_bytes=1 << 20,
            max_model_bytes=1 << 30,
            max_gossip_bytes=1 << 20,
            timeout_s=30,
            tls=TLS(load_credentials(node_certs(root, node_id))),
        )

    async def join(self) -> None:
        from coterie.node.config import PROTOCOL_VERSION
        from coterie.node.peering.messages import NodeInfo

        fp = self.target.status()["fingerprint"]
        await self.client.handshake(
            self.target.address, NodeInfo(self.node_id, PROTOCOL_VERSION, fp, address="127.0.0.1:1"), timeout=10
        )

    async def close(self) -> None:
        await self.client.close()
