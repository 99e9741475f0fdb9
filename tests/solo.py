"""A lone node run in-process by the tests of checkpoints and resumes: its config (no peers, so
no peer port in play: insecure) and a run to its last round."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from coterie.node.config import NodeConfig, validate_config

LEARNER: dict[str, Any] = {
    "dataset": "mnist1d",
    "dataset_params": {"num_samples": 600},
    "partition": "iid",
    "num_nodes": 1,
    "model": "linear",
    "local_steps": 2,
}


def solo_config(path: Path, rounds: int, learner: dict[str, Any] | None = None, **extra: Any) -> NodeConfig:
    """Node ``solo`` under ``path / "solo"``, flat out for ``rounds`` rounds; ``learner`` replaces
    keys of the small linear learner, ``extra`` sets other node keys."""
    return validate_config(
        {
            "node_id": "solo",
            "security": {"insecure": True},
            "state_dir": str(path / "solo"),
            "strategy": "local",
            "rounds": rounds,
            "min_peers": 0,
            "round_interval_s": 0.0,
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            **extra,
            "learner": {**LEARNER, **(learner or {})},
        }
    )


async def until(cond, timeout: float = 60) -> None:
    """Wait for ``cond()`` to hold (polled), at most ``timeout`` seconds."""

    async def wait() -> None:
        while not cond():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(wait(), timeout)


async def run_until_done(node, timeout: float = 60) -> None:
    """Start ``node``, wait for its last round, stop it (cleanly: asserted)."""
    await node.start()
    try:
        await until(lambda: node.done, timeout)
    finally:
        assert await node.stop()
