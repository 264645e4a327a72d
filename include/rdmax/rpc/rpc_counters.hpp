#pragma once
// What an RPC server or client counts; printable with fmt ("{}").

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <rdmax/detail/rpc/wire.hpp>

namespace rdmax::rpc {

/// Why a link ended, as far as its completions and connection events say.
struct link_end {
    ibv_wc_status failure = IBV_WC_SUCCESS; ///< the first error completion, else a flush
    int event = -1;                         ///< the rdma_cm_event_type that ended it; -1: none
    int event_status = 0;                   ///< that event's status
};

struct rpc_counters {
    // Calls.
    std::uint64_t calls = 0;        ///< server: requests handled; client: calls started
    std::uint64_t completed = 0;    ///< client: calls that ended ok
    std::uint64_t failed = 0;       ///< client: calls that ended in another status
    std::uint64_t timed_out = 0;    ///< client: of those, at their deadline
    std::uint64_t cancelled = 0;    ///< client: of those, cancelled by the caller
    std::uint64_t late_replies = 0; ///< client: replies after their call's deadline (dropped)
    std::uint64_t no_credit = 0;    ///< client: calls refused for want of a free slot
    std::uint64_t external_bodies =
        0; ///< bodies over a slot moved by READ (server) or offered (client)
    std::uint64_t external_replies = 0; ///< replies over a slot written into the caller's buffer
    /// Client: memory windows deallocated and allocated again to revoke them
    /// at once (a call that timed out, a fence that could not be posted or
    /// did not complete); an answered call's windows are invalidated on the
    /// send queue instead, which costs no verbs call.
    std::uint64_t window_reallocs = 0;
    /// Client: connections through a device with type-2 windows that had to
    /// do without (ibv_alloc_mw failed: at connect, or for a replacement
    /// later). Their large bodies and reply buffers go under the cached
    /// registrations' own keys, as on a device without windows (docs/rpc.md).
    std::uint64_t windows_unavailable = 0;
    /// Client: connections ended because an answered call's invalidation
    /// had not completed a housekeeping period after the call's deadline
    /// (a stalled send queue; the answers were handed out).
    std::uint64_t fence_stalls = 0;
    /// Server: READs of a request body withdrawn before they were posted,
    /// the caller having given the call up (its window is dead).
    std::uint64_t cancelled_reads = 0;
    /// Rails that joined a link (rpc_options::rails): the server's accepted,
    /// the client's made (a rail that comes back counts again).
    std::uint64_t rail_joins = 0;
    /// Server: request bodies and reply bodies cut across a link's rails,
    /// and the bytes its other rails (1..) carried of them.
    std::uint64_t striped_bodies = 0;
    std::uint64_t rail_bytes = 0;
    // Surviving failures (docs/rpc.md, "Failures and retries").
    std::uint64_t keepalive_probes = 0;   ///< probes sent to connections idle a keepalive
    std::uint64_t keepalive_timeouts = 0; ///< connections declared gone after keepalive_timeout
    std::uint64_t reconnects = 0;         ///< client: connections made again after one ended
    std::uint64_t reconnect_attempts = 0; ///< client: of those, attempts that failed
    std::uint64_t retried_calls = 0;      ///< client: calls re-sent on a new connection
    std::uint64_t unknown_outcomes = 0;   ///< calls that ended (client) or were answered
                                          ///< (server) unknown_outcome
    std::uint64_t duplicates = 0;         ///< server: re-sent calls answered from the reply cache
    std::uint64_t goaways = 0;            ///< goaways sent (server) or received (client)
    std::uint64_t bytes_in = 0;           ///< message bytes received (headers included)
    std::uint64_t bytes_out = 0;          ///< message bytes sent (headers included)
    std::uint64_t unknown_method = 0;     ///< server: requests with no handler (answered so)
    // A peer that breaks the protocol: each rejection counted, the message
    // dropped, the peer's connection closed.
    std::uint64_t rejected_kind = 0;      ///< wrong message kind
    std::uint64_t rejected_slot = 0;      ///< slot index out of range
    std::uint64_t rejected_length = 0;    ///< length out of range
    std::uint64_t rejected_malformed = 0; ///< header inconsistent
    std::uint64_t rejected_credit = 0;    ///< request into a slot still being answered
    std::uint64_t rejected_opcode = 0;    ///< a send, or a receive in error
    std::uint64_t stray_completions = 0;  ///< receive completions of no live connection
    // Connections.
    std::uint64_t connected = 0; ///< connections made (accepted or connected)
    /// Of those, through the node's memory (transport::shm).
    std::uint64_t connected_local = 0;
    /// Of those, over TCP (transport::tcp); the rest through the device.
    std::uint64_t connected_tcp = 0;
    std::uint64_t refused = 0; ///< connection requests refused (bad offer, too many peers)
    /// Why the last connection was refused (count_refusal): an errno (0:
    /// none) and what happened, in a few words ("" before the first).
    struct refusal {
        std::int32_t error = 0;
        std::array<char, 160> reason{}; ///< NUL-terminated; cut short when longer
        [[nodiscard]] std::string_view what() const noexcept { return reason.data(); }
    };
    refusal last_refusal;
    /// A connection refused: counted, and why kept (no allocation).
    void count_refusal(int err, std::string_view why) noexcept {
        ++refused;
        last_refusal.error = err;
        const std::size_t n = std::min(why.size(), last_refusal.reason.size() - 1);
        std::memcpy(last_refusal.reason.data(), why.data(), n);
        last_refusal.reason[n] = '\0';
    }
    /// The same, the reason formatted straight into last_refusal (cut short
    /// when longer; no allocation, so a noexcept path may use it).
    template <class... Args>
    void count_refusal_fmt(int err, fmt::format_string<Args...> f, Args&&... args) noexcept {
        ++refused;
        last_refusal.error = err;
        char* const out = last_refusal.reason.data();
        const std::size_t room = last_refusal.reason.size() - 1;
        try {
            const auto r = fmt::format_to_n(out, room, f, std::forward<Args>(args)...);
            out[std::min(r.size, room)] = '\0';
        } catch (...) {
            out[0] = '\0'; // an argument that would not format
        }
    }
    std::uint64_t disconnected =
        0; ///< connections gone (peer left, failed, or closed for a violation)
    /// Of those, links that failed under this side with an error completion,
    /// and the last such completion's ibv_wc_status (0: none yet).
    std::uint64_t link_failures = 0;
    std::uint32_t last_link_failure = 0;
    /// The connection event (rdma_cm_event_type) that ended the last link
    /// that ended by one (DISCONNECTED, REJECTED, TIMEWAIT_EXIT...); -1: none yet.
    std::int32_t last_link_event = -1;
    std::int32_t last_link_event_status = 0; ///< that event's status (-ETIMEDOUT...)
    /// A link ended: count why.
    void count_link_end(const link_end& e) noexcept {
        // A flush is the consequence of a failure or a disconnect, never the cause.
        if (e.failure != IBV_WC_SUCCESS && e.failure != IBV_WC_WR_FLUSH_ERR) {
            ++link_failures;
            last_link_failure = static_cast<std::uint32_t>(e.failure);
        }
        if (e.event >= 0) {
            last_link_event = e.event;
            last_link_event_status = e.event_status;
        }
    }

