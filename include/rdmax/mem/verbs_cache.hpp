#pragma once
// verbs_cache: the registration cache as production code wants it: verbs
// memory regions in one protection domain, the monitor chosen at run time,
// and RDMAX_RCACHE_* applied to the options unless the caller passes its own.
//
//     auto cache = rdmax::make_verbs_cache(pd);
//     auto src = cache.local<rdmax::rights::local_read>(data, n);
//     qp.write(src.buffer, peer, 0, wr_id); // keep src until the write completes

#include <cerrno>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/auto_monitor.hpp>
#include <rdmax/mem/on_demand_check.hpp>
#include <rdmax/mem/rcache_options.hpp>
#include <rdmax/mem/registrar.hpp>
#include <rdmax/mem/registration_cache.hpp>
#include <rdmax/verbs/protection_domain.hpp>

namespace rdmax {

using verbs_cache = registration_cache<verbs_registrar, auto_monitor>;

/// A cache for `pd`. The options default to rcache_options{}.with_env(), and
/// limits left at 0 come from the device (rcache_options::with_device_limits); a
/// malformed RDMAX_RCACHE_* value, or a monitor asked for by name that this
/// process cannot have, throws rdmax::error saying which and why.
///
/// With on_demand (RDMAX_RCACHE_ODP=1) the device's on-demand paging is
/// checked first (check_on_demand: capabilities and a self-test, once per
/// device); where it cannot be trusted, this throws ENOTSUP with the reason,
/// rather than hand out registrations that might move wrong bytes. An ODP
/// registration follows the process's page tables, so it cannot go stale:
/// with monitor automatic the cache then watches nothing (manual), keeping
/// its registrations until they are evicted or invalidate()d.
[[nodiscard]] inline verbs_cache
make_verbs_cache(const verbs::protection_domain& pd,
                 rcache_options opt = rcache_options{}.with_env()) {
    if (opt.on_demand) {
        if (const on_demand_verdict v = check_on_demand(pd); !v.usable())
            throw_error("make_verbs_cache", ENOTSUP,
                        fmt::format("{}: register pinned (RDMAX_RCACHE_ODP=0)", v.problem));
        if (opt.monitor == monitor_kind::automatic)
            opt.monitor = monitor_kind::manual;
    }
    opt = opt.with_device_limits(pd.device().limits());
    return verbs_cache(verbs_registrar(pd, opt.on_demand), auto_monitor(opt.monitor), opt);
}

} // namespace rdmax
