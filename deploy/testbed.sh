#!/usr/bin/env bash
# Coterie container testbed, end to end, from a bare Debian machine (root) or any Docker host.
#
#   bash deploy/testbed.sh all     # up + test + down (down also runs on failure); exit status = test result
#   bash deploy/testbed.sh up      # engine (install/start if needed), images, network of node1..node8
#   bash deploy/testbed.sh test    # assertions through the admin API (tests/testbed/check.py):
#                                  #   baseline run, then a fresh run with the faulty profile, then
#                                  #   two nodes learning from their own files (profile files),
#                                  #   then a NAT'd site of outbound-only nodes (profile nat)
#   bash deploy/testbed.sh down    # containers, networks, volumes, our iptables rule, and dockerd
#                                  #   if (and only if) this script started it
#
# Knobs (environment): TESTBED_BASE (default: the local debootstrap image coterie-base:bookworm;
# e.g. python:3.11-slim where a registry is reachable), TESTBED_PROJECT (compose project,
# default coterie-testbed), TESTBED_ROUNDS (30), TESTBED_STATE (/tmp/coterie-testbed: what this
# script started), TESTBED_KEEP_IMAGES=1 (down keeps images; default too — images are a cache),
# TESTBED_RMI=1 (down removes the images as well).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
export TESTBED_PROJECT="${TESTBED_PROJECT:-coterie-testbed}"
export TESTBED_ROUNDS="${TESTBED_ROUNDS:-30}"
export TESTBED_BRIDGE="${TESTBED_BRIDGE:-br-coterie}"
export COTERIE_IMAGE="${COTERIE_IMAGE:-coterie:local}"
STATE="${TESTBED_STATE:-/tmp/coterie-testbed}"
BASE="${TESTBED_BASE:-coterie-base:bookworm}"
export COTERIE_BASE="$BASE"
export DOCKER_BUILDKIT=0   # legacy builder: no buildx here; the Dockerfile needs nothing newer
mkdir -p "$STATE"

T_ALL=$(date +%s)
phase_start() { PHASE="$1"; T_PHASE=$(date +%s); echo "=== [$PHASE] start"; }
phase_end() { echo "=== [$PHASE] done in $(( $(date +%s) - T_PHASE ))s"; echo "$PHASE $(( $(date +%s) - T_PHASE ))" >>"$STATE/timings"; }
die() { echo "testbed: $*" >&2; exit 1; }

# Poll a command until it succeeds (every $2 s, at most $3 s). Never a bare sleep.
poll() { local cmd="$1" every="$2" timeout="$3" t0; t0=$(date +%s)
    until eval "$cmd" >/dev/null 2>&1; do
        (( $(date +%s) - t0 >= timeout )) && return 1
        sleep "$every"
    done; }

