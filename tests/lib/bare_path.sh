# shellcheck shell=bash
# Sourced by the tests of the bench scripts (test_bench_packages.sh,
# test_allreduce_vs_mpi.sh): a PATH that lacks some commands, to show what a
# script does on a machine without them.
#
#   rdmax_bare_path DIR PATTERN...   links into DIR (made) every command on
#                                    $PATH whose name matches none of the
#                                    glob PATTERNs; the first of a name wins
rdmax_bare_path() {
    local dir=$1 d f n p skip
    shift
    mkdir -p "$dir"
    local dirs
    IFS=: read -r -a dirs <<<"$PATH"
    for d in "${dirs[@]}"; do
        for f in "$d"/*; do
            n=${f##*/} skip=0
            for p in "$@"; do
                # shellcheck disable=SC2053 # the pattern is a glob on purpose
                [[ $n == $p ]] && skip=1
            done
            [ "$skip" = 0 ] && [ -x "$f" ] && [ ! -d "$f" ] && [ ! -e "$dir/$n" ] && ln -s "$f" "$dir/$n"
        done
    done
    return 0
}
