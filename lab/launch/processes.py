"""The ``processes`` backend of ``coterie run``: every node a daemon process of its own, gRPC on
loopback.

A throwaway CA is made for the run (``DIR/<strategy>/pki/ca``) and every node gets a certificate
for its id (``pki/n{i}``), so the network runs on mTLS like a real one (unless the scenario sets
``security.insecure = true``). Node ``i`` gets ``DIR/<strategy>/configs/n{i}.toml`` (a complete NodeConfig: state dir
``DIR/<strategy>/nodes/n{i}``, peer and admin ports 0 on 127.0.0.1 — each node binds a free port
itself and writes the bound addresses to its ``node.json`` — learner with num_nodes/node_index/seeds)
and runs as its own process, ``coterie node start --config ...``, output in
``DIR/<strategy>/logs/n{i}.log``. All start at once; a node with a bootstrap peer gets
``--bootstrap-from <that node's state dir>/node.json`` and waits for it after its imports, so no
port is picked (and raced for) here and start-up stays parallel.

The daemons are forked from a fork server that has imported torch and the node's code once
(``preload.py``) and run that same ``coterie node start`` command line in the child: each starts
in a fraction of a second and shares those pages copy-on-write with the others instead of holding
~150 MB of its own. (A ``command`` — e.g. ``node_command``, ``python -m coterie.cli.main node
start ...`` — starts fresh interpreters instead.)

Each node's ``/status`` is polled for the live view; when every node reports ``done`` all are
stopped (SIGTERM to each process group, SIGKILL after a grace period) — also on Ctrl-C, timeout
or a node that dies early (which is reported with the tail of its log). Each node's
``history.jsonl`` then gives the per-round figures that go into ``DIR/results.json``.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from coterie.node.admin_token import TokenError, bearer, token_for_state_dir
from coterie.node.config import NodeConfig

from ..scenario import NodeSpec, Scenario, StrategyRun, bootstrap_index, config_toml, node_config
from .common import LauncherError, LiveView, NodeProgress, collect, fresh_strategy_dir, network_done, read_history


def prepare(sc: Scenario, strategy: str, out_dir: Path) -> list[NodeSpec]:
    """Write every node's config for ``strategy`` under ``out_dir/<strategy>``."""
    strat_dir = fresh_strategy_dir(out_dir, strategy)
    specs: list[NodeSpec] = []
    for i in range(sc.nodes):
        cfg = with_certificate(node_config(sc, strategy, i, strat_dir), strat_dir / "pki")
        path = strat_dir / "configs" / f"n{i}.toml"
        path.write_text(config_toml(cfg))
        b = bootstrap_index(sc, i)
        specs.append(
            NodeSpec(
                i,
                cfg,
                path,
                strat_dir / "logs" / f"n{i}.log",
                bootstrap_from=None if b is None else specs[b].state_dir / "node.json",
            )
        )
    return specs


def with_certificate(cfg: NodeConfig, pki_dir: Path) -> NodeConfig:
    """``cfg`` with a certificate for its node from the run's throwaway CA in ``pki_dir`` (made on
    first use); unchanged when it runs insecure or brings its own certificates."""
    sec = cfg.security
    if sec.insecure or sec.cert_dir or sec.cert or cfg.node_id is None:
        return cfg
    from coterie.node.security.pki import CA_KEY, init_ca, issue_cert

    if not (pki_dir / "ca" / CA_KEY).exists():
        init_ca(pki_dir / "ca", name="coterie run CA (throwaway)")
    out = issue_cert(pki_dir / "ca", cfg.node_id, pki_dir / cfg.node_id)
    return cfg.model_copy(update={"security": sec.model_copy(update={"cert_dir": out})})


def node_args(spec: NodeSpec) -> list[str]:
    """The ``coterie`` arguments that start node ``spec``."""
    return [
        "node",
        "start",
        "--config",
        str(spec.config_path),
        *(["--bootstrap-from", str(spec.bootstrap_from)] if spec.bootstrap_from else []),
    ]