    /// Counts a message rejected for `v` (none counts nothing).
    void count(violation v) noexcept {
        switch (v) {
        case violation::wrong_kind: ++rejected_kind; break;
        case violation::bad_slot: ++rejected_slot; break;
        case violation::bad_length: ++rejected_length; break;
        case violation::malformed: ++rejected_malformed; break;
        case violation::credit: ++rejected_credit; break;
        case violation::bad_opcode: ++rejected_opcode; break;
        case violation::none: break;
        }
    }

    [[nodiscard]] std::uint64_t rejected() const noexcept {
        return rejected_kind + rejected_slot + rejected_length + rejected_malformed +
               rejected_credit + rejected_opcode;
    }
};

} // namespace rdmax::rpc

template <>
struct fmt::formatter<rdmax::rpc::rpc_counters> {
    constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
    auto format(const rdmax::rpc::rpc_counters& c, fmt::format_context& ctx) const {
        return fmt::format_to(
            ctx.out(),
            "calls {} completed {} failed {} (timed out {}, cancelled {}, late replies {}, no "
            "credit {}) "
            "external bodies {} replies {} window reallocs {} windows unavailable {} "
            "fence stalls {} cancelled reads {} rail joins {} striped {} rail bytes {} "
            "keepalive probes {} timeouts {} reconnects {} (failed attempts {}) retried {} "
            "unknown outcomes {} duplicates {} goaways {} "
            "bytes in {} out {} unknown method {} "
            "rejected {} (kind {} slot {} length {} malformed {} credit {} opcode {}) "
            "stray {} connected {} (node-local {} tcp {}) refused {} (last: {}{}{}) disconnected "
            "{} link "
            "failures {} "
            "(last: {}) "
            "last link event {} ({})",
            c.calls, c.completed, c.failed, c.timed_out, c.cancelled, c.late_replies, c.no_credit,
            c.external_bodies, c.external_replies, c.window_reallocs, c.windows_unavailable,
            c.fence_stalls, c.cancelled_reads, c.rail_joins, c.striped_bodies, c.rail_bytes,
            c.keepalive_probes, c.keepalive_timeouts, c.reconnects, c.reconnect_attempts,
            c.retried_calls, c.unknown_outcomes, c.duplicates, c.goaways, c.bytes_in, c.bytes_out,
            c.unknown_method, c.rejected(), c.rejected_kind, c.rejected_slot, c.rejected_length,
            c.rejected_malformed, c.rejected_credit, c.rejected_opcode, c.stray_completions,
            c.connected, c.connected_local, c.connected_tcp, c.refused,
            c.refused == 0 ? "none" : c.last_refusal.what(), c.last_refusal.error == 0 ? "" : ": ",
            c.last_refusal.error == 0 ? std::string_view{}
                                      : std::string_view{std::strerror(c.last_refusal.error)},
            c.disconnected, c.link_failures,
            c.last_link_failure == 0
                ? "none"
                : ibv_wc_status_str(static_cast<ibv_wc_status>(c.last_link_failure)),
            c.last_link_event < 0
                ? "none"
                : rdma_event_str(static_cast<rdma_cm_event_type>(c.last_link_event)),
            c.last_link_event_status);
    }
};
