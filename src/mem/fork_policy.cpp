#include <pthread.h>

#include <rdmax/mem/fork_policy.hpp>

namespace rdmax::detail {

std::atomic<std::uint32_t> fork_generation{0};

namespace {

void in_child() noexcept {
    fork_generation.fetch_add(1, std::memory_order_relaxed);
}

/// Registers the handler when librdmax is loaded; the header's reference to
/// fork_generation pulls this object into every program that can need it.
[[maybe_unused]] const int registered = pthread_atfork(nullptr, nullptr, &in_child);

} // namespace

} // namespace rdmax::detail
