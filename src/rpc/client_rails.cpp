// rpc::client: its links' other rails (include/rdmax/detail/rpc/client_rails.hpp).

#include <algorithm>

#include <rdmax/detail/rpc/client_rails.hpp>
#include <rdmax/detail/rpc/rdma_link.hpp>
#include <rdmax/detail/rpc/server_rails.hpp>
#include <rdmax/rpc/client.hpp>

namespace rdmax::rpc::detail {

void client_rails::name_rails(std::uint32_t s, std::span<const std::string> addresses) {
    if (sessions.size() <= s)
        sessions.resize(std::size_t{s} + 1);
    sessions[s] = {};
    sessions[s].peer.assign(addresses.begin(), addresses.end());
}

verbs_cache& client_rails::cache(std::size_t k) {
    return rail_cache(caches[k], set->pd(k));
}

namespace {
/// The dial's connection, if it made one that answered the join as asked.
std::optional<verbs::connection> joined(std::future<verbs::connection>& f,
                                        const rail_join& asked) noexcept {
    try {
        verbs::connection c = f.get();
        const std::optional<rail_join> echo = c.peer_payload_as<rail_join>();
        if (echo && echo->rail == asked.rail && echo->link_key == asked.link_key &&
            echo->incarnation == asked.incarnation)
            return c;
    } catch (...) {
        // Refused, unreachable, past the connect timeout: dialed again later.
    }
    return std::nullopt;
}
} // namespace

void client_rails::tend(client& c, sched::coarse_clock::time_point now) noexcept {
    client_rails& r = *c.rails_;
    const std::uint8_t down = r.sessions.empty() ? 0 : ports_down(*r.set);
    for (std::uint32_t s = 0; s < r.sessions.size(); ++s) {
        if (r.sessions[s].peer.empty() || s >= c.sessions_.size())
            continue;
        const client::session& ss = c.sessions_[s];
        if (!ss.used || ss.link == client::no_link)
            continue;
        client::peer& l = c.ep_.peers[ss.link];
        // join_key is set only on a link finish_device made (an rdma_link).
        if (!l.wire || l.wire->broken || l.wire->join_key == 0)
            continue;
        auto& wire = static_cast<rdma_link&>(*l.wire);
        wire.tend();
        if (down != 0)
            wire.ports_down(down);
        const std::size_t rails = std::min<std::size_t>(r.set->size(), max_link_rails);
        for (std::uint32_t k = 1; k < rails; ++k) {
            rail_dial& d = r.sessions[s].dials[k];
            if (d.conn.valid())
                r.finish_dial(c, wire, k, d, now);
            else if (!wire.rail_up(k) && now >= d.next_try && ((down >> k) & 1U) == 0)
                r.start_dial(c, wire, s, k, now); // not joined, its delay over, its port up
        }
    }
}

void client_rails::finish_dial(client& c, rdma_link& wire, std::uint32_t k, rail_dial& d,
                               sched::coarse_clock::time_point now) noexcept {
    if (d.conn.wait_for(std::chrono::seconds(0)) != std::future_status::ready)
        return;
    const rail_join asked{.rail = static_cast<std::uint16_t>(k),
                          .incarnation = c.ep_.incarnation,
                          .link_key = d.link_key};
    std::optional<verbs::connection> conn = joined(d.conn, asked);
    try {
        // For this link still (not one made since), and not joined meanwhile.
        if (conn && d.link_key == wire.join_key && !wire.rail_up(k) &&
            wire.join_rail(k, std::move(*conn), {&cache(k), (*set)[k].gbps, nullptr, stripe, k},
                           c.opts_.scheduler)) {
            ++c.ep_.counters.rail_joins;
            d.backoff = {};
            return;
        }
    } catch (...) {
        // No memory for the rail's windows or cache: dialed again later.
    }
    d.backoff = std::clamp(d.backoff * 2, c.opts_.reconnect_backoff, c.opts_.reconnect_backoff_max);
    d.next_try = now + d.backoff;
}

void client_rails::start_dial(client& c, const rdma_link& wire, std::uint32_t s, std::uint32_t k,
                              sched::coarse_clock::time_point now) noexcept {
    session_rails& sr = sessions[s];
    rail_dial& d = sr.dials[k];
    std::optional<std::size_t> at;
    try {
        at = set->peer_for(k, sr.peer);
    } catch (...) {
        // An address that does not parse: no match.
    }
    if (!at)
        return; // the server has no address on this rail's subnet
    d.link_key = wire.join_key;
    const rail_join join{.rail = static_cast<std::uint16_t>(k),
                         .incarnation = c.ep_.incarnation,
                         .link_key = d.link_key};
    const client::session& ss = c.sessions_[s];
    try {
        // On a thread: rdma_cm's resolution and handshake block. It reads
        // only what is copied and the set (const).
        d.conn = std::async(
            std::launch::async,
            [rails = set, k, where = sr.peer[*at], port = ss.port, join,
             cfg = rail_qp_config(ss.slots, set->pd(k).device().limits(), c.windows_wanted()),
             timeout = c.opts_.connect_timeout] {
                return rails->connect(k, where, port, verbs::payload_of(join), cfg, timeout);
            });
    } catch (...) {
        d.next_try = now + c.opts_.reconnect_backoff_max; // no thread now
    }
}

} // namespace rdmax::rpc::detail
