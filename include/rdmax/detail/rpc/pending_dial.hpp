#pragma once
// rpc::detail::pending_dial: a client's reconnect through the device (or
// over TCP), under way on a thread of its own, so that the client's thread
// (and its other connections) never wait on rdma_cm's resolve and connect,
// nor on a TCP connect and handshake. The link and its
// rings are made on the client's thread (the arena is not shared); the
// thread makes only the rdma_cm connection, whose queue pair takes the
// client's shared queues (verbs objects are thread-safe), and the client
// adopts it at a later poll. Over TCP the thread connects and exchanges the
// hello and welcome; the client checks the welcome and makes the link.

#include <future>
#include <memory>
#include <string>

#include <rdmax/detail/rpc/rdma_link.hpp>
#include <rdmax/detail/rpc/tcp_link.hpp>
#include <rdmax/detail/rpc/wire.hpp>
#include <rdmax/local/descriptor_passing.hpp>
#include <rdmax/verbs/connection.hpp>

namespace rdmax::rpc::detail {

/// What the TCP dial's thread brings back: the connected socket (closed
/// with it if nobody takes it), and the welcome, or why the handshake failed.
struct tcp_dialed {
    local::unix_channel ch;
    tcp_welcome welcome;
    std::size_t bytes = 0;
    std::string handshake_error; ///< empty: the welcome came (bytes of it)
    int handshake_errno = 0;
};

struct pending_dial {
    std::unique_ptr<rdma_link> wire;
    ring_offer mine;
    std::future<verbs::connection> conn; ///< through the device, or
    std::future<tcp_dialed> tcp;         ///< over TCP (a connect error: thrown)
    std::string rdma_miss;               ///< tcp: why not the device, if it was tried

    [[nodiscard]] bool ready() const {
        return (conn.valid() ? conn.wait_for(std::chrono::seconds(0))
                             : tcp.wait_for(std::chrono::seconds(0))) == std::future_status::ready;
    }
};

} // namespace rdmax::rpc::detail
