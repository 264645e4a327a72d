#pragma once
// Who a process is, beyond its pid (which the kernel reuses): its start time
// and its name, from /proc. What tells a stat segment's process from another
// that got its pid later.

#include <cstdint>
#include <string>
#include <sys/types.h>

namespace rdmax::stats {

/// /proc/PID/stat's starttime (field 22, clock ticks after boot): another
/// process that takes the pid later differs. 0: no such process, one that
/// has exited (a zombie), or /proc unreadable. (Also what the RPC client's
/// CMA grant is checked against.)
[[nodiscard]] std::uint64_t start_ticks_of(pid_t pid) noexcept;

/// /proc/PID/comm without its newline; empty when unreadable.
[[nodiscard]] std::string comm_of(pid_t pid);

} // namespace rdmax::stats
