#pragma once
// rpc::detail::endpoint: what rpc::client and rpc::server share, once. The
// memory their rings live in and the keys over them, the inbox (one
// completion queue and shared receive queue for every connection, and the
// epoll set the caller sleeps on), the table of connections with their
// generations (a peer_id names one connection, never a later one in its
// place), the map from queue pair numbers to connections, how a connection
// joins and leaves the table, and the sleep/wake protocol of wait().
//
// Each endpoint keeps its own per-connection state (the client's slots, the
// server's slots and body blocks) in a Peer that derives from peer_base.

#include <algorithm>
#include <arpa/inet.h>
#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <infiniband/verbs.h>

#include <rdmax/detail/no_device.hpp>
#include <rdmax/detail/rpc/inbox.hpp>
#include <rdmax/detail/rpc/link.hpp>
#include <rdmax/mem/handle_issuer.hpp>
#include <rdmax/mem/registered_arena.hpp>
#include <rdmax/rpc/peer_id.hpp>
#include <rdmax/rpc/rpc_counters.hpp>
#include <rdmax/rpc/rpc_options.hpp>
#include <rdmax/sched/coarse_clock.hpp>
#include <rdmax/stats/counter_fields.hpp>
#include <rdmax/stats/publisher.hpp>

namespace rdmax::rpc::detail {

/// The keys of the rings: a registration of each ring alone, made before the
/// connection is up (its key travels in the connection's handshake), which a
/// window could not be.
[[nodiscard]] inline handle_options ring_key_options() {
    handle_options h;
    h.revoke = revoke_by::memory_region;
    return h;
}

/// What a receive completion on the inbox brings.
enum class receipt : std::uint8_t {
    imm,     ///< a write-with-immediate: its immediate (host order)
    flushed, ///< nothing: the connection is going away
    bad,     ///< the peer's doing: an error completion but a flush, or another opcode
};
[[nodiscard]] inline receipt receipt_of(const ibv_wc& wc, std::uint32_t& imm) noexcept {
    if (wc.status == IBV_WC_WR_FLUSH_ERR)
        return receipt::flushed;
    // Not success: a send into a zero-length receive (local length error)...
    if (wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM ||
        (wc.wc_flags & IBV_WC_WITH_IMM) == 0)
        return receipt::bad;
    imm = ntohl(wc.imm_data);
    return receipt::imm;
}

/// The fields of an immediate from `l`'s peer, checked against the
/// link's geometry for a message of kind `k` (none: it may be read).
[[nodiscard]] inline violation checked_imm(std::uint32_t imm, message_kind k, const link& l,
                                           imm_fields& f) noexcept {
    f = decode_imm(imm);
    return check_imm(f, k, l.slots(), l.slot_bytes());
}

/// What an endpoint keeps of every connection.
struct peer_base {
    std::uint32_t generation = 0;
    std::unique_ptr<link> wire; ///< null: a free entry of the table
    /// The peer's incarnation, as its handshake said (ring_offer::incarnation).
    std::uint64_t incarnation = 0;
    // Keepalive: `heard` is set by whatever the peer sends (a store on the
    // call path, no clock read); housekeeping turns it into last_heard.
    bool heard = false;
    sched::coarse_clock::time_point last_heard{};
    /// When the last probe went since the peer was last heard ({}: none).
    sched::coarse_clock::time_point probed{};
    bool pong_owed = false; ///< a probe came: answered at housekeeping (one a round)
    std::uint8_t pings = 0; ///< probes this round: a flood is the peer's fault
};

/// Probes one connection may send in a housekeeping round.
inline constexpr std::uint8_t max_pings_per_round = 8;

/// What keepalive() finds of a connection.
enum class liveness : std::uint8_t {
    fine,   ///< heard from lately, or probed and within its time
    probe,  ///< idle for a keepalive interval: send a probe now
    silent, ///< nothing for keepalive_timeout: declare it gone
};

/// A random incarnation (never 0): one per client or server object.
[[nodiscard]] std::uint64_t new_incarnation() noexcept;

/// The clock of an endpoint's deadlines: the coarse clock, or a test's.
using clock_fn = sched::coarse_clock::time_point (*)() noexcept;

template <class Peer>
class endpoint {
public:
    /// Throws rdmax::error (the arena, the inbox's queues).
    endpoint(const verbs::protection_domain& domain, const rpc_options& opts,
             std::uint32_t inbox_depth)
        : pd(&domain)
        , arena(verbs_registrar(domain), opts.ring_arena())
        , issuer(domain, ring_key_options())
        , in(domain, inbox_depth)
        , housekeeping_(opts.housekeeping)
        , keepalive_(opts.keepalive)
        , keepalive_timeout_(opts.keepalive_timeout) {}
    /// No device (protocol tests): no queues; links are adopted as they are.
    endpoint(rdmax::detail::no_device_t none, const rpc_options& opts)
        : pd(nullptr)
        , arena(verbs_registrar(none), opts.ring_arena())
        , in(none)
        , housekeeping_(opts.housekeeping)
        , keepalive_(opts.keepalive)
        , keepalive_timeout_(opts.keepalive_timeout) {}
    endpoint(const endpoint&) = delete;
    endpoint& operator=(const endpoint&) = delete;
    /// Drops every connection left (the owner tore down what it must first).
    ~endpoint() {
        for (std::uint32_t i = 0; i < peers.size(); ++i)
            if (peers[i].wire)
                drop(i);
    }

