"""Launch a whole network of node daemons on this machine: the engine of ``coterie run`` / ``demo``.

The scenario format and the per-node configs it generates are in ``scenario.py``.

What ``run`` does for each strategy
===================================
A throwaway CA is made for the run (``DIR/<strategy>/pki/ca``) and every node gets a certificate
for its id (``pki/n{i}``), so the network runs on mTLS like a real one (unless the scenario sets
``security.insecure = true``). Node ``i`` gets ``DIR/<strategy>/configs/n{i}.toml`` (a complete NodeConfig: state dir
``DIR/<strategy>/nodes/n{i}``, peer and admin ports 0 on 127.0.0.1 — each node binds a free port
itself and writes the bound addresses to its ``node.json`` — learner with num_nodes/node_index/seeds)
and runs as its own process (``python -m coterie.cli.main node start --config ...``, output in
``DIR/<strategy>/logs/n{i}.log``). All start at once; a node with a bootstrap peer gets
``--bootstrap-from <that node's state dir>/node.json`` and waits for it after its imports, so no
port is picked (and raced for) here and start-up stays parallel.
Each node's ``/status`` is polled for the live view; when every node reports ``done`` all are
stopped (SIGTERM to each process group, SIGKILL after a grace period) — also on Ctrl-C, timeout
or a node that dies early (which is reported with the tail of its log). Each node's
``history.jsonl`` then gives the per-round figures that go into ``DIR/results.json``.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .config import ConfigError, NodeConfig
from .scenario import NodeSpec, Scenario, StrategyRun, bootstrap_index, config_toml, node_config

# a personalised strategy to fall back on, in order, when a scenario's choice is not importable
FALLBACK_STRATEGIES = ("fedfomo", "federico", "scool-sbm", "cobo", "l2c", "oracle", "dpsgd")


class LauncherError(RuntimeError):
    """A scenario that cannot run, or a network that failed while running."""


# ------------------------------------------------------------------------------- node configs
def prepare(sc: Scenario, strategy: str, out_dir: Path) -> list[NodeSpec]:
    """Write every node's config for ``strategy`` under ``out_dir/<strategy>`` (clearing the
    node state, configs and logs of an earlier run there: a stale checkpoint would resume)."""
    strat_dir = Path(out_dir).resolve() / strategy
    for sub in ("nodes", "configs", "logs", "pki"):
        shutil.rmtree(strat_dir / sub, ignore_errors=True)
        (strat_dir / sub).mkdir(parents=True, exist_ok=True)
    specs: list[NodeSpec] = []
    for i in range(sc.nodes):
        cfg = with_certificate(node_config(sc, strategy, i, strat_dir), strat_dir / "pki")
        path = strat_dir / "configs" / f"n{i}.toml"
        path.write_text(config_toml(cfg))
        b = bootstrap_index(sc, i)
        specs.append(NodeSpec(i, cfg, path, strat_dir / "logs" / f"n{i}.log",
                              bootstrap_from=None if b is None else specs[b].state_dir / "node.json"))
    return specs


def with_certificate(cfg: NodeConfig, pki_dir: Path) -> NodeConfig:
    """``cfg`` with a certificate for its node from the run's throwaway CA in ``pki_dir`` (made on
    first use); unchanged when it runs insecure or brings its own certificates."""
    sec = cfg.security
    if sec.insecure or sec.cert_dir or sec.cert or cfg.node_id is None:
        return cfg
    from .security.pki import CA_KEY, init_ca, issue_cert
    if not (pki_dir / "ca" / CA_KEY).exists():
        init_ca(pki_dir / "ca", name="coterie run CA (throwaway)")
    out = issue_cert(pki_dir / "ca", cfg.node_id, pki_dir / cfg.node_id)
    return cfg.model_copy(update={"security": sec.model_copy(update={"cert_dir": out})})


def node_command(spec: NodeSpec) -> list[str]:
    return [sys.executable, "-m", "coterie.cli.main", "node", "start", "--config",
            str(spec.config_path),
            *(["--bootstrap-from", str(spec.bootstrap_from)] if spec.bootstrap_from else [])]


# ---------------------------------------------------------------------------------- strategies
def strategy_problem(name: str) -> str | None:
    """None if ``name`` is importable, else why not."""
    from .strategies.registry import get_strategy
    try:
        get_strategy(name)
    except Exception as e:  # unknown, not implemented yet, or its module fails to import
        return f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
    return None


def resolve_strategies(names: list[str], *, fallback: bool) -> tuple[list[str], list[str]]:
    """(strategies to run, notes). Without ``fallback`` an unavailable strategy is an error; with
    it, it is replaced by the first available personalised strategy not already listed."""
    out, notes = [], []
    for n in names:
        problem = strategy_problem(n)
        if problem is None:
            out.append(n)
            continue
        if not fallback:
            raise ConfigError(f"strategy {n!r} cannot run: {problem}")
        sub = next((f for f in FALLBACK_STRATEGIES
                    if f not in names and f not in out and strategy_problem(f) is None), None)
        notes.append(f"strategy {n!r} unavailable ({problem}); "
                     + (f"using {sub!r} instead" if sub else "skipped"))
        if sub:
            out.append(sub)
    if not out:
        raise ConfigError("no strategy of the scenario can run")
    return out, notes


# ----------------------------------------------------------------------------------- processes
def _child_env() -> dict[str, str]:
    # COTERIE_* would override the generated configs in every node (env beats TOML)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COTERIE_")}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    return env


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return "(no log written)"
    tail = text.splitlines()[-lines:]
    return "\n".join(tail) if tail else "(log is empty)"


def fetch_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def read_history(path: Path) -> list[dict[str, Any]]:
    """Completed rounds from a history.jsonl, one entry per round (the last one written wins: a
    resumed node may rewrite a round); a torn last line is ignored."""
    by_round: dict[int, dict[str, Any]] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(e, dict) and isinstance(e.get("round"), int):
            by_round[e["round"]] = e
    return [by_round[r] for r in sorted(by_round)]


@dataclass
class NodeProgress:
    round: int = 0
    done: bool = False
    acc: float | None = None
    status: dict[str, Any] | None = None
    state: str = "starting"


def read_node_info(spec: NodeSpec, pid: int) -> dict[str, Any] | None:
    """The node.json of the process ``pid`` (None until that process has written it)."""
    try:
        info = json.loads((spec.state_dir / "node.json").read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("pid") == pid else None


class Network:
    """The processes of one strategy's run. Use as a context manager: leaving it (normally, by an
    exception or by Ctrl-C) stops every process."""

    def __init__(self, specs: list[NodeSpec], command: Callable[[NodeSpec], list[str]] = node_command,
                 stop_timeout_s: float = 15.0):
        self.specs = specs
        self.command = command
        self.stop_timeout_s = stop_timeout_s
        self.procs: list[subprocess.Popen] = []
        self._logs: list[Any] = []

    def __enter__(self) -> "Network":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        env = _child_env()
        for spec in self.specs:
            spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(spec.log_path, "ab")
            self._logs.append(log)
            self.procs.append(subprocess.Popen(
                self.command(spec), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True))  # own process group: killpg reaches its children

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _signal(self, proc: subprocess.Popen, sig: int) -> None:
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

    def poll(self, pool: ThreadPoolExecutor, rounds: int,
             progress: list[NodeProgress]) -> None:
        """Refresh ``progress`` from every node's /status; raise LauncherError for a node that
        died before it was done."""
        def one(spec: NodeSpec, proc: subprocess.Popen) -> dict[str, Any] | None:
            if not spec.info:
                spec.info = read_node_info(spec, proc.pid) or {}
            if not spec.admin_url:
                return None
            try:
                return fetch_json(spec.admin_url + "/status", timeout=2.0)
            except (OSError, ValueError):
                return None

        statuses = list(pool.map(one, self.specs, self.procs))
        for spec, proc, st, pr in zip(self.specs, self.procs, statuses, progress):
            if st is not None:
                pr.status = st
                pr.round = int(st.get("round") or 0)
                pr.done = pr.done or bool(st.get("done"))
                ev = st.get("last_eval") or {}
                if isinstance(ev, dict) and ev.get("test_acc") is not None:
                    pr.acc = float(ev["test_acc"])
                pr.state = "done" if pr.done else "running"
            rc = proc.poll()
            if rc is not None and not pr.done:
                hist = read_history(spec.state_dir / "history.jsonl")
                if rc == 0 and len(hist) >= rounds:  # finished and exited on its own
                    pr.done, pr.round, pr.state = True, len(hist), "done"
                    continue
                raise LauncherError(
                    f"node {spec.node_id} exited with code {rc} before finishing its rounds "
                    f"(round {pr.round}/{rounds}); last lines of {spec.log_path}:\n"
                    f"{log_tail(spec.log_path)}")


# ---------------------------------------------------------------------------------------- run
def _progress_display(console: Any, strategy: str, specs: list[NodeSpec], rounds: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    prog = Progress(TextColumn(f"[bold]{strategy}[/] {{task.description:>4}}"), BarColumn(),
                    MofNCompleteColumn(), TextColumn("acc {task.fields[acc]:>6}"),
                    TextColumn("{task.fields[state]}"), TimeElapsedColumn(),
                    console=console, transient=False, refresh_per_second=4)
    tasks = [prog.add_task(s.node_id, total=rounds, acc="–", state="starting") for s in specs]
    return prog, tasks


def run_strategy(sc: Scenario, strategy: str, out_dir: Path, *, console: Any = None,
                 command: Callable[[NodeSpec], list[str]] | None = None,
                 poll_interval_s: float = 0.5, stop_timeout_s: float = 15.0,
                 on_start: Callable[[Network], None] | None = None) -> StrategyRun:
    """Run one strategy's network to completion and collect each node's files."""
    specs = prepare(sc, strategy, out_dir)
    progress = [NodeProgress() for _ in specs]
    t0 = time.time()
    prog, tasks = _progress_display(console, strategy, specs, sc.rounds) if console else (None, [])
    with Network(specs, command or node_command, stop_timeout_s) as net, \
            ThreadPoolExecutor(max_workers=min(32, len(specs))) as pool:
        if on_start:
            on_start(net)
        if prog:
            prog.start()
        try:
            deadline = time.monotonic() + sc.timeout_s
            while True:
                net.poll(pool, sc.rounds, progress)
                if prog:
                    for t, pr in zip(tasks, progress):
                        prog.update(t, completed=min(pr.round, sc.rounds), state=pr.state,
                                    acc="–" if pr.acc is None else f"{pr.acc:.3f}")
                if all(pr.done for pr in progress):
                    break
                if time.monotonic() > deadline:
                    behind = ", ".join(f"{s.node_id}@{p.round}" for s, p in zip(specs, progress)
                                       if not p.done)
                    raise LauncherError(f"{strategy}: timed out after {sc.timeout_s:.0f}s; "
                                        f"not done: {behind}")
                time.sleep(poll_interval_s)
        finally:
            if prog:
                prog.stop()
    wall = time.time() - t0
    histories, info = {}, {}
    for s in specs:
        histories[s.node_id] = read_history(s.state_dir / "history.jsonl")
        try:
            info[s.node_id] = json.loads((s.state_dir / "node.json").read_text())
        except (OSError, ValueError):
            info[s.node_id] = {}
    by_file = {s.state_dir / "node.json": s.node_id for s in specs}
    for s in specs:  # results show the bootstrap address each node resolved from --bootstrap-from
        addr = info.get(by_file.get(s.bootstrap_from), {}).get("address") if s.bootstrap_from else None
        if addr:
            s.config = s.config.model_copy(update={"peers": [addr]})
    short = [f"{s.node_id} has {len(histories[s.node_id])}/{sc.rounds} rounds in history.jsonl"
             for s in specs if len(histories[s.node_id]) < sc.rounds]
    return StrategyRun(strategy, specs, wall, histories, info,
                       {s.node_id: p.status for s, p in zip(specs, progress)}, notes=short)


def check_data(sc: Scenario) -> list[str]:
    """Load every distinct dataset and partition the scenario's nodes use, before any process
    starts: an oversized partition or a missing data file fails here, naming the node, instead of
    in every daemon after the network came up. Returns warnings (e.g. an oracle without meaning)."""
    from .learning.datasets import load_pool
    from .learning.partition import partition, true_clusters

    seen: set[str] = set()
    warnings: list[str] = []
    for i in range(sc.nodes):
        lc = node_config(sc, sc.strategy[0], i, Path("/nonexistent")).learner
        key = lc.model_dump_json(include={"dataset", "dataset_params", "partition", "partition_params",
                                          "num_nodes", "data_seed", "val_fraction", "test_fraction"})
        if key in seen:
            continue
        seen.add(key)
        try:
            partition(load_pool(lc.dataset, lc.dataset_params, lc.data_seed), lc)
        except (ValueError, OSError) as e:
            raise ConfigError(f"scenario, node n{i}: data: {e}") from None
        if "oracle" in sc.strategy and sc.nodes > 1 and len(set(true_clusters(lc))) == sc.nodes:
            warnings.append(f"oracle has no meaning here: partition {lc.partition!r} puts every node in "
                            f"its own cluster, so the oracle learns alone (= local)")
    return sorted(set(warnings))


def _earlier_strategies(path: Path, results: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The strategies of an earlier results.json at ``path`` that this run did not redo, if that
    run had the same scenario (strategy list and params aside) and nodes; else nothing, noted."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, []
    if not isinstance(old, dict) or not isinstance(old.get("strategies"), dict):
        return {}, []
    strip = lambda scen: {k: v for k, v in (scen or {}).items() if k not in ("strategy", "strategy_params")}
    if strip(old.get("scenario")) != strip(results["scenario"]) or old.get("node_ids") != results["node_ids"]:
        return {}, [f"an earlier {path.name} there was for another scenario configuration: replaced"]
    kept = {k: v for k, v in old["strategies"].items() if k not in results["strategies"]}
    return kept, ([f"kept earlier results of {sorted(kept)} (created {old.get('created')})"] if kept else [])


def run_scenario(sc: Scenario, out_dir: str | Path, *, console: Any = None,
                 command: Callable[[NodeSpec], list[str]] | None = None,
                 poll_interval_s: float = 0.5, stop_timeout_s: float = 15.0,
                 notes: list[str] | None = None, check: bool = True) -> dict[str, Any]:
    """Run every strategy of the scenario one after another; write and return results.json.
    Strategies of an earlier results.json in ``out_dir`` for the same scenario that this run does
    not redo are kept in it (rerunning a subset replaces only those)."""
    from .results import build_results, write_results

    notes = list(notes or [])
    if check:
        for w in check_data(sc):
            notes.append(w)
            if console:
                console.print(f"[yellow]warning:[/] {w}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[StrategyRun] = []
    results: dict[str, Any] = {}
    for strategy in sc.strategy:
        if console:
            console.print(f"[bold]▶ {sc.name}: strategy {strategy}[/] — {sc.nodes} nodes, "
                          f"{sc.rounds} rounds, logs in {out / strategy / 'logs'}")
        runs.append(run_strategy(sc, strategy, out, console=console, command=command,
                                 poll_interval_s=poll_interval_s, stop_timeout_s=stop_timeout_s))
        results = build_results(sc, runs, notes=notes)
        kept, why = _earlier_strategies(out / "results.json", results)
        results["strategies"] = {**kept, **results["strategies"]}
        results["notes"] += why
        write_results(out / "results.json", results)  # after each strategy: partial results survive
    return results
