// SPDX-License-Identifier: GPL-2.0
/*
 * rdmax: tells a process, the moment it happens, that memory it registered
 * for RDMA was unmapped or had its pages replaced, so that a registration
 * cache never hands out a registration over pages the process no longer maps.
 *
 * One MMU notifier per address space, shared by every file opened in it, and
 * an interval tree of the ranges they watch that are still valid. Its
 * invalidate callback may run where sleeping is forbidden, so it takes two
 * spinlocks and allocates nothing: for each watched range the invalidation
 * overlaps, it makes the range's generation odd in the status area (read-only
 * to user space), bumps the counter, queues the range's one event, wakes
 * readers and takes the range out of the tree, all before the unmap returns.
 * Unlike a deferred worker, this means that when munmap() returns, user space
 * already sees the change. Each watch is visited once in its life, and an
 * invalidation that leaves the pages in place (write protection for writeback
 * or fork, mprotect) visits none: however many watches overlap, what they cost
 * the kernel's own work (writeback, reclaim, other users' truncates) is one
 * callback per invalidation of the address space, not one per watch (with an
 * interval notifier per watch, N overlapping watches were N callbacks per
 * page).
 *
 * What user space can write holds nothing the module relies on: slot numbers
 * come from an xarray and generations from the module's own copy; the status
 * area is only ever mapped read-only.
 */
#include <linux/capability.h>
#include <linux/cred.h>
#include <linux/delay.h>
#include <linux/fs.h>
#include <linux/interval_tree.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/mmu_notifier.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/pagemap.h>
#include <linux/poll.h>
#include <linux/sched/mm.h>
#include <linux/slab.h>
#include <linux/spinlock.h>
#include <linux/uaccess.h>
#include <linux/user_namespace.h>
#include <linux/vmalloc.h>
#include <linux/wait.h>
#include <linux/xarray.h>

#include "rdmax_compat.h"
#include "rdmax_kmod.h"

static unsigned int max_regions = 65536;
module_param(max_regions, uint, 0444);
MODULE_PARM_DESC(max_regions, "ranges one open file may watch (default 65536)");

#ifdef RDMAX_TEST_HOOKS
/* Test hooks, built only for the kmod suite (kmod/build --test-hooks): never
 * in a production module, where a sleep under ioctl_lock would be a way to
 * stall the file's other threads.
 *
 * race_window_us widens two windows where a racing unmap must still be
 * handled: in MONITOR between its last look at the range and its answer, and
 * in UNMONITOR between freeing the slot and freeing the region.
 *
 * race_gate holds MONITOR right after its watch is in place (before it checks
 * the range) until the test moves race_release on (or 5 s pass), counting
 * race_entered when it stops there: the test invalidates the range inside the
 * window, with no timing involved.
 *
 * watch_visits counts the watched ranges that invalidations visited;
 * resched_points the times a blockable one let the CPU go between them;
 * notifier_allocs the address spaces' subscriptions made.
 *
 * end_gate holds the end of a blockable invalidation that changes pages
 * (MADV_DONTNEED) until end_release moves on (or 5 s pass), counting
 * end_entered: MONITOR then meets an invalidation in progress.
 */
static unsigned int race_window_us;
module_param(race_window_us, uint, 0644);
MODULE_PARM_DESC(race_window_us,
		 "test hook: microseconds to sleep in MONITOR/UNMONITOR races");
static unsigned int race_gate, race_entered, race_release;
module_param(race_gate, uint, 0644);
MODULE_PARM_DESC(race_gate, "test hook: 1 holds MONITOR after its insert");
module_param(race_entered, uint, 0444);
MODULE_PARM_DESC(race_entered, "test hook: MONITORs held at the gate");
module_param(race_release, uint, 0644);
MODULE_PARM_DESC(race_release, "test hook: a new value lets the gate go");
static unsigned long watch_visits;
module_param(watch_visits, ulong, 0444);
MODULE_PARM_DESC(watch_visits, "test hook: ranges visited by invalidations");
static unsigned long resched_points, notifier_allocs;
module_param(resched_points, ulong, 0444);
MODULE_PARM_DESC(resched_points, "test hook: cond_resched()s of callbacks");
module_param(notifier_allocs, ulong, 0444);
MODULE_PARM_DESC(notifier_allocs, "test hook: address spaces subscribed");
static unsigned int end_gate, end_entered, end_release;
module_param(end_gate, uint, 0644);
MODULE_PARM_DESC(end_gate, "test hook: 1 holds a blockable invalidation's end");
module_param(end_entered, uint, 0444);
MODULE_PARM_DESC(end_entered, "test hook: invalidation ends held");
module_param(end_release, uint, 0644);
MODULE_PARM_DESC(end_release, "test hook: a new value lets the end go");
MODULE_INFO(rdmax_test_hooks, "yes");

static void race_window(void)
{
	unsigned int us = min(READ_ONCE(race_window_us), 1000U);

	if (unlikely(us))
		usleep_range(us, us + us / 2);
}

static void race_gate_wait(void)
{
	unsigned int release = READ_ONCE(race_release);
	int ms;

	if (!READ_ONCE(race_gate))
		return;
	WRITE_ONCE(race_entered, race_entered + 1);
	for (ms = 0; ms < 5000 && READ_ONCE(race_release) == release; ms++)
		msleep(1);
}

static void count_visit(void)
{
	WRITE_ONCE(watch_visits, watch_visits + 1);
}

static void count_resched(void)
{
	WRITE_ONCE(resched_points, resched_points + 1);
}

static void count_alloc(void)
{
	WRITE_ONCE(notifier_allocs, notifier_allocs + 1);
}

static void end_gate_wait(const struct mmu_notifier_range *range)
{
	unsigned int release = READ_ONCE(end_release);
	int ms;

	if (!READ_ONCE(end_gate) || !mmu_notifier_range_blockable(range))
		return;
	WRITE_ONCE(end_entered, end_entered + 1);
	for (ms = 0; ms < 5000 && READ_ONCE(end_release) == release; ms++)
		msleep(1);
}
#else
static inline void race_window(void)
{
}

