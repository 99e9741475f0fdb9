import asyncio
import json
import socket

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from coterie.node.admin import AdminAuth, make_admin_app, start_admin
from coterie.node.admin_token import bearer
from coterie.node.metrics import parse_text, sample
from fake_node import FakeNode

TOKEN = "test-admin-token-0123456789abcdef"  # the routes here; tests/test_admin_auth.py attacks the auth


async def _client(node):
    client = TestClient(TestServer(make_admin_app(node, auth=AdminAuth(TOKEN, node.node_id))),
                        headers=bearer(TOKEN))
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


async def test_dashboard_served_self_contained():
    client = await _client(FakeNode())
    try:
        r = await client.get("/")
        assert r.status == 200 and r.content_type == "text/html"
        html = await r.text()
        assert 'get("network")' in html and 'get("status")' in html
        # no build step, no CDN: nothing loaded from elsewhere (the browser test checks it draws)
        assert "<script src" not in html and "<link" not in html and "https://" not in html
    finally:
        await client.close()


async def test_history_last():
    client = await _client(FakeNode())
    try:
        assert [e["round"] for e in await (await client.get("/history?last=2")).json()] == [2, 3]
        assert await (await client.get("/history?last=0")).json() == []
        assert (await client.get("/history?last=-1")).status == 400
    finally:
        await client.close()


async def test_network_matrix_from_peers_admin_apis():
    """/network asks each peer's advertised admin URL for its recent weights and assembles the
    whole matrix, diagonal apart; a peer that does not answer is listed, not fatal."""
    a, b = FakeNode("n0"), FakeNode("n1")
    for node, w in ((a, {"n0": 0.6, "n1": 0.3, "n2": 0.1}), (b, {"n0": 0.2, "n1": 0.8})):
        for e in node.history:
            e["weights"] = w
    runner_b, port_b = await start_admin(b, "127.0.0.1", 0, token=None)  # peers' /history, unauthenticated
    with socket.socket() as dead:  # bound, not listening: refused
        dead.bind(("127.0.0.1", 0))
        a.peers_table = lambda: [
            {"node_id": "n1", "address": "x:1", "state": "alive", "admin_url": f"http://127.0.0.1:{port_b}",
             "labels": {"cluster": "1"}},
            {"node_id": "n2", "address": "x:2", "state": "alive",
             "admin_url": f"http://127.0.0.1:{dead.getsockname()[1]}"},
            {"node_id": "n3", "address": "x:3", "state": "dead", "admin_url": "http://127.0.0.1:9"}]
        client = await _client(a)
        try:
            net = await (await client.get("/network")).json()
        finally:
            await client.close()
            await runner_b.cleanup()
    assert sorted(net["nodes"]) == ["n0", "n1", "n2"]  # the dead peer is not queried
    idx = {n: i for i, n in enumerate(net["nodes"])}
    m = net["matrix"]
    assert m[idx["n0"]][idx["n1"]] == pytest.approx(0.3) and m[idx["n0"]][idx["n2"]] == pytest.approx(0.1)
    assert m[idx["n1"]][idx["n0"]] == pytest.approx(0.2) and m[idx["n1"]][idx["n2"]] == 0.0
    assert m[idx["n2"]] is None and "n2" in net["errors"]  # no answer: a missing row, named
    assert all(m[i][i] is None for i in range(3) if m[i] is not None)  # the diagonal is apart
    assert net["self_weights"][idx["n0"]] == pytest.approx(0.6)
    assert net["self_weights"][idx["n1"]] == pytest.approx(0.8)
    assert net["clusters"]["n1"] == "1"


async def test_start_admin_binds_free_port():
    runner, port = await start_admin(FakeNode("n7"), "127.0.0.1", 0, token=TOKEN)
    try:
        assert port > 0
        async with aiohttp.ClientSession(headers=bearer(TOKEN)) as s:
            async with s.get(f"http://127.0.0.1:{port}/status") as r:
                assert (await r.json())["node_id"] == "n7"
    finally:
        await runner.cleanup()
