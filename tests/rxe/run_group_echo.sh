#!/usr/bin/env bash
# examples/rpc/group_echo: a server_group of 2 workers, 4 clients on their
# own threads, 300 calls each, every reply checked by the example (exit 0
# only when all were right). SKIP (77) without an ACTIVE RDMA device.
# RDMAX_TEST_ADDR, if set, is the address it listens on.
# Usage: run_group_echo.sh GROUP_ECHO
set -uo pipefail
if ! grep -qs ACTIVE /sys/class/infiniband/*/ports/*/state; then
    echo "SKIPPED: no ACTIVE RDMA device"
    exit 77
fi
exec timeout 150 "$1" "${RDMAX_TEST_ADDR:-auto}" 2 4 300
