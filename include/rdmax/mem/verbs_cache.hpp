#pragma once
// verbs_cache: the registration cache as production code wants it: verbs
// memory regions in one protection domain, the monitor chosen at run time,
// and RDMAX_RCACHE_* applied to the options unless the caller passes its own.
//
//     auto cache = rdmax::make_verbs_cache(pd);
//     auto src = cache.local<rdmax::access::local_read>(data, n);
//     qp.write(src.buffer, peer, 0, wr_id); // keep src until the write completes

#include <rdmax/mem/auto_monitor.hpp>
#include <rdmax/mem/rcache_options.hpp>
#include <rdmax/mem/registrar.hpp>
#include <rdmax/mem/registration_cache.hpp>
#include <rdmax/verbs/protection_domain.hpp>

namespace rdmax {

using verbs_cache = registration_cache<verbs_registrar, auto_monitor>;

/// A cache for `pd`. The options default to rcache_options{}.with_env(); a
/// malformed RDMAX_RCACHE_* value, or a monitor asked for by name that this
/// process cannot have, throws rdmax::error saying which and why.
[[nodiscard]] inline verbs_cache
make_verbs_cache(const verbs::protection_domain& pd,
                 rcache_options opt = rcache_options{}.with_env()) {
    return verbs_cache(verbs_registrar(pd), auto_monitor(opt.monitor), opt);
}

} // namespace rdmax
