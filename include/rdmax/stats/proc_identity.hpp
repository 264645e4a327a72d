#pragma once
// Who a process is, beyond its pid (which the kernel reuses): its start time
// and its name, from /proc. What tells a stat segment's process from another
// that got its pid later.

#include <cstdint>
#include <string>
#include <sys/types.h>

namespace rdmax::stats {

/// /proc/PID/stat's starttime (field 22, clock ticks after boot); 0: no
/// such process (or /proc unreadable).
[[nodiscard]] std::uint64_t start_ticks_of(pid_t pid) noexcept;

/// /proc/PID/comm without its newline; empty when unreadable.
[[nodiscard]] std::string comm_of(pid_t pid);

} // namespace rdmax::stats
