#pragma once
// rpc::server_group: one port served by N worker threads, each an
// rpc::server of its own (its own completion queue, shared receive queue,
// rings, reply cache): nothing is shared on the call path, so no call takes
// a lock. eRPC's one endpoint per thread, behind one address.
//
//     rpc::server_group g(pd, "0.0.0.0", 7471, 4);          // 4 workers (no pd: this node only)
//     g.on(1, [](rpc::request_context& c) { c.reply(c.body()); });
//     g.start();                                             // the threads run
//     ...
//     g.drain(5s);                                           // or stop(), or the destructor
//
// An acceptor thread takes every new connection, through the device
// (rdma_cm) and from this node (the unix socket), and hands it to the worker
// with the fewest connections, through that worker's mailbox (a vector
// under a lock and an eventfd, looked at in the worker's housekeeping only
// when the eventfd fired). A client that reconnects goes back to the worker
// that has its replies, so that a call it re-sends is still known as run
// (docs/rpc.md, "Threading model"). The connection then lives on that
// worker: its handlers run on that worker's thread, one at a time, as on an
// rpc::server; handlers on different connections run at once, so what
// handlers share they must guard themselves.
//
// Clients: an rpc::client is not thread-safe and serves one thread; a
// program that calls from many threads gives each its own client (and
// connection), which the group spreads over its workers.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <thread>
#include <vector>

#include <rdmax/rpc/rpc_counters.hpp>
#include <rdmax/rpc/rpc_options.hpp>
#include <rdmax/rpc/server.hpp>
#include <rdmax/verbs/listener.hpp>

namespace rdmax::rpc {

namespace detail {
class group_routes;
}

class server_group {
public:
    /// Listens on addr:port (0: any; see port()) with `threads` workers (at
    /// least 1), each a server in `pd` (which must outlive the group, on the
    /// device that carries addr) with `opts` (max_peers is per worker).
    /// Nothing runs until start(). Throws rdmax::error.
    server_group(const verbs::protection_domain& pd, std::string_view addr, std::uint16_t port,
                 std::size_t threads, rpc_options opts = rpc_options{}.with_env());
    /// With no device: the workers serve peers on this node and over TCP, as
    /// rpc::server(addr, port, opts) does (docs/rpc.md, "Without a device").
    server_group(std::string_view addr, std::uint16_t port, std::size_t threads,
                 rpc_options opts = rpc_options{}.with_env());
    server_group(const server_group&) = delete;
    server_group& operator=(const server_group&) = delete;
    /// stop(5 s); then waits for any worker still in a handler.
    ~server_group();

    /// Serves `method` with `h` on every worker (each has its own copy of
    /// `h`, called on its thread). Before start() only (throws after).
    void on(std::uint16_t method, const server::handler& h);
    /// Runs first on each worker's thread, with its index: pin it to a CPU,
    /// name it. Before start() only.
    void on_thread_start(std::function<void(std::size_t worker)> f);
    /// What a worker's own loop (set_worker_loop) gets: its index, its
    /// server (driven on this thread only), and the flag that says to stop
    /// serving (stop() or drain(); after a drain() the loop's return, the
    /// group drains the server itself, with its calls still in flight).
    struct worker_loop_context {
        std::size_t worker;
        server& srv;
        const std::atomic<bool>& stopping;
        server_group& group;
        /// drain() asked (`stopping` is set too). A loop that keeps serving
        /// while its server drains calls begin_drain(), serves until
        /// drained() or drain_until(), then end_drain(); one that returns
        /// at once leaves the drain to the group (with its own work stopped).
        [[nodiscard]] bool draining() const noexcept;
        [[nodiscard]] std::chrono::steady_clock::time_point drain_until() const noexcept;
        void begin_drain() const noexcept;
        [[nodiscard]] bool drained() const noexcept;
        /// Closes every connection; `clean`: drained() came before the deadline.
        void end_drain(bool clean) const noexcept;
    };
    /// Replaces each worker's loop (server::wait() until stopped) by one of
    /// the caller's, on the worker's thread: an event loop that drives the
    /// server (rdmax::rpc::serve_with_asio). It may register handlers on
    /// its server first (srv.on), and must return soon after `stopping`
    /// becomes true. Before start() only.
    void set_worker_loop(std::function<void(worker_loop_context)> loop);
    /// Starts the acceptor and the workers.
    void start();

