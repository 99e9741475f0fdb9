"""The ``coterie`` command line.

  coterie node start [--config FILE] [flags]      run one node daemon (blocks; SIGHUP reloads the config)
  coterie node check-config FILE                  validate a config, its data, model and certificates
  coterie status|peers|weights|history            inspect a running node (--json for raw JSON)
  coterie model export --state-dir D --out F      the node's personalised model (+ F.json card)
  coterie predict --model F INPUT                 score inputs with an exported model (CSV out)
  coterie run SCENARIO.toml --out DIR [--backend processes|inproc|ray [--address A] [--groups G]]
                                                  launch a local network, write results.json
  coterie demo [--out DIR]                        the built-in scenario: personalised vs local
  coterie strategies                              the strategies this install can run
  coterie ca init DIR / coterie cert issue ...    the network CA and node certificates (cli/security.py)

Config precedence for ``node start``: flags > COTERIE_* environment > TOML file. The inspecting
commands take the node's admin URL from ``--admin`` or ``COTERIE_ADMIN`` and its token from
``--token`` or ``COTERIE_ADMIN_TOKEN``, or both from ``--state-dir`` of a node on this machine. Errors are one line on
stderr, never a traceback: exit 1 for a node or network problem, 2 for bad input.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(
    help="Coterie: peer-to-peer decentralized personalised learning.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
node_app = typer.Typer(help="Run a node daemon.", no_args_is_help=True)
app.add_typer(node_app, name="node")
from .security import ca_app, cert_app  # noqa: E402 - sub-apps of their own module

app.add_typer(ca_app, name="ca")
app.add_typer(cert_app, name="cert")
from .check import check_config  # noqa: E402 - `node check-config`, a module of its own

node_app.command("check-config")(check_config)

EXIT_CONFIG = 2


def _console() -> Console:
    return Console()


def _fail(msg: str, code: int = 1) -> typer.Exit:
    # escape: messages quote paths and commands that may hold brackets ("pip install 'coterie[ray]'")
    Console(stderr=True).print(f"[red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _warn(msg: str) -> None:
    Console(stderr=True).print(f"[yellow]warning:[/] {escape(msg)}", highlight=False, soft_wrap=True)


def _version() -> str:
    try:
        return metadata.version("coterie")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"coterie {_version()}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    from coterie.node.config import unknown_env

    for w in unknown_env():
        _warn(w)


# ---------------------------------------------------------------------------------- node start
def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def build_overrides(
    *,
    node_id: str | None = None,
    state_dir: Path | None = None,
    listen: str | None = None,
    advertise: str | None = None,
    admin_listen: str | None = None,
    peers: str | None = None,
    strategy: str | None = None,
    rounds: int | None = None,
    sets: list[str] | None = None,
) -> dict[str, Any]:
    """Command-line flags as a nested override dict for ``load_config``."""
    from coterie.node.config import ConfigError, _set_path

    out: dict[str, Any] = {}
    for key, v in (
        ("node_id", node_id),
        ("state_dir", str(state_dir) if state_dir else None),
        ("listen", listen),
        ("advertise", advertise),
        ("admin_listen", admin_listen),
        ("strategy", strategy),
        ("rounds", rounds),
    ):
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


def _port_taken(address: str) -> bool:
    """Whether host:port (port != 0) cannot be bound right now. A quick check so a taken port is
    reported before the node spends seconds building its data and model; the real bind later
    reports its own clean error if the port is taken in between."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if int(port) == 0:
        return False
    try:
        family = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM)[0][0]
    except OSError:
        return False  # an unresolvable host: the node's own bind names it
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "taken"
        try:
            s.bind((host, int(port)))
        except OSError:
            return True
    return False


def preflight(cfg) -> tuple[str, int] | None:
    """What would stop this node after a slow start, checked at once: (message, exit code)."""
    problems = preflight_problems(cfg)
    return problems[0] if problems else None


