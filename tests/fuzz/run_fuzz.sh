#!/usr/bin/env bash
# The fuzz suite's test: runs a libFuzzer target for RDMAX_FUZZ_SECONDS
# (default 60) and fails on any crash, leak or broken invariant. With 0 it
# only runs the corpus it has (the seeds and what earlier runs found) once.
# Usage: run_fuzz.sh FUZZER SEED_CORPUS WORK_DIR
# The fuzzer adds what it finds to WORK_DIR/corpus (in the build directory,
# so the committed seeds stay as they are) and writes a crashing input to
# WORK_DIR/artifacts/; rerun one with: FUZZER ARTIFACT.
set -u
fuzzer=$1 seeds=$2 work=$3
secs=${RDMAX_FUZZ_SECONDS:-60}
case $secs in
'' | *[!0-9]*) echo "RDMAX_FUZZ_SECONDS must be a whole number of seconds, not '$secs'"; exit 2 ;;
esac
mkdir -p "$work/corpus" "$work/artifacts"
name=$(basename "$fuzzer")
touch "$work/started" # to tell this run's artifacts from earlier ones
budget=(-max_total_time="$secs")
[ "$secs" = 0 ] && budget=(-runs=0) # libFuzzer reads -max_total_time=0 as "no limit"
# -max_total_time is the budget; -timeout=10 fails one input that hangs;
# the outer timeout is the deadline should the fuzzer itself stop honouring
# either (meson's own test timeout is the last resort).
# -error_exitcode: libFuzzer's default, 77, is what meson reads as SKIP.
timeout --kill-after=10 $((secs + 60)) "$fuzzer" "${budget[@]}" -timeout=10 -error_exitcode=1 \
    -max_len=4096 -print_final_stats=1 -artifact_prefix="$work/artifacts/$name-" \
    "$work/corpus" "$seeds"
rc=$?
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "$name: still running $((secs + 60)) s into a ${secs} s budget: killed"
elif [ "$rc" != 0 ]; then
    echo "$name: failed (exit $rc); inputs that crashed it:"
    find "$work/artifacts" -name "$name-*" -newer "$work/started" -print 2>/dev/null
    echo "reproduce with: $fuzzer ARTIFACT"
fi
# Never 77 (SKIP) for a failure, whoever returned it.
[ "$rc" = 77 ] && rc=1
exit "$rc"
