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
    if (auto v = env("RDMAX_RCACHE_MONITOR"); !v.empty()) {
        if (v == "auto")
            o.monitor = monitor_kind::automatic;
        else if (v == "kmod")
            o.monitor = monitor_kind::kmod;
        else if (v == "uffd")
            o.monitor = monitor_kind::uffd;
        else if (v == "manual")
            o.monitor = monitor_kind::manual;
        else if (v == "none")
            o.monitor = monitor_kind::none;
        else
            malformed(who, "RDMAX_RCACHE_MONITOR", v, "auto, kmod, uffd, manual or none");
    }
    return o;
}

} // namespace rdmax
