#!/bin/sh
# /init of the rdmax test VM's initramfs (busybox). It mounts the host's root,
# read-only over 9p, under a tmpfs overlay so that the guest may write anywhere
# (build/, /tmp) and every write is thrown away at power-off; mounts the
# writable results share; and hands over to tests/vm/guest.sh inside that root.
# Anything that goes wrong powers the guest off, so the host never waits for a
# deadline it could have been spared.
export PATH=/bin
say() { echo "rdmax-vm: $*"; }
die() { say "init: $*"; echo "@@RDMAX-VM-END 125"; poweroff -f; sleep 10; }

mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev

while read -r mod; do
    insmod "$mod" || die "insmod $mod failed"
done < /modules.list

opts=trans=virtio,version=9p2000.L,msize=512000
mkdir -p /lower /upper /newroot
mount -t 9p -o "$opts,ro,cache=loose" hostroot /lower || die "cannot mount the host root over 9p"
mount -t tmpfs -o mode=0755 tmpfs /upper
mkdir -p /upper/data /upper/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work /newroot ||
    die "cannot mount the overlay on the host root"

mkdir -p /newroot/run/rdmax-vm
mount -t 9p -o "$opts" results /newroot/run/rdmax-vm || die "cannot mount the results share"
mount -t proc proc /newroot/proc
mount -t sysfs sys /newroot/sys
mount -t devtmpfs dev /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs tmpfs /newroot/dev/shm

# The kernel loads modules on demand (rxe asks for crc32, say) by running
# /proc/sys/kernel/modprobe in this initramfs' root: point it at the host's
# modprobe inside the new root.
printf '#!/bin/sh\nexec chroot /newroot /sbin/modprobe "$@"\n' >/bin/modprobe-newroot
chmod +x /bin/modprobe-newroot
echo /bin/modprobe-newroot >/proc/sys/kernel/modprobe

chroot /newroot /bin/bash /run/rdmax-vm/guest.sh
status=$?
echo "@@RDMAX-VM-END $status"
sync
umount /newroot/run/rdmax-vm 2>/dev/null
poweroff -f
sleep 10
