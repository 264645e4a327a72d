#pragma once
// The address an RPC example listens on when given none: the IPv4 address of
// the first device with an ACTIVE port (192.0.2.1 in the rdmax VM). A
// listener needs a device's address: on a wildcard one, rdma_cm could not say
// on which device to make the queue pairs.

#include <optional>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

namespace rdmax::examples {

/// The first device with an ACTIVE port, or none: on a machine without RDMA
/// the RPC examples serve and reach the processes of this node only.
inline std::optional<verbs::context> active_device() {
    try {
        return verbs::context::open_first_active();
    } catch (const rdmax::error&) {
        return std::nullopt;
    }
}

/// Its RoCE v2 GID is the address mapped into IPv6 (::ffff:a.b.c.d).
inline std::string first_active_ipv4() {
    const verbs::context ctx = verbs::context::open_first_active();
    const auto g = ctx.preferred_gid(1);
    if (!g || !g->value.is_ipv4_mapped())
        throw std::runtime_error(
            fmt::format("{} has no IPv4 address to listen on: pass --addr ADDR", ctx.name()));
    const auto& r = g->value.raw;
    return fmt::format("{}.{}.{}.{}", r[12], r[13], r[14], r[15]);
}

} // namespace rdmax::examples
