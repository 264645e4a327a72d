#!/bin/bash
# Runs inside the test VM, as root in the host's root filesystem (overlaid, so
# writable). Brings up soft-RoCE on a dummy netdev (or, as one of two hosts, on
# the emulated NIC joining it to the other: RDMAX_VM_NIC), loads the rdmax module when
# one has been built for this kernel, then runs the job the host wrote and
# leaves its exit status in the results share.
set -u
results=/run/rdmax-vm
# shellcheck source=/dev/null
. "$results/env"

step() { "$@" >"$results/setup.log" 2>&1 || { echo "rdmax-vm: setup failed: $*"; cat "$results/setup.log"; echo 125 >"$results/status"; exit 125; }; }

# A kernel from tests/vm/kernel's cache: its modules, where modprobe looks.
if [ -n "${RDMAX_VM_MODULES:-}" ]; then
    step mkdir -p "/lib/modules/$(uname -r)"
    step mount --bind "$RDMAX_VM_MODULES" "/lib/modules/$(uname -r)"
fi

# Runs "$@" until it succeeds, for 5 s at most; its status at the deadline.
wait_until() {
    for _ in $(seq 50); do
        "$@" && return 0
        sleep 0.1
    done
    "$@"
}
not_ready() { echo "rdmax-vm: $1"; echo 125 >"$results/status"; exit 125; }

ip link set lo up
# A host name (the kernel's is "(none)", which Open MPI's mpirun refuses), known
# to /etc/hosts (the overlay's copy): rdmax-vm, or rdmax-host0/1 for two hosts.
vm_hostname=rdmax-vm
[ -z "${RDMAX_HOST_INDEX:-}" ] || vm_hostname=rdmax-host$RDMAX_HOST_INDEX
step hostname "$vm_hostname"
if [ -n "${RDMAX_HOSTS:-}" ]; then
    i=0
    for a in ${RDMAX_HOSTS//,/ }; do echo "$a rdmax-host$i" >>/etc/hosts; i=$((i + 1)); done
else
    echo "$RDMAX_TEST_ADDR $vm_hostname" >>/etc/hosts
fi
if [ -n "${RDMAX_VM_NIC:-}" ]; then
    # One of two hosts (tests/vm/run --hosts 2): the NIC with the MAC the host
    # gave it carries the link to the other guest. No udev here: load its driver
    # (built in on some kernels) and find the interface by its MAC.
    case $RDMAX_VM_NIC in
    virtio) driver=virtio_net driver_dir=/sys/bus/virtio/drivers/virtio_net ;;
    *) driver=$RDMAX_VM_NIC driver_dir=/sys/bus/pci/drivers/$RDMAX_VM_NIC ;;
    esac
    modprobe "$driver" >"$results/setup.log" 2>&1 || [ -d "$driver_dir" ] ||
        { echo "rdmax-vm: setup failed: modprobe $driver"; cat "$results/setup.log"; echo 125 >"$results/status"; exit 125; }
    netdev_by_mac() { # MAC
        local d
        for d in /sys/class/net/*; do
            [ "$(cat "$d/address" 2>/dev/null)" = "$1" ] && { basename "$d"; return 0; }
        done
        return 1
    }
    wait_until netdev_by_mac "$RDMAX_VM_MAC" >/dev/null || not_ready "no network interface with MAC $RDMAX_VM_MAC"
    RDMAX_VM_NETDEV=$(netdev_by_mac "$RDMAX_VM_MAC")
    export RDMAX_VM_NETDEV
    if [ -n "${RDMAX_VM_MAC2:-}" ]; then
        # The second link (the multirail step's): its address now, the link
        # and its soft-RoCE device only when a job brings them up.
        wait_until netdev_by_mac "$RDMAX_VM_MAC2" >/dev/null || not_ready "no network interface with MAC $RDMAX_VM_MAC2"
        RDMAX_VM_NETDEV2=$(netdev_by_mac "$RDMAX_VM_MAC2")
        export RDMAX_VM_NETDEV2
        step ip addr add "$RDMAX_RAIL2_ADDR/24" dev "$RDMAX_VM_NETDEV2"
    fi
else
    step modprobe dummy numdummies=0
    step ip link add "$RDMAX_VM_NETDEV" type dummy
fi
step ip addr add "$RDMAX_TEST_ADDR/24" dev "$RDMAX_VM_NETDEV"
step ip link set "$RDMAX_VM_NETDEV" up
if [ -n "${RDMAX_VM_RXE_MODULE:-}" ]; then
    # soft-RoCE rebuilt with tests/vm/patches (tests/vm/kernel says why).
    for dep in $(modinfo -F depends "$RDMAX_VM_RXE_MODULE" | tr , ' '); do step modprobe "$dep"; done
    step insmod "$RDMAX_VM_RXE_MODULE"
    echo "rdmax-vm: soft-RoCE built with tests/vm/patches"
else
    step modprobe rdma_rxe
fi
step modprobe ib_uverbs
step modprobe rdma_ucm
step rdma link add "$RDMAX_TEST_DEVICE" type rxe netdev "$RDMAX_VM_NETDEV"

# The port goes ACTIVE once the netdev is up; then the GID of the address
# (IPv4-mapped: ...:ffff:c000:0201) is added in the background, and the tests
# look devices up by it.
state_file=/sys/class/infiniband/$RDMAX_TEST_DEVICE/ports/1/state
wait_until grep -q ACTIVE "$state_file" 2>/dev/null || not_ready "$RDMAX_TEST_DEVICE port never became ACTIVE"
mapped_gid=$(echo "$RDMAX_TEST_ADDR" | awk -F. '{ printf "ffff:%02x%02x:%02x%02x", $1, $2, $3, $4 }')
has_gid() { cat /sys/class/infiniband/"$RDMAX_TEST_DEVICE"/ports/1/gids/* 2>/dev/null | grep -q "$mapped_gid$"; }
wait_until has_gid || not_ready "no GID for $RDMAX_TEST_ADDR on $RDMAX_TEST_DEVICE"

# kmod/build leaves the module at build/kmod/KVER/rdmax.ko; with --test-hooks
# (the kmod suite's, RDMAX_VM_TEST_HOOKS=1) at build/kmod-test/KVER/rdmax.ko.
kmod_dir=kmod
[ "${RDMAX_VM_TEST_HOOKS:-}" != 1 ] || kmod_dir=kmod-test
module=$RDMAX_VM_PROJECT/build/$kmod_dir/$(uname -r)/rdmax.ko
if [ -f "$module" ]; then
    step insmod "$module"
    echo "rdmax-vm: loaded the rdmax module ($kmod_dir)"
else
    echo "rdmax-vm: no build/$kmod_dir/$(uname -r)/rdmax.ko (kmod/build); the module is not loaded"
fi

cd "$RDMAX_VM_PROJECT" || exit 125
echo "@@RDMAX-VM-BEGIN"
# Through a pipe, not the console's tty: the job's output is a plain stream
# (no colours, no progress bars), as it would be in CI.
bash "$results/job.sh" 2>&1 | cat
status=${PIPESTATUS[0]}
echo "$status" >"$results/status"
exit "$status"
