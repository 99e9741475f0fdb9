"""The admin plane: a small aiohttp HTTP API per node (and a live dashboard).

Routes (all GET):
  /healthz   "ok" (200), or 503 when ``node.healthy()`` is False
  /status    node.status() as JSON
  /peers     node.peers_table() as JSON
  /weights   node.weights_view() as JSON
  /metrics   Prometheus text exposition (node.metrics.render())
  /history   checkpointed rounds (node.history_view): the recent tail, or ``?since=N`` the rounds after N
  /          the dashboard (static HTML polling /status, /peers and /weights)
Anything else answers 404 with a JSON error body.

The node is duck-typed: ``node_id``, ``status()``, ``peers_table()``, ``weights_view()``,
``metrics``, ``history_view(since)``, ``healthy()``. Node methods may be plain or async.
"""
from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from .metrics import CONTENT_TYPE
from .fsutil import json_safe

log = logging.getLogger(__name__)

DASHBOARD = Path(__file__).with_name("static") / "dashboard.html"
NODE_KEY = web.AppKey("node", object)




def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(json_safe(data), status=status,
                             dumps=lambda o: json.dumps(o, default=str, allow_nan=False))


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
    except Exception as e:  # a node bug must not take the admin plane down
        log.exception("admin %s failed", request.path)
        return _json({"error": f"{type(e).__name__}: {e}", "status": 500, "path": request.path},
                     status=500)


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
    body = request.app[NODE_KEY].metrics.render()
    return web.Response(body=body.encode(), headers={"Content-Type": CONTENT_TYPE})


async def history(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    raw = request.query.get("since")
    since = None
    if raw is not None:
        try:
            since = int(raw)
        except ValueError:
            return _json({"error": f"since must be an integer round number, got {raw!r}",
                          "status": 400, "path": request.path}, status=400)
    return _json(await _call(node.history_view, since))


async def dashboard(request: web.Request) -> web.Response:
    try:
        html = DASHBOARD.read_text()
    except FileNotFoundError:
        html = "<html><body><p>dashboard not installed; see /status</p></body></html>"
    return web.Response(text=html, content_type="text/html")


def make_admin_app(node: Any) -> web.Application:
    app = web.Application(middlewares=[_errors])
    app[NODE_KEY] = node
    app.router.add_get("/", dashboard)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/status", status)
    app.router.add_get("/peers", peers)
    app.router.add_get("/weights", weights)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/history", history)
    return app


async def start_admin(node: Any, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve the admin API on host:port (0 = a free port). Returns the runner (``await
    runner.cleanup()`` stops it) and the bound port."""
    runner = web.AppRunner(make_admin_app(node), access_log=None, handle_signals=False)
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