def preflight_problems(cfg, *, ports: bool = True) -> list[tuple[str, int]]:
    """Every quick problem (message, exit code): strategy, cluster labels, partition, and (``ports``)
    listen addresses already taken (`node check-config` leaves these to the node itself)."""
    from coterie.node.learning.partition import true_clusters
    from coterie.node.strategies.registry import strategy_problem

    out: list[tuple[str, int]] = []
    problem = strategy_problem(cfg.strategy)
    if problem is not None:
        out.append((f"strategy: {problem}", EXIT_CONFIG))
    if cfg.strategy == "oracle" and cfg.learner.data is not None and "cluster" not in cfg.labels:
        out.append(
            (
                "strategy oracle: a node on its own files (learner.data) has no true cluster; "
                "set labels.cluster on every node, or pick another strategy",
                EXIT_CONFIG,
            )
        )
    try:
        true_clusters(cfg.learner)
    except ValueError as e:
        out.append(
            (
                f"learner: {e} (a node started by hand is one of learner.num_nodes; set "
                f"learner.num_nodes/node_index and learner.partition_params)",
                EXIT_CONFIG,
            )
        )
    for field in ("listen", "admin_listen") if ports else ():
        address = getattr(cfg, field)
        if _port_taken(address):
            out.append((f"{field} {address}: the port is already in use", 1))
    return out


def bootstrap_addresses(paths: list[Path], timeout_s: float) -> list[str]:
    """The peer address in each node.json (a file, or a state dir holding one) of a *running* node
    on this machine, waiting up to ``timeout_s`` for it to appear: a node started on port 0 writes
    it once its ports are bound, so a network can start at once without picking ports."""
    import os

    def running(pid: object) -> bool:
        if not isinstance(pid, int):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    out = []
    deadline = time.monotonic() + timeout_s
    for p in paths:
        f = p / "node.json" if p.is_dir() or p.suffix != ".json" else p
        while True:
            try:
                info = json.loads(f.read_text())
            except (OSError, ValueError):
                info = {}
            if isinstance(info, dict) and info.get("address") and running(info.get("pid")):
                out.append(str(info["address"]))
                break
            if time.monotonic() > deadline:
                raise _fail(f"--bootstrap-from {p}: no running node wrote {f} within {timeout_s:g}s")
            time.sleep(0.1)  # the other node is still starting
    return out


LOG_FORMAT_OPT = typer.Option(
    "text", "--log-format", envvar="COTERIE_LOG_FORMAT", help="text, or json: one JSON object per log line"
)


