#!/usr/bin/env bash
# The resilience suite's one-guest scenarios (issue 25; docs/resilience.md):
# faults injected into a live RPC service on soft-RoCE, through the device.
#
#   run_resilience.sh SCENARIO SERVER CLIENT CHECKER
#
# SCENARIO:
#   server_kill   4 clients x 16 calls in flight (half idempotent), the server
#                 SIGKILLed under load and started again 1 s later: every call
#                 ends ok, or unknown_outcome (not idempotent, in flight across
#                 the restart); none runs twice; every client resumes.
#   silent_peer   keepalive 200 ms, timeout 1 s: the server SIGSTOPped under
#                 load until the client declares it silent (state
#                 reconnecting), then SIGCONTed: every call ends ok, none twice.
#   client_kills  RDMAX_RESILIENCE_KILLS (200) clients, two at a time, each
#                 SIGKILLed with 16 calls in flight: the server's fd count and RSS
#                 sampled after each pair has been dropped (flat: slope over the
#                 samples of the last 150 kills), and its
#                 reply cache empty within keepalive_timeout + linger of the last.
# SERVER and CLIENT are tests/rxe/resilience_{server,client}, CHECKER
# tests/rxe/resilience_check.py, which holds the clients' outcomes against the
# server's log of executions and writes the figures: resilience-SCENARIO.json
# in RDMAX_RESILIENCE_OUT (the build directory) and in the VM's results share.
# Every step has a deadline, every process a timeout. SKIP (77) without an
# ACTIVE RDMA device. RDMAX_TEST_ADDR, if set, is the server's address.
set -uo pipefail
scenario=$1 server_bin=$2 client_bin=$3 checker=$4
source_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if ! grep -qs ACTIVE /sys/class/infiniband/*/ports/*/state; then
    echo "SKIPPED: no ACTIVE RDMA device"
    exit 77
fi
export RDMAX_RPC_LOCAL=0
addr=${RDMAX_TEST_ADDR:-}
if [ -z "$addr" ]; then
    # The IPv4 address of the netdev under the first ACTIVE RDMA link.
    netdev=$(rdma link show 2>/dev/null | awk '/state ACTIVE/ { for (i = 1; i < NF; i++) if ($i == "netdev") { print $(i + 1); exit } }')
    addr=$(ip -4 -o addr show dev "${netdev:-none}" 2>/dev/null | awk '{ sub("/.*", "", $4); print $4; exit }')
fi
[ -n "$addr" ] || { echo "FAIL: no IPv4 address on an ACTIVE RDMA device (set RDMAX_TEST_ADDR)"; exit 1; }
port=${RDMAX_RESILIENCE_PORT:-7480}
scratch=$(mktemp -d)
pids=()
cleanup() {
    local p
    for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
    wait 2>/dev/null
    rm -rf "$scratch"
}
trap cleanup EXIT

