"""A stand-in node daemon for launcher tests (stdlib only, starts in milliseconds).

    python fake_daemon.py CONFIG.toml MODE

Modes: ok (write node.json + history.jsonl, serve /status done=true to a request with the token
in state_dir/admin.token, 401 to any other, until SIGTERM), crash_n1
(node n1 exits 3 at once, the others behave as ok), hang (writes node.json, never done; ignores
SIGTERM). Every
mode also starts a grandchild (`sleep`) in its process group and records its pid in
state_dir/grandchild.pid, so tests can check that it does not outlive the run.
"""

import json
import os
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import tomllib

cfg = tomllib.loads(Path(sys.argv[1]).read_text())
mode = sys.argv[2]
bootstrap_from = Path(sys.argv[3]) if len(sys.argv) > 3 else None  # as `node start --bootstrap-from`
state = Path(cfg["state_dir"])
state.mkdir(parents=True, exist_ok=True)
nid = cfg["node_id"]
n = cfg["learner"]["num_nodes"]
ids = [f"n{i}" for i in range(n)]
gc = subprocess.Popen(["sleep", "300"])
# atomically: the launcher may kill this process mid-write (another node crashed), and a test
# reading an empty pid file failed (seen in CI)
(state / "grandchild.pid.tmp").write_text(str(gc.pid))
os.replace(state / "grandchild.pid.tmp", state / "grandchild.pid")

if mode == "crash_n1" and nid == "n1":
    print("boom: fake node failed on purpose", file=sys.stderr, flush=True)
    sys.exit(3)
if mode == "hang":  # up (node.json written, as the real daemon after binding) but never done
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (state / "node.json").write_text(
        json.dumps({"node_id": nid, "address": "127.0.0.1:9", "admin_url": "http://127.0.0.1:9", "pid": os.getpid()})
    )
    while True:
        time.sleep(1)

host, port = cfg["admin_listen"].rsplit(":", 1)
peers = list(cfg.get("peers", []))
if bootstrap_from is not None:
    while not bootstrap_from.exists():
        time.sleep(0.02)
    time.sleep(0.05)  # a torn read is possible in this stand-in (the daemon writes atomically)
    peers.append(json.loads(bootstrap_from.read_text())["address"])
rounds = cfg["rounds"]
me = ids.index(nid)
with open(state / "history.jsonl", "w") as f:
    for r in range(1, rounds + 1):
        w = {m: (0.5 if m == nid else 0.5 / (n - 1)) for m in ids} if n > 1 else {nid: 1.0}
        f.write(
            json.dumps(
                {
                    "round": r,
                    "t": time.time(),
                    "train_loss": 1.0 / r,
                    "eval": {"test_acc": 0.1 * r + 0.01 * me, "test_loss": 2.0 / r},
                    "weights": w,
                    "bytes_sent": {"snapshot": 100, "gossip": 1},
                    "bytes_received": {"snapshot": 200},
                    "info": {"r": r},
                }
            )
            + "\n"
        )


token = f"fake-admin-token-{nid}-0123456789"
(state / "admin.token").write_text(token + "\n")  # like the real daemon: the launcher must send it


class H(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.headers.get("Authorization") != f"Bearer {token}":
            self.send_response(401)
            self.end_headers()
            return
        body = json.dumps({"node_id": nid, "round": rounds, "done": True, "last_eval": {"test_acc": 0.5}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


srv = ThreadingHTTPServer((host, int(port)), H)  # port 0 from the launcher: a free one
bound = srv.server_address[1]
# like the real daemon: node.json once the ports are bound (no peer port here: the admin one stands in)
(state / "node.json").write_text(
    json.dumps(
        {
            "node_id": nid,
            "address": f"{host}:{bound}",
            "admin_url": f"http://{host}:{bound}",
            "pid": os.getpid(),
            "peers": peers,
        }
    )
)
signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(SystemExit(0)))
try:
    srv.serve_forever()
except SystemExit:
    pass