@node_app.command("start")
def node_start(
    config: Path | None = typer.Option(None, "--config", "-c", envvar="COTERIE_CONFIG", help="TOML config file."),
    node_id: str | None = typer.Option(None, "--node-id"),
    state_dir: Path | None = typer.Option(None, "--state-dir"),
    listen: str | None = typer.Option(None, "--listen", help="peer (gRPC) host:port"),
    advertise: str | None = typer.Option(None, "--advertise", help="address peers dial"),
    admin_listen: str | None = typer.Option(None, "--admin-listen", help="admin HTTP host:port"),
    peers: str | None = typer.Option(None, "--peers", help="bootstrap peers a:1,b:2"),
    strategy: str | None = typer.Option(None, "--strategy"),
    rounds: int | None = typer.Option(None, "--rounds"),
    no_listen: bool = typer.Option(
        False,
        "--no-listen",
        help="outbound-only: open no peer port; peers reach this node through relays (no_listen; docs/nat.md)",
    ),
    relay: list[str] | None = typer.Option(
        None,
        "--relay",
        help="a reachable peer host:port to be relayed by (repeatable; relay.via; default: the bootstrap peers)",
    ),
    reset: bool = typer.Option(
        False,
        "--reset",
        help="start at round 0, moving the state dir's old state "
        "aside (needed when it holds history or identity but no usable checkpoint)",
    ),
    reset_privacy_ledger: bool = typer.Option(
        False,
        "--reset-privacy-ledger",
        help="start even if the privacy ledger is missing or behind the "
        "checkpoint: restore it from the checkpoint's copy (logged; releases since then are lost)",
    ),
    sets: list[str] | None = typer.Option(None, "--set", help="any field: key.path=value (JSON value or text)"),
    log_format: str = LOG_FORMAT_OPT,
    bootstrap_from: list[Path] | None = typer.Option(
        None,
        "--bootstrap-from",
        help="node.json (or state dir) of a node on this machine to bootstrap from; waits for it up to start_timeout_s",
    ),
    cert_dir: Path | None = typer.Option(
        None, "--cert-dir", help="this node's certificate directory (coterie cert issue): security.cert_dir"
    ),
    insecure: bool = typer.Option(
        False,
        "--insecure",
        help="plaintext peer port, identities unchecked (security.insecure; a trusted network only)",
    ),
    data: Path | None = typer.Option(
        None, "--data", help="learn from exactly the samples in this file or folder (learner.data; docs/own-data.md)"
    ),
    data_format: str | None = typer.Option(
        None, "--data-format", help="auto, npz, csv, parquet, images or a coterie.datasets loader (learner.data_format)"
    ),
    admin_no_auth: bool = typer.Option(
        False,
        "--admin-no-auth",
        help="admin API without a token (security.admin_auth = false): loopback admin_listen only",
    ),
) -> None:
    """Start a node daemon; it runs until SIGTERM/SIGINT."""
    from coterie.node.config import ConfigError, load_config
    from coterie.node.logs import configure_logging

    if log_format not in ("text", "json"):
        raise _fail(f"--log-format must be text or json, got {log_format!r}", EXIT_CONFIG)
    try:
        overrides = build_overrides(
            node_id=node_id,
            state_dir=state_dir,
            listen=listen,
            advertise=advertise,
            admin_listen=admin_listen,
            peers=peers,
            strategy=strategy,
            rounds=rounds,
            sets=sets,
        )
        if cert_dir is not None or insecure:
            overrides.setdefault("security", {}).update({"cert_dir": str(cert_dir)} if cert_dir is not None else {})
            if insecure:
                overrides["security"]["insecure"] = True
        if admin_no_auth:
            overrides.setdefault("security", {})["admin_auth"] = False
        if reset:
            overrides["reset"] = True
        if no_listen:
            overrides["no_listen"] = True
        if relay:
            overrides.setdefault("relay", {})["via"] = list(relay)
        for key, value in (("data", str(data) if data is not None else None), ("data_format", data_format)):
            if value is not None:
                overrides.setdefault("learner", {})[key] = value
        if reset_privacy_ledger:
            overrides["reset_privacy_ledger"] = True
        cfg = load_config(config, overrides)
    except ConfigError as e:
        raise _fail(str(e), EXIT_CONFIG) from e
    problem = preflight(cfg)
    if problem is not None:
        raise _fail(*problem)
    try:  # certificates before the slow imports: fail closed, and fast
        from coterie.node.transport.tls import load_tls

        load_tls(cfg)
    except ConfigError as e:
        raise _fail(str(e), EXIT_CONFIG) from e
    configure_logging(
        cfg.log_level, "json" if log_format == "json" else "text"
    )  # run_node's own basicConfig then stands aside
    from coterie.node.daemon import run_node  # lazy: torch and grpc only when a node really starts

    extra: list[str] = []
    if bootstrap_from:  # after the slow imports: the other node starts up meanwhile
        extra = bootstrap_addresses(bootstrap_from, cfg.start_timeout_s)

    def with_bootstrap(c):
        return c.model_copy(update={"peers": [*c.peers, *(a for a in extra if a not in c.peers)]}) if extra else c

    # SIGHUP: the same file, environment and flags read again (node/reload.py applies what it can)
    raise typer.Exit(run_node(with_bootstrap(cfg), reload=lambda: with_bootstrap(load_config(config, overrides))))