say() { echo "[$(date +%T.%3N)] $scenario: $*"; }
now() { date +%s.%N; }
fail() {
    say "FAIL: $*"
    local f
    for f in "$scratch"/*.out "$scratch"/*.err; do
        [ -s "$f" ] || continue
        echo "--- ${f##*/} (last 15 lines)"
        tail -n 15 "$f"
    done
    exit 1
}
# wait_for SECONDS WHAT COMMAND...: polls COMMAND every 50 ms until it succeeds.
wait_for() {
    local secs=$1 what=$2
    local end=$(($(date +%s%N) + secs * 1000000000))
    shift 2
    until "$@"; do
        [ "$(date +%s%N)" -lt "$end" ] || fail "$what: not within $secs s"
        sleep 0.05
    done
}
not_running() { ! kill -0 "$1" 2>/dev/null; }
# A field of the server's stats (one JSON line it rewrites every 100 ms).
stat() { sed -n "s/.*\"$1\": \"\{0,1\}\([0-9a-f.]*\).*/\1/p" "$scratch/stats.json" 2>/dev/null; }
stat_at_least() { local v; v=$(stat "$1"); [ -n "$v" ] && [ "${v%.*}" -ge "$2" ]; }
# The server's stats were written after wall-clock time $1 and say field $2 is $3.
stat_after_is() {
    local t
    t=$(stat time)
    [ -n "$t" ] && awk -v a="$t" -v b="$1" 'BEGIN { exit !(a + 0 > b + 0) }' && [ "$(stat "$2")" = "$3" ]
}
# The server's pid, from its "serving on" line (timeout is its parent).
server_pid=
start_server() {
    local label=$1 line
    rm -f "$scratch/stats.json"
    timeout -s KILL 280 "$server_bin" --addr "$addr" --port "$port" --log "$scratch/executions.log" \
        --stats "$scratch/stats.json" --deadline 270 >"$scratch/$label.out" 2>"$scratch/$label.err" &
    server_timeout_pid=$!
    pids+=("$server_timeout_pid")
    wait_for 60 "$label says it serves" grep -q "serving on" "$scratch/$label.out"
    line=$(grep "serving on" "$scratch/$label.out")
    server_pid=$(sed -n 's/.*(pid \([0-9]*\),.*/\1/p' <<<"$line")
    pids+=("$server_pid")
    wait_for 10 "$label writes its stats" test -s "$scratch/stats.json"
    say "$line"
}
# start_clients N SECONDS: N clients (tags 1..N), 16 calls in flight each.
client_pids=()
start_clients() {
    local c
    for c in $(seq "$1"); do
        timeout -s KILL $(($2 + 60)) "$client_bin" --addr "$addr" --port "$port" --tag "$c" \
            --inflight 16 --seconds "$2" --json "$scratch/client$c.json" \
            --outcomes "$scratch/client$c.outcomes" >"$scratch/client$c.out" 2>"$scratch/client$c.err" &
        client_pids+=($!)
        pids+=($!)
    done
}
all_connected() {
    local c
    for c in $(seq "${#client_pids[@]}"); do grep -q connected "$scratch/client$c.out" || return 1; done
}
# Every client said $1 (on stdout).
all_said() {
    local c
    for c in $(seq "${#client_pids[@]}"); do grep -q "$1" "$scratch/client$c.out" || return 1; done
}
# Every client said "resumed at T" with T after $1.
all_resumed_after() {
    local c
    for c in $(seq "${#client_pids[@]}"); do
        awk -v t="$1" '/resumed at/ && $5 + 0 > t + 0 { found = 1 } END { exit !found }' "$scratch/client$c.out" || return 1
    done
}
# Stops the clients (SIGTERM: they start nothing more and wait for their
# calls in flight) and checks that each exited 0.
stop_clients() {
    local c p status bad=0
    for p in "${client_pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
    c=0
    for p in "${client_pids[@]}"; do
        c=$((c + 1))
        status=0
        wait "$p" || status=$?
        if [ "$status" != 0 ]; then
            say "client $c exited $status"
            bad=1
        fi
    done
    [ "$bad" = 0 ] || fail "a client failed (its calls did not all end ok or unknown_outcome)"
}
stop_server() {
    local status=0
    kill -TERM "$server_pid" 2>/dev/null
    wait "$server_timeout_pid" || status=$?
    [ "$status" = 0 ] || fail "the server exited $status"
}
outs=("${RDMAX_RESILIENCE_OUT:-.}")
[ -d /run/rdmax-vm ] && [ -w /run/rdmax-vm ] && outs+=(/run/rdmax-vm)
check() {
    local o args=()
    for o in "${outs[@]}"; do args+=(--json "$o/resilience-$scenario.json"); done
    python3 "$checker" "$scenario" --dir "$scratch" "${args[@]}" \
        --kernel "$(uname -r)" --commit "$(git -C "$source_root" rev-parse --short HEAD 2>/dev/null || echo unknown)" "$@" ||
        fail "the checker found a fault (above)"
}

say "server on $addr:$port through the device, kernel $(uname -r)"
case $scenario in
server_kill)
    export RDMAX_RPC_TIMEOUT_MS=${RDMAX_RPC_TIMEOUT_MS:-60000}
    start_server server1
    start_clients 4 200
    wait_for 60 "4 clients connected" all_connected
    wait_for 60 "400 executions of method 2" stat_at_least executions 400
    t_kill=$(now)
    kill -KILL "$server_pid"
    say "server SIGKILLed after $(stat executions) executions"
    wait_for 10 "server 1 gone" not_running "$server_pid"
    sleep 1 # the scenario's downtime (not a synchronisation)
    t_restart=$(now)
    start_server server2
    t_serving=$(now)
    wait_for 120 "every client resumed after the restart" all_resumed_after "$t_restart"
    wait_for 60 "400 executions on the new server" stat_at_least executions 400
    stop_clients
    stop_server
    check --t-kill "$t_kill" --t-restart "$t_restart" --t-serving "$t_serving"
    ;;
