# Builds an out-of-tree kernel module, for kmod/build and tests/vm/kernel.
# Source it, then: rdmax_kbuild KDIR BUILD_ROOT SRC_DIR...
# copies SRC_DIRs' files into a scratch tree (inside BUILD_ROOT, a chroot with
# the compiler the kernel's headers need, when that is not empty), runs
# make -C KDIR M=tree W=1 modules there, and prints the scratch tree's path
# on stdout; the caller copies the .ko out and removes the tree. Make variables
# for the module's Kbuild (NAME=VALUE ...) come from RDMAX_KBUILD_VARS.
rdmax_kbuild() {
    local kdir=$1 root=$2 tree
    shift 2
    tree=$(mktemp -d "$root/tmp/rdmax-kbuild.XXXXXX") || return 1
    cp -r "$@" "$tree/" || return 1
    # W=1: extra warnings too (the rdmax module's Kbuild makes them errors).
    local args=(-s -C "$kdir" M="${tree#"$root"}" W=1)
    # shellcheck disable=SC2206 # NAME=VALUE words, split on purpose
    args+=(${RDMAX_KBUILD_VARS:-} modules)
    if [ -n "$root" ]; then
        # objtool reads /proc: mount one inside the chroot, in a mount namespace
        # of its own so that nothing stays mounted after make.
        unshare --mount --fork sh -c 'mount -t proc proc "$0/proc" && exec chroot "$0" make "$@"' \
            "$root" "${args[@]}" >&2
    else
        make "${args[@]}" >&2
    fi 2> >(grep -v "Skipping BTF generation" >&2) || { rm -rf "$tree"; return 1; }
    echo "$tree"
}
