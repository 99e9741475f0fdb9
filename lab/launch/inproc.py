"""The ``inproc`` backend of ``coterie run``: every node of a scenario in this process, on one
asyncio event loop, talking through the in-process transport (``transport/inproc.py``).

The nodes are the same ``Node`` as a daemon process runs — same configs (written to
``DIR/<strategy>/configs/n{i}.toml``), partitions, seeds, state dirs with real checkpoints and
``history.jsonl``, so ``results.json`` has the same format — with these differences:

- addresses are ``inproc:<i+1>`` and there is no admin HTTP server per node: the launcher reads
  each node's progress and final ``status()`` directly;
- nodes start in batches of ``START_BATCH``, each batch's nodes together; the next batch starts
  once every node of this one has met a peer (its bootstrap handshake answered);
- one thread pool runs every node's compute and checkpoint writes (``asyncio.to_thread``'s
  default executor, ``default_threads()``); the dataset pool and the partition are computed once
  and shared (each node copies only its own samples);
- every node pings one member per protocol period (SWIM: N pings per period in one process),
  so for very large networks the period — and the suspect/dead timeouts with it — is stretched
  until the whole network stays under ``HEARTBEATS_PER_S``; networks up to several thousand nodes
  keep the scenario's timing. The stretched values are in the node configs;
- no TLS: the nodes are one trusted process (``transport/inproc.py`` holds each call to its
  caller's node id instead), so the configs say ``security.insecure = true``;
- logs of all nodes go to ``DIR/<strategy>/logs/inproc.log``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from coterie.node.config import NodeConfig, SecurityConfig

from ..scenario import NodeSpec, Scenario, StrategyRun, bootstrap_index, config_toml, node_config
from .common import LauncherError, LiveView, NodeProgress, collect, fresh_strategy_dir, network_done

HEARTBEATS_PER_S = 20_000  # in-memory SWIM pings one process affords (tens of µs each)
START_BATCH = 50  # nodes started together; each batch has met the network before the next starts
LOG_NAME = "inproc.log"


def default_threads() -> int:
    """Compute needs about one thread per core; the rest cover threads blocked in a checkpoint's
    fsyncs (a node's checkpoint waits on the disk ~17 times), which would otherwise stall training."""
    return 4 * (os.cpu_count() or 1) + 4


def address(i: int) -> str:
    return f"inproc:{i + 1}"


def membership_timing(cfg: NodeConfig, nodes: int) -> dict[str, float]:
    """Config changes that keep N nodes' pings (one per node per period) under
    ``HEARTBEATS_PER_S`` ({} if none)."""
    floor = nodes / HEARTBEATS_PER_S
    if cfg.heartbeat_interval_s >= floor:
        return {}
    k = floor / cfg.heartbeat_interval_s
    return {
        "heartbeat_interval_s": floor,
        "suspect_after_s": cfg.suspect_after_s * k,
        "dead_after_s": cfg.dead_after_s * k,
    }


def prepare(sc: Scenario, strategy: str, out_dir: Path) -> list[NodeSpec]:
    """Every node's config for ``strategy``, as the processes backend writes them but with
    in-process addresses (and the membership timing of ``membership_timing``)."""
    strat_dir = fresh_strategy_dir(out_dir, strategy)
    log_path = strat_dir / "logs" / LOG_NAME
    specs = []
    for i in range(sc.nodes):
        b = bootstrap_index(sc, i)
        cfg = node_config(sc, strategy, i, strat_dir, bootstrap=None if b is None else address(b))
        cfg = cfg.model_copy(
            update={"listen": address(i), **membership_timing(cfg, sc.nodes), "security": SecurityConfig(insecure=True)}
        )
        path = strat_dir / "configs" / f"n{i}.toml"
        path.write_text(config_toml(cfg))
        specs.append(NodeSpec(i, cfg, path, log_path))
    return specs


class _NodeLogs:
    """All nodes' log records into one file for the run (the nodes share their loggers)."""

    def __init__(self, path: Path, level: str):
        self.logger = logging.getLogger("coterie")
        self.handler = logging.FileHandler(path)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.level = getattr(logging, level.upper(), logging.INFO)

    def __enter__(self) -> _NodeLogs:
        self.saved = (self.logger.level, self.logger.propagate)
        self.logger.addHandler(self.handler)
        self.logger.setLevel(self.level)
        self.logger.propagate = False  # a thousand nodes' warnings belong in the file, not the terminal
        return self

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.saved[0])
        self.logger.propagate = self.saved[1]
        self.handler.close()


