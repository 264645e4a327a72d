#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/rcache_options.hpp>

#include "../env_knobs.hpp"

namespace rdmax {

using detail::env;
using detail::malformed;
using detail::parse_flag;
using detail::parse_size;

rcache_options rcache_options::with_env() const {
    rcache_options o = *this;
    if (auto v = env("RDMAX_RCACHE_ENABLE"); !v.empty())
        o.enable = parse_flag("rcache_options::with_env", "RDMAX_RCACHE_ENABLE", v);
    if (auto v = env("RDMAX_RCACHE_ODP"); !v.empty())
        o.on_demand = parse_flag("rcache_options::with_env", "RDMAX_RCACHE_ODP", v);
    if (auto v = env("RDMAX_RCACHE_MAX_COUNT"); !v.empty())
        o.max_count = parse_size("rcache_options::with_env", "RDMAX_RCACHE_MAX_COUNT", v);
    if (auto v = env("RDMAX_RCACHE_MAX_BYTES"); !v.empty())
        o.max_bytes = parse_size("rcache_options::with_env", "RDMAX_RCACHE_MAX_BYTES", v);
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
            malformed("rcache_options::with_env", "RDMAX_RCACHE_MONITOR", v,
                      "auto, kmod, uffd, manual or none");
    }
    return o;
}

} // namespace rdmax
