#include <rdmax/mem/arena_options.hpp>

#include "../env_knobs.hpp"

namespace rdmax {

arena_options arena_options::with_env() const {
    using namespace detail;
    constexpr const char* who = "arena_options::with_env";
    arena_options o = *this;
    if (auto v = env("RDMAX_ARENA_AREA_BYTES"); !v.empty()) {
        o.area_bytes = parse_size(who, "RDMAX_ARENA_AREA_BYTES", v);
        if (o.area_bytes < (std::size_t{2} << 20) || (o.area_bytes & (o.area_bytes - 1)) != 0)
            malformed(who, "RDMAX_ARENA_AREA_BYTES", v, "a power of two of at least 2M");
    }
    if (auto v = env("RDMAX_ARENA_HIGH_WATERMARK"); !v.empty())
        o.high_watermark = parse_size(who, "RDMAX_ARENA_HIGH_WATERMARK", v);
    if (auto v = env("RDMAX_ARENA_HUGE_PAGES"); !v.empty())
        o.huge_pages = parse_flag(who, "RDMAX_ARENA_HUGE_PAGES", v);
    if (auto v = env("RDMAX_ARENA_PSI"); !v.empty())
        o.trim_under_pressure = parse_flag(who, "RDMAX_ARENA_PSI", v);
    return o;
}

} // namespace rdmax
