"""The admin plane: a small aiohttp HTTP API per node (and a live dashboard).

Routes (all GET):
  /healthz   "ok" (200), or 503 when ``node.healthy()`` is False
  /status    node.status() as JSON
  /peers     node.peers_table() as JSON
  /weights   node.weights_view() as JSON
  /metrics   Prometheus text exposition (node.metrics.render())
  /history   checkpointed rounds (node.history_view): the recent tail, or ``?since=N`` the rounds
             after N (from the file when they go back further); ``?last=N`` the last N
  /network   this node's part of the network's collaborator-weight matrix: its own mean row, and
             the peers it knows (id, state, labels, the admin URL each advertises). The node never
             fetches what a peer advertises (a certified insider could point it at any internal
             URL); the dashboard fetches each peer's /history itself, from the user's browser with
             the user's own credentials, and draws the matrix (rows in block order)
  /model     the node's personalised model of its last checkpoint: a safetensors file whose
             metadata holds the model card (node/modelfile.py); /model.json is the card alone
  /          the dashboard (node/static/dashboard.html: plain HTML + JS + SVG, no build step, no
             CDN), polling /status, /peers, /history and /network
Anything else answers 404 with a JSON error body.

Authentication (docs/admin-and-export.md): every route but /healthz wants the node's bearer token
(node/admin_token.py) as ``Authorization: Bearer <token>``, or the dashboard's cookie. The
dashboard opens with ``/?token=<token>`` (as Jupyter does): the node answers with an HttpOnly,
SameSite=Strict cookie and a redirect to ``/``, so the token leaves the address bar and the
browser's history. A token anywhere else in a query string is not accepted. Every refusal is the
same 401 with nothing in it about the node. Without auth (``security.admin_auth = false``) the
API only listens on loopback.

The node is duck-typed: ``node_id``, ``status()``, ``peers_table()``, ``weights_view()``,
``metrics``, ``history_view(since)``, ``healthy()``. Node methods may be plain or async.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from .admin_token import is_loopback
from .fsutil import json_safe

log = logging.getLogger(__name__)

DASHBOARD = Path(__file__).with_name("static") / "dashboard.html"
NODE_KEY: web.AppKey[Any] = web.AppKey("node")  # the Node (daemon.py imports this module, not back)
NETWORK_KEY = web.AppKey("network", dict)
AUTH_KEY: web.AppKey[AdminAuth | None] = web.AppKey("auth")

NETWORK_MAX_PEERS = 64  # peers listed by /network (the matrix is n x n; a browser draws it)
NETWORK_CACHE_S = 1.0  # several dashboards polling one node share one view
NETWORK_ROUNDS = 10  # each row is the node's weights averaged over its last rounds (less noisy)
MAX_ROUND = 10**12  # query parameters are bounded: a round number or a count, never more digits
_INT = re.compile(r"-?[0-9]{1,13}")


class BadParam(ValueError):
    """A query parameter out of its bounds: a 400 naming it, never a 500."""


def int_param(request: web.Request, name: str, lo: int, hi: int) -> int | None:
    """Query parameter ``name`` as an int in [lo, hi] (None when absent), or BadParam."""
    raw = request.query.get(name)
    if raw is None:
        return None
    if not _INT.fullmatch(raw) or not lo <= int(raw) <= hi:
        shown = raw if len(raw) <= 40 else f"{raw[:40]}... ({len(raw)} characters)"
        raise BadParam(f"{name} must be an integer from {lo} to {hi}, got {shown!r}")
    return int(raw)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(
        json_safe(data), status=status, dumps=lambda o: json.dumps(o, default=str, allow_nan=False)
    )


async def _call(fn: Any, *args: Any) -> Any:
    out = fn(*args)
    if inspect.isawaitable(out):
        out = await out
    return out


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _json({"error": e.reason, "status": e.status, "path": request.path}, status=e.status)
    except BadParam as e:
        return _json({"error": str(e), "status": 400, "path": request.path}, status=400)
    except Exception as e:  # a node bug must not take the admin plane down
        log.exception("admin %s failed", request.path)
        return _json({"error": f"{type(e).__name__}: {e}", "status": 500, "path": request.path}, status=500)


class AdminAuth:
    """The node's admin token and the dashboard cookie derived from it. Every comparison is
    hmac.compare_digest on bytes: its time does not depend on where a guess first differs."""

    OPEN_PATHS = frozenset({"/healthz"})  # probes (docker, kubernetes) carry no token

    def __init__(self, token: str, node_id: str = "node"):
        self._token = token.encode()
        # the cookie holds a value derived from the token, not the token itself; its name carries
        # the node id because cookies are per host, not per port: two local nodes keep their own
        self._cookie = hmac.new(self._token, b"coterie admin dashboard cookie", hashlib.sha256).hexdigest()
        self.cookie_name = "coterie_admin_" + re.sub(r"[^A-Za-z0-9_.-]", "_", node_id)[:64]

    @staticmethod
    def _same(given: str, want: bytes) -> bool:
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), want)

    def token_ok(self, token: str | None) -> bool:
        return token is not None and self._same(token, self._token)

    def header_ok(self, header: str | None) -> bool:
        scheme, _, cred = (header or "").strip().partition(" ")
        return scheme.lower() == "bearer" and self.token_ok(cred.strip())

    def cookie_ok(self, value: str | None) -> bool:
        return value is not None and self._same(value, self._cookie.encode())

    def allows(self, request: web.Request) -> bool:
        return self.header_ok(request.headers.get("Authorization")) or self.cookie_ok(
            request.cookies.get(self.cookie_name)
        )

    def login(self) -> web.HTTPException:
        """The dashboard bootstrap's answer: the cookie, and ``/`` without the token in the URL."""
        resp = web.HTTPSeeOther("/")
        resp.set_cookie(self.cookie_name, self._cookie, httponly=True, samesite="Strict", path="/")
        return resp


