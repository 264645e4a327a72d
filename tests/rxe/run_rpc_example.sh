#!/usr/bin/env bash
# An RPC example that runs its server and clients in one process and checks
# every reply itself (exit 0 only when all were right): examples/rpc/
# group_echo, async_kv. SKIP (77) without an ACTIVE RDMA device.
# RDMAX_TEST_ADDR, if set, is the address it listens on.
# Usage: run_rpc_example.sh PROGRAM ARGS...  (ARGS after the address)
set -uo pipefail
if ! grep -qs ACTIVE /sys/class/infiniband/*/ports/*/state; then
    echo "SKIPPED: no ACTIVE RDMA device"
    exit 77
fi
program=$1
shift
exec timeout 150 "$program" "${RDMAX_TEST_ADDR:-auto}" "$@"
