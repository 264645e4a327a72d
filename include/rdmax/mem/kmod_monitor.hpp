#pragma once
// kmod_monitor: the registration cache's monitor built on the rdmax kernel
// module (/dev/rdmax, kmod/).
//
// The module watches each cached range with an MMU notifier and, before an
// unmap or a page replacement returns, makes the range's generation odd in a
// status area that this process maps read-only. So valid() is one acquire
// load and a compare, no system call, and it already knows when munmap()
// returns; drain() reads the module's events (at most one per range) so that
// the cache can deregister what went away. Unlike userfaultfd, it watches any
// memory (file mappings too), and munmap never waits for a thread of ours.
//
// In a forked child the file is the parent's (the module answers EBADF):
// nothing is asked of it there.

#include <cstddef>
#include <cstdint>
#include <sys/types.h>

#include <rdmax/mem/fork_policy.hpp>
#include <rdmax/stats/publisher.hpp>

namespace rdmax {

namespace detail {
/// What a token that watches nothing points at: odd, so never any token's
/// generation.
inline constexpr unsigned long long kmod_unwatched = 1;
} // namespace detail

class kmod_monitor {
public:
    /// Where the range's generation lives in the status area, and the
    /// generation it had when it was watched: valid() needs nothing else.
    struct token {
        const unsigned long long* where = &detail::kmod_unwatched;
        std::uint64_t generation = 0; ///< 0: not watched
    };

    /// Whether /dev/rdmax opens and speaks this ABI (computed once).
    [[nodiscard]] static bool available() noexcept;

    /// Opens /dev/rdmax and maps its status area; throws rdmax::error naming
    /// what failed (a missing device, another ABI version, ...).
    kmod_monitor();
    kmod_monitor(kmod_monitor&&) noexcept;
    kmod_monitor& operator=(kmod_monitor&&) noexcept;
    ~kmod_monitor();

    /// Watches the pages of [start, start + len). Memory that is not mapped,
    /// or a full table, gives a token for which valid() is false (the cache
    /// then registers per use); other failures throw.
    [[nodiscard]] token watch(std::uintptr_t start, std::size_t len);
    void unwatch(token t) noexcept;
    /// One acquire load of the range's generation in the status area, through
    /// the token's own pointer (the area stays mapped while the monitor lives),
    /// and a compare: no base pointer to reload, no branch. Not in a forked
    /// child, where the area is not mapped: the cache checks the fork
    /// generation before it looks at a token.
    [[nodiscard]] static bool valid(token t) noexcept {
        return __atomic_load_n(t.where, __ATOMIC_ACQUIRE) == t.generation;
    }
    /// Reports the ranges the module saw go away as sink(ctx, start, end).
    void drain(void (*sink)(void*, std::uintptr_t, std::uintptr_t), void* ctx) noexcept;
    /// True when the module has queued events (one load of the status area;
    /// in a forked child, where the area is not mapped, false without
    /// reading it).
    [[nodiscard]] bool pending() const noexcept {
        return fork_generation_ == fork_generation() &&
               __atomic_load_n(pending_, __ATOMIC_ACQUIRE) != 0;
    }

    /// The file descriptor, for tests and for poll().
    [[nodiscard]] int fd() const noexcept { return fd_; }

private:
    void close_all() noexcept;
    void publish_figures() noexcept;

    int fd_ = -1;
    const void* map_ = nullptr;
    std::size_t map_bytes_ = 0;
    // __u64 in the module's interface (unsigned long long on Linux).
    const unsigned long long* generations_ = nullptr;
    const unsigned long long* pending_ = nullptr;
    std::uint32_t fork_generation_ = 0;
    dev_t rdev_ = 0; ///< the device fd_ is, for a child's close
    /// The module's figures for rdmax-stat ("kmod": RDMAX_IOC_QUERY from the
    /// stat thread, once an interval); dropped before fd_ is closed.
    stats::pulled stat_;
};

} // namespace rdmax
