"""The admin API's authentication, attacked: no token, a wrong one, the right one in the wrong
place (a query string on an API route, a Basic header), a forged cookie. Each is the same bare
401; /healthz stays open; the comparison is constant-time; the dashboard opens with /?token=
and continues on an HttpOnly, SameSite=Strict cookie. A real node makes its token file (0600)
and the CLI finds it through --state-dir."""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import os
import stat

import pytest
from aiohttp.test_utils import TestClient, TestServer
from typer.testing import CliRunner

import coterie.node.admin as admin
from coterie.cli.main import app
from coterie.node.admin import AdminAuth, make_admin_app, start_admin
from coterie.node.admin_token import TOKEN_FILE, TokenError, bearer, ensure_token, read_token
from coterie.node.config import ConfigError, validate_config
from tests.fake_node import FakeNode

TOKEN = "right-token-3f9a8b7c6d5e4f30"
ROUTES = [
    "/",
    "/status",
    "/peers",
    "/weights",
    "/metrics",
    "/history",
    "/network",
    "/model",
    "/model.json",
    "/no-such-route",
]


async def _client(node=None):
    node = node or FakeNode("n9")
    client = TestClient(TestServer(make_admin_app(node, auth=AdminAuth(TOKEN, node.node_id))))
    await client.start_server()
    return client


async def _refused(r) -> bytes:
    """A refusal as it must be: 401, a Bearer challenge, a body that says nothing about the node."""
    body = await r.read()
    assert r.status == 401, (r.url, r.status, body[:200])
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert "Set-Cookie" not in r.headers
    for secret in (b"n9", TOKEN.encode(), b"fedfomo", b"round"):
        assert secret not in body, (r.url, secret, body)
    return body


async def test_every_route_but_healthz_wants_the_token():
    client = await _client()
    try:
        bodies = set()
        for path in ROUTES:
            bodies.add(await _refused(await client.get(path)))
            bodies.add(await _refused(await client.get(path, headers=bearer("wrong-token-3f9a8b7c6d5e4f30"))))
            bodies.add(await _refused(await client.get(path, headers=bearer(TOKEN[:-1]))))  # a prefix
            bodies.add(await _refused(await client.get(path, headers=bearer(TOKEN + "x"))))
        assert len(bodies - {next(b for b in bodies if b.startswith(b"<html"))}) == 1  # one JSON refusal
        r = await client.get("/healthz")  # probes carry no token
        assert r.status == 200 and await r.text() == "ok"
        for path in ROUTES[1:-1]:
            r = await client.get(path, headers=bearer(TOKEN))
            assert r.status == 200, path
        r = await client.get("/model", headers={"Authorization": f"bearer  {TOKEN} "})  # scheme is case-blind
        assert r.status == 200 and await r.read() == b"model bytes of n9"
        assert (await client.get("/no-such-route", headers=bearer(TOKEN))).status == 404
    finally:
        await client.close()


async def test_the_token_in_the_wrong_place_is_refused():
    client = await _client()
    try:
        for path in ("/status", "/model", "/history?since=0"):  # a query-string token: API routes never
            sep = "&" if "?" in path else "?"
            await _refused(await client.get(f"{path}{sep}token={TOKEN}"))
        basic = base64.b64encode(f"admin:{TOKEN}".encode()).decode()
        await _refused(await client.get("/status", headers={"Authorization": f"Basic {basic}"}))
        await _refused(await client.get("/status", headers={"Authorization": f"Basic {TOKEN}"}))
        await _refused(await client.get("/status", headers={"Authorization": TOKEN}))  # no scheme
        await _refused(await client.get("/status", headers={"X-Token": TOKEN}))
        auth = AdminAuth(TOKEN, "n9")
        await _refused(await client.get("/status", cookies={auth.cookie_name: TOKEN}))  # the token is not the cookie
        await _refused(await client.get("/status", cookies={auth.cookie_name: "0" * 64}))
        await _refused(await client.get("/status", headers={"Cookie": f"{auth.cookie_name}=é"}))
        await _refused(await client.get("/status", headers=bearer("é" * 30)))  # non-ASCII: refused, not a 500
        await _refused(await client.post("/?token=" + TOKEN))  # the bootstrap is a GET of / only
    finally:
        await client.close()


async def test_dashboard_opens_with_the_token_then_lives_on_a_strict_httponly_cookie():
    client = await _client()
    try:
        await _refused(await client.get("/?token=wrong-token-3f9a8b7c6d5e4f30", allow_redirects=False))
        r = await client.get(f"/?token={TOKEN}", allow_redirects=False)
        assert r.status == 303 and r.headers["Location"] == "/"  # the token leaves the address bar
        cookie = r.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
        assert TOKEN not in cookie  # the cookie is derived from the token, not the token
        name = AdminAuth(TOKEN, "n9").cookie_name
        value = r.cookies[name].value
        r = await client.get("/", cookies={name: value})
        assert r.status == 200 and "<html" in (await r.text()).lower()
        r = await client.get("/status", cookies={name: value})  # the dashboard's own fetches
        assert r.status == 200 and (await r.json())["node_id"] == "n9"
        r = await client.get(f"/?token={TOKEN}", cookies={name: value}, allow_redirects=False)
        assert r.status == 303  # logged in already: the token still leaves the address bar
    finally:
        await client.close()


async def test_two_nodes_on_one_host_keep_their_own_cookies():
    a, b = AdminAuth(TOKEN, "n1"), AdminAuth("another-token-1234567890", "n2@host:1")
    assert a.cookie_name != b.cookie_name and b.cookie_name == "coterie_admin_n2_host_1"


