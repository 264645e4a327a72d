#!/usr/bin/env bash
# Unit-suite test of examples/bench/allreduce-vs-mpi's options, on a PATH
# without MPI, qperf and gnuplot, as in the VM guest (RDMAX_IN_VM=1: nothing
# is installed), so that nothing past the options can run:
#   - an option that would do nothing is refused with the usage (exit 2)
#     before anything starts: --wait or --algo without --hosts 2, -n other
#     than 2 or --window with --hosts 2, an unknown --wait or --algo;
#   - the usage names every option, --algo and --wait included.
set -uo pipefail
project=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
script=$project/examples/bench/allreduce-vs-mpi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
failures=0

bare=$scratch/bin
# shellcheck source=bare_path.sh
. "$(dirname "${BASH_SOURCE[0]}")/bare_path.sh"
rdmax_bare_path "$bare" mpirun mpicc mpiexec qperf 'gnuplot*'

# expect WHAT STATUS TEXT ARGS...: the script with ARGS exits STATUS saying TEXT.
expect() {
    local what=$1 want=$2 text=$3 out rc
    shift 3
    out=$(cd "$scratch" && env PATH="$bare" RDMAX_IN_VM=1 RDMAX_INSTALL=0 timeout 30 "$script" "$@" 2>&1)
    rc=$?
    if [ "$rc" = "$want" ] && grep -qF -- "$text" <<<"$out"; then
        echo "ok: $what (exit $rc)"
    else
        echo "FAIL: $what: exit $rc (want $want, saying \"$text\"):"
        sed 's/^/    /' <<<"$out"
        failures=$((failures + 1))
    fi
}

expect "the usage names --algo" 2 "--algo ALGO with --hosts 2" --help
expect "the usage names --wait" 2 "--wait HOW  with --hosts 2" --help
expect "--wait alone is refused" 2 "--wait and --algo go with --hosts 2" --wait spin
expect "--algo alone is refused" 2 "--wait and --algo go with --hosts 2" --algo ring
expect "--hosts 2 -n 4 is refused" 2 "--hosts 2 runs 2 ranks" --hosts 2 -n 4
expect "--hosts 2 --window is refused" 2 "--window is node_team's" --hosts 2 --window
expect "an unknown --algo is refused" 2 "--algo tree: ring, doubling or auto" --hosts 2 --algo tree
expect "an unknown --wait is refused" 2 "--wait busy: block, spin, hybrid or yield" --hosts 2 --wait busy
# Past the options: the first missing command is named (nothing installed).
expect "--hosts 2 -n 2 goes on" 1 "mpirun mpicc not found" --hosts 2 -n 2 --algo ring --wait hybrid

[ "$failures" = 0 ] || { echo "$failures failed"; exit 1; }
