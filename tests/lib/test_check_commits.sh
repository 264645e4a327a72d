#!/usr/bin/env bash
# Unit-suite test of check_commits.sh in a scratch repository: subjects of
# 72 characters (ASCII and multi-byte) and bodies pass; 73 characters, a
# first paragraph wrapped onto two lines, a final period and an empty
# subject fail, each naming the commit; a base outside HEAD's history fails;
# a directory that is no git checkout is a SKIP (77). SKIP without git.
set -uo pipefail
check=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/check_commits.sh
command -v git >/dev/null || { echo "SKIP: no git"; exit 77; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# Never the caller's repository: a git hook exports these, and every command
# below would then act on it.
unset GIT_DIR GIT_WORK_TREE GIT_INDEX_FILE GIT_OBJECT_DIRECTORY GIT_COMMON_DIR \
    GIT_ALTERNATE_OBJECT_DIRECTORIES
export GIT_CEILING_DIRECTORIES=$scratch
export GIT_AUTHOR_NAME=t GIT_AUTHOR_EMAIL=t@example.org GIT_COMMITTER_NAME=t \
    GIT_COMMITTER_EMAIL=t@example.org GIT_CONFIG_NOSYSTEM=1 HOME=$scratch
repo=$scratch/repo
git init -q "$repo" || exit 1
commit() { git -C "$repo" commit -q --allow-empty --allow-empty-message "$@"; }
failures=0
# expect STATUS WHAT [TEXT]: check_commits on the scratch repo against its
# base exits STATUS (and says TEXT).
expect() {
    local want=$1 what=$2 text=${3:-} out rc
    out=$("$check" "$repo" "$base" 2>&1)
    rc=$?
    if [ "$rc" != "$want" ] || { [ -n "$text" ] && ! grep -qF -- "$text" <<<"$out"; }; then
        echo "FAIL: $what: exit $rc (want $want${text:+, saying \"$text\"}):"
        echo "$out"
        failures=$((failures + 1))
    else
        echo "ok: $what (exit $rc)"
    fi
}
x72=$(printf 'x%.0s' $(seq 72))
commit -m "An old subject that is far too long for the rule but comes before the base of the check."
commit -m "Base"
base=$(git -C "$repo" rev-parse --short HEAD)
commit -m "Add a thing" -m "Why, with figures."
commit -m "$x72"
commit -m "Zähle Zeichen, nicht Bytes: $(printf 'é%.0s' $(seq 44))"
expect 0 "subjects of at most 72 characters after the base" "3 commits after"
bad_commit() { # bad_commit WHAT TEXT GIT-COMMIT-ARGS...: one bad commit, then undone
    local what=$1 text=$2
    shift 2
    commit "$@"
    expect 1 "$what" "commit $(git -C "$repo" rev-parse --short HEAD) has $text"
    git -C "$repo" reset -q --hard HEAD~1
}
bad_commit "a subject of 73 characters" "a subject of 73 characters" -m "${x72}y"
bad_commit "a first paragraph on two lines" "a subject of" -m "Subject line one
that runs on without a blank line, so git log shows it as one subject"
bad_commit "a subject with a final period" "a subject that ends in a period" -m "Add a thing."
bad_commit "an empty subject" "an empty subject" -m ""
git -C "$repo" checkout -q --orphan other
commit -m "Elsewhere"
expect 1 "a base that is not in HEAD's history" "is not in HEAD's history"
mkdir "$scratch/plain"
out=$("$check" "$scratch/plain" "$base" 2>&1)
rc=$?
if [ "$rc" = 77 ]; then echo "ok: not a git checkout (SKIP)"; else
    echo "FAIL: not a git checkout: exit $rc, want 77: $out"
    failures=$((failures + 1))
fi
[ "$failures" = 0 ] || exit 1