_UNAUTHORIZED_HTML = (
    "<html><body><p>401: this node's admin API wants its token. Open the "
    "dashboard as <code>/?token=&lt;token&gt;</code> (the token is in "
    "&lt;state-dir&gt;/admin.token).</p></body></html>"
)


def _unauthorized(request: web.Request) -> web.Response:
    """The one refusal: the same for no token, a wrong one or one in the wrong place, and
    nothing in it about the node."""
    headers = {"WWW-Authenticate": 'Bearer realm="coterie-admin"'}
    if request.path == "/":
        return web.Response(text=_UNAUTHORIZED_HTML, content_type="text/html", status=401, headers=headers)
    return web.json_response({"error": "unauthorized", "status": 401}, status=401, headers=headers)


@web.middleware
async def _auth(request: web.Request, handler):
    auth: AdminAuth | None = request.app[AUTH_KEY]
    if auth is None or request.path in AdminAuth.OPEN_PATHS:
        return await handler(request)
    # the dashboard bootstrap, and only there: elsewhere a token in a URL ends up in logs and history
    if request.path == "/" and request.method == "GET" and "token" in request.query:
        if auth.token_ok(request.query.get("token")):
            raise auth.login()  # also with a valid cookie: the token must leave the address bar
        return _unauthorized(request)
    if auth.allows(request):
        return await handler(request)
    return _unauthorized(request)


