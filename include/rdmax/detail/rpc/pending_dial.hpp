#pragma once
// rpc::detail::pending_dial: a client's reconnect through the device, under
// way on a thread of its own, so that the client's thread (and its other
// connections) never wait on rdma_cm's resolve and connect. The link and its
// rings are made on the client's thread (the arena is not shared); the
// thread makes only the rdma_cm connection, whose queue pair takes the
// client's shared queues (verbs objects are thread-safe), and the client
// adopts it at a later poll.

#include <future>
#include <memory>

#include <rdmax/detail/rpc/rdma_link.hpp>
#include <rdmax/detail/rpc/wire.hpp>
#include <rdmax/verbs/connection.hpp>

namespace rdmax::rpc::detail {

struct pending_dial {
    std::unique_ptr<rdma_link> wire;
    ring_offer mine;
    std::future<verbs::connection> conn;

    [[nodiscard]] bool ready() const {
        return conn.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    }
};

} // namespace rdmax::rpc::detail
