#include <rdmax/mem/rcache_options.hpp>

#include "../env_knobs.hpp"

namespace rdmax {

rcache_options rcache_options::with_env() const {
    using namespace detail;
    constexpr const char* who = "rcache_options::with_env";
    rcache_options o = *this;
    if (auto v = env("RDMAX_RCACHE_ENABLE"); !v.empty())
        o.enable = parse_flag(who, "RDMAX_RCACHE_ENABLE", v);
    if (auto v = env("RDMAX_RCACHE_ODP"); !v.empty())
        o.on_demand = parse_flag(who, "RDMAX_RCACHE_ODP", v);
    if (auto v = env("RDMAX_RCACHE_MAX_COUNT"); !v.empty())
        o.max_count = parse_size(who, "RDMAX_RCACHE_MAX_COUNT", v);
    if (auto v = env("RDMAX_RCACHE_MAX_BYTES"); !v.empty())
        o.max_bytes = parse_size(who, "RDMAX_RCACHE_MAX_BYTES", v);
    if (auto v = env("RDMAX_RCACHE_MONITOR"); !v.empty())
        o.monitor = parse_choice<monitor_kind>(who, "RDMAX_RCACHE_MONITOR", v,
                                               {{"auto", monitor_kind::automatic},
                                                {"kmod", monitor_kind::kmod},
                                                {"uffd", monitor_kind::uffd},
                                                {"manual", monitor_kind::manual},
                                                {"none", monitor_kind::none}});
    return o;
}

} // namespace rdmax
