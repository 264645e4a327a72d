#pragma once
// uffd_monitor: the registration cache's monitor built on userfaultfd; no
// kernel module needed.
//
// One userfaultfd per process, shared by every uffd_monitor (a range can be
// registered with one userfaultfd only), read by one background thread. The
// cached ranges are registered in write-protect mode, which is never armed: so
// no page fault ever waits on rdmax, and the kernel reports unmap events
// (munmap, mmap MAP_FIXED over the range, brk shrink, mremap, MADV_DONTNEED
// and MADV_REMOVE). Each monitor queues the ranges in a bounded
// pending_invalidations; the cache drops them at its next operation.
//
// What it watches. Only private anonymous memory (and private anonymous
// hugetlb) is cached: userfaultfd sees every way this process takes such
// pages away. Memory backed by a file, shared or not -- a file, a memfd,
// shmem, MAP_SHARED|MAP_ANONYMOUS -- can lose its pages through the file
// (ftruncate, fallocate(PUNCH_HOLE), MADV_REMOVE through another mapping, or
// another process) with no event here: watch() gives a token for which
// valid() is false, and the cache registers such memory per use (counter
// `uncached`). The kernel module (kmod_monitor) watches all of it. Nothing is
// reported for page migration or swap, which pinned pages do not undergo.
//
// What it misses even in private anonymous memory (the module sees all of it,
// and auto_monitor prefers the module): MADV_GUARD_INSTALL (Linux 6.13+,
// allowed on registered VMAs; glibc 2.41 thread stacks) zaps pages with no
// event, and shmat(SHM_REMAP) maps over a range with no UNMAP event. And
// MADV_DONTNEED / MADV_FREE deliver REMOVE before the zap (userfaultfd_remove
// waits for the reader, then madvise zaps): a miss that pins those very pages
// in that window registers the old pages, and the registration stays cached.
//
// What it changes for the application. Registering part of a mapping with
// userfaultfd splits its VMA, and a later mremap that moves a range spanning
// a registered VMA and an unregistered one fails (EFAULT; from Linux 6.17 on
// after moving the part before the registered VMA). So watch() registers the
// whole mappings (VMAs) the range lies in, not just its pages: a mapping the
// application made in one mmap stays one VMA, and moving it whole works as
// without rdmax. What still differs: on 6.17+, a move across several of the
// application's own VMAs (made by separate mmaps or split by mprotect) stops
// at the first watched VMA that is not the first; the kernel module changes
// nothing, and auto_monitor prefers it.
//
// In a watched mapping the kernel allocates no mTHP (sub-PMD huge pages,
// 6.8+: userfaultfd_armed) at fault, and khugepaged collapses no 2 MiB range
// with an unpopulated page.
//
// munmap() (or MADV_DONTNEED, MADV_FREE) anywhere in a watched mapping blocks until the
// reader thread has read the event, so that thread never takes a lock that a thread calling munmap
// could hold: it takes only the monitors' queue locks, which are never held around anything that
// can unmap memory. If the reader fails for good (poll fails with something other than EINTR,
// ENOMEM or EAGAIN), the monitor dies loudly: one line on stderr, the userfaultfd is released (so
// no munmap waits for it), failed() says why, pending() stays true and drain() reports the whole
// address space, so every cache on it drops what it holds and registers per use from then on. (A
// forked child that has not exec'd yet holds a copy of the descriptor; until it exits, releasing
// ours wakes no waiter.)
//
// After fork(), the child's copy of the shared userfaultfd still refers to
// the parent's address space: the child never touches it (see fork_policy.hpp).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

struct pollfd;

