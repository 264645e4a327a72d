#!/usr/bin/env bash
# Commit messages a reader can scan: every commit after $base below (and
# before HEAD) must have a subject, as `git log --oneline` shows it (the
# message's first paragraph), of 1 to 72 characters, not ending in a period.
# Say what the commit does in the imperative; the why, the figures and the
# commands go in a body after a blank line (welcome, not required). History
# up to $base is not rewritten, so it is not checked. Merges are commits too.
#
#   tests/lib/check_commits.sh [REPO [BASE]]   (default: this project, $base)
#
# tests/run calls it first (CI through .ci/run). Exits 0 when every commit
# passes; 1 naming each bad commit (hash and subject), or when BASE is not in
# HEAD's history (a shallow clone checks its commits made after the base); 77 (SKIP) outside
# a git checkout (a release tarball).
set -uo pipefail

# Issue 24's first commit: commits after it are checked. Its commit time
# serves a shallow clone, whose history may not reach it: commits made after
# that time are checked then.
base=87ccfe5189e5fae56e7f195cfbcec7207294d8a5
base_time=1795629619
max=72

repo=${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
base=${2:-$base}
me="check_commits"
# Characters, not bytes, whatever the caller's locale.
export LC_ALL=C.UTF-8

if ! command -v git >/dev/null; then
    echo "SKIP: git is not installed: no commit messages to check"
    exit 77
fi
if ! git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
    echo "SKIP: $repo is not a git checkout: no commit messages to check"
    exit 77
fi
range=("$base..HEAD")
if ! git -C "$repo" cat-file -e "$base^{commit}" 2>/dev/null; then
    if [ "$(git -C "$repo" rev-parse --is-shallow-repository)" != true ]; then
        echo "$me: FAIL: commit $base (the base) is not in this repository's history"
        exit 1
    fi
    # A shallow clone (CI may make one): the commits it has, made after the base.
    echo "$me: a shallow clone without $base: checking its commits made after $(date -u -d "@$base_time" '+%F %T') UTC"
    range=(--since="@$base_time" HEAD)
elif ! git -C "$repo" merge-base --is-ancestor "$base" HEAD; then
    echo "$me: FAIL: commit $base (the base) is not in HEAD's history"
    exit 1
fi

log=$(git -C "$repo" log --format='%h %s' "${range[@]}") || {
    echo "$me: FAIL: git log ${range[*]} failed: nothing could be checked"
    exit 1
}
checked=0 bad=0
while IFS= read -r line; do
    [ -n "$line" ] || continue
    hash=${line%% *} subject=${line#* }
    checked=$((checked + 1))
    trimmed=${subject//[[:space:]]/}
    why=""
    if [ -z "$trimmed" ]; then
        why="an empty subject"
    elif [ ${#subject} -gt $max ]; then
        why="a subject of ${#subject} characters (at most $max; the rest goes in the body)"
    elif [ "${subject%.}" != "$subject" ]; then
        why="a subject that ends in a period"
    fi
    if [ -n "$why" ]; then
        bad=$((bad + 1))
        echo "$me: FAIL: commit $hash has $why: \"$subject\""
    fi
done <<<"$log"

if [ "$bad" -gt 0 ]; then
    echo "$me: $bad of $checked commits after $base need a new message (git rebase -i $base, reword):"
    echo "$me: a subject of at most $max characters, no period at the end, the rest in the body"
    exit 1
fi
echo "$me: ok: $checked commits after $base, every subject 1..$max characters without a final period"
