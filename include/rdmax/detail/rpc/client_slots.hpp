#pragma once
// rpc::client's record of its calls on one connection: the phase of each
// slot, the call it holds (kept to re-send it after a reconnect), and the
// reference a result carries back to its slot. Machinery of client.hpp, kept
// apart so that the client's header stays its contract.

#include <cstdint>
#include <span>
#include <vector>

#include <rdmax/detail/rpc/endpoint.hpp>
#include <rdmax/rpc/call_status.hpp>
#include <rdmax/rpc/dmabuf_range.hpp>
#include <rdmax/sched/coarse_clock.hpp>

namespace rdmax::rpc::detail {

enum class client_slot_phase : std::uint8_t {
    free,      ///< the caller's credit, unused
    in_flight, ///< request sent, no reply yet
    fencing,   ///< replied; its result waits for its windows' invalidation to complete
    done,      ///< its result is queued or handed out; freed at the next poll
};

struct client_slot {
    client_slot_phase phase = client_slot_phase::free;
    /// Flipped at each call in the slot; the reply echoes it.
    bool epoch = false;
    /// Calls here that timed out or were cancelled, their reply not come: dropped unread.
    std::uint8_t late = 0;
    std::uint32_t seq = 0;
    // The call as sent, kept here (node-local staging is the server's to write).
    std::uint32_t bytes = 0;   ///< the request's, in the staging slot
    std::uint32_t at_body = 0; ///< where its inline body starts there
    std::uint16_t method = 0;
    std::uint8_t flags = 0; ///< flag_idempotent
    std::uint8_t priority = 0;
    std::span<const std::byte> external; ///< a body over the slot: the caller's buffer
    std::uint64_t call_id = 0;
    std::uint64_t cookie = 0;
    sched::coarse_clock::time_point deadline{};
    std::span<std::byte> reply_into;
    dmabuf_range body_dmabuf{}; ///< call_options', kept to re-send the call
    dmabuf_range reply_dmabuf{};
    /// While fencing: the result, handed out once the peer's keys are dead.
    call_status fenced_status = call_status::ok;
    std::span<const std::byte> fenced_reply;
    /// The reply's bytes the server wrote into reply_dmabuf (call_result's).
    std::uint32_t dmabuf_reply_bytes = 0;
};

struct client_slot_ref {
    std::uint32_t link = 0;
    std::uint32_t slot = 0;
    std::uint32_t seq = 0;
    bool release = false;      ///< handing the result out gives the slot back at the next poll
    std::uint64_t call_id = 0; ///< names the call across its connections (call())
};

/// A connection of a client: the endpoint's, and the calls in its slots.
struct client_link : peer_base {
    std::uint32_t session = 0; ///< the peer_id (the client's sessions) it serves
    std::vector<client_slot> slots;
    std::vector<std::uint16_t> free_slots;
    std::uint32_t next_seq = 1;
    std::uint32_t in_flight = 0;
    std::uint32_t held = 0;     ///< slots done: results queued or handed out
    std::uint32_t fencing = 0;  ///< of in_flight, slots fencing
    bool doorbell_held = false; ///< in the client's held list (hold_doorbells)
};

/// A call as rpc::client::start() encodes it.
struct outgoing_call {
    std::span<const std::byte> request;
    bool external = false; ///< the body stays in the caller's memory (over the slot)
    /// Where the peer finds the body and the reply buffer (grant_access).
    buffer_descriptor body{};
    buffer_descriptor reply{};
    std::uint64_t call_id = 0;
    std::uint8_t flags = 0; ///< flag_idempotent, flag_retry
};

} // namespace rdmax::rpc::detail