# ------------------------------------------------------------------------------ admin queries
class AdminError(Exception):
    """The admin API could not be queried; the message is the one line the user sees."""


def admin_base(admin: str | None) -> str:
    if not admin:
        raise AdminError(
            "no admin URL: pass --admin URL, set COTERIE_ADMIN, or --state-dir DIR of a "
            "node on this machine (a node prints its admin URL at start and writes it "
            "to <state-dir>/node.json)"
        )
    return (admin if "://" in admin else f"http://{admin}").rstrip("/")


class Admin:
    """Where a node's admin API is and the token it wants: ``--admin``/COTERIE_ADMIN, or the
    admin_url in ``--state-dir``'s node.json; the token from ``--token``, else the state dir's
    token file (node/admin_token.py), else COTERIE_ADMIN_TOKEN (the flag that names a node beats
    a variable that may be left over from another)."""

    def __init__(self, url: str | None, token: str | None = None, state_dir: Path | None = None):
        import os

        from coterie.node.admin_token import TOKEN_ENV, TokenError, token_for_state_dir

        self.url, self.token = url, token
        if state_dir is not None:
            if not self.url:
                try:
                    self.url = json.loads((state_dir / "node.json").read_text()).get("admin_url") or None
                except (OSError, ValueError, AttributeError):
                    raise AdminError(f"--state-dir {state_dir}: no node.json of a started node there") from None
            if self.token is None:
                try:
                    self.token = token_for_state_dir(state_dir)
                except TokenError as e:
                    raise AdminError(str(e)) from e
        if self.token is None:
            self.token = os.environ.get(TOKEN_ENV) or None


def admin_get(client, admin: Admin | str | None, path: str) -> Any:
    """GET a JSON admin endpoint with httpx; every failure becomes one AdminError line."""
    r = admin_request(client, admin, path)
    try:
        return r.json()
    except ValueError:
        raise AdminError(f"{r.url} did not answer JSON: {r.text[:200]!r}") from None


def admin_request(client, admin: Admin | str | None, path: str):
    """GET an admin endpoint with the token; the response, or one AdminError line."""
    import httpx

    from coterie.node.admin_token import bearer

    admin = admin if isinstance(admin, Admin) else Admin(admin)
    url = admin_base(admin.url) + path
    try:
        r = client.get(url, headers=bearer(admin.token))
    except httpx.ConnectError as e:
        raise AdminError(f"cannot reach the node's admin API at {url}: {e or 'connection failed'}") from e
    except httpx.TimeoutException:
        raise AdminError(f"no answer from {url} within {client.timeout.read}s") from None
    except (httpx.RemoteProtocolError, httpx.LocalProtocolError, httpx.DecodingError):
        raise AdminError(
            f"{url} does not answer HTTP: is this the node's peer (gRPC) port? "
            f"The admin URL is admin_url in /status or <state-dir>/node.json"
        ) from None
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as e:
        raise AdminError(f"not a usable admin URL {admin.url!r}: {e}") from e
    except httpx.HTTPError as e:
        raise AdminError(f"cannot reach the node's admin API at {url}: {type(e).__name__}: {e}") from e
    if r.status_code == 401:
        raise AdminError(
            f"{url} answered 401: the node wants its admin token"
            + (" and this one is not it" if admin.token else "")
            + ": pass --token, set COTERIE_ADMIN_TOKEN, or --state-dir DIR of the node "
            "(the token is in <state-dir>/admin.token)"
        )
    if r.status_code >= 400:
        raise AdminError(f"{url} answered HTTP {r.status_code}: {r.text[:300]}")
    return r


def _client(timeout: float = 5.0):
    import httpx

    return httpx.Client(timeout=timeout, follow_redirects=True)


