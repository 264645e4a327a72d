#pragma once
// Options and counters of registered_arena, with their knobs (arena_knobs,
// RDMAX_ARENA_*).

#include <cstddef>
#include <cstdint>
#include <tuple>

#include <fmt/format.h>

#include <rdmax/config/knob.hpp>
#include <rdmax/mem/rights.hpp>

namespace rdmax {

struct arena_options {
    /// Bytes of each registered area (one memory region, one key): a power of
    /// two of at least 2 MiB, so that areas can sit on huge pages. Larger
    /// requests get an area of their own.
    std::size_t area_bytes = std::size_t{16} << 20;
    /// Registered bytes kept for reuse when nothing uses them; areas wholly
    /// free above this go back to the system (deregistered, then unmapped) in
    /// the background.
    std::size_t high_watermark = std::size_t{256} << 20;
    /// Back areas with 2 MiB pages: MAP_HUGETLB where the system has reserved
    /// some, else transparent huge pages (MADV_HUGEPAGE).
    bool huge_pages = true;
    /// Trim when the system is short of memory (a PSI trigger on
    /// /proc/pressure/memory, where the kernel has one).
    bool trim_under_pressure = true;
    /// Rights of every area's registration. Add rights::mw_bind for handles
    /// by memory window over arena memory (handle_issuer.hpp); with
    /// local_write | mw_bind alone, the areas' own rkeys open nothing to a
    /// peer, and only the handles issued do.
    rights area_rights = all_rights;
    /// Back areas with memfds mapped shared, so that another process on the
    /// node can map them (local/exporter.hpp: one copy, no device). Such
    /// areas are shared with the owner's children after fork() too, where
    /// private memory would be copied: share with care.
    bool shareable = false;

    /// These options with the variables of arena_knobs that are set applied;
    /// a malformed or out-of-range value throws rdmax::error naming the
    /// variable, the value and what it accepts, and nothing is applied.
    [[nodiscard]] arena_options with_env() const;
};

/// RDMAX_ARENA_*: read by with_env() only.
inline constexpr std::tuple arena_knobs{
    config::knob{"RDMAX_ARENA_AREA_BYTES", &arena_options::area_bytes,
                 config::number{.lo = std::size_t{2} << 20, .bytes = true, .power_of_two = true},
                 "bytes per registered area"},
    config::knob{"RDMAX_ARENA_HIGH_WATERMARK", &arena_options::high_watermark,
                 config::number{.bytes = true}, "idle registered bytes kept for reuse"},
    config::knob{"RDMAX_ARENA_HUGE_PAGES", &arena_options::huge_pages, config::flag{},
                 "back areas with 2 MiB pages where allowed"},
    config::knob{"RDMAX_ARENA_PSI", &arena_options::trim_under_pressure, config::flag{},
                 "trim arenas under memory pressure (`/proc/pressure/memory`)"},
};

struct arena_counters {
    std::uint64_t allocations = 0;
    std::uint64_t frees = 0;
    std::uint64_t areas_registered = 0; ///< ever
    std::uint64_t areas_released = 0;   ///< ever: deregistered and unmapped
    std::uint64_t huge_page_areas = 0;  ///< of those registered, on 2 MiB pages
    std::uint64_t trims = 0;            ///< trim() calls, pressure-triggered ones included
    std::uint64_t pressure_events = 0;
    std::uint64_t registered_bytes = 0; ///< now
    std::uint64_t allocated_bytes = 0;  ///< now, in blocks handed out (rounded up)
};

} // namespace rdmax

template <>
struct fmt::formatter<rdmax::arena_counters> {
    constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
    auto format(const rdmax::arena_counters& c, fmt::format_context& ctx) const {
        return fmt::format_to(ctx.out(),
                              "allocations {} frees {} areas registered {} released {} (huge "
                              "pages {}) trims {} pressure events {} registered {} bytes, "
                              "allocated {} bytes",
                              c.allocations, c.frees, c.areas_registered, c.areas_released,
                              c.huge_page_areas, c.trims, c.pressure_events, c.registered_bytes,
                              c.allocated_bytes);
    }
};