static inline void race_gate_wait(void)
{
}

static inline void count_visit(void)
{
}

static inline void count_resched(void)
{
}

static inline void count_alloc(void)
{
}

static inline void end_gate_wait(const struct mmu_notifier_range *range)
{
}
#endif

/* Budgets. Any user may open the device (mode 0666, like the uverbs
 * devices), so these limits, not the file mode, bound what one user, and all
 * of them, can make the kernel keep: watched regions, and status-area pages
 * (one per open file, more only as its slots are used). A refusal is ENOSPC,
 * which rdmax's user space turns into "registered per use, not cached".
 *
 * A user is a uid of the initial user namespace. A process in a user
 * namespace that an unprivileged user made (directly or further out) is
 * charged to that user: uids mapped from its subordinate range, or made up
 * inside the namespace, are that user's, not budgets of their own. A
 * namespace root made (a container runtime's) is not one tenant: its
 * processes are charged to their own uids (of the initial namespace), so one
 * container cannot spend the others' budgets or root's. (The ucounts calls
 * are not exported to modules on 6.1, and on 7.x to binfmt_misc only.) So
 * uids outside a namespace, subordinate ones included, are separate budgets:
 * the memory cgroup the charges go to is the bound across them.
 *
 * Each user keeps a minimum however full the module's budget is, so that a
 * few users cannot leave the rest none; the minimums come out of a reserve of
 * their own, bounded too, so the module never holds more than its total and
 * its reserve whatever the number of uids.
 */
static unsigned int max_user_regions = 262144;
module_param(max_user_regions, uint, 0644);
MODULE_PARM_DESC(
	max_user_regions,
	"ranges one user may watch, all files together (default 262144)");
static unsigned int max_user_status_kib = 32768;
module_param(max_user_status_kib, uint, 0644);
MODULE_PARM_DESC(
	max_user_status_kib,
	"status-area KiB one user's open files may hold (default 32768)");
static unsigned int max_total_regions = 2097152;
module_param(max_total_regions, uint, 0644);
MODULE_PARM_DESC(max_total_regions,
		 "ranges all users may watch together (default 2097152)");
static unsigned int max_total_status_kib = 262144;
module_param(max_total_status_kib, uint, 0644);
MODULE_PARM_DESC(max_total_status_kib,
		 "status-area KiB all open files may hold (default 262144)");
static unsigned int min_user_regions = 1024;
module_param(min_user_regions, uint, 0644);
MODULE_PARM_DESC(min_user_regions,
		 "ranges each user may watch even when max_total_regions "
		 "is spent (default 1024)");
static unsigned int min_user_status_kib = 256;
module_param(min_user_status_kib, uint, 0644);
MODULE_PARM_DESC(min_user_status_kib,
		 "status-area KiB each user may hold even when "
		 "max_total_status_kib is spent (default 256)");

static unsigned int max_reserved_regions = 65536;
module_param(max_reserved_regions, uint, 0644);
MODULE_PARM_DESC(max_reserved_regions,
		 "ranges all users' minimums may hold beyond max_total_regions "
		 "(default 65536)");
static unsigned int max_reserved_status_kib = 16384;
module_param(max_reserved_status_kib, uint, 0644);
MODULE_PARM_DESC(max_reserved_status_kib,
		 "status-area KiB all users' minimums may hold beyond "
		 "max_total_status_kib (default 16384)");

enum rdmax_budget { RDMAX_REGIONS, RDMAX_STATUS_PAGES, RDMAX_BUDGETS };
enum rdmax_limit {
	RDMAX_USER_MAX,
	RDMAX_TOTAL_MAX,
	RDMAX_USER_MIN,
	RDMAX_RESERVE_MAX,
	RDMAX_LIMITS
};

/* What one user holds, shared by that user's open files. */
struct rdmax_user {
	u32 uid;	    /* in the initial user namespace */
	unsigned int files; /* under users_mutex */
	spinlock_t lock;    /* used, reserved */
	long used[RDMAX_BUDGETS];
	long reserved[RDMAX_BUDGETS]; /* of used, from the reserve */
};

static DEFINE_MUTEX(users_mutex);
static DEFINE_XARRAY(users);
static atomic_long_t total_used[RDMAX_BUDGETS], reserve_used[RDMAX_BUDGETS];

static struct kmem_cache *region_cache;
static atomic64_t files_open = ATOMIC64_INIT(0);

static unsigned long budget_limit(enum rdmax_budget b, enum rdmax_limit l)
{
	static unsigned int *const params[RDMAX_BUDGETS][RDMAX_LIMITS] = {
		[RDMAX_REGIONS] = {&max_user_regions, &max_total_regions,
				   &min_user_regions, &max_reserved_regions},
		[RDMAX_STATUS_PAGES] = {&max_user_status_kib,
					&max_total_status_kib,
					&min_user_status_kib,
					&max_reserved_status_kib},
	};
	unsigned long v = READ_ONCE(*params[b][l]);

	return b == RDMAX_REGIONS ? v : v / (PAGE_SIZE / 1024);
}

static bool take(atomic_long_t *used, unsigned long limit)
{
	if (atomic_long_inc_return(used) > (long)limit) {
		atomic_long_dec(used);
		return false;
	}
	return true;
}

/* Takes one unit of b from u's budget and the module's; false if either
 * is spent. Within the user's minimum the unit comes from the reserve while
 * that lasts, else from the module's budget like any other.
 */
