#!/usr/bin/env bash
# Unit-suite check that README.md stays short enough to read: at most 250
# lines (every line counts, the knob table's too). What does not fit goes to
# docs/: measurement detail to the benchmark pages, with its commit, kernel
# and command.
#   tests/lib/check_readme.sh [FILE [MAX]]   (default: this project's README.md, 250)
set -u
file=${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/README.md}
max=${2:-250}
[ -r "$file" ] || { echo "FAIL: cannot read $file"; exit 1; }
# awk counts a last line without a newline too (wc -l would not).
lines=$(awk 'END { print NR }' "$file") || { echo "FAIL: awk could not count $file"; exit 1; }
case $lines in '' | *[!0-9]*) echo "FAIL: no line count for $file ('$lines')"; exit 1 ;; esac
if [ "$lines" -gt "$max" ]; then
    echo "FAIL: $file has $lines lines, more than $max: move detail to docs/ (measurement"
    echo "detail to its benchmark page, with the commit, kernel and command of each figure)"
    exit 1
fi
echo "ok: $file has $lines lines (at most $max)"
