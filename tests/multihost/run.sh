#!/usr/bin/env bash
# The multi-host suite: RDMA between two soft-RoCE guests joined by an emulated
# link (tests/vm/run --hosts 2; docs/vm.md, docs/testing.md).
#
#   tests/multihost/run.sh           boots the two guests, runs the steps below in
#                                    both, and writes one meson-style test log
#   tests/multihost/run.sh --guest   one guest's side (what the line above runs there)
#
# Steps (host 0 is 198.51.100.1, host 1 is 198.51.100.2):
#   rdma-pingpong   ibv_rc_pingpong, host 1 to host 0 (plain verbs, RoCE v2 GID)
#   rdmax-pingpong  build/examples/pingpong, host 1 to host 0 (rdma_cm)
#   allreduce       rdmax_allreduce_bench, rank 0 on host 0, rank 1 on host 1 (-H),
#                   every mode, 4 KiB to 256 KiB, every element checked
#   mpirun-1host    mpirun -np 2 on host 0: both ranks there, rank and size from
#                   OMPI_COMM_WORLD_* alone (no -r, -n)
#   mpirun-2host    mpirun -np 2 -H 198.51.100.1,198.51.100.2 on host 0, one rank a host,
#                   orted started on host 1 through tests/multihost/agent (no ssh)
#   allreduce-hier  build/examples/allreduce under mpirun, 2 ranks a host: each host's
#                   node team, the two leaders' RDMA ring, every element checked
#   rpc_echo        build/examples/rpc_echo, server on host 0, client on host 1
#   kv_service      build/examples/kv_service, likewise
#   resilience-loss      the resilience suite's load (tests/rxe/resilience_server on
#                   host 0, resilience_client on host 1: 16 calls in flight, half
#                   idempotent) 10 s each at 0 %, 1 % and 5 % loss (tc netem on host 1's
#                   egress): every call ok, none run twice; p50, p99, calls/s
#   resilience-linkdown  2 such clients; host 1's link down for 5 s under load, then
#                   up: every call ok, none lost, none run twice; detection and
#                   recovery times
#   multirail       two rails, one a link (the second link, 203.0.113.1 and .2, with
#                   rxe1 on it, made for this step): build/tests/multirail_pair serves
#                   64 MiB on host 0; host 1 stripes WRITEs and READs over both, every
#                   byte checked, takes its second link down mid-transfer (no error)
#                   and up (port events, a reconnect): the rail carries bytes again
# A program that is not built is SKIPPED, said loudly, never passed. The two
# resilience steps are also checked here, after the guests, by
# tests/rxe/resilience_check.py (the server's log of executions on host 0
# against the clients' outcomes on host 1); their figures go to
# RESULTS/resilience-loss.json and RESULTS/resilience-linkdown.json.
#
# Knobs: RDMAX_VM_RESULTS (where the log goes; default build/test-results/vm-2host),
# RDMAX_VM_TIMEOUT (each guest's deadline; default 900 s), RDMAX_MULTIHOST_CALLS
# (rpc_echo calls and kv_service operations; default 200: TCG is slow),
# RDMAX_MULTIHOST_BIN (where rpc_echo and kv_service are; default build/examples),
# RDMAX_MULTIHOST_LINKDOWN=0 (leaves resilience-linkdown out; it runs by default).
# The log, RESULTS/testlog.json, has one record a step ("rdmax:multihost / STEP"),
# OK only when every host that runs the step succeeded; tests/run counts it.
# Exit status: 0 when no step failed.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
project=$(cd "$here/../.." && pwd)
cd "$project" || exit 1

# Which hosts run each step: the host side expects a record from each.
steps="rdma-pingpong:0,1 rdmax-pingpong:0,1 allreduce:0,1 mpirun-1host:0 mpirun-2host:0,1 allreduce-hier:0 rpc_echo:0,1 kv_service:0,1 resilience-loss:0,1"
# The link-down step (docs/resilience.md, "What the suite found": soft-RoCE's
# QP1 and a teardown through a port that is down); RDMAX_MULTIHOST_LINKDOWN=0 skips it.
linkdown=${RDMAX_MULTIHOST_LINKDOWN:-1}
[ "$linkdown" != 1 ] || steps+=" resilience-linkdown:0,1"
steps+=" multirail:0,1"