async def test_comparison_is_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(x, y):
        calls.append((x, y))
        return real(x, y)

    monkeypatch.setattr(admin.hmac, "compare_digest", spy)
    client = await _client()
    try:
        assert (await client.get("/status", headers=bearer(TOKEN))).status == 200
        assert (await client.get("/status", headers=bearer("wrong-token-3f9a8b7c6d5e4f30"))).status == 401
    finally:
        await client.close()
    assert len(calls) >= 2 and all(isinstance(x, bytes) and isinstance(y, bytes) for x, y in calls)
    assert (TOKEN.encode(), TOKEN.encode()) in calls


async def test_no_auth_only_on_loopback():
    with pytest.raises(ValueError, match="loopback"):
        await start_admin(FakeNode(), "0.0.0.0", 0, token=None)
    with pytest.raises(ConfigError, match="loopback"):
        validate_config({"admin_listen": "0.0.0.0:8000", "security": {"admin_auth": False}})
    with pytest.raises(ConfigError, match="loopback"):
        validate_config({"admin_listen": "node1.example:8000", "security": {"admin_auth": False}})
    for host in ("127.0.0.1", "[::1]", "localhost"):
        assert not validate_config({"admin_listen": f"{host}:0", "security": {"admin_auth": False}}).security.admin_auth
    runner, port = await start_admin(FakeNode(), "127.0.0.1", 0, token=None)  # loopback: allowed
    try:
        client = TestClient(TestServer(make_admin_app(FakeNode(), auth=None)))
        await client.start_server()
        assert (await client.get("/status")).status == 200
        await client.close()
    finally:
        await runner.cleanup()


def test_token_file_is_made_once_0600_and_bad_ones_are_named(tmp_path):
    path = tmp_path / "state" / TOKEN_FILE
    token = ensure_token(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(token) >= 40
    assert ensure_token(path) == token == read_token(path)  # kept across restarts
    assert not list(path.parent.glob(".*.tmp"))  # written atomically, nothing left behind
    for bad in ("", "short", "has a space in it 0123456789"):
        path.write_text(bad)
        with pytest.raises(TokenError, match=str(path)):
            ensure_token(path)


def _solo(tmp_path, **extra):
    return validate_config(
        {
            "node_id": "solo",
            "security": {"insecure": True, **extra.pop("security", {})},
            "state_dir": str(tmp_path / "solo"),
            "strategy": "local",
            "rounds": 1,
            "min_peers": 0,
            "round_interval_s": 0.0,
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            **extra,
            "learner": {
                "dataset": "mnist1d",
                "dataset_params": {"num_samples": 600},
                "partition": "iid",
                "num_nodes": 1,
                "model": "linear",
                "local_steps": 2,
            },
        }
    )


async def test_a_real_node_makes_its_token_and_the_cli_finds_it(tmp_path, monkeypatch):
    import httpx

    from coterie.node.daemon import Node

    monkeypatch.delenv("COTERIE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("COTERIE_ADMIN", raising=False)
    cfg = _solo(tmp_path)
    node = Node(cfg)
    await node.start()
    try:
        path = cfg.state_dir / TOKEN_FILE
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        token = read_token(path)
        info = json.loads((cfg.state_dir / "node.json").read_text())
        assert info["admin_token_file"] == str(path.resolve()) and token not in json.dumps(info)
        async with httpx.AsyncClient(base_url=node.admin_url) as c:
            assert (await c.get("/healthz")).status_code == 200
            assert (await c.get("/status")).status_code == 401
            assert (await c.get("/status", headers=bearer(token))).json()["node_id"] == "solo"

        def cli(*args):
            return CliRunner().invoke(app, ["status", "--json", *args])

        r = await asyncio.to_thread(cli, "--state-dir", str(cfg.state_dir))  # URL and token from there
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["node_id"] == "solo"
        r = await asyncio.to_thread(cli, "--admin", node.admin_url)
        assert r.exit_code == 1 and "401" in r.stderr and "--token" in r.stderr and "Traceback" not in r.output
        r = await asyncio.to_thread(cli, "--admin", node.admin_url, "--token", "wrong-token-3f9a8b7c6d5e4f30")
        assert r.exit_code == 1 and "not it" in r.stderr
        monkeypatch.setenv("COTERIE_ADMIN_TOKEN", token)
        r = await asyncio.to_thread(cli, "--admin", node.admin_url)
        assert r.exit_code == 0 and json.loads(r.stdout)["node_id"] == "solo"
    finally:
        assert await node.stop()

    # restarted: the same token; a configured token file is used (and made) instead
    node = Node(cfg.model_copy(update={"rounds": 1}))
    await node.start()
    try:
        assert read_token(path) == token
    finally:
        await node.stop()
    other = tmp_path / "secrets" / "admin-token"
    cfg2 = _solo(tmp_path / "two", security={"admin_token_file": str(other)})
    node = Node(cfg2)
    await node.start()
    try:
        assert not (cfg2.state_dir / TOKEN_FILE).exists()
        async with httpx.AsyncClient(base_url=node.admin_url) as c:
            assert (await c.get("/status", headers=bearer(read_token(other)))).status_code == 200
        r = await asyncio.to_thread(CliRunner().invoke, app, ["status", "--json", "--state-dir", str(cfg2.state_dir)])
        assert r.exit_code == 0, r.output  # node.json names the configured file
    finally:
        await node.stop()


async def test_model_route_names_an_unusable_checkpoint():
    from coterie.node.persistence import StateError

    node = FakeNode("n9")

    def broken():
        raise StateError("ckpt-000003.safetensors was written by a coterie without model export")

    node.export_model = broken
    client = await _client(node)
    try:
        r = await client.get("/model", headers=bearer(TOKEN))
        assert r.status == 503 and "without model export" in (await r.json())["error"]
    finally:
        await client.close()
