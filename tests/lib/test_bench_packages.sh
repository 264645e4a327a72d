#!/usr/bin/env bash
# Unit-suite test of what the bench scripts do about the commands they miss
# (tests/lib/packages.sh: rdmax_need, rdmax_want), on a PATH without gnuplot
# and perftest, as in the VM guest (RDMAX_IN_VM=1: nothing may be installed):
#   - rdmax_need exits 1 naming the Debian package (perftest for ib_write_lat)
#     and where to install it; with every command present it returns 0;
#   - rdmax_want returns 1 naming gnuplot-nox and what is skipped;
#   - examples/bench/rpc-bench, against stand-ins for the device and its
#     tools, still writes its figures and summary, says the plot is skipped,
#     and exits 0; its --replot (nothing but the plot) exits 1 naming gnuplot-nox;
#   - where gnuplot is installed, --replot with it writes the PNG.
set -uo pipefail
project=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
failures=0
ok() { echo "ok: $1"; }
bad() {
    echo "FAIL: $1"
    failures=$((failures + 1))
}

# A PATH of this one's commands less gnuplot and perftest's (ib_*).
bare=$scratch/bin
# shellcheck source=bare_path.sh
. "$(dirname "${BASH_SOURCE[0]}")/bare_path.sh"
rdmax_bare_path "$bare" 'gnuplot*' 'ib_*'
PATH=$bare command -v gnuplot >/dev/null && { echo "FAIL: gnuplot still on the bare PATH"; exit 1; }

# expect WHAT STATUS TEXT COMMAND...: COMMAND (on the bare PATH, as in the
# guest) exits STATUS and says TEXT.
expect() {
    local what=$1 want=$2 text=$3 out rc
    shift 3
    out=$(env PATH="$bare" RDMAX_IN_VM=1 "$@" 2>&1)
    rc=$?
    if [ "$rc" = "$want" ] && grep -qF -- "$text" <<<"$out"; then
        ok "$what (exit $rc)"
    else
        bad "$what: exit $rc (want $want, saying \"$text\"):"
        sed 's/^/    /' <<<"$out"
    fi
}
lib=$project/tests/lib/packages.sh
expect "rdmax_need with everything present" 0 "" \
    bash -c '. "$1"; rdmax_need awk sort timeout' - "$lib"
expect "rdmax_need names perftest in the guest" 1 \
    "t: ib_write_lat not found: install on the host, whose programs the VM guest runs: apt-get install -y --no-install-recommends perftest" \
    bash -c 'RDMAX_WHO=t; . "$1"; rdmax_need ib_write_lat awk; echo "went on"' - "$lib"
expect "rdmax_want names gnuplot-nox and goes on" 0 \
    "t: gnuplot not found: no plot (install on the host, whose programs the VM guest runs: apt-get install -y --no-install-recommends gnuplot-nox)" \
    bash -c 'RDMAX_WHO=t; . "$1"; if rdmax_want "no plot" gnuplot; then exit 3; fi' - "$lib"
expect "RDMAX_INSTALL=0 names the package, outside the guest too" 1 \
    "t: gnuplot not found: apt-get install -y --no-install-recommends gnuplot-nox" \
    env RDMAX_IN_VM=0 RDMAX_INSTALL=0 bash -c 'RDMAX_WHO=t; . "$1"; rdmax_need gnuplot' - "$lib"

# Stand-ins: the bench (JSON lines of each transport), perftest's two tools
# (a result line for 64 B), strace -c (a table whose counts grow with -n).
stubs=$scratch/stubs build=$scratch/build
mkdir -p "$stubs" "$build/examples/bench"
cat >"$build/examples/bench/rdmax_rpc_bench" <<'EOF'
#!/usr/bin/env bash
json=/dev/null ks="1 16"
while [ $# -gt 0 ]; do
    case $1 in --json) json=$2; shift 2 ;; --sweep) [ "$2" != latency ] || ks=1; shift 2 ;; *) shift ;; esac