def node_command(spec: NodeSpec) -> list[str]:
    return [sys.executable, "-m", "coterie.cli.main", *node_args(spec)]


# how run_strategy starts a node when not told: None = fork from the preloaded fork server; a
# function like node_command = a fresh interpreter per node (tests swap in stand-in daemons here)
default_command: Callable[[NodeSpec], list[str]] | None = None


def _child_env() -> dict[str, str]:
    # COTERIE_* would override the generated configs in every node (env beats TOML)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COTERIE_")}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's BLAS pool: one thread and buffer set per daemon
    return env


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def fork_context(strategies: list[str] | None = None) -> multiprocessing.context.ForkServerContext:
    """The fork server daemons are forked from, started (once per launcher process) with the
    daemons' environment and ``preload.py`` imported. Strategies that build a ``torch.optim``
    optimizer also get torch._dynamo preloaded (seconds of CPU and ~70 MB each otherwise)."""
    ctx = multiprocessing.get_context("forkserver")
    preload = ["coterie.lab.launch.preload"]
    if set(strategies or ()) & {"meta-l2c", "scool-attention"}:
        preload.append("torch._dynamo")
    ctx.set_forkserver_preload(preload)
    with _environment(_child_env()):  # what the server reads at start (BLAS threads) and hands down
        multiprocessing.forkserver.ensure_running()
    return ctx


def _run_forked_node(args: list[str], log_path: str) -> None:
    """A forked daemon: its own session (the launcher signals its process group), output to its
    log, then ``coterie <args>`` exactly as a fresh interpreter would run it."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    cast(io.TextIOWrapper, sys.stdout).reconfigure(line_buffering=True)  # the fd-1 text stream
    sys.argv = ["coterie", *args]
    from coterie.cli.main import app

    app(args=args, prog_name="coterie")  # exits with the command's code


class _Forked:
    """A forked daemon behind the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, proc: multiprocessing.process.BaseProcess):
        self.proc = proc

    @property
    def pid(self) -> int:
        pid = self.proc.pid
        assert pid is not None, "a started process has a pid"
        return pid

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"node process {self.pid}", timeout or 0.0)
        return self.proc.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return "(no log written)"
    tail = text.splitlines()[-lines:]
    return "\n".join(tail) if tail else "(log is empty)"


