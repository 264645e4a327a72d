# Debian package checks shared by examples/demo, tests/run and tests/vm/run.
# Source it, then call rdmax_require MODE PACKAGE... where MODE is
#   install  install what is missing with apt-get when root, else print the exact
#            apt-get line and exit 1;
#   check    print one line naming what is missing and exit 1.

# Package sets, named by what needs them.
RDMAX_PKGS_BUILD="meson ninja-build g++ pkg-config libibverbs-dev librdmacm-dev libboost-dev libasio-dev libfmt-dev catch2 clang-format-16 clang-tidy-16"
RDMAX_PKGS_RDMA="ibverbs-providers ibverbs-utils rdmacm-utils iproute2"
# tests/run's fuzz suite: clang with libFuzzer and the sanitizer runtimes.
RDMAX_PKGS_FUZZ="clang-16 libclang-rt-16-dev"
RDMAX_PKGS_VM="qemu-system-x86 linux-image-amd64 linux-headers-amd64 busybox-static cpio kmod"
# The VM's other kernels (tests/vm/kernel): unpacked, built in a debootstrap
# root where their gcc is newer than this host's, BTF for their modules (pahole).
RDMAX_PKGS_VM_MATRIX="debootstrap dwarves xz-utils zstd patch"
# The multi-host suite (tests/multihost/run.sh): mpirun in the guests.
RDMAX_PKGS_VM_2HOST="openmpi-bin"

rdmax_missing_packages() {
    local p missing=()
    for p in "$@"; do
        # Not `| grep -q`: under a caller's pipefail, grep leaving early fails the pipe.
        [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = 'install ok installed' ] || missing+=("$p")
    done
    echo "${missing[*]}"
}

rdmax_require() {
    local mode=$1; shift
    local who=${RDMAX_WHO:-rdmax}
    if ! command -v dpkg-query >/dev/null 2>&1; then
        return 0 # not Debian: let the build say what it lacks
    fi
    local missing
    missing=$(rdmax_missing_packages "$@")
    [ -z "$missing" ] && return 0
    if [ "$mode" = install ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "$who: installing missing Debian packages: $missing" >&2
        # A fresh machine may have no package lists yet; update once, then install.
        # shellcheck disable=SC2086
        if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing >/dev/null 2>&1; then
            DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null 2>&1
            # shellcheck disable=SC2086
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing >&2 || {
                echo "$who: apt-get install failed for: $missing" >&2
                exit 1
            }
        fi
        return 0
    fi
    if [ "$mode" = install ]; then
        echo "$who: missing Debian packages; run: sudo apt-get install -y --no-install-recommends $missing" >&2
    else
        echo "$who: missing Debian package(s): $missing (apt-get install $missing)" >&2
    fi
    exit 1
}
