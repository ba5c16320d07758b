#!/usr/bin/env bash
# A 3-member etcd cluster on loopback, for the cluster-scope tests and
# benchmarks (and by hand). Needs `etcd` (Debian: apt-get install etcd-server).
#
#   cluster.sh start DIR     start members 1, 2, 3 one after another (data,
#                            logs and pids under DIR); prints the endpoints
#   cluster.sh stop DIR      stop every member (by the pids in DIR)
#   cluster.sh kill DIR N    SIGKILL member N
#   cluster.sh restart DIR N start member N again (same data, same ports)
#   cluster.sh restart-all DIR
#                            start every member again (after they were all
#                            killed: one alone has no quorum, so they start
#                            together and are then waited for)
#   cluster.sh endpoints DIR the client URLs, comma-separated
#
# Ports: clients BASE+1..3, peers BASE+11..13, BASE from
# KEYLOCK_ETCD_BASE_PORT (default 23790). Heartbeat 50 ms, election timeout
# 500 ms (so a lease TTL of 1 s is allowed; a leader election takes about
# 0.5-1 s). Members are stopped by pid only.
set -euo pipefail

BASE=${KEYLOCK_ETCD_BASE_PORT:-23790}
cmd=${1:?usage: cluster.sh start|stop|kill|restart|restart-all|endpoints DIR [N]}
dir=${2:?usage: cluster.sh $cmd DIR [N]}

client_url() { echo "http://127.0.0.1:$((BASE + $1))"; }
peer_url() { echo "http://127.0.0.1:$((BASE + 10 + $1))"; }

endpoints() {
    echo "$(client_url 1),$(client_url 2),$(client_url 3)"
}

start_member() {
    local n=$1 state=$2
    local initial="m1=$(peer_url 1),m2=$(peer_url 2),m3=$(peer_url 3)"
    etcd --name "m$n" --data-dir "$dir/m$n.data" \
        --listen-client-urls "$(client_url "$n")" \
        --advertise-client-urls "$(client_url "$n")" \
        --listen-peer-urls "$(peer_url "$n")" \
        --initial-advertise-peer-urls "$(peer_url "$n")" \
        --initial-cluster "$initial" --initial-cluster-state "$state" \
        --initial-cluster-token keylock-test \
        --heartbeat-interval 50 --election-timeout 500 \
        --log-level warn >>"$dir/m$n.log" 2>&1 &
    echo $! >"$dir/m$n.pid"
}

wait_healthy() {
    local n=$1 i
    for i in $(seq 1 100); do
        if command -v curl >/dev/null 2>&1; then
            if curl -fsS "$(client_url "$n")/health" 2>/dev/null | grep -q '"health":"true"'; then
                return 0
            fi
        elif python3 - "$(client_url "$n")/health" <<'PY' 2>/dev/null
import sys, urllib.request
sys.exit(0 if b'"true"' in urllib.request.urlopen(sys.argv[1], timeout=1).read() else 1)
PY
        then
            return 0
        fi
        sleep 0.1
    done
    echo "etcd member $n did not become healthy; its log:" >&2
    tail -20 "$dir/m$n.log" >&2
    return 1
}

# Waits (at most 10 s) until member N's ports can be bound again: a
# member killed with SIGKILL releases them only once the kernel has torn
# the process down, which `kill` does not wait for; a restart before then
# fails with "address already in use".
wait_ports_free() {
    local n=$1
    python3 - "$((BASE + n))" "$((BASE + 10 + n))" <<'PY'
import socket, sys, time
ports = [int(p) for p in sys.argv[1:]]
deadline = time.monotonic() + 10
while True:
    busy = []
    for port in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            busy.append(port)
        finally:
            s.close()
    if not busy or time.monotonic() > deadline:
        sys.exit(0)
    time.sleep(0.05)
PY
}

stop_member() {
    local n=$1 pid
    [ -f "$dir/m$n.pid" ] || return 0
    pid=$(cat "$dir/m$n.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$dir/m$n.pid"
}

case $cmd in
    start)
        command -v etcd >/dev/null 2>&1 || { echo "etcd not found" >&2; exit 1; }
        mkdir -p "$dir"
        for n in 1 2 3; do
            stop_member "$n"
            rm -rf "$dir/m$n.data"
            wait_ports_free "$n"
            start_member "$n" new
        done
        for n in 1 2 3; do wait_healthy "$n"; done
        endpoints
        ;;
    stop)
        for n in 1 2 3; do stop_member "$n"; done
        ;;
    kill)
        n=${3:?member number}
        kill -9 "$(cat "$dir/m$n.pid")"
        rm -f "$dir/m$n.pid"
        ;;
    restart)
        n=${3:?member number}
        stop_member "$n"
        wait_ports_free "$n"
        start_member "$n" existing
        wait_healthy "$n"
        ;;
    restart-all)
        for n in 1 2 3; do
            stop_member "$n"
            wait_ports_free "$n"
            start_member "$n" existing
        done
        for n in 1 2 3; do wait_healthy "$n"; done
        ;;
    endpoints)
        endpoints
        ;;
    *)
        echo "unknown command $cmd" >&2
        exit 2
        ;;
esac