def read_node_info(spec: NodeSpec, pid: int) -> dict[str, Any] | None:
    """The node.json of the process ``pid`` (None until that process has written it)."""
    try:
        info = json.loads((spec.state_dir / "node.json").read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("pid") == pid else None


def fetch_json(url: str, timeout: float = 2.0, token: str | None = None) -> Any:
    req = urllib.request.Request(url, headers=bearer(token))  # the node's admin token
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


class Network:
    """The processes of one strategy's run. Use as a context manager: leaving it (normally, by an
    exception or by Ctrl-C) stops every process."""

    def __init__(
        self,
        specs: list[NodeSpec],
        command: Callable[[NodeSpec], list[str]] | None = None,
        stop_timeout_s: float = 15.0,
    ):
        self.specs = specs
        self.command = command  # None: fork each daemon from the preloaded fork server
        self.stop_timeout_s = stop_timeout_s
        self.procs: list[subprocess.Popen | _Forked] = []
        self._logs: list[Any] = []

    def __enter__(self) -> Network:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        if self.command is None:
            ctx = fork_context(sorted({s.config.strategy for s in self.specs}))
            for spec in self.specs:
                spec.log_path.parent.mkdir(parents=True, exist_ok=True)
                proc = ctx.Process(
                    target=_run_forked_node, args=(node_args(spec), str(spec.log_path)), name=f"coterie-{spec.node_id}"
                )
                proc.start()
                self.procs.append(_Forked(proc))
            return
        env = _child_env()
        for spec in self.specs:
            spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(spec.log_path, "ab")
            self._logs.append(log)
            self.procs.append(
                subprocess.Popen(
                    self.command(spec),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )  # own process group: killpg reaches its children

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _signal(self, proc: subprocess.Popen | _Forked, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # pgid == pid (start_new_session)
        except (ProcessLookupError, PermissionError):
            if proc.poll() is None:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        """SIGTERM every process group, wait, SIGKILL what is left. Never raises, never leaves a
        process behind; a second Ctrl-C while waiting goes straight to SIGKILL."""
        try:
            for p in self.procs:
                self._signal(p, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout_s
            for p in self.procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        except KeyboardInterrupt:
            pass
        finally:
            for p in self.procs:
                self._signal(p, signal.SIGKILL)  # also reaches grandchildren left in the group
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:  # pragma: no cover - unkillable
                    pass
            for f in self._logs:
                f.close()
            self._logs.clear()

    def poll(self, pool: ThreadPoolExecutor, rounds: int, progress: list[NodeProgress]) -> None:
        """Refresh ``progress`` from every node's /status; raise LauncherError for a node that
        died before it was done."""

        def one(spec: NodeSpec, proc: subprocess.Popen | _Forked) -> dict[str, Any] | None:
            if not spec.info:
                spec.info = read_node_info(spec, proc.pid) or {}
            if not spec.admin_url:
                return None
            try:  # the token file is written before node.json, which names it
                return fetch_json(spec.admin_url + "/status", timeout=2.0, token=token_for_state_dir(spec.state_dir))
            except (OSError, ValueError, TokenError):
                return None

        statuses = list(pool.map(one, self.specs, self.procs))
        for spec, proc, st, pr in zip(self.specs, self.procs, statuses, progress, strict=True):
            if st is not None:
                pr.update(st)
            rc = proc.poll()
            if rc is not None and not pr.done:
                hist = read_history(spec.state_dir / "history.jsonl")
                if rc == 0 and len(hist) >= rounds:  # finished and exited on its own
                    pr.observe(len(hist), True, None)
                    continue
                raise LauncherError(
                    f"node {spec.node_id} exited with code {rc} before finishing its rounds "
                    f"(round {pr.round}/{rounds}); last lines of {spec.log_path}:\n"
                    f"{log_tail(spec.log_path)}"
                )


def run_strategy(
    sc: Scenario,
    strategy: str,
    out_dir: Path,
    *,
    console: Any = None,
    command: Callable[[NodeSpec], list[str]] | None = None,
    poll_interval_s: float = 0.5,
    stop_timeout_s: float = 15.0,
    on_start: Callable[[Network], None] | None = None,
) -> StrategyRun:
    """Run one strategy's network to completion and collect each node's files."""
    specs = prepare(sc, strategy, out_dir)
    progress = [NodeProgress() for _ in specs]
    command = command or default_command
    if command is None:
        fork_context(sc.strategy)  # once per launcher: preloaded for every strategy of the scenario
    t0 = time.time()
    view = LiveView(console, strategy, specs, sc.rounds) if console else None
    with Network(specs, command, stop_timeout_s) as net, ThreadPoolExecutor(max_workers=min(32, len(specs))) as pool:
        if on_start:
            on_start(net)
        if view:
            view.__enter__()
        try:
            deadline = time.monotonic() + sc.timeout_s
            while True:
                net.poll(pool, sc.rounds, progress)
                if network_done(strategy, specs, progress, view, deadline, sc.timeout_s):
                    break
                time.sleep(poll_interval_s)
        finally:
            if view:
                view.__exit__()
    run = collect(strategy, specs, sc.rounds, time.time() - t0, progress)
    by_file = {s.state_dir / "node.json": s.node_id for s in specs}
    for s in specs:  # results show the bootstrap address each node resolved from --bootstrap-from
        addr = run.node_info.get(by_file.get(s.bootstrap_from, ""), {}).get("address") if s.bootstrap_from else None
        if addr:
            s.config = s.config.model_copy(update={"peers": [addr]})
    return run
