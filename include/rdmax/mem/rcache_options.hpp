#pragma once
// Options of the registration cache, with defaults, and their knobs
// (rcache_knobs, RDMAX_RCACHE_*; as UCX_RCACHE_* and FI_MR_CACHE_* are for
// those libraries' users).

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <tuple>

#include <fmt/format.h>

#include <rdmax/config/knob.hpp>
#include <rdmax/verbs/device_limits.hpp>

namespace rdmax {

enum class monitor_kind : std::uint8_t { automatic, kmod, uffd, manual, none };

[[nodiscard]] constexpr std::string_view to_string(monitor_kind k) noexcept {
    switch (k) {
    case monitor_kind::automatic: return "auto";
    case monitor_kind::kmod: return "kmod";
    case monitor_kind::uffd: return "uffd";
    case monitor_kind::manual: return "manual";
    case monitor_kind::none: return "none";
    }
    return "?";
}

struct rcache_options {
    /// false: every get() registers and the release deregisters (no caching).
    bool enable = true;
    /// Idle registrations are evicted above either limit. Registrations in
    /// use are never evicted, so the cache may exceed them while they are.
    /// 0 (the default): derived. make_verbs_cache derives them from the device
    /// and the process (with_device_limits); a cache built directly has none.
    std::size_t max_count = 0;
    std::size_t max_bytes = 0;
    /// Register with IBV_ACCESS_ON_DEMAND: nothing is pinned, and the device
    /// follows the process's page tables. Only where the device has on-demand
    /// paging (make_verbs_cache refuses otherwise); soft-RoCE has it from
    /// Linux 6.15 on.
    bool on_demand = false;
    /// Which monitor auto_monitor uses (see auto_monitor.hpp).
    monitor_kind monitor = monitor_kind::automatic;

    /// These options with the variables of rcache_knobs that are set applied;
    /// a malformed or out-of-range value throws rdmax::error naming the
    /// variable, the value and what it accepts, and nothing is applied.
    [[nodiscard]] rcache_options with_env() const;

    /// These options with a limit left at 0 taken from `dev` and this process:
    /// max_count half the device's max_mr (the rest is the application's and
    /// its arenas'); max_bytes half of RLIMIT_MEMLOCK, or no limit where
    /// pinning has none (an unlimited rlimit, CAP_IPC_LOCK) or nothing is
    /// pinned (on_demand). A constant would be wrong for most devices: 4096,
    /// the old default, made a working set of 16 k one-page buffers miss on
    /// every access where the device holds 2^20 registrations.
    [[nodiscard]] rcache_options with_device_limits(const verbs::device_limits& dev) const;
};

/// RDMAX_RCACHE_*: read by with_env() only (make_verbs_cache's default options).
inline constexpr std::tuple rcache_knobs{
    config::knob{"RDMAX_RCACHE_ENABLE", &rcache_options::enable, config::flag{},
                 "`0`: every `get` registers, its release deregisters"},
    config::knob{"RDMAX_RCACHE_MAX_COUNT", &rcache_options::max_count,
                 config::number{.zero_word = "auto"},
                 "idle registrations evicted above this many; `auto`: half the device's `max_mr`"},
    config::knob{"RDMAX_RCACHE_MAX_BYTES", &rcache_options::max_bytes,
                 config::number{.bytes = true, .zero_word = "auto"},
                 "... or above this many bytes; `auto`: half `RLIMIT_MEMLOCK`, no limit where "
                 "pinning has none (unlimited, `CAP_IPC_LOCK`) or with ODP"},
    config::knob{"RDMAX_RCACHE_MONITOR", &rcache_options::monitor,
                 config::one_of<monitor_kind>({{"auto", monitor_kind::automatic},
                                               {"kmod", monitor_kind::kmod},
                                               {"uffd", monitor_kind::uffd},
                                               {"manual", monitor_kind::manual},
                                               {"none", monitor_kind::none}}),
                 "what watches cached memory; one named that cannot be had is an error"},
    config::knob{"RDMAX_RCACHE_ODP", &rcache_options::on_demand, config::flag{},
                 "`1`: register with `IBV_ACCESS_ON_DEMAND` (refused, with why, unless the device "
                 "passes rdmax's ODP check); the cache then watches nothing under `auto`"},
};

/// What the cache has done, for users to print.
struct rcache_counters {
    std::uint64_t lookups = 0;
    std::uint64_t hits = 0;
    std::uint64_t misses = 0;
    std::uint64_t merges = 0;
    std::uint64_t evictions = 0;
    std::uint64_t invalidations = 0;
    std::uint64_t registrations = 0;
    /// Requests served by a registration of their own, not cached: caching
    /// off, memory the monitor cannot watch, or a merge that could not register.
    std::uint64_t uncached = 0;
    /// Misses that registered again a range evicted moments before (among the
    /// last 64 evictions): the limits are below the working set.
    std::uint64_t thrash = 0;
    std::uint64_t registered_count = 0; ///< now
    std::uint64_t registered_bytes = 0; ///< now
};

} // namespace rdmax

template <>
struct fmt::formatter<rdmax::rcache_counters> {
    constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
    auto format(const rdmax::rcache_counters& c, fmt::format_context& ctx) const {
        return fmt::format_to(
            ctx.out(),
            "lookups {} hits {} misses {} merges {} evictions {} thrash {} invalidations {} "
            "registrations {} uncached {} registered {} ({} bytes)",
            c.lookups, c.hits, c.misses, c.merges, c.evictions, c.thrash, c.invalidations,
            c.registrations, c.uncached, c.registered_count, c.registered_bytes);
    }
};