static bool charge(struct rdmax_user *u, enum rdmax_budget b)
{
	bool ok = true;

	spin_lock(&u->lock);
	if (u->used[b] >= (long)budget_limit(b, RDMAX_USER_MAX))
		ok = false;
	else if (u->used[b] < (long)budget_limit(b, RDMAX_USER_MIN) &&
		 take(&reserve_used[b], budget_limit(b, RDMAX_RESERVE_MAX)))
		u->reserved[b]++;
	else if (!take(&total_used[b], budget_limit(b, RDMAX_TOTAL_MAX)))
		ok = false;
	if (ok)
		u->used[b]++;
	spin_unlock(&u->lock);
	return ok;
}

/* Gives back n units of b: the module's budget's first, the reserve's last
 * (the user's minimum is what it keeps longest).
 */
static void uncharge(struct rdmax_user *u, enum rdmax_budget b, long n)
{
	long from_total, from_reserve;

	spin_lock(&u->lock);
	if (WARN_ON_ONCE(n > u->used[b]))
		n = u->used[b];
	from_total = min(n, u->used[b] - u->reserved[b]);
	from_reserve = n - from_total;
	u->used[b] -= n;
	u->reserved[b] -= from_reserve;
	spin_unlock(&u->lock);
	atomic_long_sub(from_total, &total_used[b]);
	atomic_long_sub(from_reserve, &reserve_used[b]);
}

/* Who pays for the caller: in a user namespace some user other than root
 * made, the outermost such one's owner; else its own uid (see Budgets).
 */
static u32 budget_owner(void)
{
	const struct user_namespace *ns;
	kuid_t uid = current_uid();

	for (ns = current_user_ns(); ns != &init_user_ns; ns = ns->parent)
		if (!uid_eq(ns->owner, GLOBAL_ROOT_UID))
			uid = ns->owner;
	return from_kuid_munged(&init_user_ns, uid);
}

/* The opener's budget, made on its first open file. */
static struct rdmax_user *user_get(void)
{
	u32 uid = budget_owner();
	struct rdmax_user *u;

	mutex_lock(&users_mutex);
	u = xa_load(&users, uid);
	if (!u) {
		u = kzalloc(sizeof(*u), GFP_KERNEL_ACCOUNT);
		if (u)
			spin_lock_init(&u->lock);
		if (u && xa_err(xa_store(&users, uid, u, GFP_KERNEL_ACCOUNT))) {
			kfree(u);
			u = NULL;
		}
		if (u)
			u->uid = uid;
	}
	if (u)
		u->files++;
	mutex_unlock(&users_mutex);
	return u;
}

static void user_put(struct rdmax_user *u)
{
	mutex_lock(&users_mutex);
	if (--u->files == 0) {
		xa_erase(&users, u->uid);
		kfree(u);
	}
	mutex_unlock(&users_mutex);
}

struct rdmax_file;

/* The watched ranges of one address space, of all its files. */
struct rdmax_mm {
	struct mmu_notifier notifier; /* mmu_notifier_get()'s, one per mm */
	spinlock_t lock; /* the tree, active; taken before any file's lock */
	struct rb_root_cached tree; /* ranges still valid */
	/* Invalidations that change pages in progress, the smallest range
	 * that holds all of them (reset when none is), and MONITORs waiting
	 * for those that overlap their range to end.
	 */
	unsigned long active;
	u64 active_start, active_end;
	wait_queue_head_t idle;
	/* On rdmax_mms: this address space keeps its subscription after its
	 * last file closes, until it exits or the module goes (a reopen then
	 * finds it, instead of registering again under mm_take_all_locks()).
	 */
	struct list_head link;
	bool listed; /* under mms_mutex */
};

static DEFINE_MUTEX(mms_mutex);
static LIST_HEAD(rdmax_mms);

struct rdmax_region {
	/* [start, end - 1], in the address space's tree while in_tree */
	struct interval_tree_node node;
	bool in_tree; /* under the rdmax_mm's lock */
	struct rdmax_file *file;
	u64 start, end, cookie;
	u64 generation; /* the module's copy; odd once invalidated */
	u32 slot;
	/* Retired: its slot is (or may soon be) another region's. Out of
	 * the tree, so no callback touches it. Under file->lock.
	 */
	bool dead;
	/* The queued event (at most one per region), under file->lock. */
	bool queued;
	u32 kind;
	u64 hit_start, hit_end;
	struct list_head event_link;
};

struct rdmax_file {
	/* mmgrab()bed: the structure, not the address space */
	struct mm_struct *mm;
	struct rdmax_mm *watch;	 /* mm's, shared with its other files */
	struct mutex ioctl_lock; /* MONITOR / UNMONITOR */
	spinlock_t lock; /* generations, the event queue, invalidate seqs */
	struct xarray regions; /* slot -> region */
	struct list_head events;
	wait_queue_head_t wait;
	struct rdmax_user *user;
	/* The status area: status_bytes of address space, backed by pages
	 * charged to the opener's memory cgroup and budget as its slots are
	 * first used (page 0, the header, at open), mapped into user space
	 * read-only, page by page as it touches them. Pages stay until close,
	 * so a slot's generation only grows.
	 */
	struct rdmax_status *status; /* page 0 */
	struct page **status_pages;  /* NULL: not yet used */
	unsigned int status_npages, status_used;
	size_t status_bytes;
	u64 live, monitors, unmonitors, invalidations, events_read;
};

static size_t slot_offset(u32 slot)
{
	return RDMAX_STATUS_GENERATIONS + (size_t)slot * sizeof(__u64);
}

/* Only for a slot whose page status_page_get() made. */
static __u64 *generation_of(struct rdmax_file *f, u32 slot)
{
	size_t off = slot_offset(slot);

	return (__u64 *)((char *)page_address(
				 f->status_pages[off >> PAGE_SHIFT]) +
			 offset_in_page(off));
}

/* Makes the page that holds slot's generation, charged, on the slot's first
 * use. Under f->ioctl_lock (or at open).
 */
