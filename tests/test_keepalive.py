"""The peer server accepts our clients' keepalive pings: a connection idle between rounds is kept,
not torn down with GOAWAY too_many_pings (the server's ping allowance was once set under a
misspelt channel arg, so gRPC kept its 5-minute default and the daemons' logs filled with
GOAWAYs).  Run in a subprocess:
gRPC core reports the GOAWAY on stderr only."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import asyncio, sys, grpc
    from coterie.node.transport import server as srv
    srv.KEEPALIVE_MS = int(sys.argv[2])  # the server allows a ping every KEEPALIVE_MS / 2 (scaled down here)

    async def main(ping_ms):
        server, port = await srv.serve(object(), object(), "127.0.0.1:0", tls=None)
        options = [("grpc.keepalive_time_ms", ping_ms), ("grpc.keepalive_permit_without_calls", 1),
                   ("grpc.http2.max_pings_without_data", 0)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as ch:
            await ch.channel_ready()
            await asyncio.sleep(6)  # the idle connection: only keepalive pings cross it
        await server.stop(None)

    asyncio.run(main(int(sys.argv[1])))
""")


def _goaways(ping_ms: int, keepalive_ms: int) -> int:
    cmd = [sys.executable, "-c", SCRIPT, str(ping_ms), str(keepalive_ms)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stderr.count("too_many_pings")


@pytest.mark.parametrize("keepalive_ms, sent_away", [(1000, False), (600_000, True)])
def test_the_server_keeps_connections_whose_keepalive_pings_it_allows(keepalive_ms, sent_away):
    """A client pinging every second: within an allowance of one ping per 500 ms it stays; a
    server allowing one per 5 min (gRPC's default, what the misspelt arg left) sends it away."""
    assert (_goaways(1000, keepalive_ms) > 0) == sent_away
