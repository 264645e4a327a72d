#pragma once
// rpc::detail::handoff: how a server_group's acceptor gives a new connection
// to one of its workers, and what the workers share about their clients.
//
// The acceptor (one thread) takes rdma_cm requests and node-local sockets off
// the group's one port, picks a worker, and posts the connection into that
// worker's mailbox: a vector under a mutex, and an eventfd the worker's epoll
// set watches. The worker takes the mailbox only when the eventfd fired (its
// housekeeping, which reads watched descriptors only when one is readable):
// the call path never takes the lock. The load each worker publishes is an
// atomic, so that choosing a worker takes no lock either.
//
// A client's reconnections go to the worker that has its replies (the reply
// cache is per worker): `routes` maps client incarnations to workers.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include <rdmax/local/descriptor_passing.hpp>
#include <rdmax/rpc/rpc_counters.hpp>
#include <rdmax/verbs/connection_request.hpp>

namespace rdmax::rpc::detail {

/// A connection handed to a worker: an rdma_cm request, a node-local (or TCP) socket
/// whose hello is still to come, or one whose hello came (a reconnection
/// another worker read, forwarded to the worker that has the client's replies).
struct handoff_item {
    std::optional<verbs::connection_request> device;
    local::unix_channel local;
    std::vector<std::byte> hello; ///< empty: the hello is still to come
    bool tcp = false;             ///< `local` is a TCP socket
};

/// One worker's mailbox.
class handoff {
public:
    handoff(); ///< throws rdmax::error (eventfd)
    handoff(const handoff&) = delete;
    handoff& operator=(const handoff&) = delete;
    ~handoff();

    /// Readable when something was posted (or the worker is asked to look).
    [[nodiscard]] int fd() const noexcept { return fd_; }
    /// Posts a connection (counted in pending until the worker took it).
    void post(handoff_item item);
    /// Wakes the worker: it looks at its mailbox and its flags.
    void wake() noexcept;
    /// The worker: what was posted (the eventfd read), oldest first.
    [[nodiscard]] std::vector<handoff_item> take() noexcept;

    /// Connections the worker has (published by it after each change) and
    /// those posted it has not yet taken: the acceptor's measure of load.
    std::atomic<std::size_t> load{0};
    std::atomic<std::size_t> pending{0};

    /// Counters asked for while the worker runs: the worker copies its own
    /// when `snapshot_wanted` (its next wake), under the mailbox's lock.
    std::atomic<bool> snapshot_wanted{false};
    void publish(const rpc_counters& c) noexcept;
    /// The last copy, waiting up to `timeout` for a fresher one than the
    /// copy made before this call.
    [[nodiscard]] rpc_counters snapshot(std::chrono::milliseconds timeout);

private:
    int fd_ = -1;
    std::mutex m_;
    std::condition_variable published_;
    std::vector<handoff_item> items_;
    rpc_counters snapshot_{};
    std::uint64_t snapshots_ = 0;
};

/// What a group's acceptor and workers share: the mailboxes, and which
/// worker each client's replies are with.
class group_routes {
public:
    explicit group_routes(std::size_t workers, std::size_t most_clients);

    [[nodiscard]] std::size_t workers() const noexcept { return boxes_.size(); }
    [[nodiscard]] handoff& box(std::size_t worker) noexcept { return *boxes_[worker]; }
    /// The worker with the fewest connections (ties: the lowest index).
    [[nodiscard]] std::size_t least_loaded() const noexcept;
    /// The worker that served client `incarnation` last, if one did.
    [[nodiscard]] std::optional<std::size_t> owner(std::uint64_t incarnation);
    /// Worker `w` serves client `incarnation` now. Past most_clients
    /// clients the oldest are forgotten (their next connection may land
    /// elsewhere: a re-sent call there is not known as one already run).
    void claim(std::uint64_t incarnation, std::size_t w);

private:
    std::vector<std::unique_ptr<handoff>> boxes_;
    std::mutex m_;
    std::unordered_map<std::uint64_t, std::size_t> owner_;
    std::deque<std::uint64_t> order_; ///< claims, oldest first (for forgetting)
    std::size_t most_;
};

} // namespace rdmax::rpc::detail
