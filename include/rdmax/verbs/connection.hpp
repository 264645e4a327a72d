#pragma once
// An RC connection made with rdma_cm: address and route resolution, the
// queue pair's state transitions, and a small user payload (remote buffer
// tokens, say) carried in the connection's private data each way.
//
// Every wait has a deadline. A peer that disconnects or vanishes (its process
// dies: the kernel then tears its connection down) shows as
// peer_disconnected() on this side, and its queue pair goes to the error
// state, so posted work completes with an error rather than hanging.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include <rdma/rdma_cma.h>

#include <rdmax/verbs/queue_pair.hpp>

namespace rdmax::verbs {

/// Payload bytes that fit in the private data of a connect request and of an
/// accept reply (the wire's 56 and 196, less rdmax's one-byte length prefix).
inline constexpr std::size_t max_connect_payload = 55;
inline constexpr std::size_t max_accept_payload = 195;

using namespace std::chrono_literals;

class listener;
class connection_request;
class prepared_connection;

class connection {
public:
    /// Connects to a listener at addr:port. The route must lead out of the
    /// device `pd` belongs to. Throws rdmax::error naming the step that failed
    /// (address, route, rejected, unreachable) or the deadline that passed.
    /// To post receives before the peer can send, use prepared_connection.
    /// A `source` address binds it to the device that carries that address.
    [[nodiscard]] static connection
    connect(const protection_domain& pd, std::string_view addr, std::uint16_t port,
            std::span<const std::byte> payload = {}, const qp_config& cfg = {},
            std::chrono::milliseconds timeout = 5s, std::string_view source = {});

    connection(connection&& other) noexcept;
    connection& operator=(connection&& other) noexcept;
    connection(const connection&) = delete;
    connection& operator=(const connection&) = delete;
    /// Disconnects (without waiting for the peer) and frees QP, id and channel.
    ~connection();

    [[nodiscard]] queue_pair<rc>& qp() noexcept { return *qp_; }
    /// What the peer sent in its private data.
    [[nodiscard]] std::span<const std::byte> peer_payload() const noexcept { return peer_payload_; }
    /// The peer's payload read as a trivially copyable T (e.g. a remote_buffer);
    /// nullopt if the peer sent a different number of bytes.
    template <class T>
        requires std::is_trivially_copyable_v<T>
    [[nodiscard]] std::optional<T> peer_payload_as() const noexcept {
        if (peer_payload_.size() != sizeof(T))
            return std::nullopt;
        T out;
        std::memcpy(&out, peer_payload_.data(), sizeof(T));
        return out;
    }

    /// Like queue_pair::wait_send / wait_recv, but also watch the connection:
    /// if the peer goes away meanwhile, the QP enters the error state and its
    /// outstanding work completes flushed, so the wait ends with an error
    /// completion instead of relying on the device's retry timer (soft-RoCE
    /// on Linux 6.1 may never fire it). 0 at the deadline.
    int wait_send(std::span<completion> out, std::chrono::microseconds timeout) noexcept;
    int wait_recv(std::span<completion> out, std::chrono::microseconds timeout) noexcept;

    /// Non-blocking: true once the peer disconnected or went away.
    [[nodiscard]] bool peer_disconnected() noexcept;
    /// The rdma_cm event that ended the connection (DISCONNECTED, REJECTED,
    /// TIMEWAIT_EXIT...) and its status, once one did; nullopt before.
    struct ending {
        rdma_cm_event_type event;
        int status;
    };
    [[nodiscard]] std::optional<ending> ended_by() const noexcept { return ended_by_; }
    /// Non-blocking: true once the connection is established. Always true
    /// but after connection_request::accept_nowait, until rdma_cm's
    /// ESTABLISHED arrives (or established_by_traffic()).
    [[nodiscard]] bool established() noexcept;
    /// The peer's first message arrived: the connection is up, whether or not
    /// rdma_cm said so yet (its ESTABLISHED follows the peer's RTU, which may
    /// come after the peer's first write: InfiniBand's "communication
    /// established").
    void established_by_traffic() noexcept;
    /// Waits up to `timeout` for the peer to disconnect; true if it did.
    [[nodiscard]] bool wait_disconnected(std::chrono::milliseconds timeout) noexcept;
    /// Disconnects and waits up to `timeout` for the exchange to finish.
    /// Idempotent.
    void disconnect(std::chrono::milliseconds timeout = 2s) noexcept;

    [[nodiscard]] rdma_cm_id* id() const noexcept { return id_; }

private:
    friend class listener;
    friend class connection_request;
    friend class prepared_connection;
    connection(rdma_event_channel* ch, rdma_cm_id* id) noexcept;
    void release() noexcept;
    /// On a soft-RoCE port that cannot carry MADs now: destroys the QP,
    /// parks the id (detail/verbs/parked_ids.hpp) and returns true.
    bool park_if_port_down() noexcept;
    /// Makes the QP on the id, in `pd`, which must be on the id's device
    /// (`what` names the request or target in the error). The QP starts in
    /// INIT: it takes receives before the connection is established.
    void create_qp(const protection_domain& pd, const qp_config& cfg, std::string_view what);
    /// ESTABLISHED arrived: keep the peer's payload; the QP is ready to send.
    void established(std::vector<std::byte> peer_payload) noexcept;
    /// Handles one pending connection event, if any arrives within `timeout`.
    void pump(std::chrono::milliseconds timeout) noexcept;
    /// rdma_disconnect, once: it starts this side's disconnect, or answers
    /// the peer's. `port_checked`: may_send_mads() was true just now (the
    /// caller asked it; it is a system call or two on soft-RoCE).
    void send_disconnect(bool port_checked = false) noexcept;

    rdma_event_channel* channel_ = nullptr;
    rdma_cm_id* id_ = nullptr;
    std::optional<queue_pair<rc>> qp_;
    std::vector<std::byte> peer_payload_;
    bool disconnected_ = false; ///< DISCONNECTED seen (either side's doing)
    std::optional<ending> ended_by_;
    bool disconnect_sent_ = false;
    bool establishing_ = false; ///< accepted without waiting, ESTABLISHED not yet seen
};

} // namespace rdmax::verbs
