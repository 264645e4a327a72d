// rpc::server: its links' other rails (include/rdmax/detail/rpc/server_rails.hpp).

#include <algorithm>
#include <cerrno>

#include <rdmax/detail/rpc/rdma_link.hpp>
#include <rdmax/detail/rpc/server_rails.hpp>
#include <rdmax/rpc/server.hpp>

namespace rdmax::rpc::detail {

server_rails::server_rails(const verbs::rail_set& rails, std::uint16_t port)
    : set(&rails) {
    for (std::size_t k = 1; k < rails.size() && k < max_link_rails; ++k)
        listeners[k].emplace(rails[k].address, port);
}

verbs_cache& rail_cache(std::unique_ptr<verbs_cache>& slot, const verbs::protection_domain& pd) {
    // The cache cannot move: new builds it in place (as client::cache()).
    if (!slot) {
        // NOLINTBEGIN(modernize-make-unique)
        slot = std::unique_ptr<verbs_cache>(new verbs_cache(make_verbs_cache(pd)));
        // NOLINTEND(modernize-make-unique)
    }
    return *slot;
}

verbs_cache& server_rails::cache(std::size_t k) {
    return rail_cache(caches[k], set->pd(k));
}

std::uint8_t ports_down(const verbs::rail_set& set) noexcept {
    std::uint8_t down = 0;
    for (std::size_t k = 1; k < set.size() && k < max_link_rails; ++k) {
        try {
            if (set.port_now(k).state != IBV_PORT_ACTIVE)
                down = static_cast<std::uint8_t>(down | (1U << k));
        } catch (...) {
            down = static_cast<std::uint8_t>(down | (1U << k)); // the device cannot say: down
        }
    }
    return down;
}

namespace {
/// The live link (through the device) that `j` names, or nullopt.
template <class Peers>
std::optional<std::uint32_t> link_of(const Peers& peers, const rail_join& j) noexcept {
    for (std::uint32_t i = 0; i < peers.size(); ++i) {
        const auto& p = peers[i];
        // join_key is set only on a link accept_one made (an rdma_link).
        if (p.wire && !p.wire->broken && p.join_key == j.link_key && p.incarnation == j.incarnation)
            return i;
    }
    return std::nullopt;
}
} // namespace

void server_rails::accept(server& s) noexcept {
    server_rails& r = *s.rails_;
    for (std::size_t k = 1; k < max_link_rails; ++k) {
        if (!r.listeners[k])
            continue;
        try {
            while (std::optional<verbs::connection_request> req = r.listeners[k]->poll_request()) {
                const std::optional<rail_join> j = req->peer_payload_as<rail_join>();
                const char* bad = !j ? "no rail join" : check_join(*j);
                const std::optional<std::uint32_t> at =
                    bad == nullptr ? link_of(s.ep_.peers, *j) : std::nullopt;
                if (bad == nullptr && !at)
                    bad = "a join for no link of this server";
                if (bad == nullptr && r.pending.size() >= s.opts_.max_peers)
                    bad = "too many joins at once";
                if (bad == nullptr &&
                    std::any_of(r.pending.begin(), r.pending.end(), [&](const joining& p) {
                        return p.peer == *at && p.link_key == j->link_key && p.rail == j->rail;
                    }))
                    bad = "that rail of the link is joining already";
                if (bad != nullptr) {
                    s.ep_.counters.count_refusal_fmt(EPROTO, "rail {} connection request: {}", k,
                                                     bad);
                    req->reject();
                    continue;
                }
                const std::uint16_t slots = s.ep_.peers[*at].wire->slots();
                req->create_qp(r.set->pd(k),
                               rail_qp_config(slots, r.set->pd(k).device().limits(), false));
                // The answer echoes the join; the handshake ends later
                // (progress() looks for it, as for a link's own).
                verbs::connection conn = req->accept_nowait(verbs::payload_of(*j));
                r.pending.push_back({*at, j->link_key, j->rail, static_cast<std::uint32_t>(k),
                                     std::move(conn), s.ep_.now() + s.opts_.connect_timeout});
            }
        } catch (...) {
            s.refuse_current("rail connection request");
        }
    }
}

void server_rails::progress(server& s) noexcept {
    server_rails& r = *s.rails_;
    const auto now = s.ep_.now();
    for (std::size_t i = 0; i < r.pending.size();) {
        joining& p = r.pending[i];
        auto& peers = s.ep_.peers;
        const bool link_there = p.peer < peers.size() && peers[p.peer].wire &&
                                !peers[p.peer].wire->broken && peers[p.peer].join_key == p.link_key;
        bool done = !link_there || now >= p.by;
        if (!done && p.conn->established()) {
            auto& wire = static_cast<rdma_link&>(*peers[p.peer].wire);
            try {
                // Refused while the rail's old connection is still joined
                // (its loss not yet seen) or its pieces still out: tried
                // again at the next round, until the deadline.
                const rail_context ctx{&r.cache(p.device_rail), (*r.set)[p.device_rail].gbps,
                                       &s.ep_.counters, r.stripe, p.device_rail};
                if (wire.join_rail(p.rail, std::move(*p.conn), ctx, s.opts_.scheduler)) {
                    ++s.ep_.counters.rail_joins;
                    done = true;
                } else if (wire.rail_up(p.rail)) {
                    // The client dials a rail only once it lost it (a join
                    // with the link's key and client is its word): the old
                    // one goes, half open here (its port went down there,
                    // and no disconnect came), then this joins once its
                    // pieces are back. Else tried again, until the deadline.
                    wire.rail_lost(p.rail);
                }
            } catch (...) {
                s.refuse_current("rail join");
                done = true;
            }
        }
        if (!done) {
            ++i;
            continue;
        }
        r.pending.erase(r.pending.begin() + static_cast<std::ptrdiff_t>(i));
    }
    const std::uint8_t down = ports_down(*r.set);
    for (auto& p : s.ep_.peers) {
        if (!p.wire || p.wire->broken || p.join_key == 0)
            continue;
        auto& wire = static_cast<rdma_link&>(*p.wire);
        wire.tend();
        if (down != 0)
            wire.ports_down(down);
    }
}

} // namespace rdmax::rpc::detail