static int status_page_get(struct rdmax_file *f, u32 slot)
{
	unsigned int i = slot_offset(slot) >> PAGE_SHIFT;
	struct page *page;

	if (f->status_pages[i])
		return 0;
	if (!charge(f->user, RDMAX_STATUS_PAGES))
		return -ENOSPC;
	page = alloc_page(GFP_KERNEL_ACCOUNT | __GFP_ZERO);
	if (!page) {
		uncharge(f->user, RDMAX_STATUS_PAGES, 1);
		return -ENOMEM;
	}
	f->status_used++;
	/* pairs with the acquire load of the fault handler */
	smp_store_release(&f->status_pages[i], page);
	return 0;
}

/* Events that leave the pages where they were do not invalidate: mprotect
 * (PROTECTION_VMA), fork's copy-on-write write protection (PROTECTION_PAGE)
 * and soft-dirty tracking. Everything else may change the pages behind the
 * range, so it does.
 */
static bool changes_pages(enum mmu_notifier_event event)
{
	switch (event) {
	case MMU_NOTIFY_PROTECTION_VMA:
	case MMU_NOTIFY_PROTECTION_PAGE:
	case MMU_NOTIFY_SOFT_DIRTY:
		return false;
	default:
		return true;
	}
}

static u32 event_kind(enum mmu_notifier_event event)
{
	switch (event) {
	case MMU_NOTIFY_UNMAP:
		return RDMAX_EVENT_UNMAP;
	case MMU_NOTIFY_CLEAR:
		return RDMAX_EVENT_CLEAR;
	case MMU_NOTIFY_RELEASE:
		return RDMAX_EVENT_RELEASE;
	case MMU_NOTIFY_MIGRATE:
		return RDMAX_EVENT_MIGRATE;
	default:
		return RDMAX_EVENT_OTHER;
	}
}

/* Makes r's generation odd, here and in the status area, unless it is
 * already; whether it changed. Under f->lock.
 */
static bool make_invalid_locked(struct rdmax_file *f, struct rdmax_region *r)
{
	if (r->generation & 1)
		return false;
	/* UNMONITOR reads it without f->lock */
	WRITE_ONCE(r->generation, r->generation | 1);
	/* pairs with the acquire load of a validity check */
	smp_store_release(generation_of(f, r->slot), r->generation);
	return true;
}

/* Tells r of an invalidation of [start, end): its generation goes odd and its
 * one event is queued; and takes it out of the tree, since it stays invalid
 * for good. Under m->lock.
 */
static void region_hit_locked(struct rdmax_mm *m, struct rdmax_region *r,
			      u64 start, u64 end, u32 kind)
{
	struct rdmax_file *f = r->file;
	bool wake = false;

	count_visit();
	interval_tree_remove(&r->node, &m->tree);
	r->in_tree = false;
	spin_lock(&f->lock);
	if (!r->dead) {
		if (make_invalid_locked(f, r)) {
			f->invalidations++;
			WRITE_ONCE(f->status->invalidations, f->invalidations);
		}
		if (!r->queued) {
			r->queued = true;
			r->kind = kind;
			r->hit_start = max_t(u64, start, r->start);
			r->hit_end = min_t(u64, end, r->end);
			list_add_tail(&r->event_link, &f->events);
			WRITE_ONCE(f->status->pending_events,
				   f->status->pending_events + 1);
			wake = true;
		}
	}
	spin_unlock(&f->lock);
	if (wake && wq_has_sleeper(&f->wait))
		wake_up_interruptible(&f->wait);
}

/* A blockable callback lets the CPU go after this many watches. */
#define RDMAX_HITS_PER_RESCHED 64

/* Every still-valid range overlapping [start, end). Under m->lock, which a
 * blockable caller's walk drops now and then: each range it visited left
 * the tree, so it starts again from the first one left.
 */
static void hit_overlapping_locked(struct rdmax_mm *m, u64 start, u64 end,
				   u32 kind, bool blockable)
{
	struct interval_tree_node *n, *next;
	unsigned int hits = 0;

again:
	for (n = interval_tree_iter_first(&m->tree, start, end - 1); n;
	     n = next) {
		next = interval_tree_iter_next(n, start, end - 1);
		region_hit_locked(m, container_of(n, struct rdmax_region, node),
				  start, end, kind);
		if (blockable && next && ++hits % RDMAX_HITS_PER_RESCHED == 0) {
			spin_unlock(&m->lock);
			count_resched();
			cond_resched();
			spin_lock(&m->lock);
			goto again;
		}
	}
}

/* Whether an invalidation in progress may overlap [start, end). Under
 * m->lock.
 */
static bool active_overlaps_locked(const struct rdmax_mm *m, u64 start, u64 end)
{
	return m->active && m->active_start < end && start < m->active_end;
}

static int rdmax_mm_start(struct mmu_notifier *mn,
			  const struct mmu_notifier_range *range)
{
	struct rdmax_mm *m = container_of(mn, struct rdmax_mm, notifier);

	if (!changes_pages(range->event))
		return 0;
	spin_lock(&m->lock);
	if (m->active++) {
		m->active_start = min_t(u64, m->active_start, range->start);
		m->active_end = max_t(u64, m->active_end, range->end);
	} else {
		m->active_start = range->start;
		m->active_end = range->end;
	}
	hit_overlapping_locked(m, range->start, range->end,
			       event_kind(range->event),
			       mmu_notifier_range_blockable(range));
	spin_unlock(&m->lock);
	return 0;
}

static void rdmax_mm_end(struct mmu_notifier *mn,
			 const struct mmu_notifier_range *range)
{
	struct rdmax_mm *m = container_of(mn, struct rdmax_mm, notifier);
	bool idle;

	if (!changes_pages(range->event))
		return;
	end_gate_wait(range);
	spin_lock(&m->lock);
	/* paired with start, but never below zero */
	if (!WARN_ON_ONCE(!m->active))
		m->active--;
	idle = !m->active;
	spin_unlock(&m->lock);
	if (idle && wq_has_sleeper(&m->idle))
		wake_up_all(&m->idle);
}