ADMIN_OPT = typer.Option(
    None,
    "--admin",
    "-a",
    envvar="COTERIE_ADMIN",
    show_envvar=True,
    help="admin URL of the node, e.g. http://127.0.0.1:8000",
)
TOKEN_OPT = typer.Option(
    None, "--token", help="the node's admin token (default: from --state-dir, else $COTERIE_ADMIN_TOKEN)"
)
STATE_DIR_OPT = typer.Option(
    None,
    "--state-dir",
    help="state dir of a node on this machine: its admin URL and token, when --admin/--token are not given",
)
JSON_OPT = typer.Option(False, "--json", help="print JSON instead of a table")
WATCH_OPT = typer.Option(False, "--watch", "-w", help="refresh until Ctrl-C")
INTERVAL_OPT = typer.Option(2.0, "--interval", min=0.1, help="seconds between refreshes (--watch)")


def _show(data: Any, as_json: bool, table: Callable[[Any], Any]) -> None:
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        _console().print(table(data))


def _admin(admin: str | None, token: str | None, state_dir: Path | None) -> Admin:
    try:
        return Admin(admin, token, state_dir)
    except AdminError as e:
        raise _fail(str(e)) from e


def _inspect(
    where: tuple[str | None, str | None, Path | None],
    path: str,
    as_json: bool,
    table: Callable[[Any], Any],
    watch: bool = False,
    interval: float = 2.0,
) -> None:
    """``where`` is (--admin, --token, --state-dir). --watch resolves it on every refresh, so it
    may start before the node has written its node.json and token (a node on its first start)."""
    with _client() as client:
        if not watch:
            admin = _admin(*where)
            try:
                data = admin_get(client, admin, path)
            except AdminError as e:
                raise _fail(str(e)) from e
            _show(data, as_json, table)
            return
        _watch(lambda: admin_get(client, Admin(*where), path), as_json, table, interval)


def _watch(fetch: Callable[[], Any], as_json: bool, table: Callable[[Any], Any], interval: float) -> None:
    """Refresh until Ctrl-C. A node that stops answering is shown as such and retried; --json
    prints one JSON object per refresh (JSON lines)."""
    from rich.live import Live
    from rich.text import Text

    try:
        if as_json:
            while True:
                try:
                    typer.echo(json.dumps(fetch()))
                except AdminError as e:
                    typer.echo(json.dumps({"error": str(e)}))
                time.sleep(interval)
        with Live(console=_console(), auto_refresh=False) as live:
            while True:
                try:
                    view = table(fetch())
                except AdminError as e:
                    view = Text(f"{e} (retrying every {interval:g}s)", style="red")
                live.update(view, refresh=True)
                time.sleep(interval)
    except KeyboardInterrupt:
        pass


@app.command()
def status(
    admin: str | None = ADMIN_OPT,
    as_json: bool = JSON_OPT,
    watch: bool = WATCH_OPT,
    interval: float = INTERVAL_OPT,
    token: str | None = TOKEN_OPT,
    state_dir: Path | None = STATE_DIR_OPT,
) -> None:
    """Round, model version, strategy, health and recent problems of a running node."""
    from .render import status_table

    _inspect((admin, token, state_dir), "/status", as_json, status_table, watch, interval)


@app.command()
def peers(
    admin: str | None = ADMIN_OPT,
    as_json: bool = JSON_OPT,
    watch: bool = WATCH_OPT,
    interval: float = INTERVAL_OPT,
    token: str | None = TOKEN_OPT,
    state_dir: Path | None = STATE_DIR_OPT,
) -> None:
    """The node's peer table."""
    from .render import peers_table

    _inspect((admin, token, state_dir), "/peers", as_json, peers_table, watch, interval)


@app.command()
def weights(
    admin: str | None = ADMIN_OPT,
    as_json: bool = JSON_OPT,
    token: str | None = TOKEN_OPT,
    state_dir: Path | None = STATE_DIR_OPT,
) -> None:
    """The node's collaborator weights."""
    from .render import weights_table

    _inspect((admin, token, state_dir), "/weights", as_json, weights_table)


