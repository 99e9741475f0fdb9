"""Real node daemons for the benchmarks: start N processes on loopback, watch them, stop them.

Each node is ``coterie node start --config nI.toml`` in its own process group (session), with
its log, state dir and config under one root directory; by default it is forked from the
preloaded fork server the ``processes`` backend of ``coterie run`` uses (``fork=False``: a fresh
``python -m coterie.cli.main`` interpreter, ~200 MB and seconds of imports each, needed to run
another checkout's code or to wrap the daemon in ``lagprobe.py``). Nodes speak mTLS with
certificates from a throwaway CA made under the root (``tls=False``: plaintext, for an older
checkout without it; ``legacy=True`` also leaves ``security`` out of the configs, for a checkout
that predates it; ``wraps``: a command prefix per node, e.g. ``ip netns exec NS``). Used by ``frozen_peer.py`` and ``round_overhead.py`` (the tests have their
own harness, ``tests/nodeproc.py``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import tomli_w

from coterie.node.admin_token import bearer, token_for_state_dir


def mnist1d_mlp(
    num_nodes: int,
    index: int,
    *,
    hidden: list[int] | None = None,
    steps: int = 40,
    samples: int = 400,
    clusters: int = 2,
) -> dict[str, Any]:
    """The issue's small model (mnist1d MLP 40-64-64-10, 40 steps of batch 32); ``hidden`` wider
    for the ~21 MB model."""
    return {
        "dataset": "mnist1d",
        "dataset_params": {"num_samples": 8000},
        "partition": "label_permutation",
        "partition_params": {"num_clusters": clusters, "samples_per_node": samples},
        "num_nodes": num_nodes,
        "node_index": index,
        "model": "mlp",
        "model_params": {"hidden": hidden or [64, 64]},
        "optimizer": "adam",
        "lr": 0.003,
        "batch_size": 32,
        "local_steps": steps,
        "device": "cpu",
    }


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


def http_json(url: str, timeout: float = 5.0, token: str | None = None) -> Any:
    with urllib.request.urlopen(urllib.request.Request(url, headers=bearer(token)), timeout=timeout) as r:
        return json.loads(r.read())


LAGPROBE = Path(__file__).resolve().parent / "lagprobe.py"


class Daemon:
    """One node process. ``python``: the interpreter (another one runs another checkout's code,
    e.g. the baseline); ``lag_probe``: run it under ``lagprobe.py`` (event-loop lag to a file)."""

    def __init__(
        self,
        root: Path,
        node_id: str,
        config: dict[str, Any],
        *,
        python: str = sys.executable,
        lag_probe: bool = False,
        fork: bool | None = None,
        wrap: list[str] | None = None,
    ):
        self.python = python
        # a command the daemon runs under, e.g. ``ip netns exec NS`` (links.py); it must exec the
        # daemon in place (same pid), and rules out forking from this process
        self.wrap = list(wrap or [])
        # forking runs this interpreter's code: only when that is the code asked for
        self.fork = (python == sys.executable and not lag_probe and not self.wrap) if fork is None else fork
        self.lag_path = (root / node_id / "lag.json") if lag_probe else None
        self.node_id = node_id
        self.dir = root / node_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.dir / "state"
        self.config = {
            "node_id": node_id,
            "state_dir": str(self.state_dir),
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            **config,
        }
        self.config_path = self.dir / "node.toml"
        self.config_path.write_text(tomli_w.dumps(self.config))
        self.log_path = self.dir / "node.log"
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}

    def spawn(self) -> None:
        if self.fork:
            from coterie.lab.launch import processes

            ctx = processes.fork_context([self.config.get("strategy", "local")])
            proc = ctx.Process(
                target=processes._run_forked_node,
                name=f"coterie-{self.node_id}",
                args=(["node", "start", "--config", str(self.config_path)], str(self.log_path)),
            )
            proc.start()
            self.proc = processes._Forked(proc)
            return
        env = {k: v for k, v in os.environ.items() if not k.startswith("COTERIE_")}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        cmd = (
            [self.python, str(LAGPROBE), str(self.lag_path)]
            if self.lag_path
            else [self.python, "-m", "coterie.cli.main"]
        )
        self.proc = subprocess.Popen(
            [*self.wrap, *cmd, "node", "start", "--config", str(self.config_path)],
            stdin=subprocess.DEVNULL,
            stdout=open(self.log_path, "ab"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def ready(self) -> dict[str, Any] | None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.node_id} exited with {self.proc.poll()}: {self.log_tail()}")
        info = json.loads((self.state_dir / "node.json").read_text())
        if info.get("pid") != self.proc.pid:
            return None
        self.info = info
        return info

    @property
    def address(self) -> str:
        return self.info["address"]

    def get(self, path: str, timeout: float = 5.0) -> Any:
        return http_json(self.info["admin_url"] + path, timeout, token_for_state_dir(self.state_dir))

    def history(self) -> list[dict[str, Any]]:
        p = self.state_dir / "history.jsonl"
        out: dict[int, dict[str, Any]] = {}
        for line in p.read_text().splitlines() if p.exists() else []:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            out[e["round"]] = e
        return [out[r] for r in sorted(out)]

    def lag(self) -> dict[str, Any]:
        try:
            return json.loads(self.lag_path.read_text()) if self.lag_path else {}
        except (OSError, ValueError):
            return {}

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

    def __init__(
        self,
        root: Path,
        configs: list[dict[str, Any]],
        names: list[str] | None = None,
        *,
        tls: bool = True,
        legacy: bool = False,
        wraps: list[list[str]] | None = None,
        **daemon_kw: Any,
    ):
        self.root = Path(root)
        names = names or [f"n{i}" for i in range(len(configs))]
        if tls:
            configs = [
                {**c, "security": {**c.get("security", {}), "cert_dir": str(self._certificate(name))}}
                for name, c in zip(names, configs, strict=True)
            ]
        elif not legacy:
            configs = [{**c, "security": {**c.get("security", {}), "insecure": True}} for c in configs]
        self.nodes = [
            Daemon(self.root, names[i], c, wrap=wraps[i] if wraps else None, **daemon_kw) for i, c in enumerate(configs)
        ]

    def _certificate(self, node_id: str) -> Path:
        from coterie.node.security.pki import CA_KEY, init_ca, issue_cert

        ca = self.root / "pki" / "ca"
        if not (ca / CA_KEY).exists():
            init_ca(ca, name="netlab CA (throwaway)")
        return issue_cert(ca, node_id, self.root / "pki" / node_id)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, *, seeds: int = 1, timeout: float = 300, batch: int = 0, on_ready=None) -> None:
        """Start the first node, then the other ``seeds - 1`` bootstrapped to it, then the rest
        bootstrapped to the seeds (round-robin), in batches of ``batch`` (0: all at once), each
        batch up before the next is launched."""
        first = self.nodes[0]
        first.spawn()
        wait_for(first.ready, timeout, f"{first.node_id} to come up")
        if on_ready:
            on_ready(first)
        for n in self.nodes[1:seeds]:
            n.config["peers"] = [first.address]
            n.config_path.write_text(tomli_w.dumps(n.config))
            n.spawn()
        for n in self.nodes[1:seeds]:
            wait_for(n.ready, timeout, f"{n.node_id} to come up")
            if on_ready:
                on_ready(n)
        boot = [n.address for n in self.nodes[:seeds]]
        rest = self.nodes[seeds:]
        step = batch or len(rest) or 1
        for b in range(0, len(rest), step):
            group = rest[b : b + step]
            for i, n in enumerate(group, start=b):
                n.config["peers"] = [boot[i % len(boot)]]
                n.config_path.write_text(tomli_w.dumps(n.config))
                n.spawn()
            for n in group:
                wait_for(n.ready, timeout, f"{n.node_id} to come up")
                if on_ready:
                    on_ready(n)

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


def mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