/* Drops the reference the address space keeps on its subscription, once. */
static void rdmax_mm_unlist(struct rdmax_mm *m)
{
	bool listed;

	mutex_lock(&mms_mutex);
	listed = m->listed;
	if (listed) {
		list_del(&m->link);
		m->listed = false;
	}
	mutex_unlock(&mms_mutex);
	if (listed)
		mmu_notifier_put(&m->notifier);
}

/* The address space is going away (exit): every range hears it, and the
 * subscription goes with its last file.
 */
static void rdmax_mm_release(struct mmu_notifier *mn, struct mm_struct *mm)
{
	struct rdmax_mm *m = container_of(mn, struct rdmax_mm, notifier);

	spin_lock(&m->lock);
	hit_overlapping_locked(m, 0, ULONG_MAX, RDMAX_EVENT_RELEASE, true);
	spin_unlock(&m->lock);
	rdmax_mm_unlist(m);
}

static struct mmu_notifier *rdmax_mm_alloc(struct mm_struct *mm)
{
	struct rdmax_mm *m = kzalloc(sizeof(*m), GFP_KERNEL_ACCOUNT);

	if (!m)
		return ERR_PTR(-ENOMEM);
	spin_lock_init(&m->lock);
	m->tree = RB_ROOT_CACHED;
	init_waitqueue_head(&m->idle);
	INIT_LIST_HEAD(&m->link);
	count_alloc();
	return &m->notifier;
}

static void rdmax_mm_free(struct mmu_notifier *mn)
{
	kfree(container_of(mn, struct rdmax_mm, notifier));
}

static const struct mmu_notifier_ops rdmax_mm_ops = {
	.release = rdmax_mm_release,
	.invalidate_range_start = rdmax_mm_start,
	.invalidate_range_end = rdmax_mm_end,
	.alloc_notifier = rdmax_mm_alloc,
	.free_notifier = rdmax_mm_free,
};

/* Whether VMAs cover every byte of [start, end). Under mmap_read_lock. */
static bool range_mapped(struct mm_struct *mm, unsigned long start,
			 unsigned long end)
{
	unsigned long at = start;

	while (at < end) {
		struct vm_area_struct *vma = find_vma(mm, at);

		if (!vma || vma->vm_start > at)
			return false;
		at = vma->vm_end;
	}
	return true;
}

static void dequeue_locked(struct rdmax_file *f, struct rdmax_region *r)
{
	if (r->queued) {
		list_del(&r->event_link);
		r->queued = false;
		WRITE_ONCE(f->status->pending_events,
			   f->status->pending_events - 1);
	}
}

/* Takes r out of f->regions and its address space's tree, under
 * f->ioctl_lock. Its slot is free from here on, so first it is made dead: its
 * token reads invalid and its queued event goes; and out of the tree, no
 * callback writes the slot again, which would make the next owner's
 * generation odd (a spurious invalidation) and move the slot's generation
 * back, to be handed out a second time.
 */
static void region_retire(struct rdmax_file *f, struct rdmax_region *r)
{
	struct rdmax_mm *m = f->watch;

	spin_lock(&m->lock);
	if (r->in_tree) {
		interval_tree_remove(&r->node, &m->tree);
		r->in_tree = false;
	}
	spin_lock(&f->lock);
	r->dead = true;
	make_invalid_locked(f, r);
	dequeue_locked(f, r);
	spin_unlock(&f->lock);
	spin_unlock(&m->lock);
	xa_erase(&f->regions, r->slot);
}

/* Frees r, retired (or never watched). */
static void region_free(struct rdmax_file *f, struct rdmax_region *r)
{
	kmem_cache_free(region_cache, r);
	uncharge(f->user, RDMAX_REGIONS, 1);
}

static bool monitor_busy(struct rdmax_mm *m, const struct rdmax_region *r)
{
	bool busy;

	spin_lock(&m->lock);
	busy = active_overlaps_locked(m, r->start, r->end);
	spin_unlock(&m->lock);
	return busy;
}

