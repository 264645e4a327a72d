#!/usr/bin/env bash
# Unit-suite test of run.sh's link_health (a failed multi-host step's note on
# the emulated link), taken out of run.sh and run with stub tools on a PATH
# of its own: a peer that answers, one that does not, a ping that hangs (the
# note still comes, within its deadline), no ping at all (the note says so
# and blames no link), busybox's ping where there is no other (the guests see
# the host's root, which may have busybox-static and not iputils-ping), and no
# RDMAX_VM_NETDEV (no unbound-variable error under set -u).
set -uo pipefail
run_sh=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/run.sh
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
fn=$(sed -n '/^link_health() {/,/^}/p' "$run_sh")
[ -n "$fn" ] || { echo "FAIL: no link_health() in $run_sh"; exit 1; }
# The tools link_health may use besides ping, from the real PATH.
tools=$scratch/tools
mkdir -p "$tools"
for t in cat timeout sleep bash env; do
    p=$(command -v "$t") || { echo "SKIP: no $t"; exit 77; }
    ln -s "$p" "$tools/$t"
done
failures=0
# expect WHAT WANT-TEXT [STUB-NAME STUB-BODY]...: link_health's note, with
# only the stubs named (and the tools) on PATH, within 20 s, says WANT-TEXT.
expect() {
    local what=$1 want=$2 bin out rc start
    shift 2
    bin=$scratch/bin.$RANDOM
    mkdir -p "$bin"
    while [ $# -ge 2 ]; do
        printf '#!%s\n%s\n' "$(command -v bash)" "$2" >"$bin/$1"
        chmod +x "$bin/$1"
        shift 2
    done
    start=$SECONDS
    out=$(PATH="$bin:$tools" RDMAX_PEER_ADDR=198.51.100.2 timeout 20 \
        bash -uo pipefail -c "$fn"$'\n''link_health' 2>&1)
    rc=$?
    if [ "$rc" != 0 ] || ! grep -qF -- "$want" <<<"$out" || [ "$(wc -l <<<"$out")" != 1 ]; then
        echo "FAIL: $what: exit $rc after $((SECONDS - start)) s, want one line saying \"$want\":"
        echo "$out" | head -5
        failures=$((failures + 1))
    else
        echo "ok: $what ($((SECONDS - start)) s): $out"
    fi
}
export RDMAX_VM_NETDEV=eth9
expect "the peer answers" "the peer answers ping" ping 'exit 0'
expect "the peer does not answer" "does NOT answer" ping 'exit 1'
expect "a ping that hangs" "does NOT answer" ping 'exec sleep 600'
expect "no ping at all" "no ping"
# shellcheck disable=SC2016 # the stub's own $1
expect "busybox's ping" "the peer answers ping" busybox '[ "$1" = ping ] || exit 9; exit 0'
unset RDMAX_VM_NETDEV
expect "no RDMAX_VM_NETDEV" "the peer answers ping" ping 'exit 0'
[ "$failures" = 0 ] || { echo "$failures failure(s)"; exit 1; }