@app.command()
def history(
    admin: str | None = ADMIN_OPT,
    as_json: bool = JSON_OPT,
    last: int = typer.Option(20, "--last", "-n", min=0, help="only the last N rounds (0: all)"),
    since: int | None = typer.Option(None, "--since", help="only rounds after this one"),
    token: str | None = TOKEN_OPT,
    state_dir: Path | None = STATE_DIR_OPT,
) -> None:
    """The node's rounds: accuracy, loss, duration, traffic and top collaborators per round; the
    rounds older than history.jsonl keeps in full, summarised below them."""
    from .render import history_summary_table, history_table

    path = "/history" + (f"?since={since}" if since is not None else "")
    node = _admin(admin, token, state_dir)
    with _client() as client:
        try:
            entries = admin_get(client, node, path)
            st = {} if as_json else admin_get(client, node, "/status")
        except AdminError as e:
            raise _fail(str(e)) from e
    _show(entries[-last:] if last else entries, as_json, lambda es: history_table(es, st.get("node_id")))
    if not as_json and st.get("history_summary"):
        _console().print(history_summary_table(st["history_summary"]))


model_app = typer.Typer(help="A node's personalised model.", no_args_is_help=True)
app.add_typer(model_app, name="model")


@model_app.command("export")
def model_export(
    state_dir: Path = typer.Option(..., "--state-dir", help="the node's state dir (it may be running)"),
    out: Path = typer.Option(..., "--out", "-o", help="model file to write; its card goes to OUT.json"),
    fmt: str = typer.Option("safetensors", "--format", help="safetensors, or onnx (pip install 'coterie\\[onnx]')"),
    own: bool = typer.Option(
        False,
        "--own",
        help="the node's own model only, where it predicts with a mixture of its own and peers' models (FedeRiCo)",
    ),
) -> None:
    """Write the node's personalised model of its last checkpoint (the mixture of models it
    predicts with, if it uses one), and its model card (OUT.json)."""
    from coterie.node.persistence import StateError

    if fmt not in ("safetensors", "onnx"):
        raise _fail(f"--format must be safetensors or onnx, got {fmt!r}", EXIT_CONFIG)
    from coterie.node.modelfile import sidecar_path, write_export

    try:
        card = write_export(state_dir, out, fmt, own=own)
    except StateError as e:
        raise _fail(str(e)) from e
    except (ValueError, OSError) as e:
        raise _fail(str(e), EXIT_CONFIG if isinstance(e, ValueError) else 1) from e
    ev = card.get("eval") or {}
    acc = ev.get("test_acc") if card.get("mixture") else ev.get("own_test_acc", ev.get("test_acc"))
    what = (
        f"mixture of {len(card['mixture'])} {card['architecture']} models"
        if card.get("mixture")
        else card["architecture"]
    )
    typer.echo(
        f"{out}: {what} of node {card['node_id']} at round {card['round']}"
        + (f" (test accuracy {acc:.4f})" if isinstance(acc, (int, float)) else "")
        + f"; card: {sidecar_path(out)}"
    )


@app.command()
def predict(
    model: Path = typer.Option(..., "--model", "-m", help="an exported model (coterie model export, GET /model)"),
    inputs: Path = typer.Argument(
        ..., help="npz with x, a CSV/Parquet table of feature columns, an image, or a folder of images"
    ),
    label_column: str | None = typer.Option(
        None, "--label-column", help="a table column to ignore (default: the model's learner.data_label, 'label')"
    ),
) -> None:
    """Score INPUTS with an exported model: CSV on stdout, one row per input, the predicted class last."""
    import sys

    from coterie.node.modelfile import load_model
    from coterie.node.predict import predict_csv

    try:
        loaded = load_model(model)
        predict_csv(loaded, inputs, sys.stdout, label_column=label_column)
    except ValueError as e:
        raise _fail(str(e), EXIT_CONFIG) from e
    except OSError as e:
        raise _fail(f"{inputs}: {e.strerror or e}") from e


