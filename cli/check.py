"""``coterie node check-config CONFIG``: everything ``node start`` would find wrong with a config,
found without joining a network. The config (file, then the COTERIE_* environment, as ``node
start`` reads them), the strategy, the data (loaded) and the model (built), the certificates
(readable, issued by the CA, the key theirs, not expired or revoked) and the state directory
(writable; its newest checkpoint of this node, this strategy and this model, as a start demands).
Every problem is listed, not only the first: an operator editing a unit's config before a reload
fixes them in one go. No port is bound and no peer dialled."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

EXIT_PROBLEMS = 2  # bad input, as every other command of the CLI


def _state_dir_problem(state_dir: Path) -> str | None:
    """The state dir (or, before a first start, the nearest existing parent) must be writable."""
    probe = state_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"state_dir {state_dir}: {probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"state_dir {state_dir}: {probe} is not writable by this user"
    return None


def check(config: Path) -> tuple[list[str], list[str]]:
    """(summary lines, problems) for ``config``."""
    from coterie.cli.main import preflight_problems
    from coterie.node.config import ConfigError, load_config
    from coterie.node.transport.tls import load_tls

    try:
        cfg = load_config(config)
    except ConfigError as e:
        return [], [str(e)]  # nothing further can be checked without a config
    summary = [f"config {config}: parsed and validated (strategy {cfg.strategy}, state dir {cfg.state_dir})"]
    problems = [msg for msg, _ in preflight_problems(cfg, ports=False)]  # a running node holds its ports
    tls = None
    try:
        tls = load_tls(cfg)
        summary.append(f"certificates: node {tls.node_id}, issued by the CA" if tls else "security.insecure: no TLS")
    except ConfigError as e:
        problems.append(str(e))
    if (why := _state_dir_problem(Path(cfg.state_dir))) is not None:
        problems.append(why)
    try:  # the slow part: torch, the data and the model, exactly as the daemon builds them
        from coterie.node.learning.torch_learner import build_learner

        learner = build_learner(cfg.learner)
        summary.append(_learner_summary(learner, cfg))
    except Exception as e:  # noqa: BLE001 - whatever the data or model raises, named for the operator
        problems.append(f"learner: {type(e).__name__}: {e}")
    else:
        resumes, line = _resumes(cfg, learner.fingerprint(), tls.node_id if tls else None)
        (summary if resumes else problems).append(line)
    return summary, problems


def _resumes(cfg: Any, fingerprint: str, cert_id: str | None) -> tuple[bool, str]:
    """Whether the node starts from its state dir under this config, and a line saying so or
    naming what would stop it (the checks of ``Node._restore``). The newest checkpoint is read
    without the lock, as `model export` does: the node may be running."""
    from coterie.node.persistence import StateError, checkpoint_files, read_latest

    d = Path(cfg.state_dir)
    if cfg.reset or not d.is_dir() or not checkpoint_files(d):
        return True, f"state dir {d}: starts at round 0" + (" (reset: old state moved aside)" if cfg.reset else "")
    try:
        ckpt = read_latest(d)
    except StateError as e:
        return False, f"state dir: {e}"
    st, fix = ckpt.state, "(or start once with --reset to begin again)"
    wanted = cfg.node_id or cert_id  # (load_tls already matched the two)
    if wanted is not None and ckpt.node_id != wanted:
        return False, f"state dir {d} belongs to node {ckpt.node_id!r}, this config runs node {wanted!r}"
    if st.get("fingerprint") != fingerprint:
        return False, f"state dir: {ckpt.path} is for another model architecture than learner.model builds {fix}"
    if st.get("strategy") != cfg.strategy:
        return (
            False,
            f"state dir: {ckpt.path} was written by strategy {st.get('strategy')!r}, not {cfg.strategy!r} {fix}",
        )
    return True, f"state dir {d}: resumes node {ckpt.node_id} at round {ckpt.round}"


def _learner_summary(learner: Any, cfg: Any) -> str:
    params = sum(int(p.numel()) for p in learner.get_params().values())
    splits = ", ".join(f"{s} {learner.num_samples(s)}" for s in ("train", "val", "test"))
    source = cfg.learner.data or f"{cfg.learner.dataset} (node {cfg.learner.node_index} of {cfg.learner.num_nodes})"
    return f"data {source}: {splits} samples; model {cfg.learner.model}: {params:,} parameters"


def check_config(
    config: Path = typer.Argument(..., help="the node's TOML config file (COTERIE_* variables apply, as at start)"),
) -> None:
    """Validate a config and its data source (load the data, build the model, check the TLS files)
    without joining a network: exit 0 with a summary, else 2 with each problem named."""
    summary, problems = check(config)
    out, err = Console(highlight=False, soft_wrap=True), Console(stderr=True, highlight=False, soft_wrap=True)
    for line in summary:
        out.print(escape(line))
    for p in problems:
        err.print(f"[red]problem:[/] {escape(p)}")
    if problems:
        err.print(f"{len(problems)} problem(s): the node would not start (or would refuse this config on reload)")
        raise typer.Exit(EXIT_PROBLEMS)
    out.print("ok: the node can start with this config")