static long rdmax_do_monitor(struct rdmax_file *f, void __user *arg)
{
	struct rdmax_monitor req;
	struct rdmax_region *r;
	u64 generation;
	u32 slot;
	bool mapped, changed, busy;
	int ret;

	if (copy_from_user(&req, arg, sizeof(req)))
		return -EFAULT;
	if (req.reserved || !req.len || !PAGE_ALIGNED(req.addr) ||
	    !PAGE_ALIGNED(req.len) || req.addr + req.len < req.addr)
		return -EINVAL;
	if (req.addr + req.len > TASK_SIZE)
		return -EFAULT;

	if (!charge(f->user, RDMAX_REGIONS))
		return -ENOSPC;
	r = kmem_cache_alloc(region_cache, GFP_KERNEL); /* SLAB_ACCOUNT */
	if (!r) {
		uncharge(f->user, RDMAX_REGIONS, 1);
		return -ENOMEM;
	}
	memset(r, 0, sizeof(*r));
	r->file = f;
	r->start = req.addr;
	r->end = req.addr + req.len;
	r->cookie = req.cookie;
	INIT_LIST_HEAD(&r->event_link);

	/* MONITOR copies out under the lock, and that copy may wait on a
	 * fault (userfaultfd): let the other threads' ioctls be killed.
	 */
	if (mutex_lock_killable(&f->ioctl_lock)) {
		ret = -EINTR;
		goto unlocked;
	}
	/* The lowest free slot: the pages in use stay a dense prefix. */
	ret = xa_alloc(&f->regions, &slot, r, XA_LIMIT(0, max_regions - 1),
		       GFP_KERNEL_ACCOUNT);
	if (ret) {
		ret = ret == -EBUSY ? -ENOSPC : ret;
		goto locked;
	}
	ret = status_page_get(f, slot);
	if (ret) {
		xa_erase(&f->regions, slot);
		goto locked;
	}
	r->slot = slot;
	/* A generation no use of this slot had before: old tokens never match.
	 */
	spin_lock(&f->lock);
	generation = (READ_ONCE(*generation_of(f, slot)) | 1) + 1;
	r->generation = generation;
	/* pairs with the acquire load of a validity check */
	smp_store_release(generation_of(f, slot), generation);
	spin_unlock(&f->lock);

	/* Watched from here on: any invalidation that starts now hits it. */
	r->node.start = r->start;
	r->node.last = r->end - 1;
	spin_lock(&f->watch->lock);
	interval_tree_insert(&r->node, &f->watch->tree);
	r->in_tree = true;
	busy = active_overlaps_locked(f->watch, r->start, r->end);
	spin_unlock(&f->watch->lock);
	race_gate_wait();
	/* One that started before may still be replacing pages it did not
	 * tell r about: wait, a bounded time, until none that may overlap r is
	 * in progress (invalidations elsewhere do not hold MONITOR up).
	 */
	if (busy && !wait_event_timeout(f->watch->idle,
					!monitor_busy(f->watch, r), HZ / 10)) {
		ret = -EAGAIN;
		goto undo;
	}
	/* The range must be mapped, and stay so while we look: a munmap that
	 * races with MONITOR either ran before the insert (the range is not
	 * mapped: EFAULT) or after it (r was hit: EAGAIN). An invalidation
	 * that left the range mapped (MADV_DONTNEED) made r invalid too: a
	 * token MONITOR answers is never invalid from its first check.
	 */
	mmap_read_lock(f->mm);
	mapped = range_mapped(f->mm, r->start, r->end);
	mmap_read_unlock(f->mm);
	spin_lock(&f->lock);
	changed = r->generation & 1;
	spin_unlock(&f->lock);
	if (!mapped || changed) {
		ret = mapped ? -EAGAIN : -EFAULT;
		goto undo;
	}
	race_window();
	req.slot = slot;
	/* The even value we set, never r->generation: an unmap from here on
	 * makes that odd, and a token carrying the odd value would match the
	 * status area again, valid over pages that are gone.
	 */
	req.generation = generation;
	if (copy_to_user(arg, &req, sizeof(req))) {
		ret = -EFAULT;
		goto undo;
	}
	f->live++;
	f->monitors++;
	mutex_unlock(&f->ioctl_lock);
	return 0;

undo:
	region_retire(f, r);
	mutex_unlock(&f->ioctl_lock);
	region_free(f, r);
	return ret;

locked:
	mutex_unlock(&f->ioctl_lock);
unlocked:
	kmem_cache_free(region_cache, r);
	uncharge(f->user, RDMAX_REGIONS, 1);
	return ret;
}

static long rdmax_do_unmonitor(struct rdmax_file *f, void __user *arg)
{
	struct rdmax_unmonitor req;
	struct rdmax_region *r;

	if (copy_from_user(&req, arg, sizeof(req)))
		return -EFAULT;
	if (req.reserved)
		return -EINVAL;
	if (mutex_lock_killable(&f->ioctl_lock))
		return -EINTR;
	r = xa_load(&f->regions, req.slot);
	if (!r) {
		mutex_unlock(&f->ioctl_lock);
		return -EINVAL; /* no such slot */
	}
	if (req.generation != (READ_ONCE(r->generation) & ~1ULL)) {
		mutex_unlock(&f->ioctl_lock);
		return -ESTALE; /* an earlier use of this slot */
	}
	region_retire(f, r);
	f->live--;
	f->unmonitors++;
	mutex_unlock(&f->ioctl_lock);
	race_window();
	region_free(f, r);
	return 0;
}

static long rdmax_do_query(struct rdmax_file *f, void __user *arg)
{
	struct rdmax_query q;

	memset(&q, 0, sizeof(q));
	q.abi_version = RDMAX_KMOD_ABI_VERSION;
	q.max_regions = max_regions;
	q.status_bytes = f->status_bytes;
	if (mutex_lock_killable(&f->ioctl_lock))
		return -EINTR;
	q.live_regions = f->live;
	q.monitors = f->monitors;
	q.unmonitors = f->unmonitors;
	mutex_unlock(&f->ioctl_lock);
	spin_lock(&f->lock);
	q.invalidations = f->invalidations;
	q.events_read = f->events_read;
	spin_unlock(&f->lock);
	/* Module-wide figures tell when other users register RDMA buffers:
	 * for the administrator only; other callers see zero there.
	 */
	if (ns_capable_noaudit(&init_user_ns, CAP_SYS_ADMIN)) {
		/* the region budget counts every region from its MONITOR on */
		q.module_live_regions =
			atomic_long_read(&total_used[RDMAX_REGIONS]) +
			atomic_long_read(&reserve_used[RDMAX_REGIONS]);
		q.module_files = atomic64_read(&files_open);
	}
	return copy_to_user(arg, &q, sizeof(q)) ? -EFAULT : 0;
}

/* A forked child inherits the file but not the address space it watches. */
static bool foreign(const struct rdmax_file *f)
{
	return current->mm != f->mm;
}

static long rdmax_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct rdmax_file *f = file->private_data;

	if (foreign(f))
		return -EBADF;
	switch (cmd) {
	case RDMAX_IOC_MONITOR:
		return rdmax_do_monitor(f, (void __user *)arg);
	case RDMAX_IOC_UNMONITOR:
		return rdmax_do_unmonitor(f, (void __user *)arg);
	case RDMAX_IOC_QUERY:
		return rdmax_do_query(f, (void __user *)arg);
	default:
		return -ENOTTY;
	}
}

/* Copies the first queued events, at most `most`, to buf, and only then
 * dequeues them: a read into a bad buffer loses nothing. Under f->lock, so
 * the copy may not fault: -EFAULT then, with *need the bytes to fault in.
 */
