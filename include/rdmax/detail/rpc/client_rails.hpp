#pragma once
// What an rpc::client keeps for its links' other rails (rpc_options::rails):
// per session, the server's rail addresses and the dials under way (on a
// thread each: rdma_cm's resolution and handshake block), and per rail a
// registration cache for the calls' buffers shown there. Machinery of
// client.hpp (src/rpc/client_rails.cpp).

#include <array>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include <rdmax/detail/rpc/wire.hpp>
#include <rdmax/mem/verbs_cache.hpp>
#include <rdmax/sched/coarse_clock.hpp>
#include <rdmax/sched/stripe_options.hpp>
#include <rdmax/verbs/connection.hpp>
#include <rdmax/verbs/listener.hpp>
#include <rdmax/verbs/rail_set.hpp>

namespace rdmax::rpc {
class client;
} // namespace rdmax::rpc

namespace rdmax::rpc::detail {

class rdma_link;

struct client_rails {
    explicit client_rails(const verbs::rail_set& rails)
        : set(&rails) {}

    /// Session s's server has these addresses on its rails.
    void name_rails(std::uint32_t s, std::span<const std::string> addresses);
    /// Dials the rails of each session's link that are not joined (after a
    /// delay that doubles while they fail), joins the dials that ended, and
    /// tends the links' rails (a failed or closed one is taken out).
    static void tend(client& c, sched::coarse_clock::time_point now) noexcept;

    struct rail_dial;
    /// Session s's rail k dials the server's address on its subnet (on a thread).
    void start_dial(client& c, const rdma_link& wire, std::uint32_t s, std::uint32_t k,
                    sched::coarse_clock::time_point now) noexcept;
    /// Rail k's dial, if it ended: joined to `wire`, else dialed again after a delay.
    void finish_dial(client& c, rdma_link& wire, std::uint32_t k, rail_dial& d,
                     sched::coarse_clock::time_point now) noexcept;

    /// Rail k's registration cache, made at its first use.
    verbs_cache& cache(std::size_t k);

    struct rail_dial {
        std::future<verbs::connection> conn;
        std::uint64_t link_key = 0; ///< the link it joins (a newer link: dropped)
        sched::coarse_clock::time_point next_try{};
        std::chrono::milliseconds backoff{0};
    };
    struct session_rails {
        std::vector<std::string> peer; ///< the server's addresses (empty: no rails)
        std::array<rail_dial, max_link_rails> dials;
    };

    const verbs::rail_set* set;
    sched::stripe_options stripe = sched::stripe_options{}.with_env();
    std::array<std::unique_ptr<verbs_cache>, max_link_rails> caches;
    std::vector<session_rails> sessions; ///< by session index
};

} // namespace rdmax::rpc::detail
