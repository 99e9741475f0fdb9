"""What every backend of ``coterie run`` shares: strategy resolution, run directories, the live
progress view, collecting each node's files into a ``StrategyRun``, and the loop over a
scenario's strategies that writes ``results.json`` after each one."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coterie.node.config import ConfigError
from coterie.node.strategies.registry import strategy_problem

from ..scenario import NodeSpec, Scenario, StrategyRun, node_config

# a personalised strategy to fall back on, in order, when a scenario's choice is not importable
FALLBACK_STRATEGIES = ("fedfomo", "federico", "scool-sbm", "cobo", "l2c", "oracle", "dpsgd")
PER_NODE_ROWS = 32  # larger networks get one summary row in the live view


class LauncherError(RuntimeError):
    """A scenario that cannot run, or a network that failed while running."""


# ---------------------------------------------------------------------------------- strategies
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
        sub = next(
            (f for f in FALLBACK_STRATEGIES if f not in names and f not in out and strategy_problem(f) is None), None
        )
        notes.append(f"strategy {n!r} unavailable ({problem}); " + (f"using {sub!r} instead" if sub else "skipped"))
        if sub:
            out.append(sub)
    if not out:
        raise ConfigError("no strategy of the scenario can run")
    return out, notes


# ------------------------------------------------------------------------------ run directories
def fresh_strategy_dir(out_dir: Path, strategy: str) -> Path:
    """``out_dir/<strategy>`` with empty nodes/, configs/, logs/ and pki/ (the node state, configs,
    logs and throwaway CA of an earlier run there are cleared: a stale checkpoint would resume)."""
    strat_dir = Path(out_dir).resolve() / strategy
    for sub in ("nodes", "configs", "logs", "pki"):
        shutil.rmtree(strat_dir / sub, ignore_errors=True)
        (strat_dir / sub).mkdir(parents=True, exist_ok=True)
    return strat_dir


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


# ------------------------------------------------------------------------------------ progress
@dataclass
class NodeProgress:
    round: int = 0
    done: bool = False
    acc: float | None = None
    status: dict[str, Any] | None = None
    state: str = "starting"

    def update(self, status: dict[str, Any]) -> None:
        """From a node's ``/status`` (or ``Node.status()``)."""
        self.status = status
        ev = status.get("last_eval") or {}
        acc = ev.get("test_acc") if isinstance(ev, dict) else None
        self.observe(int(status.get("round") or 0), bool(status.get("done")), None if acc is None else float(acc))

    def observe(self, round: int, done: bool, acc: float | None) -> None:
        """Progress read from a node: its round, whether it is done, its last test accuracy (None:
        none yet, the last one stays)."""
        self.round = round
        self.done = self.done or done
        if acc is not None:
            self.acc = acc
        self.state = "done" if self.done else "running"