static ssize_t events_take_locked(struct rdmax_file *f, char __user *buf,
				  size_t most, size_t *need)
{
	struct rdmax_event batch[16];
	struct rdmax_region *r;
	size_t n = 0, i;

	list_for_each_entry(r, &f->events, event_link) {
		if (n == min_t(size_t, most, ARRAY_SIZE(batch)))
			break;
		batch[n].cookie = r->cookie;
		batch[n].slot = r->slot;
		batch[n].kind = r->kind;
		batch[n].start = r->hit_start;
		batch[n].end = r->hit_end;
		batch[n].generation = r->generation & ~1ULL;
		n++;
	}
	*need = n * sizeof(batch[0]);
	if (n == 0)
		return 0;
	if (copy_to_user_nofault(buf, batch, *need))
		return -EFAULT;
	for (i = 0; i < n; i++)
		dequeue_locked(f,
			       list_first_entry(&f->events, struct rdmax_region,
						event_link));
	f->events_read += n;
	return *need;
}

static ssize_t rdmax_read(struct file *file, char __user *buf, size_t count,
			  loff_t *pos)
{
	struct rdmax_file *f = file->private_data;
	size_t most = count / sizeof(struct rdmax_event), need;
	int faults = 0;
	ssize_t ret;

	if (foreign(f))
		return -EBADF;
	if (most == 0)
		return -EINVAL;
	for (;;) {
		spin_lock(&f->lock);
		ret = events_take_locked(f, buf, most, &need);
		spin_unlock(&f->lock);
		if (ret > 0)
			return ret;
		if (ret == -EFAULT) {
			/* Fault the buffer in where that may sleep, and try
			 * again; one that cannot be written is the caller's
			 * EFAULT, with the events still queued. (A bound, for
			 * a buffer another thread keeps unmapping.)
			 */
			if (fault_in_writeable(buf, need) || ++faults > 16)
				return -EFAULT;
			continue;
		}
		if (file->f_flags & O_NONBLOCK)
			return -EAGAIN;
		if (wait_event_interruptible(
			    f->wait, READ_ONCE(f->status->pending_events)))
			return -ERESTARTSYS;
	}
}

static __poll_t rdmax_poll(struct file *file, poll_table *wait)
{
	struct rdmax_file *f = file->private_data;

	if (foreign(f))
		return EPOLLERR;
	poll_wait(file, &f->wait, wait);
	return READ_ONCE(f->status->pending_events) ? EPOLLIN | EPOLLRDNORM : 0;
}

/* A page of the status area on first touch; past the slots this file has
 * used, there is none (user space reads only slots it was given).
 */
static vm_fault_t rdmax_status_fault(struct vm_fault *vmf)
{
	struct rdmax_file *f = vmf->vma->vm_private_data;
	struct page *page = NULL;

	/* Only the opener's address space sees the area (VM_DONTCOPY keeps it
	 * out of a forked child; this holds whatever else copies a VMA).
	 */
	if (vmf->vma->vm_mm != f->mm)
		return VM_FAULT_SIGBUS;
	if (vmf->pgoff < f->status_npages)
		/* pairs with the release store of status_page_get() */
		page = smp_load_acquire(&f->status_pages[vmf->pgoff]);
	if (!page)
		return VM_FAULT_SIGBUS;
	return vmf_insert_page(vmf->vma, vmf->address, page);
}

static const struct vm_operations_struct rdmax_status_vm_ops = {
	.fault = rdmax_status_fault,
};

static int rdmax_mmap(struct file *file, struct vm_area_struct *vma)
{
	struct rdmax_file *f = file->private_data;

	if (foreign(f))
		return -EBADF;
	if (vma->vm_flags & VM_WRITE)
		return -EPERM; /* data, the module's to write */
	if (vma->vm_pgoff != 0 ||
	    vma->vm_end - vma->vm_start > PAGE_ALIGN(f->status_bytes))
		return -EINVAL;
	/* Never executable: VM_EXEC is cleared (a 32-bit program with
	 * READ_IMPLIES_EXEC asks for it with every PROT_READ), and mprotect()
	 * may not make it writable or executable later. Pages are
	 * inserted as they are touched (VM_MIXEDMAP must be set here, under
	 * mmap_lock held for writing, for vm_insert_page() at fault time). A
	 * forked child does not get the mapping (VM_DONTCOPY): the area shows
	 * this address space's ranges, live, and the child has its own. VM_IO
	 * makes madvise(MADV_DOFORK) refuse to clear that (EINVAL), and
	 * get_user_pages() refuse the area.
	 */
	rdmax_vm_flags_mod(vma,
			   VM_MIXEDMAP | VM_DONTEXPAND | VM_DONTDUMP |
				   VM_DONTCOPY | VM_IO,
			   VM_EXEC | VM_MAYWRITE | VM_MAYEXEC);
	vma->vm_ops = &rdmax_status_vm_ops;
	vma->vm_private_data = f; /* the vma holds the file, so f lives */
	return 0;
}

/* Any part of it may be missing: undoes what status_alloc() got done. */
static void status_free(struct rdmax_file *f)
{
	unsigned int i;

	for (i = 0; f->status_pages && i < f->status_npages; i++)
		if (f->status_pages[i])
			put_page(f->status_pages[i]);
	kvfree(f->status_pages);
	if (f->user)
		uncharge(f->user, RDMAX_STATUS_PAGES, f->status_used);
}

/* The page table of the status area (1 KiB at the default max_regions) and
 * its page 0, the header: an open file that watches nothing costs about
 * that, charged to the opener's memory cgroup and budget.
 */
static int status_alloc(struct rdmax_file *f)
{
	int ret;

	f->status_npages = f->status_bytes >> PAGE_SHIFT;
	f->status_pages = kvcalloc(f->status_npages, sizeof(*f->status_pages),
				   GFP_KERNEL_ACCOUNT);
	if (!f->status_pages)
		return -ENOMEM;
	ret = status_page_get(f, 0);
	if (ret)
		return ret;
	f->status = page_address(f->status_pages[0]);
	return 0;
}