if [ "${1:-}" != --guest ]; then
    [ $# -eq 0 ] || { sed -n '2,47p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }
    RDMAX_WHO=$0
    # shellcheck source=../lib/packages.sh
    . "$project/tests/lib/packages.sh"
    # shellcheck disable=SC2086
    rdmax_require install $RDMAX_PKGS_VM_2HOST
    results=${RDMAX_VM_RESULTS:-$project/build/test-results/vm-2host}
    # A log left by an earlier run must not be counted as this one's.
    rm -rf "$results/testlog.json" "$results/host0" "$results/host1"
    mkdir -p "$results" || exit 1
    vm_status=0
    RDMAX_VM_TIMEOUT=${RDMAX_VM_TIMEOUT:-900} RDMAX_VM_RESULTS=$results \
        "$project/tests/vm/run" --hosts 2 -- tests/multihost/run.sh --guest || vm_status=$?
    # One record a step: FAIL if a host failed it or never said, SKIP if one skipped it.
    python3 - "$results" "$vm_status" "$steps" "$project" <<'EOF'
import json, os, shutil, subprocess, sys, tempfile

results, vm_status, steps, project = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4]


def check_resilience(step):
    """The resilience checker over host 0's log and host 1's outcomes: a fault, or None."""
    name = step.split("-", 1)[1]  # loss, linkdown
    h0, h1 = os.path.join(results, "host0"), os.path.join(results, "host1")
    scratch = tempfile.mkdtemp()
    try:
        src = os.path.join(h0, f"{name}-executions.txt")
        if os.path.exists(src):
            shutil.copy(src, os.path.join(scratch, "executions.log"))
        for f in os.listdir(h1) if os.path.isdir(h1) else []:
            if f.startswith(f"{name}-client") and f.endswith(".json"):
                shutil.copy(os.path.join(h1, f), os.path.join(scratch, f[len(name) + 1:]))
            elif f.startswith(f"{name}-client") and f.endswith(".outcomes.txt"):
                shutil.copy(os.path.join(h1, f),
                            os.path.join(scratch, f[len(name) + 1:-len(".txt")]))
        args = [sys.executable, os.path.join(project, "tests/rxe/resilience_check.py"),
                "link_down" if name == "linkdown" else "loss", "--dir", scratch,
                "--json", os.path.join(results, f"resilience-{name}.json"),
                "--kernel", "", "--commit", ""]
        times = os.path.join(h1, f"{name}-times.json")
        if os.path.exists(times):
            with open(times, encoding="utf-8") as f:
                t = json.load(f)
            args += ["--kernel", t.get("kernel", ""), "--commit", t.get("commit", "")]
            for k in ("t_down", "t_up", "keepalive_ms", "keepalive_timeout_ms"):
                if k in t:
                    args += ["--" + k.replace("_", "-"), str(t[k])]
        r = subprocess.run(args, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            return "resilience_check.py: " + "; ".join(
                l.split("FAULT: ", 1)[-1] for l in r.stderr.splitlines() if l.strip())[:400]
        return None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


seen = {}
for host in (0, 1):
    path = os.path.join(results, f"host{host}", "multihost.json")
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    seen[(rec["step"], host)] = rec
    except (OSError, ValueError):
        pass
out, failed = [], 0
print("multihost: results")
for spec in steps:
    step, _, hosts = spec.partition(":")
    result, notes, duration = "OK", [], 0.0
    for h in (int(x) for x in hosts.split(",")):
        rec = seen.get((step, h))
        if rec is None:
            result = "FAIL"
            notes.append(f"host {h} never reported it")
            continue
        duration = max(duration, rec.get("duration", 0.0))
        if rec["result"] == "FAIL":
            result = "FAIL"
        elif rec["result"] == "SKIP" and result == "OK":
            result = "SKIP"
        if rec["result"] != "OK" or rec.get("note"):
            notes.append(f"host {h}: {rec['result']} {rec.get('note', '')}".strip())
    if step.startswith("resilience-"):
        # Its figures are written even when a host failed the step.
        fault = check_resilience(step)
        if fault:
            result = "FAIL"
            notes.append(fault)
    failed += result == "FAIL"
    # The notes go into the record too: tests/run's summary shows them under a failure.
    note = "; ".join(notes)
    out.append({"name": f"rdmax:multihost / {step}", "result": result, "duration": duration,
                "note": note})
    shown = "SKIPPED" if result == "SKIP" else result
    print(f"  {step:<15} {shown:<8} {note}")
if vm_status != 0 and failed == 0:
    # Every step passed, yet a guest failed: never let that pass.
    out.append({"name": "rdmax:multihost / guests", "result": "FAIL", "duration": 0.0})
    print(f"  guests          FAIL     tests/vm/run --hosts 2 exited {vm_status}")
    failed += 1
with open(os.path.join(results, "testlog.json"), "w", encoding="utf-8") as f:
    for rec in out:
        f.write(json.dumps(rec) + "\n")
sys.exit(1 if failed else 0)
EOF
    exit $?
fi

# --- One guest's side. ---
: "${RDMAX_HOST_INDEX:?run by tests/vm/run --hosts 2}" "${RDMAX_HOST_ADDR:?}" "${RDMAX_PEER_ADDR:?}" "${RDMAX_HOSTS:?}"
me=$RDMAX_HOST_INDEX
log=/run/rdmax-vm/multihost.json
: >"$log"
calls=${RDMAX_MULTIHOST_CALLS:-200}
examples=$project/build/examples
rpc_bin=${RDMAX_MULTIHOST_BIN:-$examples}
bench=$examples/bench/rdmax_allreduce_bench
any_failed=0
export OMPI_MCA_btl=self,tcp # the ranks never call MPI; keep Open MPI off the RDMA device

say() { echo "multihost[host$me]: $*"; }

# The emulated link's health, for a failed step's note: whether the peer
# answers a ping now, and the watchdog's count of this NIC's transmit stalls.
# The guests see the host's root: its ping (iputils-ping is in no package set
# here), else busybox's (busybox-static is); with neither the note says so
# rather than blame the link. Within 5 s whatever ping does (tests/multihost/
# test_link_health.sh).
link_health() {
    local to dev=${RDMAX_VM_NETDEV:-?} peer=${RDMAX_PEER_ADDR:-?}
    local -a pinger=()
    to=$(cat "/sys/class/net/$dev/queues/tx-0/tx_timeout" 2>/dev/null || echo '?')
    if command -v ping >/dev/null 2>&1; then
        pinger=(ping)
    elif command -v busybox >/dev/null 2>&1; then
        pinger=(busybox ping)
    else
        echo "link: no ping here to ask the peer (install iputils-ping), $dev tx timeouts $to"
        return 0
    fi
    # The NIC's packet counters across the ping: a transmit side frozen while
    # frames still arrive is the emulated NIC's stall (docs/vm.md).
    local stats=/sys/class/net/$dev/statistics tx0 rx0 moved
    tx0=$(cat "$stats/tx_packets" 2>/dev/null || echo '?')
    rx0=$(cat "$stats/rx_packets" 2>/dev/null || echo '?')
    # -w: ping's own deadline; timeout: ours, should it block anyway.
    if timeout 5 "${pinger[@]}" -c 2 -W 1 -w 3 "$peer" >/dev/null 2>&1; then
        moved="the peer answers ping"
    else
        moved="the peer does NOT answer ping (the emulated link is down)"
    fi
    echo "link: $moved, $dev tx timeouts $to, tx packets $tx0 -> $(cat "$stats/tx_packets" 2>/dev/null || echo '?'), rx packets $rx0 -> $(cat "$stats/rx_packets" 2>/dev/null || echo '?') across the ping"
}

# record STEP OK|FAIL|SKIP SECONDS [NOTE]
record() {
    local note=${4:-}
    [ "$2" != FAIL ] || note="${note:+$note; }$(link_health)"
    python3 -c 'import json, sys; print(json.dumps({"step": sys.argv[1], "result": sys.argv[2], "duration": float(sys.argv[3]), "note": sys.argv[4]}))' \
        "$1" "$2" "$3" "$note" >>"$log"
    case $2 in
    OK) say "$1: ok (${3} s)${note:+; $note}" ;;
    SKIP) say "$1: SKIPPED: $note" ;;
    *) say "$1: FAILED (${3} s)${note:+; $note}"; any_failed=1 ;;
    esac
}

