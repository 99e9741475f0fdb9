#!/bin/sh
# Container entrypoint for a Coterie node.
#
# Testbed knobs (deliberately NOT prefixed COTERIE_: every COTERIE_* variable is read as a node
# config field, and the config rejects unknown fields):
#   TESTBED_RATE=1mbit        cap this container's link with tc (egress tbf on eth0, plus an ingress
#                             policer at the same rate when the kernel has one). Needs cap NET_ADMIN.
#   TESTBED_BURST=32kbit      tbf bucket size (default 32kbit)
#   TESTBED_JOIN_AFTER_ROUND=N  join late: before starting, poll TESTBED_JOIN_WATCH (an admin URL,
#                             e.g. http://node1:8000) until its /status round >= N
#   TESTBED_JOIN_TIMEOUT_S=600  give up waiting and start anyway after this long
#   TESTBED_GATEWAY=10.231.2.2  route everything through this address (a NAT router container,
#                             profile nat); needs cap NET_ADMIN
#   TESTBED_STRATEGY_PARAMS='{...}'  when non-empty, replaces COTERIE_STRATEGY_PARAMS (lets compose
#                             users override a JSON default, which compose interpolation cannot hold)
# Latency is not done here (the kernel has no netem): set the node's own COTERIE_DELAY_MS.
#
# Then execs `coterie node start "$@"` (as PID 1's child under `init: true`), so signals reach it.
set -eu

log() { echo "entrypoint: $*" >&2; }

if [ -n "${TESTBED_STRATEGY_PARAMS:-}" ]; then
    export COTERIE_STRATEGY_PARAMS="$TESTBED_STRATEGY_PARAMS"
fi

if [ -n "${TESTBED_GATEWAY:-}" ]; then
    ip route replace default via "$TESTBED_GATEWAY"
    log "default route via $TESTBED_GATEWAY (behind the NAT router)"
fi

if [ -n "${TESTBED_RATE:-}" ]; then
    dev="${TESTBED_DEV:-eth0}"
    burst="${TESTBED_BURST:-32kbit}"
    tc qdisc replace dev "$dev" root tbf rate "$TESTBED_RATE" burst "$burst" latency 400ms
    log "egress of $dev capped: tbf rate $TESTBED_RATE burst $burst"
    # ingress: police at the same rate (TCP backs off on the drops); optional, kernel-dependent
    tc qdisc del dev "$dev" ingress 2>/dev/null || true
    if tc qdisc add dev "$dev" handle ffff: ingress 2>/dev/null \
       && tc filter add dev "$dev" parent ffff: protocol all prio 1 u32 match u32 0 0 \
            action police rate "$TESTBED_RATE" burst "$burst" drop 2>/dev/null; then
        log "ingress of $dev policed at $TESTBED_RATE"
    else
        tc qdisc del dev "$dev" ingress 2>/dev/null || true
        log "ingress policing unavailable; egress cap only"
    fi
fi

if [ -n "${TESTBED_JOIN_AFTER_ROUND:-}" ]; then
    watch="${TESTBED_JOIN_WATCH:?TESTBED_JOIN_WATCH (admin URL) is required with TESTBED_JOIN_AFTER_ROUND}"
    log "joining late: waiting for $watch round >= $TESTBED_JOIN_AFTER_ROUND"
    python3 - "$watch" "$TESTBED_JOIN_AFTER_ROUND" "${TESTBED_JOIN_TIMEOUT_S:-600}" <<'EOF'
import json, os, sys, time, urllib.request
url, want, timeout = sys.argv[1].rstrip("/") + "/status", int(sys.argv[2]), float(sys.argv[3])
deadline, last = time.monotonic() + timeout, None
while time.monotonic() < deadline:
    try:  # the testbed's shared admin token (deploy/pki.sh)
        token = open(os.environ["COTERIE_SECURITY__ADMIN_TOKEN_FILE"]).read().strip()
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=3) as r:
            last = json.load(r).get("round")
        if last is not None and int(last) >= want:
            print(f"entrypoint: {url} at round {last}; joining", file=sys.stderr)
            sys.exit(0)
    except Exception as e:  # not up yet
        last = repr(e)
    time.sleep(1)
print(f"entrypoint: gave up waiting after {timeout}s (last: {last}); joining anyway", file=sys.stderr)
EOF
fi

exec coterie node start "$@"
