// rpc::detail::endpoint: what is not a template.

#include <sys/random.h>

#include <rdmax/detail/rpc/endpoint.hpp>

namespace rdmax::rpc::detail {

std::uint64_t new_incarnation() noexcept {
    std::uint64_t v = 0;
    // getrandom of 8 bytes from the urandom pool neither blocks (once the
    // pool is ready, at boot) nor returns short.
    while (v == 0)
        if (::getrandom(&v, sizeof v, 0) != static_cast<ssize_t>(sizeof v))
            v = static_cast<std::uint64_t>(sched::coarse_clock::now().time_since_epoch().count()) ^
                reinterpret_cast<std::uintptr_t>(&v);
    return v;
}

} // namespace rdmax::rpc::detail
