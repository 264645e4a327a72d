#pragma once
// What rdmax does at fork(), and the counter that lets it tell.
//
// A forked child shares the parent's verbs file: deregistering a memory region
// from the child would destroy the parent's. The child's copy of the
// userfaultfd still refers to the parent's address space. So in a child every
// registration cache inherited from the parent becomes inert: get() throws,
// and releasing handles, invalidate(), flush() and the destructor forget
// registrations without deregistering them or touching any monitor, and none
// of them waits for the cache's mutex (a parent thread may have held it at
// fork, and then it stays locked in the child for good). A child
// that needs RDMA opens its own device context and builds its own cache.
//
// rdmax does not MADV_DONTFORK registered memory: that splits mappings until
// vm.max_map_count runs out (Mooncake #3639), and since Linux 5.9 the kernel
// copies pages pinned for DMA into the child at fork, so the parent's
// registrations keep the parent's pages and data.

#include <atomic>
#include <cstdint>

namespace rdmax {

namespace detail {
/// Incremented in every child at fork (a pthread_atfork handler in librdmax).
extern std::atomic<std::uint32_t> fork_generation;
} // namespace detail

/// Changes in the child at every fork(); compare with a value saved earlier
/// to know whether this process is a fork of the one that saved it.
[[nodiscard]] inline std::uint32_t fork_generation() noexcept {
    return detail::fork_generation.load(std::memory_order_relaxed);
}

} // namespace rdmax