    [[nodiscard]] Peer* find(peer_id p) noexcept {
        if (p.index >= peers.size() || !peers[p.index].wire ||
            peers[p.index].generation != p.generation)
            return nullptr;
        return &peers[p.index];
    }
    [[nodiscard]] const Peer* find(peer_id p) const noexcept {
        return const_cast<endpoint*>(this)->find(p);
    }
    [[nodiscard]] peer_id id_of(std::uint32_t index) const noexcept {
        return {index, peers[index].generation};
    }

    /// Makes `fresh` (its own state filled in) the connection over `wire`:
    /// all or nothing (throws, nothing changed). Returns its index.
    std::uint32_t add(std::unique_ptr<link> wire, Peer fresh, std::uint64_t peer_incarnation) {
        if (free_.empty()) {
            free_.reserve(peers.size() + 1);
            peers.emplace_back();
            free_.push_back(static_cast<std::uint32_t>(peers.size() - 1));
        }
        const std::uint32_t index = free_.back();
        const std::uint32_t qp = wire->qp_num();
        if (qp != 0)
            by_qp.insert_or_assign(qp, index); // may throw: nothing else changed yet
        const int event_fd = wire->event_fd();
        const int wake_fd = wire->wake_fd();
        try {
            in.watch(event_fd);
            try {
                if (wake_fd >= 0)
                    in.watch(wake_fd);
            } catch (...) {
                in.forget(event_fd);
                throw;
            }
        } catch (...) {
            if (qp != 0)
                by_qp.erase(qp);
            throw;
        }
        free_.pop_back();
        Peer& p = peers[index];
        p = std::move(fresh);
        p.generation = ++generations_;
        p.wire = std::move(wire);
        p.incarnation = peer_incarnation;
        p.heard = false;
        p.last_heard = now();
        p.probed = {};
        return index;
    }
    /// Takes connection `index` out of the table: its descriptors leave the
    /// epoll set, its queue pair number the map, and its link goes (no more
    /// DMA into this side's memory). Its entry is free for another.
    void drop(std::uint32_t index) noexcept {
        Peer& p = peers[index];
        in.forget(p.wire->event_fd());
        if (p.wire->wake_fd() >= 0)
            in.forget(p.wire->wake_fd());
        if (p.wire->qp_num() != 0)
            by_qp.erase(p.wire->qp_num());
        p.wire.reset();
        free_.push_back(index); // room reserved at add
    }

