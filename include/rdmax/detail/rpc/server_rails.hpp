#pragma once
// What an rpc::server keeps for its links' other rails (rpc_options::rails):
// a listener on each other rail's address at the server's port, the
// connections that asked to join a link and wait for their handshake, and a
// registration cache per rail for the body blocks it cuts across them.
// Machinery of server.hpp (src/rpc/server_rails.cpp).

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <rdmax/detail/rpc/wire.hpp>
#include <rdmax/mem/verbs_cache.hpp>
#include <rdmax/sched/coarse_clock.hpp>
#include <rdmax/sched/stripe_options.hpp>
#include <rdmax/verbs/connection.hpp>
#include <rdmax/verbs/listener.hpp>
#include <rdmax/verbs/rail_set.hpp>

namespace rdmax::rpc {
class server;
} // namespace rdmax::rpc

namespace rdmax::rpc::detail {

/// The rails of `set` (past rail 0) whose port is not ACTIVE now (bit k):
/// a port query each (a system call each on soft-RoCE).
[[nodiscard]] std::uint8_t ports_down(const verbs::rail_set& set) noexcept;
/// The registration cache in `slot`, made on `pd` at its first use (a
/// rail's, at either end).
verbs_cache& rail_cache(std::unique_ptr<verbs_cache>& slot, const verbs::protection_domain& pd);

struct server_rails {
    /// Listens on rails 1.. of `set` at `port` (watched by the server's inbox).
    server_rails(const verbs::rail_set& set, std::uint16_t port);

    /// Connection requests on the rails' listeners: each one that names a
    /// live link of this server (its join key and client) is accepted and
    /// waits for its handshake; the others are refused, counted.
    static void accept(server& s) noexcept;
    /// The joins whose handshake ended go to their links; those past the
    /// connect timeout, or whose link went, are dropped. And every link's
    /// rails are tended (a failed or closed rail is taken out).
    static void progress(server& s) noexcept;

    /// Rail k's registration cache, made at its first use.
    verbs_cache& cache(std::size_t k);

    struct joining {
        std::uint32_t peer = 0;        ///< its link's index
        std::uint64_t link_key = 0;    ///< the link's key when it asked (a new link: dropped)
        std::uint32_t rail = 0;        ///< the link's rail it joins as (the client's index)
        std::uint32_t device_rail = 0; ///< this server's rail it came in on (its device)
        std::optional<verbs::connection> conn;
        sched::coarse_clock::time_point by{};
    };

    const verbs::rail_set* set;
    sched::stripe_options stripe = sched::stripe_options{}.with_env();
    std::array<std::optional<verbs::listener>, max_link_rails> listeners;
    std::array<std::unique_ptr<verbs_cache>, max_link_rails> caches;
    std::vector<joining> pending;
};

} // namespace rdmax::rpc::detail