class LiveView:
    """The terminal progress of one strategy's network: a bar per node, or one summary bar (all
    nodes' rounds) for networks larger than ``PER_NODE_ROWS``."""

    def __init__(self, console: Any, strategy: str, specs: Sequence[NodeSpec], rounds: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.rounds = rounds
        self.per_node = len(specs) <= PER_NODE_ROWS
        self.prog = Progress(
            TextColumn(f"[bold]{strategy}[/] {{task.description:>4}}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("acc {task.fields[acc]:>6}"),
            TextColumn("{task.fields[state]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            refresh_per_second=4,
        )
        if self.per_node:
            self.tasks = [self.prog.add_task(s.node_id, total=rounds, acc="–", state="starting") for s in specs]
        else:
            self.tasks = [
                self.prog.add_task(f"{len(specs)} nodes", total=rounds * len(specs), acc="–", state="starting")
            ]

    def __enter__(self) -> LiveView:
        self.prog.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.prog.stop()

    def update(self, progress: Sequence[NodeProgress]) -> None:
        if self.per_node:
            for t, pr in zip(self.tasks, progress, strict=True):
                self.prog.update(
                    t,
                    completed=min(pr.round, self.rounds),
                    state=pr.state,
                    acc="–" if pr.acc is None else f"{pr.acc:.3f}",
                )
            return
        accs = [p.acc for p in progress if p.acc is not None]
        done = sum(p.done for p in progress)
        self.prog.update(
            self.tasks[0],
            completed=sum(min(p.round, self.rounds) for p in progress),
            acc="–" if not accs else f"{sum(accs) / len(accs):.3f}",
            state=f"{done}/{len(progress)} done",
        )


def network_done(
    strategy: str,
    specs: Sequence[NodeSpec],
    progress: Sequence[NodeProgress],
    view: LiveView | None,
    deadline: float,
    timeout_s: float,
) -> bool:
    """Every backend's poll, after it read its nodes' progress: show it; True once every node is
    done; LauncherError past the deadline."""
    if view:
        view.update(progress)
    if all(pr.done for pr in progress):
        return True
    check_deadline(strategy, specs, progress, deadline, timeout_s)
    return False


def check_deadline(
    strategy: str, specs: Sequence[NodeSpec], progress: Sequence[NodeProgress], deadline: float, timeout_s: float
) -> None:
    if time.monotonic() > deadline:
        behind = [f"{s.node_id}@{p.round}" for s, p in zip(specs, progress, strict=True) if not p.done]
        more = f" and {len(behind) - 20} more" if len(behind) > 20 else ""
        raise LauncherError(f"{strategy}: timed out after {timeout_s:.0f}s; not done: {', '.join(behind[:20])}{more}")


# ------------------------------------------------------------------------------------- results
def collect(
    strategy: str, specs: Sequence[NodeSpec], rounds: int, wall_s: float, progress: Sequence[NodeProgress]
) -> StrategyRun:
    """Each node's history.jsonl and node.json, as results.py reads them."""
    histories, info = {}, {}
    for s in specs:
        histories[s.node_id] = read_history(s.state_dir / "history.jsonl")
        try:
            info[s.node_id] = json.loads((s.state_dir / "node.json").read_text())
        except (OSError, ValueError):
            info[s.node_id] = {}
    short = [
        f"{s.node_id} has {len(histories[s.node_id])}/{rounds} rounds in history.jsonl"
        for s in specs
        if len(histories[s.node_id]) < rounds
    ]
    return StrategyRun(
        strategy,
        list(specs),
        wall_s,
        histories,
        info,
        {s.node_id: p.status for s, p in zip(specs, progress, strict=True)},
        notes=short,
    )


def check_data(sc: Scenario) -> list[str]:
    """Load every distinct dataset and partition the scenario's nodes use, before any node starts:
    an oversized partition or a missing data file fails here, naming the node, instead of in
    every daemon after the network came up. Returns warnings (e.g. an oracle without meaning).
    (The partition is computed as the nodes of this process will use it: ``shared_partition``.)"""
    from coterie.node.learning.datasets import load_pool
    from coterie.node.learning.partition import shared_partition, true_clusters

    seen: set[str] = set()
    warnings: list[str] = []
    for i in range(sc.nodes):
        cfg = node_config(sc, sc.strategy[0], i, Path("/nonexistent"))
        lc = cfg.learner
        if lc.data is not None:  # the node's own files: read and checked as the node will
            from coterie.node.learning.own_data import load_own_data

            try:
                load_own_data(lc)
            except (ValueError, OSError) as e:
                raise ConfigError(f"scenario, node n{i}: data: {e}") from None
            if "oracle" in sc.strategy and "cluster" not in cfg.labels:
                raise ConfigError(
                    f"scenario, node n{i}: strategy oracle needs a true cluster, which own "
                    f"files (learner.data) do not have: set labels.cluster per node "
                    f"([[overrides]]) or drop oracle"
                )
            continue
        key = lc.model_dump_json(
            include={
                "dataset",
                "dataset_params",
                "partition",
                "partition_params",
                "num_nodes",
                "data_seed",
                "val_fraction",
                "test_fraction",
            }
        )
        if key in seen:
            continue
        seen.add(key)
        try:
            shared_partition(load_pool(lc.dataset, lc.dataset_params, lc.data_seed), lc)
        except (ValueError, OSError) as e:
            raise ConfigError(f"scenario, node n{i}: data: {e}") from None
        if "oracle" in sc.strategy and sc.nodes > 1 and len(set(true_clusters(lc))) == sc.nodes:
            warnings.append(
                f"oracle has no meaning here: partition {lc.partition!r} puts every node in "
                f"its own cluster, so the oracle learns alone (= local)"
            )
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
    strip = lambda scen: {k: v for k, v in (scen or {}).items() if k not in ("strategy", "strategy_params")}  # noqa: E731
    if strip(old.get("scenario")) != strip(results["scenario"]) or old.get("node_ids") != results["node_ids"]:
        return {}, [f"an earlier {path.name} there was for another scenario configuration: replaced"]
    kept = {k: v for k, v in old["strategies"].items() if k not in results["strategies"]}
    return kept, ([f"kept earlier results of {sorted(kept)} (created {old.get('created')})"] if kept else [])


def run_strategies(
    sc: Scenario,
    out_dir: str | Path,
    run_strategy: Callable[[str], StrategyRun],
    *,
    console: Any = None,
    notes: list[str] | None = None,
    backend: str = "",
    check: bool = True,
) -> dict[str, Any]:
    """Run every strategy of the scenario one after another; write and return results.json.
    Strategies of an earlier results.json in ``out_dir`` for the same scenario that this run does
    not redo are kept in it (rerunning a subset replaces only those)."""
    from ..results import build_results, write_results

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
            console.print(
                f"[bold]▶ {sc.name}: strategy {strategy}[/] — {sc.nodes} nodes, {sc.rounds} rounds"
                + (f" ({backend})" if backend else "")
                + f", logs in {out / strategy / 'logs'}"
            )
        runs.append(run_strategy(strategy))
        results = build_results(sc, runs, notes=notes)
        if backend:
            results["backend"] = backend
        kept, why = _earlier_strategies(out / "results.json", results)
        results["strategies"] = {**kept, **results["strategies"]}
        results["notes"] += why
        write_results(out / "results.json", results)  # after each strategy: partial results survive
    return results