# run_step STEP COMMAND...: records OK when COMMAND exits 0, else FAIL with its status.
# A step's function may set step_why to say, in the record, why it failed.
run_step() {
    local step=$1 start=$SECONDS status=0
    shift
    say "$step: $*"
    step_why=
    "$@" || status=$?
    if [ "$status" = 0 ]; then record "$step" OK $((SECONDS - start)); else record "$step" FAIL $((SECONDS - start)) "exit $status${step_why:+; $step_why}"; fi
}

# retry SECONDS COMMAND...: runs COMMAND until it succeeds, for SECONDS at most
# (a client whose server is not listening yet fails at once); its last status.
retry() {
    local end=$((SECONDS + $1)) status
    shift
    while :; do
        "$@" && return 0
        status=$?
        [ "$SECONDS" -lt "$end" ] || return "$status"
        echo "multihost[host$me]: retrying in 2 s (exit $status): $*"
        sleep 2
    done
}

# The GID index of this host's address as RoCE v2 (::ffff:a.b.c.d), for ibv_rc_pingpong.
gid_index() {
    local mapped f i
    mapped=$(echo "$RDMAX_HOST_ADDR" | awk -F. '{ printf "ffff:%02x%02x:%02x%02x", $1, $2, $3, $4 }')
    for f in /sys/class/infiniband/"$RDMAX_TEST_DEVICE"/ports/1/gids/*; do
        i=${f##*/}
        grep -q "$mapped\$" "$f" 2>/dev/null || continue
        [ "$(cat /sys/class/infiniband/"$RDMAX_TEST_DEVICE"/ports/1/gid_attrs/types/"$i" 2>/dev/null)" = "RoCE v2" ] || continue
        echo "$i"
        return 0
    done
    return 1
}

