#!/usr/bin/env bash
# The RPC hello of examples/rpc: hello_server started, its "serving on
# ADDR:PORT" line awaited (30 s), hello_client run against that address
# (60 s), and its one line of output checked: "hello, rdmax (through the RDMA
# device)", or "(through this node's memory)" where RDMAX_RPC_LOCAL is not 0.
# The server must still be serving afterwards. Without an ACTIVE RDMA device
# both programs run with none (the server on 127.0.0.1, this node's clients
# only: the README's hello on a machine without RDMA); RDMAX_RPC_LOCAL=0 then
# SKIPs (77): it needs the device. RDMAX_TEST_ADDR, if set, is the address the
# server listens on.
# Usage: run_hello.sh HELLO_SERVER HELLO_CLIENT
set -uo pipefail
server_bin=$1 client_bin=$2
if ! grep -qs ACTIVE /sys/class/infiniband/*/ports/*/state && [ "${RDMAX_RPC_LOCAL:-1}" = 0 ]; then
    echo "SKIPPED: no ACTIVE RDMA device, and RDMAX_RPC_LOCAL=0 asks for the device"
    exit 77
fi
if [ "${RDMAX_RPC_LOCAL:-1}" = 0 ]; then path="through the RDMA device"; else path="through this node's memory"; fi
# Yama's ptrace_scope 2 or 3 refuses the node-local path's CMA: the client
# then goes through the device, rightly; nothing node-local to show here.
if [ "${RDMAX_RPC_LOCAL:-1}" != 0 ] && [ "$(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo 0)" -ge 2 ]; then
    echo "SKIPPED: Yama ptrace_scope >= 2 refuses the node-local path"
    exit 77
fi
scratch=$(mktemp -d)
errlog=$scratch/stderr
# The server's stdout comes through a FIFO, read a line at a time with a
# deadline; its stderr goes to errlog, shown on failure. timeout bounds it.
mkfifo "$scratch/stdout"
timeout 180 "$server_bin" ${RDMAX_TEST_ADDR:+"$RDMAX_TEST_ADDR"} >"$scratch/stdout" 2>"$errlog" &
server_pid=$!
exec {from_server}<"$scratch/stdout"
cleanup() {
    kill "$server_pid" 2>/dev/null
    wait "$server_pid" 2>/dev/null
    rm -rf "$scratch"
}
trap cleanup EXIT
fail() {
    echo "FAIL: $*"
    echo "--- hello_server's stderr:"
    cat "$errlog"
    exit 1
}

at="" deadline=$((SECONDS + 30))
while [ -z "$at" ] && [ $SECONDS -lt $deadline ]; do
    IFS= read -r -t $((deadline - SECONDS)) -u "$from_server" line || break
    echo "server: $line"
    at=$(sed -n 's/^hello_server: serving on \([^ ]*\):[0-9]*\( .*\)\{0,1\}$/\1/p' <<<"$line")
done
[ -n "$at" ] || fail "hello_server did not say it serves within 30 s"

out=$(timeout 60 "$client_bin" "$at" rdmax 2>&1)
rc=$?
echo "client (exit $rc): $out"
[ "$rc" = 0 ] || fail "hello_client exited with $rc"
[ "$out" = "hello, rdmax ($path)" ] || fail "hello_client printed '$out', not 'hello, rdmax ($path)'"
kill -0 "$server_pid" 2>/dev/null || fail "hello_server is no longer running"
echo "PASS: hello, rdmax ($path)"