    /// The live connection a receive completion is for, or null (counted as
    /// stray: a queue pair no longer in the table, or a broken link's).
    [[nodiscard]] Peer* receiver(const ibv_wc& wc, std::uint32_t& index) noexcept {
        const auto it = by_qp.find(wc.qp_num);
        if (it == by_qp.end() || peers[it->second].wire->broken) {
            ++counters.stray_completions;
            return nullptr;
        }
        index = it->second;
        return &peers[index];
    }
    /// Takes the inbox's completions (one batch, or `all` of them), each to
    /// on_wc, and gives their receives back.
    template <class OnWc>
    int take_inbox(OnWc&& on_wc, bool all = false) noexcept {
        ibv_wc wcs[32];
        int total = 0;
        for (int n; (n = in.poll(wcs)) > 0;) {
            for (int i = 0; i < n; ++i)
                on_wc(wcs[i]);
            in.replenish(static_cast<std::uint32_t>(n));
            total += n;
            if (!all)
                break;
        }
        return total;
    }

    [[nodiscard]] sched::coarse_clock::time_point now() const noexcept { return clock(); }
    [[nodiscard]] bool housekeeping_due() const noexcept { return now() >= next_housekeeping_; }
    /// Housekeeping starts now: the next is due one interval on.
    sched::coarse_clock::time_point start_housekeeping() noexcept {
        const auto t = now();
        next_housekeeping_ = t + housekeeping_;
        return t;
    }

    /// Where connection `p` stands (at housekeeping): probed after a
    /// keepalive interval of silence, again each interval, and silent (gone)
    /// after keepalive_timeout, counted. The bound holds to a housekeeping
    /// interval (and the clock's jiffy).
    [[nodiscard]] liveness keepalive(Peer& p, sched::coarse_clock::time_point t) noexcept {
        if (p.heard) {
            p.heard = false;
            p.last_heard = t;
            p.probed = {};
        }
        if (t - p.last_heard >= keepalive_timeout_) {
            ++counters.keepalive_timeouts;
            return liveness::silent;
        }
        if (t - p.last_heard < keepalive_ ||
            (p.probed != sched::coarse_clock::time_point{} && t - p.probed < keepalive_))
            return liveness::fine;
        p.probed = t;
        ++counters.keepalive_probes;
        return liveness::probe;
    }
    /// Keepalive at housekeeping, for a link whose messages go as kind `k`:
    /// the pong owed, a probe if one is due. Silent: counted why (the caller
    /// ends the link).
    [[nodiscard]] liveness tend(Peer& p, message_kind k,
                                sched::coarse_clock::time_point t) noexcept {
        p.pings = 0;
        if (p.pong_owed && send_control(p, k, control::pong) == status::ok)
            p.pong_owed = false;
        const liveness l = keepalive(p, t);
        if (l == liveness::probe)
            (void)send_control(p, k, control::ping);
        else if (l == liveness::silent)
            // No connection event came (a pulled cable, a hung host, a
            // stopped process): gone all the same.
            counters.count_link_end(p.wire->ended(look::cause).value_or(link_end{}));
        return l;
    }
    /// A probe came: owed an answer; false for one too many this round.
    [[nodiscard]] static bool pinged(Peer& p) noexcept {
        p.pong_owed = true;
        return ++p.pings <= max_pings_per_round;
    }
    /// Sends control message `c` (no bytes, no slot) as kind `k`. A send
    /// queue with no room: the next housekeeping tries again.
    [[nodiscard]] status send_control(Peer& p, message_kind k, control c) noexcept {
        return p.wire->send_slot(k, static_cast<std::uint32_t>(c), 0, sched::urgent, false);
    }
    /// Something changed that housekeeping must look at: at the next poll.
    void housekeep_soon() noexcept { next_housekeeping_ = {}; }

    /// Before a sleep on the inbox's fd in the owner's own loop: arms the
    /// completion channel and asks every live link's peer to wake this side.
    /// False (everyone told it is awake again) when a link has something
    /// already or the device refused: poll instead of sleeping.
    [[nodiscard]] bool prepare_sleep() noexcept {
        bool asleep = in.arm();
        for (Peer& p : peers)
            if (p.wire && !p.wire->broken && !p.wire->sleep(true))
                asleep = false;
        if (!asleep)
            wake_all();
        return asleep;
    }
    /// After that sleep (the fd was readable, or the owner's timer ran out):
    /// the channel's events taken, the links told, housekeeping at the next poll.
    void woke() noexcept {
        in.sleep(std::chrono::microseconds{0});
        wake_all();
        housekeep_soon();
    }