# server_client STEP SERVER-COMMAND -- CLIENT-COMMAND: the server on host 0 (with a
# deadline), the client on host 1 (retried until the server listens).
server_client() {
    local step=$1 i
    shift
    local -a server=() client=()
    for ((i = 1; i <= $#; i++)); do [ "${!i}" = -- ] && break; server+=("${!i}"); done
    client=("${@:i+1}")
    if [ "$me" = 0 ]; then
        run_step "$step" timeout 240 "${server[@]}"
    else
        run_step "$step" retry 90 timeout 150 "${client[@]}"
    fi
}

# A program of the examples that may not be built yet: SKIPPED, loudly, if absent.
built() {
    [ -x "$rpc_bin/$2" ] && return 0
    echo "multihost[host$me]: ******** $1 SKIPPED: $rpc_bin/$2 is not built ********"
    record "$1" SKIP 0 "$rpc_bin/$2 is not built"
    return 1
}

say "this is host $me ($RDMAX_HOST_ADDR on $RDMAX_VM_NETDEV), the peer is $RDMAX_PEER_ADDR"

# 1. Plain verbs across the link: proves the two rxe devices reach each other.
if gid=$(gid_index); then
    server_client rdma-pingpong ibv_rc_pingpong -d "$RDMAX_TEST_DEVICE" -g "$gid" -n 20 \
        -- ibv_rc_pingpong -d "$RDMAX_TEST_DEVICE" -g "$gid" -n 20 "$RDMAX_PEER_ADDR"
else
    record rdma-pingpong FAIL 0 "no RoCE v2 GID for $RDMAX_HOST_ADDR on $RDMAX_TEST_DEVICE"
fi

# 2. rdmax's own pingpong (rdma_cm), event mode: spinning starves TCG's CPUs.
server_client rdmax-pingpong "$examples/pingpong" -b "$RDMAX_HOST_ADDR" -p 7470 -n 50 -t 60 -e \
    -- "$examples/pingpong" -p 7470 -n 50 -t 60 -e "$RDMAX_PEER_ADDR"

# 3. The ring allreduce, one rank a host, every result checked by the bench.
run_step allreduce timeout 300 "$bench" -r "$me" -n 2 -H "$RDMAX_HOSTS" -s 4K -S 256K -i 3 -w 1 -t 60 -p 18600

# 4. mpirun with both ranks on host 0: rank and size from the launcher's environment.
mpirun_common=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2)
# shellcheck disable=SC2016 # expanded by the ranks' shell
show_rank='echo "rank $OMPI_COMM_WORLD_RANK of $OMPI_COMM_WORLD_SIZE on $(hostname -I | cut -d" " -f1)"; exec "$@"'
if [ "$me" = 0 ]; then
    run_step mpirun-1host timeout 300 "${mpirun_common[@]}" bash -c "$show_rank" rank \
        "$bench" -a "$RDMAX_HOST_ADDR" -s 4K -S 4K -i 3 -w 1 -t 60 -p 18700
fi

# 5. mpirun across the hosts: orted reaches host 1 through tests/multihost/agent,
# a command server host 1 runs until host 0 says stop (there is no ssh here).
rsh=$here/agent
if [ "$me" = 0 ]; then
    start=$SECONDS
    if retry 100 timeout 20 "$rsh" "$RDMAX_PEER_ADDR" true; then
        run_step mpirun-2host timeout 300 "${mpirun_common[@]}" -H "$RDMAX_HOSTS" \
            --mca plm_rsh_agent "$rsh" bash -c "$show_rank" rank \
            "$bench" -H "$RDMAX_HOSTS" -s 4K -S 4K -i 3 -w 1 -t 60 -p 18800
        # The hierarchical allreduce: 2 ranks a host (slots filled host by
        # host: ranks 0, 1 on host 0), a node team each, the leaders' ring.
        hosts2=$(echo "$RDMAX_HOSTS" | sed 's/,/:2,/; s/$/:2/')
        run_step allreduce-hier timeout 300 "${mpirun_common[@]:0:5}" -np 4 -H "$hosts2" \
            --mca plm_rsh_agent "$rsh" "$examples/allreduce" -H "$RDMAX_HOSTS" -p 18900 \
            -c 65536 -i 3
    else
        record mpirun-2host FAIL $((SECONDS - start)) "host 1's command server never answered"
        record allreduce-hier FAIL $((SECONDS - start)) "host 1's command server never answered"
    fi
    timeout 30 "$rsh" --stop "$RDMAX_PEER_ADDR" || say "could not stop host 1's command server"
else
    # Long enough for host 0's steps 3 to 5; then it gives up by itself.
    run_step mpirun-2host timeout 900 "$rsh" --serve "$RDMAX_HOST_ADDR" --deadline 800
fi

# 6, 7. The RPC examples, where built. The server's deadline (200 s, inside the
# step's 240) covers the client's retries to connect and its whole run: at 60 s
# it cut kv_service's client off mid-run when its 528 calls took 50-80 s (about 6
# s now), and the server now fails when its deadline passes with a client connected.
if built rpc_echo rpc_echo; then
    server_client rpc_echo "$rpc_bin/rpc_echo" --server --addr "$RDMAX_HOST_ADDR" --port 7471 --clients 1 --timeout 200 \
        -- "$rpc_bin/rpc_echo" --connect "$RDMAX_PEER_ADDR" --port 7471 --calls "$calls" --verify
fi
if built kv_service kv_service; then
    server_client kv_service "$rpc_bin/kv_service" --server --addr "$RDMAX_HOST_ADDR" --port 7472 --clients 1 --timeout 200 \
        -- "$rpc_bin/kv_service" --connect "$RDMAX_PEER_ADDR" --port 7472 --ops "$calls" --verify
fi

# 8, 9. The resilience suite's two-host part (docs/resilience.md): its server
# on host 0 (until host 1's last client calls its method 3), its clients on
# host 1, through the device. Keepalive 200 ms / 1 s; the server keeps
# replies 30 s past a connection (linger), longer than the link is down.
res_server=$project/build/tests/resilience_server
res_client=$project/build/tests/resilience_client
out=/run/rdmax-vm
export RDMAX_RPC_LOCAL=0 RDMAX_RPC_KEEPALIVE_MS=200 RDMAX_RPC_KEEPALIVE_TIMEOUT_MS=1000
export RDMAX_RPC_REPLY_CACHE_LINGER_MS=30000 RDMAX_RPC_TIMEOUT_MS=60000
now() { date +%s.%N; }
# poll_until SECONDS COMMAND...: COMMAND every 50 ms until it succeeds; false at the deadline.
poll_until() {
    local end=$((SECONDS + $1))
    shift
    until "$@"; do
        [ "$SECONDS" -lt "$end" ] || return 1
        sleep 0.05
    done
}
# The clients' stdout files (host 1) each have a line matching $1 ... after time $2 (awk).
clients_said() {
    local f
    for f in "${client_outs[@]}"; do grep -q "$1" "$f" || return 1; done
}
# Each client connected again (state ready) and then had an ok call, after time $1.
clients_reconnected_after() {
    local f
    for f in "${client_outs[@]}"; do
        awk -v t="$1" '/state ready at/ && $6 + 0 > t + 0 { ready = $6 + 0 }
            /resumed at/ && ready && $5 + 0 >= ready { found = 1 } END { exit !found }' "$f" || return 1
    done
}
clients_resumed_after() {
    local f
    for f in "${client_outs[@]}"; do
        awk -v t="$1" '/resumed at/ && $5 + 0 > t + 0 { found = 1 } END { exit !found }' "$f" || return 1
    done
}
times_json() { # NAME KEY=VALUE...: host 1's times of a step, for the check on the host
    local name=$1 kv
    shift
    {
        printf '{"kernel": "%s", "commit": "%s", "keepalive_ms": %s, "keepalive_timeout_ms": %s' \
            "$(uname -r)" "$(git -C "$project" rev-parse --short HEAD 2>/dev/null)" \
            "$RDMAX_RPC_KEEPALIVE_MS" "$RDMAX_RPC_KEEPALIVE_TIMEOUT_MS"
        for kv in "$@"; do printf ', "%s": %s' "${kv%%=*}" "${kv#*=}"; done
        echo '}'
    } >"$out/$name-times.json"
}
finish_server() { timeout 120 "$res_client" --addr "$RDMAX_PEER_ADDR" --port "$1" --connect-seconds 60 --finish; }

# resilience-loss (host 1): one client 10 s at each loss, then the server's end.
loss_clients() {
    local loss tag status=0
    modprobe sch_netem 2>/dev/null
    for loss in 0 1 5; do
        tag=$((100 + loss))
        if [ "$loss" = 0 ]; then
            tc qdisc del dev "$RDMAX_VM_NETDEV" root 2>/dev/null
        else
            tc qdisc replace dev "$RDMAX_VM_NETDEV" root netem loss "$loss%" || { status=1; break; }
        fi
        say "resilience-loss: $loss % loss on $RDMAX_VM_NETDEV's egress ($(tc qdisc show dev "$RDMAX_VM_NETDEV" | head -1))"
        local errs=/tmp/loss-client$tag.err s=0
        timeout 150 "$res_client" --addr "$RDMAX_PEER_ADDR" --port 7482 --tag "$tag" --inflight 16 \
            --seconds 10 --connect-seconds 120 --json "$out/loss-client$tag.json" \
            --outcomes "$out/loss-client$tag.outcomes.txt" 2>"$errs" | grep -v progress
        s=${PIPESTATUS[0]} # the client's, not grep's
        cat "$errs" >&2
        if [ "$s" != 0 ]; then
            status=1
            step_why="${step_why:+$step_why; }at $loss % loss the client ended $s: $(tail -n 3 "$errs" | tr '\n' ' ')"
        fi
    done
    tc qdisc del dev "$RDMAX_VM_NETDEV" root 2>/dev/null
    times_json loss
    finish_server 7482 || { status=1; step_why="${step_why:+$step_why; }the server's finish call failed"; }
    return "$status"
}

# resilience-linkdown (host 1): 2 clients; once each has 1000 ok, the link
# goes down for 5 s; once each resumed after it came up, they stop.
linkdown_clients() {
    local c p status=0 t_down t_up scratch
    scratch=$(mktemp -d)
    client_outs=() client_pids=()
    for c in 1 2; do
        timeout 300 "$res_client" --addr "$RDMAX_PEER_ADDR" --port 7481 --tag "$c" --inflight 16 \
            --seconds 240 --connect-seconds 120 --json "$out/linkdown-client$c.json" \
            --outcomes "$out/linkdown-client$c.outcomes.txt" >"$scratch/client$c.out" 2>&1 &
        client_pids+=($!)
        client_outs+=("$scratch/client$c.out")
    done
    if poll_until 180 clients_said "progress 1000 ok"; then
        t_down=$(now)
        ip link set dev "$RDMAX_VM_NETDEV" down
        say "resilience-linkdown: $RDMAX_VM_NETDEV down"
        sleep 5 # the fault's length, not a synchronisation
        ip link set dev "$RDMAX_VM_NETDEV" up
        t_up=$(now)
        say "resilience-linkdown: $RDMAX_VM_NETDEV up"
        # Resumed after the outage began (not after t_up: `ip link set up`
        # returns after the port is active, and a client may resume first).
        poll_until 120 clients_reconnected_after "$(awk -v t="$t_down" 'BEGIN { printf "%.3f", t + 1 }')" || { step_why="a client did not resume within 120 s"; say "resilience-linkdown: $step_why"; status=1; }
        times_json linkdown "t_down=$t_down" "t_up=$t_up"
    else
        step_why="the clients did not reach 1000 ok calls each within 180 s"
        say "resilience-linkdown: $step_why"
        status=1
    fi
    for p in "${client_pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
    for c in 0 1; do
        local s=0
        wait "${client_pids[c]}" || s=$?
        [ "$s" != 0 ] || continue
        status=1
        step_why="${step_why:+$step_why; }client $((c + 1)) ended $s: $(grep -v progress "${client_outs[c]}" | tail -n 2 | tr '\n' ' ')"
    done
    grep -hv progress "${client_outs[@]}"
    rm -rf "$scratch"
    finish_server 7481 || { status=1; step_why="${step_why:+$step_why; }the server's finish call failed"; }
    return "$status"
}

if [ ! -x "$res_server" ] || [ ! -x "$res_client" ]; then
    for step in resilience-loss $([ "$linkdown" != 1 ] || echo resilience-linkdown); do
        echo "multihost[host$me]: ******** $step SKIPPED: build/tests/resilience_{server,client} are not built ********"
        record "$step" SKIP 0 "build/tests/resilience_server or resilience_client is not built"
    done
elif [ "$me" = 0 ]; then
    for spec in loss:7482 $([ "$linkdown" != 1 ] || echo linkdown:7481); do
        run_step "resilience-${spec%%:*}" timeout 300 "$res_server" --addr "$RDMAX_HOST_ADDR" --port "${spec#*:}" \
            --log "$out/${spec%%:*}-executions.txt" --stats "/tmp/${spec%%:*}-stats.json" --deadline 280
    done
else
    run_step resilience-loss loss_clients
    [ "$linkdown" != 1 ] || run_step resilience-linkdown linkdown_clients
fi

# 10. Two rails between the hosts (issue 31): the second link and rxe1 on it,
# then multirail_pair, its server on host 0 and its client on host 1 (which
# waits for the server itself: no retry of the whole run, whose server counts
# the connections it accepts).
rail2_ready() {
    local mapped
    mapped=$(echo "$RDMAX_RAIL2_ADDR" | awk -F. '{ printf "ffff:%02x%02x:%02x%02x", $1, $2, $3, $4 }')
    # grep on the files, not through a pipe: under pipefail, grep -q leaving
    # early would fail a `cat | grep -q`.
    grep -qs ACTIVE /sys/class/infiniband/rxe1/ports/1/state &&
        grep -qs "$mapped\$" /sys/class/infiniband/rxe1/ports/1/gids/*
}
rail2_up() {
    ip link set dev "$RDMAX_VM_NETDEV2" up && rdma link add rxe1 type rxe netdev "$RDMAX_VM_NETDEV2" &&
        poll_until 20 rail2_ready
}
pair=$project/build/tests/multirail_pair
rails="$RDMAX_HOST_ADDR,${RDMAX_RAIL2_ADDR:-}"
rail2_start=$SECONDS
if [ ! -x "$pair" ]; then
    echo "multihost[host$me]: ******** multirail SKIPPED: build/tests/multirail_pair is not built ********"
    record multirail SKIP 0 "build/tests/multirail_pair is not built"
elif [ -z "${RDMAX_VM_NETDEV2:-}" ]; then
    record multirail FAIL 0 "no second link (tests/vm/run gives one with --hosts 2)"
elif ! rail2_up; then
    record multirail FAIL $((SECONDS - rail2_start)) "rxe1 on $RDMAX_VM_NETDEV2 ($RDMAX_RAIL2_ADDR) not ACTIVE with its GID in 20 s"
elif [ "$me" = 0 ]; then
    run_step multirail timeout 240 "$pair" --serve --rails "$rails" --port 7490 --deadline 230
else
    # The peer's addresses in the other order: each rail finds its own by subnet.
    run_step multirail timeout 240 "$pair" --rails "$rails" \
        --peer "$RDMAX_PEER_RAIL2_ADDR,$RDMAX_PEER_ADDR" --port 7490 --netdev "$RDMAX_VM_NETDEV2"
fi

exit "$any_failed"