async def healthz(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    ok = await _call(node.healthy)
    return web.Response(text="ok" if ok else "unhealthy", status=200 if ok else 503)


async def status(request: web.Request) -> web.Response:
    return _json(await _call(request.app[NODE_KEY].status))


async def peers(request: web.Request) -> web.Response:
    return _json(await _call(request.app[NODE_KEY].peers_table))


async def weights(request: web.Request) -> web.Response:
    return _json(await _call(request.app[NODE_KEY].weights_view))


async def metrics(request: web.Request) -> web.Response:
    m = request.app[NODE_KEY].metrics
    body, content_type = m.exposition(request.headers.get("Accept"))  # OpenMetrics when asked
    return web.Response(body=body, headers={"Content-Type": content_type})


async def history(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    since = int_param(request, "since", -MAX_ROUND, MAX_ROUND)
    last = int_param(request, "last", 0, MAX_ROUND)
    entries = await _call(node.history_view, since)
    if last is not None:
        entries = entries[-last:] if last else []
    resp = _json(entries)
    origin = request.headers.get("Origin")
    if origin and origin in await _peer_origins(node):  # a peer's dashboard draws the network
        resp.headers["Access-Control-Allow-Origin"] = origin
        resp.headers["Access-Control-Allow-Credentials"] = "true"  # the user's cookie for this node
        resp.headers["Vary"] = "Origin"
    return resp


async def _peer_origins(node: Any) -> set[str]:
    """The origins of the admin URLs known peers advertise: only compared, never fetched."""
    out = set()
    for p in await _call(node.peers_table):
        m = re.fullmatch(r"(https?://[^/?#]+)/?", str(p.get("admin_url") or ""))
        if m:
            out.add(m.group(1))
    return out


def _mean_row(entries: list[dict[str, Any]]) -> dict[str, float]:
    sums: dict[str, float] = {}
    rows = [w for e in entries if isinstance(w := e.get("weights"), dict)]
    for w in rows:
        for k, v in w.items():
            try:
                sums[k] = sums.get(k, 0.0) + float(v or 0.0)
            except (TypeError, ValueError):
                continue
    return {k: v / len(rows) for k, v in sums.items()} if rows else {}


async def network_view(node: Any) -> dict[str, Any]:
    """This node's row of the weight matrix and the peers it knows (see the module docstring).
    Nothing here calls out: the rows of peers are the browser's to fetch."""
    status_ = await _call(node.status)
    table = await _call(node.peers_table)
    me = status_["node_id"]
    peers = sorted((p for p in table if p.get("state") != "dead"), key=lambda p: p["node_id"])
    skipped = max(0, len(peers) - NETWORK_MAX_PEERS)
    return {
        "node_id": me,
        "round": status_.get("round"),
        "rounds_averaged": NETWORK_ROUNDS,
        "row": _mean_row(list(node.history)[-NETWORK_ROUNDS:]),
        "labels": status_.get("labels") or {},
        "peers": [
            {
                "node_id": p["node_id"],
                "state": p.get("state"),
                "labels": p.get("labels") or {},
                "admin_url": str(p.get("admin_url") or ""),
            }
            for p in peers[:NETWORK_MAX_PEERS]
        ],
        "skipped_peers": skipped,
        "t": time.time(),
    }


async def network(request: web.Request) -> web.Response:
    cache = request.app[NETWORK_KEY]
    now = time.monotonic()
    if cache.get("view") is None or now - cache["at"] > NETWORK_CACHE_S:
        async with cache["lock"]:
            if cache.get("view") is None or time.monotonic() - cache["at"] > NETWORK_CACHE_S:
                cache["view"] = await network_view(request.app[NODE_KEY])
                cache["at"] = time.monotonic()
    return _json(cache["view"])


async def dashboard(request: web.Request) -> web.Response:
    try:
        html = DASHBOARD.read_text()
    except FileNotFoundError:
        html = "<html><body><p>dashboard not installed; see /status</p></body></html>"
    return web.Response(text=html, content_type="text/html")


async def _export(request: web.Request) -> tuple[bytes, dict[str, Any]]:
    from .persistence import StateError

    try:
        return await _call(request.app[NODE_KEY].export_model)
    except StateError as e:  # e.g. a checkpoint written before model export existed
        raise web.HTTPServiceUnavailable(reason=str(e).encode("ascii", "replace").decode()[:300]) from None


async def model(request: web.Request) -> web.Response:
    """The personalised model of the last checkpoint (node.export_model: safetensors bytes with
    the model card in their metadata, and the card)."""
    data, card = await _export(request)
    name = f"{card['node_id']}-round{card['round']}.safetensors"
    return web.Response(
        body=data,
        content_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{name}"', "X-Coterie-Round": str(card["round"])},
    )


async def model_card(request: web.Request) -> web.Response:
    _, card = await _export(request)
    return _json(card)


def make_admin_app(node: Any, *, auth: AdminAuth | None) -> web.Application:
    """``auth=None`` serves without authentication: only ``start_admin`` on loopback may ask so."""
    app = web.Application(middlewares=[_errors, _auth])
    app[NODE_KEY] = node
    app[NETWORK_KEY] = {"lock": asyncio.Lock(), "view": None, "at": 0.0}
    app[AUTH_KEY] = auth
    app.router.add_get("/", dashboard)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/status", status)
    app.router.add_get("/peers", peers)
    app.router.add_get("/weights", weights)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/history", history)
    app.router.add_get("/network", network)
    app.router.add_get("/model", model)
    app.router.add_get("/model.json", model_card)
    return app


async def start_admin(node: Any, host: str, port: int, *, token: str | None) -> tuple[web.AppRunner, int]:
    """Serve the admin API on host:port (0 = a free port) behind ``token`` (None: no auth, refused
    unless ``host`` is loopback). Returns the runner (``await runner.cleanup()`` stops it) and the
    bound port."""
    if token is None and not is_loopback(host):
        raise ValueError(
            f"admin API on {host}:{port} without a token: an address other than "
            "loopback needs authentication (security.admin_auth = true)"
        )
    auth = AdminAuth(token, str(getattr(node, "node_id", "node"))) if token is not None else None
    runner = web.AppRunner(make_admin_app(node, auth=auth), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = port
    server = getattr(site, "_server", None)
    if server is not None and server.sockets:
        bound = server.sockets[0].getsockname()[1]
    return runner, bound


async def serve_node_admin(node: Any, cfg: Any, state_dir: Path) -> tuple[web.AppRunner, str, Path | None]:
    """A daemon's admin API on ``cfg.admin_listen`` behind its token (``security.admin_auth``: the
    file ``security.admin_token_file`` names, else ``<state_dir>/admin.token``, made on first
    start). Returns the runner, the admin URL peers and tools reach it at, and the token file."""
    from .admin_token import ensure_token, token_path

    host, _, port = cfg.admin_listen.rpartition(":")
    host = host.strip("[]")
    token_file = token = None
    if cfg.security.admin_auth:
        token_file = token_path(state_dir, cfg.security.admin_token_file).resolve()
        token = ensure_token(token_file)
    runner, bound = await start_admin(node, host, int(port), token=token)
    return runner, f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{bound}", token_file
