"""Launch a whole network of node daemons on this machine: the engine of ``coterie run`` / ``demo``.

Scenario file (TOML)
====================

.. code-block:: toml

    name = "two-clusters"        # free text, copied into results.json
    description = "..."          # optional
    seed = 0                     # data_seed and init_seed of every node; node i gets seed + i
    nodes = 8                    # number of node daemons, ids n0 .. n7
    rounds = 30                  # rounds every node runs before it reports done
    strategy = ["local", "fedfomo"]   # one name or a list: each runs in turn on identical data
    bootstrap = "chain"          # "chain": n_i knows n_{i-1}; "star": n_i knows n0. Discovery
                                 # (peer exchange) does the rest.
    timeout_s = 1800             # per strategy: give up (and stop every node) after this long

    [strategy_params.fedfomo]    # parameters per strategy name (Strategy.defaults keys)
    M = 5

    [learner]                    # LearnerConfig fields shared by all nodes
    dataset = "mnist1d"
    partition = "label_permutation"
    partition_params = { num_clusters = 2 }
    model = "mlp"

    [node]                       # NodeConfig fields shared by all nodes
    round_interval_s = 0.2
    min_peers = 7                # default: nodes - 1, so round 1 waits for full membership
    start_timeout_s = 120        # default 120

    [[overrides]]                # per-node changes, applied last, in file order
    nodes = [3]                  # node indices (0-based)
    learner.label_noise = 1.0    # any NodeConfig field; dotted keys descend (TOML dotted keys)

    [[overrides]]
    nodes = [7]
    round_interval_s = 2.0       # a slow node
    delay_ms = 50

The launcher owns these fields and refuses them in ``[node]``/``[learner]``/``[[overrides]]``:
``node_id, state_dir, listen, advertise, admin_listen, peers, strategy, rounds`` and
``learner.num_nodes, learner.node_index, learner.data_seed, learner.init_seed``.

What ``run`` does for each strategy
===================================
Free loopback ports are picked; node ``i`` gets ``DIR/<strategy>/configs/n{i}.toml`` (a complete
NodeConfig: state dir ``DIR/<strategy>/nodes/n{i}``, listen/admin on 127.0.0.1, bootstrap peer,
learner with num_nodes/node_index/seeds) and runs as its own process
(``python -m coterie.cli.main node start --config ...``, output in ``DIR/<strategy>/logs/n{i}.log``).
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
import socket
import subprocess
import sys
import time

import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .config import ConfigError, NodeConfig, deep_merge, read_toml, validate_config

RESERVED_NODE = ("node_id", "state_dir", "listen", "advertise", "admin_listen", "peers", "strategy",
                 "rounds")
RESERVED_LEARNER = ("num_nodes", "node_index", "data_seed", "init_seed")
# a personalised strategy to fall back on, in order, when a scenario's choice is not importable
FALLBACK_STRATEGIES = ("fedfomo", "federico", "scool-sbm", "cobo", "l2c", "oracle", "dpsgd")


class LauncherError(RuntimeError):
    """A scenario that cannot run, or a network that failed while running."""


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "scenario"
    description: str = ""
    seed: int = 0
    nodes: int = Field(..., ge=1, le=256)
    rounds: int = Field(..., ge=1)
    strategy: list[str] = Field(default_factory=lambda: ["local"], min_length=1)
    strategy_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    bootstrap: Literal["chain", "star"] = "chain"
    timeout_s: float = Field(1800.0, gt=0)
    learner: dict[str, Any] = Field(default_factory=dict)
    node: dict[str, Any] = Field(default_factory=dict)
    overrides: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("strategy", mode="before")
    @classmethod
    def _one_or_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [s.strip() for s in v.split(",") if s.strip()]
        return v

    @field_validator("strategy")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"listed twice: {sorted({s for s in v if v.count(s) > 1})}")
        return v


def _check_scenario(sc: Scenario) -> None:
    """Cross-field checks pydantic alone cannot express; messages name the field."""
    for k in RESERVED_NODE + ("learner",):
        if k in sc.node:
            raise ConfigError(f"scenario: node.{k} is set by the launcher"
                              + (" (use the [learner] table)" if k == "learner" else ""))
    for k in RESERVED_LEARNER:
        if k in sc.learner:
            raise ConfigError(f"scenario: learner.{k} is set by the launcher"
                              + (" (from seed)" if "seed" in k else ""))
    for s in sc.strategy_params:
        if s not in sc.strategy:
            raise ConfigError(f"scenario: strategy_params.{s} given but {s!r} is not in strategy "
                              f"{sc.strategy}")
    for n, ov in enumerate(sc.overrides):
        where = f"overrides[{n}]"
        nodes = ov.get("nodes")
        if (not isinstance(nodes, list) or not nodes
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in nodes)):
            raise ConfigError(f"scenario: {where}.nodes must be a non-empty list of node indices")
        bad = [i for i in nodes if not 0 <= i < sc.nodes]
        if bad:
            raise ConfigError(f"scenario: {where}.nodes: {bad} out of range 0..{sc.nodes - 1}")
        for k in RESERVED_NODE:
            if k in ov:
                raise ConfigError(f"scenario: {where}.{k} is set by the launcher")
        for k in RESERVED_LEARNER:
            if k in (ov.get("learner") or {}):
                raise ConfigError(f"scenario: {where}.learner.{k} is set by the launcher")


def parse_scenario(data: dict[str, Any], *, strategies: list[str] | None = None,
                   seed: int | None = None, rounds: int | None = None,
                   nodes: int | None = None) -> Scenario:
    """Validate a scenario dict, with command-line overrides. Every node config it generates is
    validated too, so a bad learner/node field fails here, before any process starts."""
    data = dict(data)
    for k, v in (("strategy", strategies), ("seed", seed), ("rounds", rounds), ("nodes", nodes)):
        if v is not None:
            data[k] = v
    if strategies is not None:  # a command-line subset: the file's params for the others stay unused
        chosen = strategies.split(",") if isinstance(strategies, str) else list(strategies)
        data["strategy_params"] = {k: v for k, v in (data.get("strategy_params") or {}).items()
                                   if k in chosen}
    try:
        sc = Scenario.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}"
                             for err in e.errors())
        raise ConfigError(f"invalid scenario: {problems}") from None
    _check_scenario(sc)
    for strat in sc.strategy:
        for i in range(sc.nodes):
            try:
                node_config(sc, strat, i, Path("/nonexistent"), ports=[(1, 2)] * sc.nodes)
            except ConfigError as e:
                raise ConfigError(f"scenario, node n{i} ({strat}): {e}") from None
    return sc


def load_scenario(path: str | Path, **overrides: Any) -> Scenario:
    return parse_scenario(read_toml(path, "scenario"), **overrides)


def builtin_scenario(name: str = "demo") -> Path:
    """Path of a scenario shipped inside the package (``coterie.node/scenarios/<name>.toml``)."""
    p = Path(__file__).with_name("scenarios") / f"{name}.toml"
    if not p.exists():
        raise ConfigError(f"no built-in scenario {name!r}")
    return p


# ------------------------------------------------------------------------------- node configs
def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago (all held open together while picking)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def bootstrap_index(sc: Scenario, i: int) -> int | None:
    if i == 0:
        return None
    return i - 1 if sc.bootstrap == "chain" else 0


def node_config(sc: Scenario, strategy: str, i: int, strat_dir: Path,
                ports: list[tuple[int, int]]) -> NodeConfig:
    """The complete config of node ``i`` for ``strategy``; ``ports[i]`` = (peer, admin)."""
    peer_port, admin_port = ports[i]
    data: dict[str, Any] = {"min_peers": sc.nodes - 1, "start_timeout_s": 120.0}
    data = deep_merge(data, sc.node)
    data = deep_merge(data, {
        "node_id": f"n{i}",
        "state_dir": str(strat_dir / "nodes" / f"n{i}"),
        "listen": f"127.0.0.1:{peer_port}",
        "admin_listen": f"127.0.0.1:{admin_port}",
        "peers": [] if (b := bootstrap_index(sc, i)) is None else [f"127.0.0.1:{ports[b][0]}"],
        "strategy": strategy,
        "strategy_params": dict(sc.strategy_params.get(strategy, {})),
        "rounds": sc.rounds,
        "seed": data.get("seed", sc.seed) + i,
        "learner": deep_merge(sc.learner, {"num_nodes": sc.nodes, "node_index": i,
                                           "data_seed": sc.seed, "init_seed": sc.seed}),
    })
    for ov in sc.overrides:
        if i in ov["nodes"]:
            data = deep_merge(data, {k: v for k, v in ov.items() if k != "nodes"})
    return validate_config(data)


def _drop_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_none(v) for v in obj]
    return obj


def config_toml(cfg: NodeConfig) -> str:
    import tomli_w
    return tomli_w.dumps(_drop_none(cfg.model_dump(mode="json")))


@dataclass
class NodeSpec:
    index: int
    config: NodeConfig
    config_path: Path
    log_path: Path

    @property
    def node_id(self) -> str:
        return self.config.node_id or f"n{self.index}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.config.admin_listen}"

    @property
    def state_dir(self) -> Path:
        return Path(self.config.state_dir)


def prepare(sc: Scenario, strategy: str, out_dir: Path) -> list[NodeSpec]:
    """Write every node's config for ``strategy`` under ``out_dir/<strategy>`` (clearing the
    node state, configs and logs of an earlier run there: a stale checkpoint would resume)."""
    strat_dir = Path(out_dir).resolve() / strategy
    for sub in ("nodes", "configs", "logs"):
        shutil.rmtree(strat_dir / sub, ignore_errors=True)
        (strat_dir / sub).mkdir(parents=True, exist_ok=True)
    flat = free_ports(2 * sc.nodes)
    ports = [(flat[2 * i], flat[2 * i + 1]) for i in range(sc.nodes)]
    specs = []
    for i in range(sc.nodes):
        cfg = node_config(sc, strategy, i, strat_dir, ports)
        path = strat_dir / "configs" / f"n{i}.toml"
        path.write_text(config_toml(cfg))
        specs.append(NodeSpec(i, cfg, path, strat_dir / "logs" / f"n{i}.log"))
    return specs


def node_command(spec: NodeSpec) -> list[str]:
    return [sys.executable, "-m", "coterie.cli.main", "node", "start", "--config",
            str(spec.config_path)]


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
        def one(spec: NodeSpec) -> dict[str, Any] | None:
            try:
                return fetch_json(spec.admin_url + "/status", timeout=2.0)
            except (OSError, ValueError):
                return None

        statuses = list(pool.map(one, self.specs))
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
@dataclass
class StrategyRun:
    strategy: str
    specs: list[NodeSpec]
    wall_time_s: float
    histories: dict[str, list[dict[str, Any]]]
    node_info: dict[str, dict[str, Any]]
    final_status: dict[str, dict[str, Any] | None]
    notes: list[str] = field(default_factory=list)


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
        lc = node_config(sc, sc.strategy[0], i, Path("/nonexistent"), ports=[(1, 2)] * sc.nodes).learner
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