async def _start_batch(node_cls: Any, switchboard: Any, batch: list[NodeSpec], nodes: list[Any]) -> None:
    """Start ``batch`` together (their checkpoint writes and data copies overlap), then wait until
    each one that has a bootstrap peer has met someone: a batch joins the network before the next
    one starts, instead of a thousand nodes' first handshakes queueing behind each other's starts
    and retrying with backoff."""
    group = []
    for spec in batch:
        try:
            node = node_cls(spec.config, transport=switchboard.transport_for(spec.config), admin=False)
        except (OSError, ValueError, RuntimeError) as e:
            raise LauncherError(f"node {spec.node_id} could not start: {type(e).__name__}: {e}") from e
        nodes.append(node)
        group.append((spec, node))
    started = await asyncio.gather(*(node.start() for _, node in group), return_exceptions=True)
    for (spec, _), r in zip(group, started, strict=True):
        if isinstance(r, (OSError, ValueError, RuntimeError)):
            raise LauncherError(f"node {spec.node_id} could not start: {type(r).__name__}: {r}") from r
        if isinstance(r, BaseException):
            raise r
    joining = [(spec, node) for spec, node in group if spec.config.peers]
    deadline = time.monotonic() + max((spec.config.start_timeout_s for spec, _ in joining), default=0.0)
    while joining and time.monotonic() < deadline:
        joining = [(spec, node) for spec, node in joining if not node.peers.alive()]
        if joining:
            await asyncio.sleep(0.02)  # polls membership, bounded by the nodes' start timeout
    for spec, _ in joining:  # membership keeps trying; the run's own timeout bounds the rest
        logging.getLogger("coterie.lab").warning("node %s met no peer within its start timeout", spec.node_id)


async def _run(
    sc: Scenario,
    strategy: str,
    specs: list[NodeSpec],
    progress: list[NodeProgress],
    view: LiveView | None,
    poll_interval_s: float,
    threads: int,
    on_done: Callable[[list[Any]], None] | None = None,
) -> None:
    from coterie.node.daemon import Node
    from coterie.node.transport.inproc import InProcNetwork

    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="compute")
    loop.set_default_executor(pool)  # asyncio.to_thread: every node's training and served compute
    switchboard = InProcNetwork()
    nodes: list[Any] = []
    try:
        for lo in range(0, len(specs), START_BATCH):
            await _start_batch(Node, switchboard, specs[lo : lo + START_BATCH], nodes)
        deadline = time.monotonic() + sc.timeout_s
        while True:
            for spec, node, pr in zip(specs, nodes, progress, strict=True):
                if not node.healthy():
                    task = node._round_task
                    why = repr(task.exception()) if task is not None and task.done() and not task.cancelled() else "?"
                    raise LauncherError(
                        f"node {spec.node_id}: its round loop died at round {node.round}/"
                        f"{sc.rounds}: {why}; see {spec.log_path}"
                    )
                pr.observe(node.round, node.done, node.last_eval.get("test_acc"))
            if network_done(strategy, specs, progress, view, deadline, sc.timeout_s):
                break
            await asyncio.sleep(poll_interval_s)
        for node, pr in zip(nodes, progress, strict=True):
            pr.update(node.status())
        if on_done is not None:  # the finished nodes, live, before they stop (e.g. lab/audit.py)
            on_done(nodes)
    finally:
        # a batch at a time, together: one by one, 1,000 nodes took minutes to stop while the rest
        # kept gossiping on the same loop (the run's figures wait for it)
        errors = []
        for lo in range(0, len(nodes), START_BATCH):
            done = await asyncio.gather(*(n.stop() for n in nodes[lo : lo + START_BATCH]), return_exceptions=True)
            errors += [e for e in done if isinstance(e, BaseException)]
        pool.shutdown(wait=True, cancel_futures=True)
        if errors:
            raise errors[0]


def run_strategy(
    sc: Scenario,
    strategy: str,
    out_dir: Path,
    *,
    console: Any = None,
    poll_interval_s: float = 0.5,
    threads: int | None = None,
    on_done: Callable[[list[Any]], None] | None = None,
) -> StrategyRun:
    """Run one strategy's network in this process to completion and collect each node's files.
    ``on_done``: called with the live ``Node``s (index = node index) once all have finished their
    rounds, before they stop — to look at what only a running node holds."""
    specs = prepare(sc, strategy, out_dir)
    progress = [NodeProgress() for _ in specs]
    threads = threads or default_threads()
    t0 = time.time()
    view = LiveView(console, strategy, specs, sc.rounds) if console else None
    with _NodeLogs(specs[0].log_path, specs[0].config.log_level):
        if view:
            view.__enter__()
        try:
            asyncio.run(_run(sc, strategy, specs, progress, view, poll_interval_s, threads, on_done))
        finally:
            if view:
                view.__exit__()
    return collect(strategy, specs, sc.rounds, time.time() - t0, progress)