done
: >"$json"
for t in rdmax local sendrecv tcp; do
    for k in $ks; do
        printf '{"kind":"rpc","transport":"%s","bytes":64,"outstanding":%s,"clients":1,"p50_us":%s,"p99_us":90.00,"calls_per_s":%s,"calls":100,"bad":0,"api":"poll"}\n' \
            "$t" "$k" 40.00 $((20000 * (k > 1 ? 2 : 1))) >>"$json"
    done
done
echo "table"
EOF
for t in ib_write_lat ib_send_lat; do
    # The client gets the server's address last (ADDR, 192.0.2.1 by default).
    cat >"$stubs/$t" <<'EOF'
#!/usr/bin/env bash
case ${!#} in
192.0.2.1) echo " 64       1000          14.00          40.00        15.00" ;;
*) echo "Waiting for client to connect..." ;;
esac
EOF
done
cat >"$stubs/strace" <<'EOF'
#!/usr/bin/env bash
o= n=0
while [ $# -gt 0 ]; do case $1 in -o) o=$2; shift 2 ;; -n) n=$2; shift 2 ;; *) shift ;; esac; done
{
    echo "% time     seconds  usecs/call     calls    errors syscall"
    echo "------ ----------- ----------- --------- --------- ----------------"
    printf ' 90.00    0.100000          10 %9d           write\n' $((2 * n + 50))
    printf ' 10.00    0.010000          10 %9d           ioctl\n' 40
    echo "------ ----------- ----------- --------- --------- ----------------"
    printf '100.00    0.110000          10 %9d         0 total\n' $((2 * n + 90))
} >"$o"
EOF
chmod +x "$stubs"/* "$build/examples/bench/rdmax_rpc_bench"

out=$scratch/out
log=$(env PATH="$stubs:$bare" RDMAX_IN_VM=1 BUILD="$build" ROUNDS=1 CALLS=100 RUN_TIMEOUT=30 \
    "$project/examples/bench/rpc-bench" --out "$out" 2>&1)
rc=$?
if [ "$rc" = 0 ] && grep -qF "rpc-bench: gnuplot not found: the figures come out, the plot (rpc.png) does not (install on the host" <<<"$log" &&
    grep -qF "apt-get install -y --no-install-recommends gnuplot-nox" <<<"$log" &&
    grep -q '^64 B echo p50: rdmax 40.0 us; ib_write_lat round trip (2 x 15.00) 30.0 us: ratio 1.33' "$out/rpc-summary.txt" 2>/dev/null &&
    grep -qF '{"write":2.000} = 2.000 in all' "$out/rpc-summary.txt" &&
    grep -q '"kind":"syscalls"' "$out/rpc.json" && [ ! -e "$out/rpc.png" ]; then
    ok "rpc-bench without gnuplot: figures and summary, the plot skipped with its package named (exit 0)"
else
    bad "rpc-bench without gnuplot: exit $rc; its output:"
    sed 's/^/    /' <<<"$log"
    [ ! -f "$out/rpc-summary.txt" ] || sed 's/^/    summary: /' "$out/rpc-summary.txt"
fi
expect "rpc-bench --replot without gnuplot" 1 \
    "rpc-bench: gnuplot not found: install on the host, whose programs the VM guest runs: apt-get install -y --no-install-recommends gnuplot-nox" \
    "$project/examples/bench/rpc-bench" --replot "$out/rpc.json" --out "$scratch/replot"

if command -v gnuplot >/dev/null && gnuplot -e 'set terminal pngcairo' 2>/dev/null; then
    if "$project/examples/bench/rpc-bench" --replot "$out/rpc.json" --out "$scratch/replot" 2>/dev/null &&
        [ -s "$scratch/replot/rpc.png" ]; then
        ok "rpc-bench --replot with gnuplot writes rpc.png"
    else
        bad "rpc-bench --replot with gnuplot wrote no rpc.png"
    fi
else
    echo "note: no gnuplot with pngcairo here: the PNG itself is not tried"
fi

[ "$failures" = 0 ] || { echo "$failures failed"; exit 1; }
echo "all passed"
