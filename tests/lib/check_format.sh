#!/usr/bin/env bash
# Unit-suite check that every C++ source follows .clang-format, with the
# formatter version the project is pinned to (clang-format-16, Debian 12's
# newest: older ones mangle C++20 requires-clauses). SKIP (77) where it is
# not installed; the file list comes from git when available.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
fmt=${CLANG_FORMAT:-clang-format-16}
command -v "$fmt" >/dev/null 2>&1 || { echo "SKIP: $fmt is not installed (apt-get install clang-format-16)"; exit 77; }
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    mapfile -t files < <(git ls-files --cached --others --exclude-standard '*.cpp' '*.hpp' '*.h' '*.c' | grep -v '^subprojects/')
else
    mapfile -t files < <(find include src examples tests kmod -name '*.[ch]pp' -o -name '*.[ch]' 2>/dev/null)
fi
bad=0
for f in "${files[@]}"; do
    [ -f "$f" ] || continue
    if ! "$fmt" --dry-run -Werror "$f" >/dev/null 2>&1; then
        echo "not formatted: $f (run: $fmt -i $f)"
        bad=1
    fi
done
[ "$bad" = 0 ] && echo "ok: ${#files[@]} files follow .clang-format"
exit "$bad"
