"""``coterie run``: a scenario's whole network on this machine, one strategy after another.

Backends (``run_scenario(..., backend=...)``):

- ``processes`` (default, ``processes.py``): every node its own daemon process, gRPC on loopback;
- ``inproc`` (``inproc.py``): every node in this process on one event loop, in-process transport;
- ``ray`` (``ray.py``): groups of in-process nodes as Ray actors across a Ray cluster, memory
  within a group and gRPC between groups (needs the ``ray`` extra).

All write the same ``DIR/results.json`` (``results.py``) from the nodes' state dirs; what they
share (strategy resolution, run directories, live progress, collection) is in ``common.py``. The
scenario format and the per-node configs are in ``scenario.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from coterie.node.config import ConfigError

from ..scenario import Scenario, StrategyRun
from .common import run_strategies

BACKENDS = ("processes", "inproc", "ray")
# daemon processes on one machine; inproc: memory; ray: as many as the scenario format allows
MAX_NODES = {"processes": 256, "inproc": 10_000, "ray": 10_000}


def check_backend(sc: Scenario, backend: str) -> None:
    """ConfigError naming the problem if ``backend`` cannot run ``sc``."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    if sc.nodes > MAX_NODES[backend]:
        raise ConfigError(
            f"scenario: nodes={sc.nodes} is more than the {backend} backend runs on one machine "
            f"({MAX_NODES[backend]})" + ("; try --backend inproc" if backend == "processes" else "")
        )
    if backend == "ray":
        from .ray import ray_problem

        problem = ray_problem()
        if problem:
            raise ConfigError(problem)


def run_scenario(
    sc: Scenario,
    out_dir: str | Path,
    *,
    backend: str = "processes",
    console: Any = None,
    notes: list[str] | None = None,
    check: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Run every strategy of ``sc`` on ``backend``; write and return ``out_dir/results.json``
    (``common.run_strategies``: the data are checked first unless ``check`` is False).
    ``options`` go to the backend's ``run_strategy`` (processes: command, poll_interval_s,
    stop_timeout_s; inproc: poll_interval_s, threads, on_done; ray: address — of the cluster, for the
    whole run —, groups, cpus, threads, poll_interval_s)."""
    check_backend(sc, backend)
    if backend == "ray":
        from .ray import ray_session
        from .ray import run_strategy as on_ray

        with ray_session(options.pop("address", None)):
            return run_strategies(
                sc,
                out_dir,
                lambda s: on_ray(sc, s, Path(out_dir), console=console, **options),
                console=console,
                notes=notes,
                backend=backend,
            )
    run_strategy: Callable[..., StrategyRun]
    if backend == "processes":
        from .processes import run_strategy
    else:
        from .inproc import run_strategy
    return run_strategies(
        sc,
        out_dir,
        lambda s: run_strategy(sc, s, Path(out_dir), console=console, **options),
        console=console,
        notes=notes,
        backend=backend,
        check=check,
    )
