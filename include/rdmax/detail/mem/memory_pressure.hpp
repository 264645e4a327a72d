#pragma once
// memory_pressure: tells its subscribers when the system is short of memory,
// from a PSI trigger on /proc/pressure/memory ("some" stall of 150 ms within
// any 2 s), watched by one background thread per process. Arenas subscribe
// to give idle registered areas back (registered_arena.hpp).
//
// Where the kernel has no PSI (or it is disabled: Debian boots with psi=0
// unless told psi=1) or the process may not create triggers, available() is
// false and says why; subscribing then does nothing.

#include <functional>
#include <memory>
#include <string>

namespace rdmax {

class memory_pressure_subscription {
public:
    /// Calls `on_pressure` from the watcher thread at each pressure event,
    /// until destroyed. It must not block on anything a thread that
    /// allocates could hold.
    explicit memory_pressure_subscription(std::function<void()> on_pressure);
    memory_pressure_subscription(const memory_pressure_subscription&) = delete;
    memory_pressure_subscription& operator=(const memory_pressure_subscription&) = delete;
    /// Waits for a running call to end.
    ~memory_pressure_subscription();

    /// Whether PSI triggers work here; if not, why (computed once).
    [[nodiscard]] static bool available(std::string* why = nullptr);

    struct entry;

private:
    std::unique_ptr<entry> entry_;
};

namespace detail {
/// Calls every subscriber as a pressure event would (for tests).
void simulate_memory_pressure();
} // namespace detail

} // namespace rdmax
