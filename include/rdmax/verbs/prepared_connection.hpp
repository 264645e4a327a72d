#pragma once
// The client's half of a two-phase connect: the address and route resolved
// and the QP made, not yet connected.
//
// connection::connect() makes the QP and connects in one step, so a peer
// that sends as soon as its accept() returns may find no receive posted
// here. With a prepared connection the caller posts receives first:
//
//     verbs::prepared_connection p(pd, "192.0.2.1", port, cfg);
//     p.qp().post_recv(buf, 1);
//     verbs::connection c = p.connect(payload_of(hello));

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include <rdmax/verbs/connection.hpp>

namespace rdmax::verbs {

class prepared_connection {
public:
    /// Resolves addr:port's address and route (up to `timeout`) and makes the
    /// QP in `pd`, which must be on the device the route leads out of. Throws
    /// rdmax::error naming the step that failed, as connection::connect does.
    /// A `source` address binds the connection to the device that carries it
    /// (a rail's), whatever route the kernel would pick for addr.
    prepared_connection(const protection_domain& pd, std::string_view addr, std::uint16_t port,
                        const qp_config& cfg = {}, std::chrono::milliseconds timeout = 5s,
                        std::string_view source = {});
    prepared_connection(prepared_connection&&) noexcept = default;
    prepared_connection& operator=(prepared_connection&&) noexcept = default;
    prepared_connection(const prepared_connection&) = delete;
    prepared_connection& operator=(const prepared_connection&) = delete;
    /// Frees the QP, id and channel if connect() did not take them.
    ~prepared_connection() = default;

    /// Not connected yet (connect() not called).
    [[nodiscard]] bool pending() const noexcept { return conn_.id_ != nullptr; }

    /// The QP, in INIT until connect(): it takes receives now. Valid while
    /// pending(); afterwards it is the connection's qp().
    [[nodiscard]] queue_pair<rc>& qp() noexcept { return conn_.qp(); }

    /// Connects with `payload` in the request (at most max_connect_payload
    /// bytes) and waits up to `timeout` for the connection to be established.
    /// Too large a payload, or a spent object, throws and changes nothing;
    /// otherwise the object is spent, whether this returns or throws.
    [[nodiscard]] connection connect(std::span<const std::byte> payload = {},
                                     std::chrono::milliseconds timeout = 5s);

private:
    connection conn_;    ///< id and channel with the route resolved, and the QP
    std::string target_; ///< "addr:port", for errors
};

} // namespace rdmax::verbs