    /// Stops taking connections, then drains every worker at once
    /// (server::drain, each on its own thread) and stops. True when no
    /// worker left a call unanswered and all finished by `deadline`.
    bool drain(std::chrono::milliseconds deadline) noexcept;
    /// Stops the acceptor and the workers (their calls in flight get no
    /// answer) and joins them; false when a worker was still in a handler at
    /// `deadline` (the destructor waits for it).
    bool stop(std::chrono::milliseconds deadline = std::chrono::seconds(5)) noexcept;

    [[nodiscard]] std::uint16_t port() const noexcept { return port_; }
    [[nodiscard]] std::size_t threads() const noexcept { return workers_.size(); }
    /// Connections of worker `w` (live and in their handshake), as it last
    /// published them; peers() sums them.
    [[nodiscard]] std::size_t peers(std::size_t w) const noexcept;
    [[nodiscard]] std::size_t peers() const noexcept;
    /// Worker `w`'s counters: while it runs, a copy it makes at its next wake
    /// (this waits up to a second for it), else its own. counters() sums
    /// every worker's and the acceptor's refusals (the last refusal and link
    /// end: the last worker's that has one).
    [[nodiscard]] rpc_counters counters(std::size_t w) const;
    [[nodiscard]] rpc_counters counters() const;
    /// CPU time worker `w`'s thread used (all of it: calls, housekeeping,
    /// sleeping's wake-ups), and the acceptor's.
    [[nodiscard]] std::chrono::nanoseconds cpu_time(std::size_t w) const noexcept;
    [[nodiscard]] std::chrono::nanoseconds acceptor_cpu_time() const noexcept;

private:
    friend struct group_test_access; // tests: a group with no device (node-local only)
    server_group(detail::no_device_t none, std::string_view addr, std::uint16_t port,
                 std::size_t threads, rpc_options opts);
    void listen_local(std::string_view addr);
    /// TCP on addr:port_ (port_ 0: a free one); `needed`: throws, else says why not.
    void listen_tcp(std::string_view addr, bool needed);
    /// Without rdma: TCP (which takes the port) and the node-local name.
    void listen_without_rdma(std::string_view addr);
    void accept_tcp() noexcept;
    void worker_main(std::size_t w) noexcept;
    void acceptor_main() noexcept;
    void accept_device() noexcept;
    void accept_local(); ///< throws what unix_listener::accept throws
    /// Waits for every worker to end (up to `until`), then joins them.
    bool join_workers(std::chrono::steady_clock::time_point until) noexcept;
    void stop_acceptor() noexcept;
    static std::chrono::nanoseconds thread_cpu(std::thread& t,
                                               const std::atomic<std::int64_t>& final) noexcept;

    rpc_options opts_;
    std::unique_ptr<detail::group_routes> routes_;
    std::vector<std::unique_ptr<server>> workers_;
    verbs::listener listener_;
    std::optional<local::unix_listener> local_listener_;
    int tcp_listener_ = -1;   ///< peers with neither rdma nor shm to the group
    bool tcp_paused_ = false; ///< the acceptor's: out of descriptors at accept
    std::uint16_t port_ = 0;
    std::function<void(std::size_t)> on_start_;
    std::function<void(worker_loop_context)> loop_;

    std::vector<std::thread> threads_;
    std::thread acceptor_;
    int acceptor_wake_ = -1; ///< an eventfd: the acceptor stops
    std::atomic<bool> stop_{false};
    std::atomic<bool> stop_acceptor_{false};
    std::atomic<bool> drain_{false};
    std::atomic<bool> leaving_{false}; ///< stop_ or drain_: a worker's own loop returns
    std::chrono::milliseconds drain_deadline_{0};
    std::chrono::steady_clock::time_point drain_until_{}; ///< set before drain_
    /// Per worker: its own loop drained it (end_drain), else the group does.
    std::unique_ptr<std::atomic<bool>[]> loop_drained_;
    /// Per worker: drained clean (written by the worker, read after join).
    std::unique_ptr<std::atomic<bool>[]> drained_;
    /// Per worker and the acceptor: CPU time at its end (ns), and done.
    std::unique_ptr<std::atomic<std::int64_t>[]> final_cpu_;
    std::unique_ptr<std::atomic<bool>[]> done_;
    std::atomic<std::int64_t> acceptor_cpu_{-1};
    std::atomic<std::uint64_t> acceptor_refused_{0};
    bool started_ = false;
};

} // namespace rdmax::rpc