    /// poll_once(), sleeping on the inbox's epoll up to `timeout` (and at
    /// most a housekeeping interval) when nothing came. Every live link is
    /// asked to have its peer wake this side first, and told when it is awake.
    template <class PollOnce>
    int wait(std::chrono::microseconds timeout, PollOnce&& poll_once) noexcept {
        if (const int n = poll_once(); n != 0)
            return n;
        (void)in.arm();
        bool asleep = true;
        for (Peer& p : peers)
            if (p.wire && !p.wire->broken && !p.wire->sleep(true))
                asleep = false;
        if (const int n = poll_once(); n != 0 || !asleep) {
            wake_all();
            return n != 0 ? n : poll_once();
        }
        in.sleep(std::min(timeout,
                          std::chrono::duration_cast<std::chrono::microseconds>(housekeeping_)));
        wake_all();
        // Whatever woke it (a completion, a connection event): look now.
        housekeep_soon();
        return poll_once();
    }

    /// Names this endpoint's stat records (kind "rpc_client" or "rpc_server",
    /// and "scheduler" for its connections' schedulers, summed).
    void open_stats(std::string_view kind, std::string_view name) noexcept {
        stat_slot = stats::slot(kind, name, stats::rpc_fields());
        try {
            sched_stat_slot = stats::slot("scheduler", fmt::format("{} {}", kind, name),
                                          stats::scheduler_fields());
        } catch (...) { // no memory for the name: published without it
            sched_stat_slot = stats::slot("scheduler", {}, stats::scheduler_fields());
        }
    }
    /// Copies the counters into the stat records, once an interval (the
    /// owner's housekeeping, at `t`): plain copies, no lock, no atomic add.
    void publish_stats(sched::coarse_clock::time_point t, std::uint64_t in_flight) noexcept {
        if (!stat_slot.due(t))
            return;
        std::array<std::uint64_t, stats::max_fields> v{};
        std::array<std::uint64_t, stats::max_fields> s{};
        std::uint64_t live = 0;
        for (const Peer& p : peers) {
            if (!p.wire)
                continue;
            ++live;
            if (const std::optional<sched::scheduler_counters> c = p.wire->scheduler_counters())
                stats::add_scheduler_values(*c, s);
        }
        const auto n = std::min(stats::rpc_fields().size(), v.size());
        stats::rpc_values(counters, in_flight, live, std::span(v.data(), n));
        stat_slot.publish(std::span(v.data(), n));
        sched_stat_slot.publish(
            std::span(s.data(), std::min(stats::scheduler_fields().size(), s.size())));
    }

    const verbs::protection_domain* pd;
    registered_arena arena; ///< the rings and staging slots
    handle_issuer issuer;   ///< the rings' keys
    inbox in;
    std::vector<Peer> peers;                                ///< by peer_id::index
    std::unordered_map<std::uint32_t, std::uint32_t> by_qp; ///< qp_num -> index
    rpc_counters counters;
    /// This side's incarnation, sent in every handshake.
    std::uint64_t incarnation = new_incarnation();
    clock_fn clock = &sched::coarse_clock::now;
    stats::slot stat_slot;       ///< rpc_counters for rdmax-stat
    stats::slot sched_stat_slot; ///< the connections' schedulers, summed

private:
    void wake_all() noexcept {
        for (Peer& p : peers)
            if (p.wire)
                (void)p.wire->sleep(false);
    }

    std::vector<std::uint32_t> free_; ///< entries with no link, reserved for every entry
    std::uint32_t generations_ = 0;
    std::chrono::nanoseconds housekeeping_;
    std::chrono::nanoseconds keepalive_;
    std::chrono::nanoseconds keepalive_timeout_;
    sched::coarse_clock::time_point next_housekeeping_{};
};

} // namespace rdmax::rpc::detail