namespace rdmax {

namespace detail {

/// What pending() computes, from the two words it loads, in the order that
/// makes it true from the moment a munmap of watched memory returns until the
/// cache has dropped the range (the sink has returned). `reading` is the
/// reader's word (bit 0: between poll and queueing; bit 1: dead), `state` the
/// monitor's (bit 0: its queue is not empty; above it: drains in progress);
/// the reader's word counts the batches it queued above its two bits.
/// An event moves from `reading` to the queue bit to a drain and out, so the
/// words are loaded in that order: a load that finds a stage over finds the
/// next one begun. A template so that a test can interleave the loads.
template <class Word>
[[nodiscard]] inline bool uffd_pending(const Word& reading, const Word& state) noexcept {
    if ((reading.load(std::memory_order_acquire) & 3U) != 0)
        return true;
    return state.load(std::memory_order_acquire) != 0;
}

/// Test seams of the userfaultfd reader (tests/unit/test_uffd_monitor.cpp);
/// null in production. Set them before the process's first uffd_monitor.
struct uffd_hooks {
    /// Replaces poll() in the reader thread.
    int (*poll)(pollfd* fds, unsigned long n, int timeout) = nullptr;
    /// Runs in watch() between the first look at the mappings and UFFDIO_REGISTER.
    void (*before_register)() = nullptr;
    /// Runs in watch() between UFFDIO_REGISTER and counting the range watched.
    void (*after_register)() = nullptr;
    /// Reads /proc/self/maps as text even where PROCMAP_QUERY exists.
    bool no_procmap_query = false;
};
[[nodiscard]] uffd_hooks& uffd_test_hooks() noexcept;

/// Whether userfaultfd sees everything that can take a mapping's pages away,
/// from /proc/self/maps's fields: private anonymous memory, and private
/// hugetlb memory (named exactly "/anon_hugepage", or "/anon_hugepage (deleted)").
[[nodiscard]] bool uffd_sees_everything(bool shared, unsigned long inode,
                                        std::string_view name) noexcept;

} // namespace detail

class uffd_monitor {
public:
    struct token {
        std::uintptr_t start = 0;
        std::uintptr_t end = 0; ///< 0: not watched (memory userfaultfd cannot watch)
    };

    /// Whether this process can use userfaultfd (kernel support, permission
    /// for user-mode-only faults); the answer is computed once.
    [[nodiscard]] static bool available() noexcept;

    /// Subscribes to the process's userfaultfd, starting it on first use.
    /// Throws rdmax::error naming userfaultfd and the reason when unavailable.
    uffd_monitor();
    uffd_monitor(uffd_monitor&&) noexcept;
    uffd_monitor& operator=(uffd_monitor&&) noexcept;
    ~uffd_monitor();

    /// Registers the mappings that [start, start + len) lies in, whole, with
    /// the userfaultfd; the token holds their span. A range it cannot watch
    /// (or whose memory can change behind its back: see above) gives a token
    /// for which valid() is false. UFFDIO_REGISTER passes over holes, so
    /// after it watch() looks at the mappings again and asks the kernel
    /// (UFFDIO_WRITEPROTECT of one page or aligned 2 MiB of each, a no-op)
    /// whether each is registered: one unmapped before the registration and
    /// mapped again after it is not, and is never cached. Doubt (more than 32
    /// mappings, 1 GiB hugetlb pages) also says not valid: per use.
    [[nodiscard]] token watch(std::uintptr_t start, std::size_t len);
    void unwatch(token t) noexcept;
    [[nodiscard]] bool valid(token t) const noexcept { return t.end != 0; }
    /// Reports the ranges unmapped since the last call as sink(ctx, start, end)
    /// (the whole address space once the monitor died).
    void drain(void (*sink)(void*, std::uintptr_t, std::uintptr_t), void* ctx) noexcept;
    /// True when an event is being read, queued, or being drained (until the
    /// sink returned), and for good once the monitor died. Two loads, no call.
    [[nodiscard]] bool pending() const noexcept {
        return detail::uffd_pending(*reading_flag_, *state_flag_);
    }
    /// Why the monitor died, or empty while it works.
    [[nodiscard]] std::string failed() const;

    /// Events this monitor received, and merges its bounded queue was forced into.
    [[nodiscard]] std::uint64_t events() const noexcept;
    [[nodiscard]] std::uint64_t overflow_merges() const noexcept;
    /// Ranges in the queue now (at most its capacity).
    [[nodiscard]] std::size_t queued() const noexcept;

    struct subscription;

private:
    std::unique_ptr<subscription> sub_;
    const std::atomic<std::uint32_t>* state_flag_;   ///< queued bit, drains in progress
    const std::atomic<std::uint32_t>* reading_flag_; ///< reading bit, dead bit
};

} // namespace rdmax
