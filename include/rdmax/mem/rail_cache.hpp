#pragma once
// rail_cache: the registration cache over a set of rails: one lookup
// registers a range in every rail's protection domain (once per device) and
// hands back every rail's key (issue 31).
//
//     verbs::rail_set rails = verbs::rail_set::discover();
//     rdmax::rail_cache cache = rdmax::make_rail_cache(rails);
//     auto h = cache.get<rights::local_read>(data, n);
//     auto src = rail_verbs_registrar::local<rights::local_read>(h.registration(), data, n);
//     striper.write(prio, src, peer, 0, wr_id); // keep h until it completes

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/auto_monitor.hpp>
#include <rdmax/mem/on_demand_check.hpp>
#include <rdmax/mem/rail_registrar.hpp>
#include <rdmax/mem/rcache_options.hpp>
#include <rdmax/mem/registrar.hpp>
#include <rdmax/mem/registration_cache.hpp>
#include <rdmax/verbs/rail_set.hpp>

namespace rdmax {

using rail_verbs_registrar = rail_registrar<verbs_registrar>;
using rail_cache = registration_cache<rail_verbs_registrar, auto_monitor>;

/// A registrar over `rails`: one verbs_registrar per device, each rail's
/// keys from its device's. The set must outlive it.
[[nodiscard]] inline rail_verbs_registrar make_rail_registrar(const verbs::rail_set& rails,
                                                              bool on_demand = false) {
    if (rails.empty())
        throw_error("make_rail_registrar", EINVAL, "no rails (RDMAX_RAILS=off?)");
    std::vector<verbs_registrar> per_domain;
    for (std::size_t d = 0; d < rails.domains(); ++d)
        per_domain.emplace_back(rails.domain(d), on_demand);
    std::vector<std::uint8_t> domain_of;
    for (const verbs::rail& r : rails.rails())
        domain_of.push_back(r.domain);
    return rail_verbs_registrar(std::move(per_domain), domain_of);
}
// A temporary set's protection domains would go with it.
rail_verbs_registrar make_rail_registrar(const verbs::rail_set&&, bool = false) = delete;

/// make_verbs_cache (verbs_cache.hpp) over every rail. Limits left at 0 come
/// from the devices: the smallest max_count of any, and the byte limit
/// divided by the devices, since each device pins the pages again and every
/// pin counts against the one RLIMIT_MEMLOCK (a byte limit the caller set,
/// RDMAX_RCACHE_MAX_BYTES, is the cache's: it pins that many times the
/// devices). With on_demand every device
/// must pass check_on_demand, or this throws ENOTSUP naming the one that
/// does not.
[[nodiscard]] inline rail_cache make_rail_cache(const verbs::rail_set& rails,
                                                rcache_options opt = rcache_options{}.with_env()) {
    if (rails.empty())
        throw_error("make_rail_cache", EINVAL, "no rails (RDMAX_RAILS=off?)");
    rcache_options limits = opt.with_device_limits(rails.domain(0).device().limits());
    for (std::size_t d = 0; d < rails.domains(); ++d) {
        const verbs::protection_domain& pd = rails.domain(d);
        if (opt.on_demand)
            if (const on_demand_verdict v = check_on_demand(pd); !v.usable())
                throw_error("make_rail_cache", ENOTSUP,
                            fmt::format("{}: {}: register pinned (RDMAX_RCACHE_ODP=0)",
                                        pd.device().name(), v.problem));
        // The smallest limit any device has (0: none).
        const rcache_options one = opt.with_device_limits(pd.device().limits());
        if (one.max_count != 0 && (limits.max_count == 0 || one.max_count < limits.max_count))
            limits.max_count = one.max_count;
    }
    if (opt.max_bytes == 0 && limits.max_bytes != 0)
        limits.max_bytes = std::max<std::size_t>(limits.max_bytes / rails.domains(), 1);
    if (limits.on_demand && limits.monitor == monitor_kind::automatic)
        limits.monitor = monitor_kind::manual;
    return rail_cache(make_rail_registrar(rails, limits.on_demand), auto_monitor(limits.monitor),
                      limits);
}
rail_cache make_rail_cache(const verbs::rail_set&&, rcache_options = {}) = delete;

} // namespace rdmax
