#pragma once
// A connection request a listener received and has not yet answered: the
// server's half of a two-phase accept.
//
// The request shows the device it arrived on before anything is made for it,
// so a listener on a wildcard address ("0.0.0.0") can pick a protection
// domain of that device; and its QP exists before the connection does, so
// receives posted on it are in place before the peer can send (no "receiver
// not ready" for a peer that sends as soon as its connect() returns):
//
//     verbs::connection_request req = listener.next_request(5s);
//     req.create_qp(pds(req.device()), cfg);
//     req.qp().post_recv(buf, 1);
//     verbs::connection c = req.accept(payload_of(token));
//
// A request nobody answers is rejected when it is destroyed: the peer's
// connect fails with "rejected" at once, and its rdma_cm id and channel go.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <rdma/rdma_cma.h>

#include <rdmax/verbs/connection.hpp>
#include <rdmax/verbs/context.hpp>

namespace rdmax::verbs {

class connection_request {
public:
    connection_request(connection_request&& other) noexcept;
    /// Rejects the request this one held, if unanswered, then takes `other`'s.
    connection_request& operator=(connection_request&& other) noexcept;
    connection_request(const connection_request&) = delete;
    connection_request& operator=(const connection_request&) = delete;
    /// Rejects the request if it is still unanswered.
    ~connection_request();

    /// Neither accepted nor rejected yet.
    [[nodiscard]] bool pending() const noexcept { return conn_.id_ != nullptr; }

    /// The device the request arrived on (librdmacm's context for it, which
    /// context::open(name) also returns): make the QP's protection domain on
    /// it. The handle does not own the device; a protection domain made on it
    /// keeps a pointer to it, so keep the handle as long as the domain (or
    /// use domain_per_device, which keeps its own).
    [[nodiscard]] context device() const;

    /// What the peer sent in its connect request's private data.
    [[nodiscard]] std::span<const std::byte> peer_payload() const noexcept {
        return conn_.peer_payload();
    }
    template <class T>
        requires std::is_trivially_copyable_v<T>
    [[nodiscard]] std::optional<T> peer_payload_as() const noexcept {
        return conn_.peer_payload_as<T>();
    }

    /// True when the client gave up on this request (its rejection or a
    /// connect error reached this side), waiting up to `wait` for it: a server
    /// can then let a stale request go instead of spending a QP on it. A
    /// rejection that came before the request was taken from the listener is
    /// not reported (the kernel drops events of a request nobody has read
    /// yet); create_qp() then fails, naming rdma_create_qp.
    [[nodiscard]] bool abandoned(std::chrono::milliseconds wait = {}) noexcept;

    /// Makes the connection's QP in `pd`, which must be on device(): a
    /// protection domain of another device, or of a context of the same
    /// device other than librdmacm's (a second ibv_open_device), is refused
    /// with an rdmax::error naming both, and the request stays pending (make
    /// the QP again, or let it go). The QP is in INIT: it takes receives now.
    /// `pd` must outlive the connection.
    queue_pair<rc>& create_qp(const protection_domain& pd, const qp_config& cfg = {});
    [[nodiscard]] bool has_qp() const noexcept { return conn_.qp_.has_value(); }
    /// The QP create_qp() made; throws if there is none yet.
    [[nodiscard]] queue_pair<rc>& qp();

    /// Accepts with `payload` in the reply (at most max_accept_payload bytes)
    /// and waits up to `timeout` for the connection to be established. Needs
    /// the QP (create_qp); without it, or with too large a payload, throws and
    /// the request stays pending. Otherwise the request is spent, whether this
    /// returns or throws (then the connection's resources are freed).
    [[nodiscard]] connection accept(std::span<const std::byte> payload = {},
                                    std::chrono::milliseconds timeout = 5s);
    /// Accepts without waiting for the connection to be established: for a
    /// loop that serves many peers, where one that stalls in its handshake
    /// must not hold the others. The connection's established() says when it
    /// is up (its rdma_cm channel becomes readable then); posts before are
    /// refused (not_connected). Throws and spends the request as accept() does.
    [[nodiscard]] connection accept_nowait(std::span<const std::byte> payload = {});
    /// Refuses the request (the peer's connect fails with "rejected") and
    /// frees what was made for it. Idempotent.
    void reject() noexcept;

    [[nodiscard]] rdma_cm_id* id() const noexcept { return conn_.id_; }

private:
    friend class listener;
    connection_request(connection&& pending, std::uint8_t initiator_depth,
                       std::uint8_t responder_resources, std::string where) noexcept;

    connection conn_; ///< the request's id and channel, the QP once made; not yet connected
    std::uint8_t initiator_depth_ = 0;     ///< the peer's, from the request
    std::uint8_t responder_resources_ = 0; ///< the peer's, from the request
    std::string where_;                    ///< "listener on port N", for errors
};

} // namespace rdmax::verbs