# ------------------------------------------------------------------ engine
install_tools() {
    local need=()
    command -v dockerd >/dev/null || need+=(docker.io)
    command -v debootstrap >/dev/null || [[ "$BASE" != coterie-base:* ]] || need+=(debootstrap)
    if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then need+=(docker-compose); fi
    command -v iptables >/dev/null || need+=(iptables)
    command -v curl >/dev/null || need+=(curl)
    if ((${#need[@]})); then
        echo "testbed: installing ${need[*]}"
        [[ $(id -u) == 0 ]] || die "need root to install ${need[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >"$STATE/apt.log" 2>&1 \
            || { tail -20 "$STATE/apt.log"; die "apt-get install failed"; }
    fi
}

start_engine() {
    if docker info >/dev/null 2>&1; then echo "testbed: using the running Docker engine"; return; fi
    [[ $(id -u) == 0 ]] || die "no Docker engine answers and only root can start one"
    echo "testbed: starting dockerd in the background"
    nohup dockerd >"$STATE/dockerd.log" 2>&1 &
    echo $! >"$STATE/dockerd.pid"     # marks: this script started it, down stops it
    poll "docker info" 0.5 60 || { tail -20 "$STATE/dockerd.log"; die "dockerd did not come up"; }
    echo "testbed: dockerd up (pid $(cat "$STATE/dockerd.pid"))"
}

compose_cmd() {
    if docker compose version >/dev/null 2>&1; then echo "docker compose -p $TESTBED_PROJECT"
    else echo "docker-compose -p $TESTBED_PROJECT"; fi
}

# ------------------------------------------------------------------ images
build_images() {
    if [[ "$BASE" == coterie-base:* ]]; then
        BASE_IMAGE="$BASE" bash deploy/base-image.sh
    fi
    bash deploy/wheelhouse.sh 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
    ls deploy/wheels/torch-*.whl >/dev/null 2>&1 || die "no torch wheel in deploy/wheels"
    docker build -q -f deploy/Dockerfile --build-arg BASE="$BASE" -t "$COTERIE_IMAGE" . 2>&1 \
        | grep -v -e DEPRECATED -e "legacy builder" -e buildx -e BuildKit -e "environment-variable" -e "^ *$" -e "docs.docker.com" || true
    docker image inspect "$COTERIE_IMAGE" >/dev/null || die "image build failed"
}

# ------------------------------------------------------------------ network
forward_rule() {  # accept traffic within each testbed bridge when FORWARD drops by default
    local br spec   # the main bridge, and profile nat's wan and site bridges (docker-compose.yml)
    for br in "$TESTBED_BRIDGE" "$TESTBED_BRIDGE-wan" "$TESTBED_BRIDGE-site"; do
        spec=(FORWARD -i "$br" -o "$br" -m comment --comment coterie-testbed -j ACCEPT)
        case "$1" in
            add)
                command -v iptables >/dev/null || return 0
                if iptables -S FORWARD 2>/dev/null | head -1 | grep -q "^-P FORWARD DROP" \
                   && ! iptables -C "${spec[@]}" 2>/dev/null; then
                    iptables -I "${spec[@]}" && touch "$STATE/iptables-rule" \
                        && echo "testbed: added iptables ACCEPT for $br (FORWARD policy is DROP)"
                fi ;;
            del)
                if [[ -f "$STATE/iptables-rule" ]]; then
                    while iptables -C "${spec[@]}" 2>/dev/null; do iptables -D "${spec[@]}"; done
                fi ;;
        esac
    done
    if [[ "$1" == del && -f "$STATE/iptables-rule" ]]; then
        rm -f "$STATE/iptables-rule"; echo "testbed: removed our iptables rules"
    fi
}

net_up() {  # $@: extra compose args (profiles), then optionally -- and the services to start
    local c args=() svcs=(); c=$(compose_cmd)
    while (($#)); do
        if [[ "$1" == -- ]]; then shift; svcs=("$@"); break; fi
        args+=("$1"); shift
    done
    forward_rule add
    $c "${args[@]}" up -d --no-build "${svcs[@]}" 2>&1 | grep -v -e "^$" || true
    $c "${args[@]}" ps
}

net_down() {
    local c; c=$(compose_cmd)
    $c --profile faulty --profile gpu --profile files --profile nat down -v --remove-orphans --timeout 10 2>&1 | grep -v "^$" || true
}

# ------------------------------------------------------------------ commands
cmd_up() {
    phase_start engine; install_tools; start_engine; phase_end
    phase_start images; build_images; phase_end
    phase_start network-up; net_up; phase_end
}

dump_logs() {
    local c; c=$(compose_cmd)
    echo "testbed: last log lines of every node:"
    $c --profile faulty --profile files --profile nat logs --no-color --tail=15 2>&1 | tail -n 200 || true
}

# Run one check.py phase, its transcript kept in $STATE/check.log: on a failure the node logs are
# dumped, and summary repeats the transcript's end after them (CI keeps only the output's tail).
check_phase() {
    python3 tests/testbed/check.py "$@" 2>&1 | tee -a "$STATE/check.log"
    [[ ${PIPESTATUS[0]} == 0 ]] || { echo "$1" >"$STATE/check.failed"; dump_logs; return 1; }
}

cmd_test() {
    local c; c=$(compose_cmd)
    export TESTBED_COMPOSE="$c"
    docker info >/dev/null 2>&1 || die "no Docker engine; run: bash deploy/testbed.sh up"
    [[ -n "$($c ps -q node1 2>/dev/null)" ]] || { phase_start network-up; forward_rule add; net_up; phase_end; }
    phase_start test-baseline
    check_phase baseline --out "$STATE/baseline.json" || return 1
    phase_end
    phase_start test-faulty
    net_down
    net_up --profile faulty
    check_phase faulty --baseline "$STATE/baseline.json" || return 1
    phase_end
    phase_start test-files
    net_down
    net_up --profile files -- filea fileb
    check_phase files || return 1
    phase_end
    phase_start test-nat
    net_down
    net_up --profile nat -- natrouter relay1 relay2 nat1 nat2
    check_phase nat || return 1
    phase_end
    echo "testbed: try it yourself: coterie peers --admin http://127.0.0.1:8101 --token \"\$($c exec -T node1 cat /pki/admin.token)\""
}

cmd_down() {
    phase_start down
    if docker info >/dev/null 2>&1; then
        net_down
        if [[ "${TESTBED_RMI:-0}" == 1 ]]; then docker rmi -f "$COTERIE_IMAGE" >/dev/null 2>&1 || true; fi
    fi
    forward_rule del
    if [[ -f "$STATE/dockerd.pid" ]]; then
        local pid; pid=$(cat "$STATE/dockerd.pid")
        if kill -0 "$pid" 2>/dev/null; then
            echo "testbed: stopping the dockerd we started (pid $pid)"
            kill -TERM "$pid"
            poll "! kill -0 $pid" 0.5 60 || { echo "testbed: dockerd did not stop in 60s; SIGKILL"; kill -KILL "$pid" || true; }
        fi
        rm -f "$STATE/dockerd.pid"
    fi
    phase_end
}

summary() {
    if [[ -f "$STATE/check.failed" ]]; then
        echo "=== check.py $(cat "$STATE/check.failed") FAILED; the end of its transcript:"
        tail -n 25 "$STATE/check.log"
    fi
    [[ -f "$STATE/timings" ]] || return 0
    echo "=== phase timings (s):"; cat "$STATE/timings"
    echo "=== total: $(( $(date +%s) - T_ALL ))s"
}

case "${1:-}" in
    up) rm -f "$STATE/timings"; cmd_up; summary ;;
    test) rm -f "$STATE/timings" "$STATE/check.log" "$STATE/check.failed"; cmd_test; summary ;;
    down) cmd_down ;;
    all)
        rm -f "$STATE/timings" "$STATE/check.log" "$STATE/check.failed"
        trap 'rc=$?; trap - EXIT; cmd_down || true; summary; exit $rc' EXIT
        cmd_up
        cmd_test ;;
    *) sed -n 2,17p "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
