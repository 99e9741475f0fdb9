"""The ``coterie`` command line.

  coterie node start [--config FILE] [flags]      run one node daemon (blocks)
  coterie status|peers|weights --admin URL        inspect a running node (--json for raw JSON)
  coterie run SCENARIO.toml --out DIR [--backend processes|inproc]
                                                  launch a local network, write results.json
  coterie demo [--out DIR]                        the built-in scenario: personalised vs local
  coterie strategies                              the strategies this install can run

Config precedence for ``node start``: flags > COTERIE_* environment > TOML file.
"""
from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

app = typer.Typer(help="Coterie: peer-to-peer decentralized personalised learning.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
node_app = typer.Typer(help="Run a node daemon.", no_args_is_help=True)
app.add_typer(node_app, name="node")

EXIT_CONFIG = 2


def _console() -> Console:
    return Console()


def _fail(msg: str, code: int = 1) -> "typer.Exit":
    Console(stderr=True).print(f"[red]error:[/] {msg}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


# ---------------------------------------------------------------------------------- node start
def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def build_overrides(*, node_id: str | None = None, state_dir: Path | None = None,
                    listen: str | None = None, advertise: str | None = None,
                    admin_listen: str | None = None, peers: str | None = None,
                    strategy: str | None = None, rounds: int | None = None,
                    sets: list[str] | None = None) -> dict[str, Any]:
    """Command-line flags as a nested override dict for ``load_config``."""
    from coterie.node.config import ConfigError, _set_path

    out: dict[str, Any] = {}
    for key, v in (("node_id", node_id), ("state_dir", str(state_dir) if state_dir else None),
                   ("listen", listen), ("advertise", advertise), ("admin_listen", admin_listen),
                   ("strategy", strategy), ("rounds", rounds)):
        if v is not None:
            out[key] = v
    if peers is not None:
        out["peers"] = [p.strip() for p in peers.split(",") if p.strip()]
    for item in sets or []:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set expects key.path=value, got {item!r}")
        _set_path(out, key, _parse_value(raw))
    return out


@node_app.command("start")
def node_start(
    config: Optional[Path] = typer.Option(None, "--config", "-c", envvar="COTERIE_CONFIG",
                                          help="TOML config file."),
    node_id: Optional[str] = typer.Option(None, "--node-id"),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir"),
    listen: Optional[str] = typer.Option(None, "--listen", help="peer (gRPC) host:port"),
    advertise: Optional[str] = typer.Option(None, "--advertise", help="address peers dial"),
    admin_listen: Optional[str] = typer.Option(None, "--admin-listen", help="admin HTTP host:port"),
    peers: Optional[str] = typer.Option(None, "--peers", help="bootstrap peers a:1,b:2"),
    strategy: Optional[str] = typer.Option(None, "--strategy"),
    rounds: Optional[int] = typer.Option(None, "--rounds"),
    sets: Optional[list[str]] = typer.Option(None, "--set",
                                             help="any field: key.path=value (JSON value or text)"),
) -> None:
    """Start a node daemon; it runs until SIGTERM/SIGINT."""
    from coterie.node.config import ConfigError, load_config

    try:
        overrides = build_overrides(node_id=node_id, state_dir=state_dir, listen=listen,
                                    advertise=advertise, admin_listen=admin_listen, peers=peers,
                                    strategy=strategy, rounds=rounds, sets=sets)
        cfg = load_config(config, overrides)
    except ConfigError as e:
        raise _fail(str(e), EXIT_CONFIG)
    from coterie.node.daemon import run_node  # lazy: torch and grpc only when a node really starts
    raise typer.Exit(run_node(cfg))


# ------------------------------------------------------------------------------ admin queries
def _admin_get(admin: str, path: str, timeout: float = 5.0) -> Any:
    base = admin if "://" in admin else f"http://{admin}"
    url = base.rstrip("/") + path
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read().decode()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        raise _fail(f"{url} answered HTTP {e.code}: {detail}")
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise _fail(f"cannot reach the node's admin API at {url}: {reason}")
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        raise _fail(f"{url} did not answer JSON: {body[:200]!r}")


ADMIN_OPT = typer.Option(..., "--admin", "-a", help="admin URL of the node, e.g. http://127.0.0.1:8080")
JSON_OPT = typer.Option(False, "--json", help="print the raw JSON")


def _show(data: Any, as_json: bool, table) -> None:
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        _console().print(table(data))


@app.command()
def status(admin: str = ADMIN_OPT, as_json: bool = JSON_OPT) -> None:
    """Round, model version, strategy and health of a running node."""
    from .render import status_table
    _show(_admin_get(admin, "/status"), as_json, status_table)


@app.command()
def peers(admin: str = ADMIN_OPT, as_json: bool = JSON_OPT) -> None:
    """The node's peer table."""
    from .render import peers_table
    _show(_admin_get(admin, "/peers"), as_json, peers_table)


@app.command()
def weights(admin: str = ADMIN_OPT, as_json: bool = JSON_OPT) -> None:
    """The node's collaborator weights."""
    from .render import weights_table
    _show(_admin_get(admin, "/weights"), as_json, weights_table)


@app.command()
def strategies() -> None:
    """Strategies known to the registry, and whether this install can run them."""
    from coterie.node.launcher import strategy_problem
    from coterie.node.strategies.registry import available

    for name in available():
        problem = strategy_problem(name)
        typer.echo(f"{name:18s} {'ok' if problem is None else 'unavailable: ' + problem}")


# ---------------------------------------------------------------------------------- run / demo
class _Terminated(KeyboardInterrupt):
    pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


def _launch(sc, out: Path, notes: list[str], demo: bool, backend: str = "processes") -> None:
    from coterie.node import launcher, results as res

    console = _console()
    for n in notes:
        console.print(f"[yellow]note:[/] {n}")
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        r = launcher.run_scenario(sc, out, backend=backend, console=console, notes=notes)
    except KeyboardInterrupt:
        raise _fail("interrupted; every node was stopped", 130)
    except launcher.LauncherError as e:
        raise _fail(str(e), 1)
    finally:
        signal.signal(signal.SIGTERM, old)
    console.print(res.summary_table(r))
    console.print(res.run_table(r))
    if demo:
        for s in r["strategies"]:
            if s != "local":
                console.print(res.heatmap(r, s))
    try:
        figs = res.save_figures(r, out)
        console.print("figures: " + ", ".join(str(p) for p in figs))
    except Exception as e:  # a plotting problem must not hide the results
        console.print(f"[yellow]could not draw figures: {e}[/]")
    for n in r.get("notes", []):
        console.print(f"[yellow]note:[/] {n}")
    console.print(f"results: {out / 'results.json'}")


@app.command()
def run(
    scenario: Path = typer.Argument(..., help="scenario TOML (see scenarios/README.md)"),
    out: Path = typer.Option(..., "--out", "-o", help="output directory"),
    strategy: Optional[str] = typer.Option(None, "--strategy", help="a,b,c: overrides the scenario"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    rounds: Optional[int] = typer.Option(None, "--rounds"),
    nodes: Optional[int] = typer.Option(None, "--nodes"),
    backend: str = typer.Option("processes", "--backend",
                                help="processes: a daemon process per node (gRPC on loopback); "
                                     "inproc: every node in this process (in-process transport)"),
) -> None:
    """Launch every node of a scenario on this machine, per strategy; write OUT/results.json."""
    from coterie.node.config import ConfigError
    from coterie.node.launcher import check_backend, resolve_strategies
    from coterie.node.scenario import load_scenario

    try:
        strategies_ = [s.strip() for s in strategy.split(",") if s.strip()] if strategy else None
        sc = load_scenario(scenario, strategies=strategies_, seed=seed, rounds=rounds, nodes=nodes)
        resolve_strategies(sc.strategy, fallback=False)
        check_backend(sc, backend)
    except ConfigError as e:
        raise _fail(str(e), EXIT_CONFIG)
    _launch(sc, out, [], demo=False, backend=backend)


@app.command()
def demo(
    out: Path = typer.Option(Path("coterie-demo"), "--out", "-o", help="output directory"),
    rounds: Optional[int] = typer.Option(None, "--rounds"),
    seed: Optional[int] = typer.Option(None, "--seed"),
) -> None:
    """The built-in scenario: a personalised strategy against local-only learning."""
    from coterie.node.config import ConfigError
    from coterie.node.launcher import resolve_strategies
    from coterie.node.scenario import builtin_scenario, load_scenario

    try:
        sc = load_scenario(builtin_scenario("demo"), rounds=rounds, seed=seed)
        names, notes = resolve_strategies(sc.strategy, fallback=True)
        sc = sc.model_copy(update={"strategy": names})
    except ConfigError as e:
        raise _fail(str(e), EXIT_CONFIG)
    _launch(sc, out, notes, demo=True)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # `python -m coterie.cli.main` (how the launcher starts nodes)
    app()