@app.command()
def strategies(as_json: bool = JSON_OPT) -> None:
    """Strategies known to the registry, and whether this install can run them."""
    from coterie.node.strategies.registry import available, strategy_problem

    rows = [{"name": n, "ok": (p := strategy_problem(n)) is None, "problem": p} for n in available()]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        state = "ok" if r["ok"] else f"unavailable: {r['problem']}"
        typer.echo(f"{r['name']:18s} {state}")


# ---------------------------------------------------------------------------------- run / demo
class _Terminated(KeyboardInterrupt):
    pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


def _launch(sc, out: Path, notes: list[str], demo: bool, backend: str = "processes", **options: Any) -> None:
    from coterie.lab import launcher
    from coterie.lab import results as res

    console = _console()
    for n in notes:
        console.print(f"[yellow]note:[/] {n}")
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        r = launcher.run_scenario(sc, out, backend=backend, console=console, notes=notes, **options)
    except KeyboardInterrupt:
        raise _fail("interrupted; every node was stopped", 130) from None
    except launcher.LauncherError as e:
        raise _fail(str(e), 1) from e
    except launcher.ConfigError as e:  # the data check before any process starts
        raise _fail(str(e), EXIT_CONFIG) from e
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
    strategy: str | None = typer.Option(None, "--strategy", help="a,b,c: overrides the scenario"),
    seed: int | None = typer.Option(None, "--seed"),
    rounds: int | None = typer.Option(None, "--rounds"),
    nodes: int | None = typer.Option(None, "--nodes"),
    backend: str = typer.Option(
        "processes",
        "--backend",
        help="processes: a daemon process per node (gRPC on loopback); "
        "inproc: every node in this process (in-process transport); "
        "ray: groups of in-process nodes as Ray actors (pip install 'coterie\\[ray]')",
    ),
    address: str | None = typer.Option(
        None,
        "--address",
        help="ray: the cluster (ray.init's address: host:port, 'auto'); "
        "default $RAY_ADDRESS, else a new local Ray instance",
    ),
    groups: int | None = typer.Option(
        None, "--groups", min=1, help="ray: actors to spread the nodes over (default: one per Ray node)"
    ),
) -> None:
    """Launch every node of a scenario on this machine, per strategy; write OUT/results.json."""
    from coterie.lab.launcher import check_backend, resolve_strategies
    from coterie.lab.scenario import load_scenario
    from coterie.node.config import ConfigError

    try:
        strategies_ = [s.strip() for s in strategy.split(",") if s.strip()] if strategy else None
        sc = load_scenario(scenario, strategies=strategies_, seed=seed, rounds=rounds, nodes=nodes)
        resolve_strategies(sc.strategy, fallback=False)
        check_backend(sc, backend)
        if backend != "ray" and (address is not None or groups is not None):
            raise ConfigError("--address and --groups are options of --backend ray")
    except ConfigError as e:
        raise _fail(str(e), EXIT_CONFIG) from e
    options = {"address": address, "groups": groups} if backend == "ray" else {}
    _launch(sc, out, [], demo=False, backend=backend, **options)


@app.command()
def demo(
    out: Path = typer.Option(Path("coterie-demo"), "--out", "-o", help="output directory"),
    rounds: int | None = typer.Option(None, "--rounds"),
    seed: int | None = typer.Option(None, "--seed"),
) -> None:
    """The built-in scenario: a personalised strategy against local-only learning."""
    from coterie.lab.launcher import resolve_strategies
    from coterie.lab.scenario import builtin_scenario, load_scenario
    from coterie.node.config import ConfigError

    try:
        sc = load_scenario(builtin_scenario("demo"), rounds=rounds, seed=seed)
        names, notes = resolve_strategies(sc.strategy, fallback=True)
        sc = sc.model_copy(update={"strategy": names})
    except ConfigError as e:
        raise _fail(str(e), EXIT_CONFIG) from e
    _launch(sc, out, notes, demo=True)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # `python -m coterie.cli.main` (how the launcher starts nodes)
    app()
