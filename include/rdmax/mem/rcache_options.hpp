#pragma once
// Options of the registration cache, with defaults, and their RDMAX_RCACHE_*
// environment overrides (as UCX_RCACHE_* and FI_MR_CACHE_* are for those
// libraries' users).

#include <cstddef>
#include <cstdint>
#include <string_view>

#include <fmt/format.h>

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
    std::size_t max_count = 4096;
    std::size_t max_bytes = std::size_t{1} << 34; // 16 GiB of pinned memory
    /// Register with IBV_ACCESS_ON_DEMAND: nothing is pinned, and the device
    /// follows the process's page tables. Only where the device has on-demand
    /// paging (make_verbs_cache refuses otherwise); soft-RoCE has it from
    /// Linux 6.15 on.
    bool on_demand = false;
    /// Which monitor auto_monitor uses (see auto_monitor.hpp).
    monitor_kind monitor = monitor_kind::automatic;

    /// These options with RDMAX_RCACHE_ENABLE (0/1), RDMAX_RCACHE_MAX_COUNT,
    /// RDMAX_RCACHE_MAX_BYTES (a number, with K/M/G/T suffix allowed),
    /// RDMAX_RCACHE_ODP (0/1) and
    /// RDMAX_RCACHE_MONITOR (auto|kmod|uffd|manual|none) applied; a malformed
    /// value throws rdmax::error naming the variable.
    [[nodiscard]] rcache_options with_env() const;
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
            "lookups {} hits {} misses {} merges {} evictions {} invalidations {} "
            "registrations {} uncached {} registered {} ({} bytes)",
            c.lookups, c.hits, c.misses, c.merges, c.evictions, c.invalidations, c.registrations,
            c.uncached, c.registered_count, c.registered_bytes);
    }
};
