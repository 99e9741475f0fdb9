import asyncio
import json

import aiohttp
from aiohttp.test_utils import TestClient, TestServer

from coterie.node.admin import make_admin_app, start_admin
from coterie.node.metrics import parse_text, sample
from fake_node import FakeNode


async def _client(node):
    client = TestClient(TestServer(make_admin_app(node)))
    await client.start_server()
    return client


async def test_json_routes():
    node = FakeNode()
    client = await _client(node)
    try:
        r = await client.get("/status")
        assert r.status == 200
        st = await r.json()
        assert st["node_id"] == "n0" and st["round"] == 3 and st["strategy"] == "fedfomo"

        r = await client.get("/peers")
        peers = await r.json()
        assert [p["node_id"] for p in peers] == ["n1", "n2"]
        assert peers[1]["state"] == "dead"

        r = await client.get("/weights")
        text = await r.text()
        w = json.loads(text)  # strict JSON: NaN became null
        assert "NaN" not in text and w["strategy_state"]["loss"] is None
        assert w["weights"] == {"n0": 0.5, "n1": 0.5}
    finally:
        await client.close()


async def test_healthz_follows_node():
    node = FakeNode()
    client = await _client(node)
    try:
        r = await client.get("/healthz")
        assert r.status == 200 and await r.text() == "ok"
        node.is_healthy = False
        r = await client.get("/healthz")
        assert r.status == 503
    finally:
        await client.close()


async def test_metrics_exposition():
    client = await _client(FakeNode())
    try:
        r = await client.get("/metrics")
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        s = parse_text(await r.text())
        assert sample(s, "coterie_rounds_total") == 3
        assert sample(s, "coterie_sent_bytes_total", kind="snapshot") == 4096
    finally:
        await client.close()


async def test_history_since_and_errors():
    client = await _client(FakeNode())
    try:
        assert [e["round"] for e in await (await client.get("/history")).json()] == [1, 2, 3]
        assert [e["round"] for e in await (await client.get("/history?since=1")).json()] == [2, 3]
        r = await client.get("/history?since=abc")
        assert r.status == 400 and "since" in (await r.json())["error"]

        r = await client.get("/no/such/route")
        assert r.status == 404
        body = await r.json()
        assert body["status"] == 404 and body["path"] == "/no/such/route"
    finally:
        await client.close()


async def test_node_exception_is_json_500():
    node = FakeNode()

    def boom():
        raise RuntimeError("strategy exploded")

    node.peers_table = boom
    client = await _client(node)
    try:
        r = await client.get("/peers")
        assert r.status == 500 and "strategy exploded" in (await r.json())["error"]
        assert (await client.get("/status")).status == 200  # still serving
    finally:
        await client.close()


async def test_async_node_methods_are_awaited():
    node = FakeNode()
    sync_status = node.status

    async def status():
        await asyncio.sleep(0)
        return sync_status()

    node.status = status
    client = await _client(node)
    try:
        assert (await (await client.get("/status")).json())["round"] == 3
    finally:
        await client.close()


async def test_dashboard_served():
    client = await _client(FakeNode())
    try:
        r = await client.get("/")
        assert r.status == 200 and r.content_type == "text/html"
        html = await r.text()
        for path in ("status", "peers", "weights"):
            assert f'get("{path}")' in html
        assert "setInterval(refresh, 2000)" in html and "<script src" not in html  # no CDN
    finally:
        await client.close()


async def test_start_admin_binds_free_port():
    runner, port = await start_admin(FakeNode("n7"), "127.0.0.1", 0)
    try:
        assert port > 0
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/status") as r:
                assert (await r.json())["node_id"] == "n7"
    finally:
        await runner.cleanup()
