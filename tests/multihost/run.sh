#!/usr/bin/env bash
# The multi-host suite: RDMA between two soft-RoCE guests joined by an emulated
# link (tests/vm/run --hosts 2; docs/vm.md, docs/testing.md).
#
#   tests/multihost/run.sh           boots the two guests, runs the steps below in
#                                    both, and writes one meson-style test log
#   tests/multihost/run.sh --guest   one guest's side (what the line above runs there)
#
# Steps (host 0 is 10.0.0.1, host 1 is 10.0.0.2):
#   rdma-pingpong   ibv_rc_pingpong, host 1 to host 0 (plain verbs, RoCE v2 GID)
#   rdmax-pingpong  build/examples/pingpong, host 1 to host 0 (rdma_cm)
#   allreduce       rdmax_allreduce_bench, rank 0 on host 0, rank 1 on host 1 (-H),
#                   every mode, 4 KiB to 64 KiB, every element checked
#   mpirun-1host    mpirun -np 2 on host 0: both ranks there, rank and size from
#                   OMPI_COMM_WORLD_* alone (no -r, -n)
#   mpirun-2host    mpirun -np 2 -H 10.0.0.1,10.0.0.2 on host 0, one rank a host,
#                   orted started on host 1 through tests/multihost/agent (no ssh)
#   rpc_echo        build/examples/rpc_echo, server on host 0, client on host 1
#   kv_service      build/examples/kv_service, likewise
# A program that is not built is SKIPPED, said loudly, never passed.
#
# Knobs: RDMAX_VM_RESULTS (where the log goes; default build/test-results/vm-2host),
# RDMAX_VM_TIMEOUT (each guest's deadline; default 900 s), RDMAX_MULTIHOST_CALLS
# (rpc_echo calls and kv_service operations; default 200: TCG is slow),
# RDMAX_MULTIHOST_BIN (where rpc_echo and kv_service are; default build/examples).
# The log, RESULTS/testlog.json, has one record a step ("rdmax:multihost / STEP"),
# OK only when every host that runs the step succeeded; tests/run counts it.
# Exit status: 0 when no step failed.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
project=$(cd "$here/../.." && pwd)
cd "$project" || exit 1

# Which hosts run each step: the host side expects a record from each.
steps="rdma-pingpong:0,1 rdmax-pingpong:0,1 allreduce:0,1 mpirun-1host:0 mpirun-2host:0,1 rpc_echo:0,1 kv_service:0,1"

if [ "${1:-}" != --guest ]; then
    [ $# -eq 0 ] || { sed -n '2,28p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }
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
    python3 - "$results" "$vm_status" "$steps" <<'EOF'
import json, os, sys

results, vm_status, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
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
    failed += result == "FAIL"
    out.append({"name": f"rdmax:multihost / {step}", "result": result, "duration": duration})
    shown = "SKIPPED" if result == "SKIP" else result
    print(f"  {step:<15} {shown:<8} {'; '.join(notes)}")
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

# record STEP OK|FAIL|SKIP SECONDS [NOTE]
record() {
    local note=${4:-}
    python3 -c 'import json, sys; print(json.dumps({"step": sys.argv[1], "result": sys.argv[2], "duration": float(sys.argv[3]), "note": sys.argv[4]}))' \
        "$1" "$2" "$3" "$note" >>"$log"
    case $2 in
    OK) say "$1: ok (${3} s)${note:+; $note}" ;;
    SKIP) say "$1: SKIPPED: $note" ;;
    *) say "$1: FAILED (${3} s)${note:+; $note}"; any_failed=1 ;;
    esac
}

# run_step STEP COMMAND...: records OK when COMMAND exits 0, else FAIL with its status.
run_step() {
    local step=$1 start=$SECONDS status=0
    shift
    say "$step: $*"
    "$@" || status=$?
    if [ "$status" = 0 ]; then record "$step" OK $((SECONDS - start)); else record "$step" FAIL $((SECONDS - start)) "exit $status"; fi
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
run_step allreduce timeout 300 "$bench" -r "$me" -n 2 -H "$RDMAX_HOSTS" -s 4K -S 64K -i 3 -w 1 -t 60 -p 18600

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
    else
        record mpirun-2host FAIL $((SECONDS - start)) "host 1's command server never answered"
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

exit "$any_failed"