silent_peer)
    export RDMAX_RPC_KEEPALIVE_MS=${RDMAX_RPC_KEEPALIVE_MS:-200}
    export RDMAX_RPC_KEEPALIVE_TIMEOUT_MS=${RDMAX_RPC_KEEPALIVE_TIMEOUT_MS:-1000}
    export RDMAX_RPC_CONNECT_TIMEOUT_MS=${RDMAX_RPC_CONNECT_TIMEOUT_MS:-2000}
    export RDMAX_RPC_TIMEOUT_MS=${RDMAX_RPC_TIMEOUT_MS:-60000}
    start_server server
    start_clients 2 200
    wait_for 60 "2 clients connected" all_connected
    wait_for 60 "200 executions of method 2" stat_at_least executions 200
    t_stop=$(now)
    kill -STOP "$server_pid"
    say "server SIGSTOPped"
    wait_for 30 "every client declares the server silent" all_said "state reconnecting"
    t_cont=$(now)
    kill -CONT "$server_pid"
    say "every client went reconnecting; server SIGCONTed"
    wait_for 120 "every client resumed after SIGCONT" all_resumed_after "$t_cont"
    stop_clients
    stop_server
    check --t-stop "$t_stop" --t-cont "$t_cont" \
        --keepalive-ms "$RDMAX_RPC_KEEPALIVE_MS" --keepalive-timeout-ms "$RDMAX_RPC_KEEPALIVE_TIMEOUT_MS"
    ;;
client_kills)
    export RDMAX_RPC_KEEPALIVE_MS=${RDMAX_RPC_KEEPALIVE_MS:-200}
    export RDMAX_RPC_KEEPALIVE_TIMEOUT_MS=${RDMAX_RPC_KEEPALIVE_TIMEOUT_MS:-1000}
    export RDMAX_RPC_REPLY_CACHE_LINGER_MS=${RDMAX_RPC_REPLY_CACHE_LINGER_MS:-1000}
    kills=${RDMAX_RESILIENCE_KILLS:-200}
    start_server server
    : >"$scratch/samples"
    # Two clients at a time (TCG is slow): a sample after each pair.
    for round in $(seq $((kills / 2))); do
        pair=()
        for i in $((2 * round - 1)) $((2 * round)); do
            timeout -s KILL 60 "$client_bin" --addr "$addr" --port "$port" --tag "$i" --inflight 16 \
                --die-after 20 >"$scratch/client$((i % 2)).out" 2>"$scratch/client$((i % 2)).err" &
            pair+=($!)
        done
        for p in "${pair[@]}"; do
            status=0
            wait "$p" || status=$?
            [ "$status" = 137 ] || fail "a client of round $round exited $status, not killed by its own SIGKILL mid-call"
        done
        t_killed=$(now)
        # Dropped: no peer left, in stats written after the kills.
        wait_for 20 "the server drops the clients of round $round" stat_after_is "$t_killed" peers 0
        t_dropped=$(now)
        fds=$(find "/proc/$server_pid/fd" -mindepth 1 -maxdepth 1 | wc -l)
        rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$server_pid/status")
        echo "$((2 * round)) $fds $rss $(stat cached_clients) $(stat cached_calls) $t_killed $t_dropped" >>"$scratch/samples"
        [ $((round % 25)) != 0 ] || say "$((2 * round)) clients killed: server fds $fds, VmRSS $rss kB, cached clients $(stat cached_clients)"
    done
    t_last=$(now)
    wait_for 60 "the reply cache empties" stat_after_is "$t_last" cached_clients 0
    t_empty=$(now)
    stop_server
    check --t-last "$t_last" --t-empty "$t_empty" \
        --keepalive-timeout-ms "$RDMAX_RPC_KEEPALIVE_TIMEOUT_MS" --linger-ms "$RDMAX_RPC_REPLY_CACHE_LINGER_MS"
    ;;
*)
    echo "usage: run_resilience.sh server_kill|silent_peer|client_kills SERVER CLIENT CHECKER" >&2
    exit 2
    ;;
esac
say "PASS"
