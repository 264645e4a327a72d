/* SPDX-License-Identifier: (GPL-2.0 WITH Linux-syscall-note) OR MIT */
/*
 * The interface of /dev/rdmax, shared by the kernel module (kmod/) and its
 * user-space client (src/mem/kmod_monitor.cpp).
 *
 * open() binds the file to the caller's address space. MONITOR watches a
 * page-aligned range and answers {slot, generation}; the read-only status
 * area (mmap offset 0) holds a 64-bit generation per slot, which the module
 * makes odd, before the unmap or page replacement returns, when the range's
 * pages go away. A token {slot, generation} is valid while
 * status->generation[slot] == generation: one load, no system call. UNMONITOR
 * ends a token at once, and a slot's generations only grow. read()
 * and poll() deliver at most one rdmax_event per watched range.
 */
#ifndef RDMAX_KMOD_H
#define RDMAX_KMOD_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define RDMAX_KMOD_ABI_VERSION 1
#define RDMAX_KMOD_DEVICE "/dev/rdmax"

/* MONITOR: in addr, len (page-aligned, len > 0) and cookie; out slot and
 * generation. */
struct rdmax_monitor {
	__u64 addr;
	__u64 len;
	__u64 cookie;
	__u32 slot;
	__u32 reserved; /* zero */
	__u64 generation;
};

/* UNMONITOR: the slot and the generation MONITOR answered. */
struct rdmax_unmonitor {
	__u32 slot;
	__u32 reserved; /* zero */
	__u64 generation;
};

/* QUERY: limits and counters. */
struct rdmax_query {
	__u32 abi_version;
	__u32 max_regions;  /* slots per open file */
	__u64 status_bytes; /* size of the status area to mmap */
	__u64 live_regions; /* watched by this file now */
	__u64 monitors;	    /* MONITOR calls that succeeded, this file */
	__u64 unmonitors;
	__u64 invalidations; /* ranges made invalid */
	__u64 events_read;
	/* Module-wide, for CAP_SYS_ADMIN only (zero for other callers): */
	__u64 module_live_regions; /* every file of every process: a leak shows
				      here */
	__u64 module_files;	   /* files open now */
};

/* What happened to a range. */
enum rdmax_event_kind {
	RDMAX_EVENT_UNMAP =
		1, /* munmap, mremap away, mmap MAP_FIXED over it, brk shrink */
	RDMAX_EVENT_CLEAR =
		2, /* pages dropped or replaced: MADV_DONTNEED, ... */
	RDMAX_EVENT_RELEASE = 3, /* the address space is going away */
	RDMAX_EVENT_MIGRATE = 4, /* pages moved */
	RDMAX_EVENT_OTHER = 5,
};

/* One event from read(): the part of the watched range that was hit. */
struct rdmax_event {
	__u64 cookie;
	__u32 slot;
	__u32 kind; /* enum rdmax_event_kind */
	__u64 start;
	__u64 end;
	__u64 generation; /* the token's generation (even) */
};

/* The read-only status area: this 64-byte header, then, at
 * RDMAX_STATUS_GENERATIONS, __u64 generation[max_regions].
 */
struct rdmax_status {
	__u32 abi_version;
	__u32 max_regions;
	__u64 invalidations;  /* bumped with every range made invalid */
	__u64 pending_events; /* events queued for read() */
	__u64 reserved[5];
};

#define RDMAX_STATUS_GENERATIONS 64 /* bytes from the start of the area */

#define RDMAX_IOC_MAGIC 0xb5
#define RDMAX_IOC_MONITOR _IOWR(RDMAX_IOC_MAGIC, 1, struct rdmax_monitor)
#define RDMAX_IOC_UNMONITOR _IOW(RDMAX_IOC_MAGIC, 2, struct rdmax_unmonitor)
#define RDMAX_IOC_QUERY _IOR(RDMAX_IOC_MAGIC, 3, struct rdmax_query)

#endif /* RDMAX_KMOD_H */
