"""Real node daemons for the benchmarks: start N processes on loopback, watch them, stop them.

Each node is ``python -m coterie.cli.main node start --config nI.toml`` in its own process group,
with its log, state dir and config under one root directory. Used by ``frozen_peer.py`` and
``round_overhead.py`` (the tests have their own harness, ``tests/nodeproc.py``)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import tomli_w


def mnist1d_mlp(num_nodes: int, index: int, *, hidden: list[int] | None = None, steps: int = 40,
                samples: int = 400, clusters: int = 2) -> dict[str, Any]:
    """The issue's small model (mnist1d MLP 40-64-64-10, 40 steps of batch 32); ``hidden`` wider
    for the ~21 MB model."""
    return {"dataset": "mnist1d", "dataset_params": {"num_samples": 8000}, "partition": "label_permutation",
            "partition_params": {"num_clusters": clusters, "samples_per_node": samples},
            "num_nodes": num_nodes, "node_index": index, "model": "mlp",
            "model_params": {"hidden": hidden or [64, 64]}, "optimizer": "adam", "lr": 0.003,
            "batch_size": 32, "local_steps": steps, "device": "cpu"}


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            v = cond()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - not observable yet
            last = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" ({last})" if last else ""))


def http_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class Daemon:
    def __init__(self, root: Path, node_id: str, config: dict[str, Any]):
        self.node_id = node_id
        self.dir = root / node_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.dir / "state"
        self.config = {"node_id": node_id, "state_dir": str(self.state_dir), "listen": "127.0.0.1:0",
                       "admin_listen": "127.0.0.1:0", **config}
        self.config_path = self.dir / "node.toml"
        self.config_path.write_text(tomli_w.dumps(self.config))
        self.log_path = self.dir / "node.log"
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}

    def spawn(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("COTERIE_")}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "coterie.cli.main", "node", "start", "--config",
                                      str(self.config_path)], stdin=subprocess.DEVNULL,
                                     stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def ready(self) -> dict[str, Any] | None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.node_id} exited with {self.proc.returncode}: {self.log_tail()}")
        info = json.loads((self.state_dir / "node.json").read_text())
        if info.get("pid") != self.proc.pid:
            return None
        self.info = info
        return info

    @property
    def address(self) -> str:
        return self.info["address"]

    def get(self, path: str, timeout: float = 5.0) -> Any:
        return http_json(self.info["admin_url"] + path, timeout)

    def history(self) -> list[dict[str, Any]]:
        p = self.state_dir / "history.jsonl"
        out: dict[int, dict[str, Any]] = {}
        for line in (p.read_text().splitlines() if p.exists() else []):
            try:
                e = json.loads(line)
            except ValueError:
                continue
            out[e["round"]] = e
        return [out[r] for r in sorted(out)]

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:]) if self.log_path.exists() else ""

    def transitions(self) -> list[tuple[str, str, str]]:
        """(peer, old, new) state changes this node logged."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return re.findall(r"peer (\S+): (alive|suspect|dead) -> (alive|suspect|dead)", text)

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(timeout=10)


class Lab:
    """N daemons; a context manager that always stops them."""

    def __init__(self, root: Path, configs: list[dict[str, Any]], names: list[str] | None = None):
        self.root = Path(root)
        self.nodes = [Daemon(self.root, (names or [f"n{i}" for i in range(len(configs))])[i], c)
                      for i, c in enumerate(configs)]

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, *, seeds: int = 1, timeout: float = 300, stagger_s: float = 0.0) -> None:
        """Start the first ``seeds`` nodes, then the rest bootstrapped to them (round-robin)."""
        for n in self.nodes[:seeds]:
            n.spawn()
        for n in self.nodes[:seeds]:
            wait_for(n.ready, timeout, f"{n.node_id} to come up")
        boot = [n.address for n in self.nodes[:seeds]]
        for i, n in enumerate(self.nodes[seeds:]):
            n.config["peers"] = [boot[i % len(boot)]]
            n.config_path.write_text(tomli_w.dumps(n.config))
            n.spawn()
            if stagger_s:
                time.sleep(stagger_s)
        for n in self.nodes[seeds:]:
            wait_for(n.ready, timeout, f"{n.node_id} to come up")

    def statuses(self, timeout: float = 5.0) -> list[dict[str, Any] | None]:
        def one(n: Daemon):
            try:
                return n.get("/status", timeout)
            except (OSError, ValueError):
                return None
        with ThreadPoolExecutor(max_workers=min(32, len(self.nodes))) as pool:
            return list(pool.map(one, self.nodes))

    def stop(self) -> None:
        with ThreadPoolExecutor(max_workers=min(32, len(self.nodes))) as pool:
            list(pool.map(lambda n: n.stop(), self.nodes))


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def rss_mib(pid: int) -> float:
    """Resident set of a process, MiB (VmRSS) — and its peak (VmHWM) with ``peak_rss_mib``."""
    return _status_field(pid, "VmRSS")


def peak_rss_mib(pid: int) -> float:
    return _status_field(pid, "VmHWM")


def _status_field(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")