static int rdmax_open(struct inode *inode, struct file *file)
{
	struct mmu_notifier *watch;
	struct rdmax_file *f;
	int ret;

	if (!current->mm)
		return -EINVAL;
	f = kzalloc(sizeof(*f), GFP_KERNEL_ACCOUNT);
	if (!f)
		return -ENOMEM;
	f->user = user_get();
	if (!f->user) {
		kfree(f);
		return -ENOMEM;
	}
	/* The address space's notifier and tree: made by its first file */
	watch = mmu_notifier_get(&rdmax_mm_ops, current->mm);
	if (IS_ERR(watch)) {
		user_put(f->user);
		kfree(f);
		return PTR_ERR(watch);
	}
	f->watch = container_of(watch, struct rdmax_mm, notifier);
	/* The address space keeps its subscription from its first file on
	 * (a reference of its own, dropped at exit or module unload), so that
	 * open/close loops do not register it again and again.
	 */
	mutex_lock(&mms_mutex);
	if (!f->watch->listed && mmget_not_zero(current->mm)) {
		mmu_notifier_get(&rdmax_mm_ops,
				 current->mm); /* found: no fail */
		f->watch->listed = true;
		list_add(&f->watch->link, &rdmax_mms);
		mmput(current->mm);
	}
	mutex_unlock(&mms_mutex);
	f->status_bytes = PAGE_ALIGN(RDMAX_STATUS_GENERATIONS +
				     (size_t)max_regions * sizeof(__u64));
	ret = status_alloc(f);
	if (ret) {
		status_free(f);
		mmu_notifier_put(watch);
		user_put(f->user);
		kfree(f);
		return ret;
	}
	f->status->abi_version = RDMAX_KMOD_ABI_VERSION;
	f->status->max_regions = max_regions;
	mutex_init(&f->ioctl_lock);
	spin_lock_init(&f->lock);
	xa_init_flags(&f->regions, XA_FLAGS_ALLOC);
	INIT_LIST_HEAD(&f->events);
	init_waitqueue_head(&f->wait);
	f->mm = current->mm;
	mmgrab(f->mm);
	file->private_data = f;
	atomic64_inc(&files_open);
	return nonseekable_open(inode, file);
}

/* On close, and at process exit (after the address space is gone: the
 * notifier saw RELEASE; mmgrab kept the structure it hangs on).
 */
static int rdmax_release(struct inode *inode, struct file *file)
{
	struct rdmax_file *f = file->private_data;
	struct rdmax_region *r;
	unsigned long slot;

	xa_for_each(&f->regions, slot, r) {
		region_retire(f, r);
		region_free(f, r);
	}
	xa_destroy(&f->regions);
	/* the address space's last file frees its tree, after a grace period
	 * (rdmax_exit waits for those)
	 */
	mmu_notifier_put(&f->watch->notifier);
	mmdrop(f->mm);
	status_free(f);
	user_put(f->user);
	kfree(f);
	atomic64_dec(&files_open);
	return 0;
}

static const struct file_operations rdmax_fops = {
	.owner = THIS_MODULE,
	.open = rdmax_open,
	.release = rdmax_release,
	.unlocked_ioctl = rdmax_ioctl,
	/* every argument is a pointer to a struct laid out alike for 32-bit
	 * callers (only __u32 and naturally aligned __u64 fields)
	 */
	.compat_ioctl = compat_ptr_ioctl,
	.read = rdmax_read,
	.poll = rdmax_poll,
	.mmap = rdmax_mmap,
	.llseek = rdmax_no_llseek,
};

static struct miscdevice rdmax_misc = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "rdmax",
	.fops = &rdmax_fops,
	.mode = 0666,
};

/* A constructor keeps SLUB from merging this cache with others, so that
 * /proc/slabinfo shows rdmax_region on its own (the leak test reads it).
 */
static void region_ctor(void *p)
{
	memset(p, 0, sizeof(struct rdmax_region));
}

static int __init rdmax_init(void)
{
	int ret;

	BUILD_BUG_ON(sizeof(struct rdmax_status) != RDMAX_STATUS_GENERATIONS);
	/* compat_ptr_ioctl: the same layout for 32-bit callers */
	BUILD_BUG_ON(sizeof(struct rdmax_monitor) != 40);
	BUILD_BUG_ON(sizeof(struct rdmax_unmonitor) != 16);
	BUILD_BUG_ON(sizeof(struct rdmax_query) != 72);
	if (max_regions == 0 || max_regions > (1U << 24))
		return -EINVAL;
	region_cache =
		kmem_cache_create("rdmax_region", sizeof(struct rdmax_region),
				  0, SLAB_ACCOUNT, region_ctor);
	if (!region_cache)
		return -ENOMEM;
	ret = misc_register(&rdmax_misc);
	if (ret)
		kmem_cache_destroy(region_cache);
	return ret;
}

static void __exit rdmax_exit(void)
{
	struct rdmax_mm *m;

	misc_deregister(&rdmax_misc);
	/* the subscriptions address spaces kept after their last file */
	for (;;) {
		mutex_lock(&mms_mutex);
		m = list_first_entry_or_null(&rdmax_mms, struct rdmax_mm, link);
		if (m) {
			list_del(&m->link);
			m->listed = false;
		}
		mutex_unlock(&mms_mutex);
		if (!m)
			break;
		mmu_notifier_put(&m->notifier);
	}
	/* the trees of address spaces whose last file closed are freed by
	 * rdmax_mm_free() after a grace period: before this module goes
	 */
	mmu_notifier_synchronize();
	kmem_cache_destroy(region_cache);
	xa_destroy(&users); /* empty: every file has closed */
}

module_init(rdmax_init);
module_exit(rdmax_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION(
	"rdmax: MMU-notifier invalidation of RDMA registration caches");
