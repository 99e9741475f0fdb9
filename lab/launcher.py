"""The launcher's public names in one place (``coterie run``/``demo``, tests, benchmarks); the
code lives in ``lab/launch/``: ``common.py`` (shared), ``processes.py`` and ``inproc.py``."""

from __future__ import annotations

from coterie.node.config import ConfigError

from .launch import BACKENDS, MAX_NODES, check_backend, run_scenario
from .launch.common import (
    FALLBACK_STRATEGIES,
    LauncherError,
    NodeProgress,
    check_data,
    read_history,
    resolve_strategies,
    strategy_problem,
)
from .launch.processes import (
    Network,
    _child_env,
    fetch_json,
    log_tail,
    node_args,
    node_command,
    prepare,
    read_node_info,
    run_strategy,
)

__all__ = [
    "BACKENDS",
    "FALLBACK_STRATEGIES",
    "MAX_NODES",
    "ConfigError",
    "LauncherError",
    "Network",
    "NodeProgress",
    "check_backend",
    "check_data",
    "fetch_json",
    "log_tail",
    "node_args",
    "node_command",
    "prepare",
    "read_history",
    "read_node_info",
    "resolve_strategies",
    "run_scenario",
    "run_strategy",
    "strategy_problem",
    "_child_env",
]
