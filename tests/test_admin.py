import asyncio
import json

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from coterie.node.admin import AdminAuth, make_admin_app, start_admin
from coterie.node.admin_token import bearer
from coterie.node.metrics import parse_text, sample
from tests.fake_node import FakeNode

TOKEN = "test-admin-token-0123456789abcdef"  # the routes here; tests/test_admin_auth.py attacks the auth


async def _client(node):
    client = TestClient(TestServer(make_admin_app(node, auth=AdminAuth(TOKEN, node.node_id))), headers=bearer(TOKEN))
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


async def test_network_never_fetches_what_peers_advertise():
    """A certified insider advertised an internal URL as its admin URL and /network used to GET it
    from the node (a listener received ``GET /internal-only/history?last=10``). Now /network lists
    the peers and this node's own row only; the browser fetches peers' rows itself."""
    received: list[str] = []

    async def record(request):
        received.append(request.path_qs)
        return aiohttp.web.json_response([])

    app = aiohttp.web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    listener = TestServer(app)
    await listener.start_server()
    a = FakeNode("n0")
    for e in a.history:
        e["weights"] = {"n0": 0.6, "n1": 0.3, "n2": 0.1}
    a.peers_table = lambda: [
        {
            "node_id": "n1",
            "address": "x:1",
            "state": "alive",
            "labels": {"cluster": "1"},
            "admin_url": f"http://127.0.0.1:{listener.port}/internal-only",
        },
        {"node_id": "n2", "address": "x:2", "state": "alive", "admin_url": f"http://127.0.0.1:{listener.port}"},
        {"node_id": "n3", "address": "x:3", "state": "dead", "admin_url": "http://127.0.0.1:9"},
    ]
    client = await _client(a)
    try:
        net = await (await client.get("/network")).json()
        await asyncio.sleep(0)  # (nothing is in flight to wait for: the view is built locally)
    finally:
        await client.close()
        await listener.close()
    assert received == []
    assert [p["node_id"] for p in net["peers"]] == ["n1", "n2"]  # the dead peer is not listed
    assert net["peers"][0]["labels"] == {"cluster": "1"} and net["peers"][0]["admin_url"].endswith("/internal-only")
    assert net["row"] == pytest.approx({"n0": 0.6, "n1": 0.3, "n2": 0.1})


async def test_history_is_readable_cross_origin_by_peer_dashboards_only():
    a = FakeNode("n0")
    a.peers_table = lambda: [
        {"node_id": "n1", "address": "x:1", "state": "alive", "admin_url": "http://127.0.0.1:4242"}
    ]
    client = await _client(a)
    try:
        peer = await client.get("/history?last=1", headers={"Origin": "http://127.0.0.1:4242"})
        other = await client.get("/history?last=1", headers={"Origin": "http://evil.example"})
    finally:
        await client.close()
    assert peer.headers.get("Access-Control-Allow-Origin") == "http://127.0.0.1:4242"
    assert peer.headers.get("Access-Control-Allow-Credentials") == "true"  # with the user's cookie for this node
    assert "Access-Control-Allow-Origin" not in other.headers


async def test_query_parameters_are_bounded_never_500():
    """``/history?last=<5000 digits>`` answered 500 with a traceback (int() refuses > 4300 digits)."""
    import random

    rng = random.Random(0)
    values = [
        "9" * 5000,
        "-" + "9" * 5000,
        "1e9",
        "0x10",
        "\u00b2",
        "\u0663",
        " 1",
        "1 ",
        "",
        "-",
        "+1",
        "nan",
        "inf",
        "1.5",
        "%00",
        "9" * 14,
        "-9" * 7,
        "\x00",
        "[]",
        "{}",
        "'",
        '"',
    ]
    values += ["".join(rng.choice("0123456789-+e. x\u00b2") for _ in range(rng.randint(1, 30))) for _ in range(60)]
    client = await _client(FakeNode())
    statuses = {}
    try:
        for path in ("/history", "/network", "/status", "/peers", "/weights", "/metrics", "/healthz"):
            for name in ("last", "since", "x"):
                for v in values:
                    r = await client.get(path, params={name: v})
                    statuses.setdefault(r.status, []).append((path, name, v[:20]))
                    if r.status == 400:
                        body = await r.json()
                        assert name in body["error"] and "Traceback" not in body["error"], body
        r = await client.get("/history", params={"last": "9" * 5000})
        assert r.status == 400 and "5000 characters" in (await r.json())["error"]
    finally:
        await client.close()
    assert 500 not in statuses, statuses[500][:5]
    assert statuses.get(400), "out-of-bounds values are refused"


async def test_start_admin_binds_free_port():
    runner, port = await start_admin(FakeNode("n7"), "127.0.0.1", 0, token=TOKEN)
    try:
        assert port > 0
        async with aiohttp.ClientSession(headers=bearer(TOKEN)) as s:
            async with s.get(f"http://127.0.0.1:{port}/status") as r:
                assert (await r.json())["node_id"] == "n7"
    finally:
        await runner.cleanup()
