#pragma once
// Options of RPC servers and clients, with their RDMAX_RPC_* overrides.

#include <chrono>
#include <cstdint>

#include <rdmax/sched/scheduler_options.hpp>

namespace rdmax::rpc {

struct rpc_options {
    /// Slots per connection: calls in flight on it at most (the client asks,
    /// the server grants at most its own). At most wire max_slots.
    std::uint16_t slots = 64;
    /// Bytes per slot: header, descriptors and inline body (64 B .. 256 KiB,
    /// a multiple of 8). Bodies over it go by READ (requests) or into the
    /// caller's reply buffer (replies).
    std::uint32_t slot_bytes = 4096;
    /// Largest request or reply body, inline or not (the server refuses
    /// larger requests with request_too_large; the client refuses to send them).
    std::uint32_t max_message = 16U << 20;
    /// Server: connections at once; more are refused.
    std::uint32_t max_peers = 256;
    /// Client: a call's deadline unless the call names its own.
    std::chrono::milliseconds call_timeout{5000};
    /// Connection setup and teardown deadline (rdma_cm).
    std::chrono::milliseconds connect_timeout{5000};
    /// How often poll() looks at connection events (new peers, peers gone)
    /// and deadlines: an epoll_wait (and, when it reports one, the events'
    /// reads), so not at every poll. Deadlines are this precise.
    std::chrono::microseconds housekeeping{5000};
    /// Between processes on one node, through shared memory and CMA instead
    /// of the device: the server also answers on a Unix name, the client tries
    /// it first (RDMAX_RPC_LOCAL=0: always the device).
    bool local = true;
    /// Whom a client lets read and write its memory by CMA where Yama's
    /// ptrace_scope is 1 (only descendants otherwise): the server on this
    /// node reads large bodies from it and writes large replies into it.
    enum class ptracer_grant : std::uint8_t {
        off,  ///< nobody: under scope 1 such servers are reached through the device
        peer, ///< the first node-local server's process (prctl PR_SET_PTRACER, pid):
              ///< one process at a time, so a second server goes through the device
        any,  ///< any process of this user (PR_SET_PTRACER_ANY), as MPI libraries do
    };
    ptracer_grant ptracer = ptracer_grant::peer;
    /// Each connection's scheduler (priorities, slicing of large transfers).
    sched::scheduler_options scheduler = {};

    /// These options with RDMAX_RPC_SLOTS, RDMAX_RPC_SLOT_BYTES,
    /// RDMAX_RPC_MAX_MESSAGE (K/M/G allowed), RDMAX_RPC_MAX_PEERS,
    /// RDMAX_RPC_TIMEOUT_MS, RDMAX_RPC_CONNECT_TIMEOUT_MS, RDMAX_RPC_LOCAL (0/1),
    /// RDMAX_RPC_PTRACER (off, peer, any) and RDMAX_RPC_HOUSEKEEPING_US applied, and the
    /// scheduler's RDMAX_SCHED_*; a malformed or out-of-range value throws rdmax::error naming it.
    [[nodiscard]] rpc_options with_env() const;
    /// Throws rdmax::error if a field is out of range.
    void check(const char* who) const;
};

} // namespace rdmax::rpc
