#!/usr/bin/env bash
# Suite tidy: clang-tidy-16 with the project's .clang-tidy over every
# translation unit in BUILD-DIR's compile_commands.json (the library, its
# examples and its tests; the fuzz targets build elsewhere). Any finding fails.
# SKIP (77) where clang-tidy-16 is not installed.
#   check_tidy.sh BUILD-DIR SOURCE-DIR
set -uo pipefail
build=$1 source=$2
tidy=${CLANG_TIDY:-clang-tidy-16}
runner=${RUN_CLANG_TIDY:-run-clang-tidy-16}
command -v "$tidy" >/dev/null 2>&1 && command -v "$runner" >/dev/null 2>&1 ||
    { echo "SKIP: $tidy / $runner are not installed (apt-get install clang-tidy-16)"; exit 77; }
cd "$source" || exit 1
out=$(mktemp) db=$(mktemp -d)
trap 'rm -rf "$out" "$db"' EXIT
# Each source once (a file built into several programs, test_rpc.cpp with other
# defines, is checked under its first command only: a unit takes ~6 s), and only
# the units not found clean before with the same inputs (tests/lib/tidy_cache.py).
python3 tests/lib/tidy_cache.py select "$build" "$build/compile_commands.json" \
    "$db/compile_commands.json" "$db/keys" "$source" "$("$tidy" --version | tr -s ' \n' ' ')" ||
    exit 1
# -quiet: only findings; the .clang-tidy at the top is found from each file.
status=0
if [ -s "$db/compile_commands.json" ] && [ "$(cat "$db/compile_commands.json")" != "[]" ]; then
    "$runner" -clang-tidy-binary "$(command -v "$tidy")" -p "$db" -j "$(nproc)" -quiet \
        >"$out" 2>&1
    status=$?
fi
findings=$(grep -cE '(warning|error): ' "$out")
if [ "$status" -ne 0 ] || [ "$findings" -ne 0 ]; then
    grep -E -A3 '(warning|error): ' "$out" | head -200
    echo "FAIL: clang-tidy reported $findings finding(s) (exit $status)"
    exit 1
fi
python3 tests/lib/tidy_cache.py mark "$db/keys"
echo "ok: $(python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))))' "$db/compile_commands.json") translation units checked, all meet .clang-tidy"
