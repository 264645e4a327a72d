# Debian package checks shared by examples/demo, tests/run, tests/vm/run and
# the bench scripts (examples/bench/). Source it, then call
#   rdmax_require MODE PACKAGE...  where MODE is
#     install  install what is missing with apt-get when root, else print the exact
#              apt-get line and exit 1;
#     check    print one line naming what is missing and exit 1;
#   rdmax_need COMMAND...          the commands a script cannot do without: what is
#              not on PATH is installed (its Debian package, as root, not in the VM
#              guest), else named with its package, and the script exits 1;
#   rdmax_want WHAT COMMAND...     the commands of an optional step (a plot): the
#              same, but when they cannot be had it prints one line naming the
#              packages and WHAT is skipped, and returns 1 (the script goes on).
# The VM guest (RDMAX_IN_VM=1) runs the host's programs over a read-only share:
# nothing can be installed there, so the line says to install on the host.
# RDMAX_INSTALL=0 never installs (names the packages only).

# Package sets, named by what needs them. ccache: Meson compiles through it
# where it is installed, so a machine that keeps ~/.cache rebuilds in seconds.
RDMAX_PKGS_BUILD="meson ninja-build ccache g++ pkg-config libibverbs-dev librdmacm-dev libboost-dev libasio-dev libfmt-dev catch2 clang-format-16 clang-tidy-16"
RDMAX_PKGS_RDMA="ibverbs-providers ibverbs-utils rdmacm-utils iproute2"
# The Python bindings (python/) and rdmax-stat's OpenMetrics check (test_stat).
RDMAX_PKGS_PYTHON="python3-dev pybind11-dev python3-mesonpy python3-pytest python3-numpy python3-venv python3-prometheus-client"
# tests/vm/rdma-core: rdma-core from source for the dmabuf suite's provider.
RDMAX_PKGS_VM_RDMA_CORE="cmake ninja-build pkg-config patch libnl-3-dev libnl-route-3-dev libudev-dev"
# tests/run's fuzz suite: clang with libFuzzer and the sanitizer runtimes.
RDMAX_PKGS_FUZZ="clang-16 libclang-rt-16-dev"
RDMAX_PKGS_VM="qemu-system-x86 linux-image-amd64 linux-headers-amd64 busybox-static cpio kmod"
# The VM's other kernels (tests/vm/kernel): unpacked, built in a debootstrap
# root where their gcc is newer than this host's, BTF for their modules (pahole).
RDMAX_PKGS_VM_MATRIX="debootstrap dwarves xz-utils zstd patch"
# The multi-host suite (tests/multihost/run.sh): mpirun in the guests.
RDMAX_PKGS_VM_2HOST="openmpi-bin"
# The bench scripts (examples/bench/): perftest's baselines, strace's counts,
# the plots, jq and python3 for ab-compare. tests/vm/run installs them (as root)
# before it runs one of those scripts in the guest, which cannot install.
RDMAX_PKGS_BENCH="perftest strace gnuplot-nox jq python3 openmpi-bin libopenmpi-dev qperf"

rdmax_missing_packages() {
    local p missing=()
    for p in "$@"; do
        # Not `| grep -q`: under a caller's pipefail, grep leaving early fails the pipe.
        [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = 'install ok installed' ] || missing+=("$p")
    done
    echo "${missing[*]}"
}

# True where apt-get may install here: root, apt-get present, not the VM guest
# (its root is the host's, read-only), not RDMAX_INSTALL=0.
rdmax_can_install() {
    [ "${RDMAX_INSTALL:-1}" != 0 ] && [ "${RDMAX_IN_VM:-0}" != 1 ] && [ "$(id -u)" = 0 ] &&
        command -v apt-get >/dev/null 2>&1
}

# rdmax_apt_install PACKAGE...: apt-get install, updating the lists once if the
# first try fails (a fresh machine may have none). Says what it installs.
rdmax_apt_install() {
    local who=${RDMAX_WHO:-rdmax}
    echo "$who: installing missing Debian packages: $*" >&2
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1; then
        DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null 2>&1
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >&2 || {
            echo "$who: apt-get install failed for: $*" >&2
            return 1
        }
    fi
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
    if [ "$mode" = install ] && rdmax_can_install; then
        # shellcheck disable=SC2086 # one package a word
        rdmax_apt_install $missing || exit 1
        return 0
    fi
    if [ "$mode" = install ]; then
        echo "$who: missing Debian packages; run: sudo apt-get install -y --no-install-recommends $missing" >&2
    else
        echo "$who: missing Debian package(s): $missing (apt-get install $missing)" >&2
    fi
    exit 1
}

# rdmax_tool_package COMMAND: the Debian package that provides COMMAND.
rdmax_tool_package() {
    case $1 in
    ib_*_lat | ib_*_bw) echo perftest ;;
    gnuplot) echo gnuplot-nox ;; # gnuplot without X, with the pngcairo terminal
    awk) echo mawk ;;
    timeout | mktemp | sort | seq | nproc) echo coreutils ;;
    flock | setpriv) echo util-linux ;;
    ss | ip) echo iproute2 ;;
    mpirun) echo openmpi-bin ;;
    mpicc) echo libopenmpi-dev ;; # mpi.h and the wrapper; mpirun comes with it
    *) echo "$1" ;; # strace, jq, python3, ...
    esac
}

# rdmax_missing_tools COMMAND...: "COMMAND:PACKAGE ..." of those not on PATH.
rdmax_missing_tools() {
    local t out=()
    for t in "$@"; do
        command -v "$t" >/dev/null 2>&1 || out+=("$t:$(rdmax_tool_package "$t")")
    done
    echo "${out[*]}"
}

# rdmax_get_tools COMMAND...: installs the packages of the commands missing
# where it may; prints "COMMANDS<TAB>PACKAGES" of what is still missing.
rdmax_get_tools() {
    local missing tools=() pkgs=() m
    missing=$(rdmax_missing_tools "$@")
    if [ -n "$missing" ] && rdmax_can_install; then
        for m in $missing; do pkgs+=("${m#*:}"); done
        # shellcheck disable=SC2046 # one package a word, each once
        rdmax_apt_install $(printf '%s\n' "${pkgs[@]}" | sort -u) >&2 || true
        hash -r
        missing=$(rdmax_missing_tools "$@")
    fi
    pkgs=()
    for m in $missing; do tools+=("${m%%:*}") pkgs+=("${m#*:}"); done
    printf '%s\t%s\n' "${tools[*]}" "$(printf '%s\n' "${pkgs[@]}" | sort -u | xargs)"
}

# The advice for packages that could not be installed here.
rdmax_install_hint() {
    if [ "${RDMAX_IN_VM:-0}" = 1 ]; then
        echo "install on the host, whose programs the VM guest runs: apt-get install -y --no-install-recommends $1"
    else
        echo "apt-get install -y --no-install-recommends $1"
    fi
}

rdmax_need() {
    local who=${RDMAX_WHO:-rdmax} r
    r=$(rdmax_get_tools "$@")
    [ -n "${r%%$'\t'*}" ] || return 0
    echo "$who: ${r%%$'\t'*} not found: $(rdmax_install_hint "${r#*$'\t'}")" >&2
    exit 1
}

rdmax_want() {
    local who=${RDMAX_WHO:-rdmax} what=$1 r
    shift
    r=$(rdmax_get_tools "$@")
    [ -n "${r%%$'\t'*}" ] || return 0
    echo "$who: ${r%%$'\t'*} not found: $what ($(rdmax_install_hint "${r#*$'\t'}"))" >&2
    return 1
}
