// rpc::server_group: the acceptor thread, the worker threads, and how they
// start, drain and stop. The call path is the workers' rpc::server's own.

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <system_error>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/detail/rpc/handoff.hpp>
#include <rdmax/detail/rpc/shm_link.hpp>
#include <rdmax/detail/rpc/tcp_link.hpp>
#include <rdmax/error.hpp>
#include <rdmax/local/node_address.hpp>
#include <rdmax/rpc/server_group.hpp>

#include "../notice.hpp"

namespace rdmax::rpc {

namespace {
/// Why a group is not reached over rdma, in its "no transport" error.
constexpr std::string_view group_rdma_why = "rdma has no device or is left out too";

std::size_t checked_threads(std::size_t threads) {
    if (threads == 0 || threads > 1024)
        throw_error("rpc::server_group", EINVAL,
                    fmt::format("{} worker threads asked (1 .. 1024)", threads));
    return threads;
}
std::int64_t own_cpu_ns() noexcept {
    timespec ts{};
    (void)::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return std::int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}
/// Adds `b`'s counts to `a`'s; the last refusal and link end are b's where it has one.
// A field added to rpc_counters must be added to the sum below too: this
// trips when the struct's size changes (then update both).
static_assert(sizeof(rpc_counters) == 504, "rpc_counters changed: update add_counters");

void add_counters(rpc_counters& a, const rpc_counters& b) noexcept {
    for (auto f : {&rpc_counters::calls,
                   &rpc_counters::completed,
                   &rpc_counters::failed,
                   &rpc_counters::timed_out,
                   &rpc_counters::cancelled,
                   &rpc_counters::late_replies,
                   &rpc_counters::no_credit,
                   &rpc_counters::external_bodies,
                   &rpc_counters::external_replies,
                   &rpc_counters::window_reallocs,
                   &rpc_counters::windows_unavailable,
                   &rpc_counters::fence_stalls,
                   &rpc_counters::cancelled_reads,
                   &rpc_counters::rail_joins,
                   &rpc_counters::striped_bodies,
                   &rpc_counters::rail_bytes,
                   &rpc_counters::keepalive_probes,
                   &rpc_counters::keepalive_timeouts,
                   &rpc_counters::reconnects,
                   &rpc_counters::reconnect_attempts,
                   &rpc_counters::retried_calls,
                   &rpc_counters::unknown_outcomes,
                   &rpc_counters::duplicates,
                   &rpc_counters::goaways,
                   &rpc_counters::bytes_in,
                   &rpc_counters::bytes_out,
                   &rpc_counters::unknown_method,
                   &rpc_counters::rejected_kind,
                   &rpc_counters::rejected_slot,
                   &rpc_counters::rejected_length,
                   &rpc_counters::rejected_malformed,
                   &rpc_counters::rejected_credit,
                   &rpc_counters::rejected_opcode,
                   &rpc_counters::stray_completions,
                   &rpc_counters::connected,
                   &rpc_counters::connected_local,
                   &rpc_counters::connected_tcp,
                   &rpc_counters::disconnected,
                   &rpc_counters::link_failures})
        a.*f += b.*f;
    if (b.refused != 0)
        a.last_refusal = b.last_refusal;
    a.refused += b.refused;
    if (b.last_link_failure != 0)
        a.last_link_failure = b.last_link_failure;
    if (b.last_link_event >= 0) {
        a.last_link_event = b.last_link_event;
        a.last_link_event_status = b.last_link_event_status;
    }
}
/// A round of node-local accepts at most: a flood does not hold the acceptor.
constexpr int local_round = 64;
} // namespace

server_group::server_group(const verbs::protection_domain& pd, std::string_view addr,
                           std::uint16_t port, std::size_t threads, rpc_options opts)
    : opts_((opts.check("rpc::server_group"), opts))
    , routes_(std::make_unique<detail::group_routes>(checked_threads(threads),
                                                     std::size_t{4} * opts_.max_peers * threads))
    , listener_(opts_.transports.has(transport::rdma) ? verbs::listener(addr, port)
                                                      : verbs::listener())
    , port_(listener_.fd() >= 0 ? listener_.port() : port) {
    for (std::size_t w = 0; w < threads; ++w)
        workers_.push_back(std::unique_ptr<server>(new server(
            pd, *routes_, w, opts_))); // NOLINT(modernize-make-unique): a private constructor
    if (listener_.fd() < 0) {
        listen_without_rdma(addr);
        return;
    }
    if (opts_.node_local())
        listen_local(addr);
    listen_tcp(addr, false);
}

server_group::server_group(std::string_view addr, std::uint16_t port, std::size_t threads,
                           rpc_options opts)
    : opts_((opts.check("rpc::server_group"), opts))
    , routes_(std::make_unique<detail::group_routes>(checked_threads(threads),
                                                     std::size_t{4} * opts_.max_peers * threads))
    , port_(port) {
    for (std::size_t w = 0; w < threads; ++w)
        workers_.push_back(std::unique_ptr<server>(new server(
            detail::no_device, *routes_, w, opts_))); // NOLINT(modernize-make-unique): private
    listen_without_rdma(addr);
}

void server_group::listen_without_rdma(std::string_view addr) {
    // As rpc::server does (server_tcp.cpp): TCP takes the port, the
    // node-local name its number, and a name that cannot be had is refused
    // where shm is wanted.
    if (!local::is_node_address(addr))
        throw_error("rpc::server_group", EADDRNOTAVAIL,
                    fmt::format("{}: not an address of this node (without rdma, a group "
                                "listens on this node's addresses)",
                                addr));
    listen_tcp(addr, !opts_.node_local());
    if (opts_.node_local())
        local_listener_.emplace(listen_without_device(addr, port_));
    else if (tcp_listener_ < 0)
        throw_no_transport("rpc::server_group", addr, port_, group_rdma_why);
}

void server_group::listen_tcp(std::string_view addr, bool needed) {
    if (!opts_.transports.has(transport::tcp)) {
        if (needed)
            throw_no_transport("rpc::server_group", addr, port_, group_rdma_why);
        return;
    }
    tcp_listener_ = tcp_listen_for("rpc::server_group", addr, port_, needed);
}

server_group::server_group(detail::no_device_t none, std::string_view addr, std::uint16_t port,
                           std::size_t threads, rpc_options opts)
    : opts_((opts.check("rpc::server_group"), opts))
    , routes_(std::make_unique<detail::group_routes>(checked_threads(threads),
                                                     std::size_t{4} * opts_.max_peers * threads))
    , port_(port) {
    for (std::size_t w = 0; w < threads; ++w)
        workers_.push_back(std::unique_ptr<server>(new server(
            none, *routes_, w, opts_))); // NOLINT(modernize-make-unique): a private constructor
    listen_local(addr);
}

void server_group::listen_local(std::string_view addr) {
    // The name rpc::server's node-local clients look for: a client cannot
    // tell a group from a server.
    try {
        local_listener_.emplace(local_name(addr, port_));
    } catch (const error& e) {
        local_listener_.reset();
        rdmax::detail::notice(fmt::format("rpc::server_group on {}:{}: no node-local path ({}); "
                                          "peers here go through the device",
                                          addr, port_, e.what()));
    }
}

server_group::~server_group() {
    (void)stop();
    // A worker still in a handler at stop()'s deadline: waited for here
    // (its server, which it is using, goes with this object).
    for (std::thread& t : threads_)
        if (t.joinable())
            t.join();
    if (acceptor_wake_ >= 0)
        ::close(acceptor_wake_);
    if (tcp_listener_ >= 0)
        ::close(tcp_listener_);
}

void server_group::on(std::uint16_t method, const server::handler& h) {
    if (started_)
        throw_error("rpc::server_group::on", EBUSY, "handlers are set before start()");
    for (const std::unique_ptr<server>& w : workers_)
        w->on(method, h);
}

void server_group::on_thread_start(std::function<void(std::size_t)> f) {
    if (started_)
        throw_error("rpc::server_group::on_thread_start", EBUSY, "set before start()");
    on_start_ = std::move(f);
}

void server_group::set_worker_loop(std::function<void(worker_loop_context)> loop) {
    if (started_)
        throw_error("rpc::server_group::set_worker_loop", EBUSY, "set before start()");
    loop_ = std::move(loop);
}

void server_group::start() {
    if (started_)
        throw_error("rpc::server_group::start", EBUSY, "started already");
    acceptor_wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (acceptor_wake_ < 0)
        throw_error("eventfd", errno, "rpc::server_group acceptor");
    const std::size_t n = workers_.size();
    drained_ = std::make_unique<std::atomic<bool>[]>(n);
    loop_drained_ = std::make_unique<std::atomic<bool>[]>(n);
    final_cpu_ = std::make_unique<std::atomic<std::int64_t>[]>(n);
    done_ = std::make_unique<std::atomic<bool>[]>(n);
    for (std::size_t w = 0; w < n; ++w)
        final_cpu_[w].store(-1);
    started_ = true;
    threads_.reserve(n);
    try {
        for (std::size_t w = 0; w < n; ++w)
            threads_.emplace_back([this, w] { worker_main(w); });
        acceptor_ = std::thread([this] { acceptor_main(); });
    } catch (...) {
        (void)stop();
        throw;
    }
}

void server_group::worker_main(std::size_t w) noexcept {
    if (on_start_) {
        try {
            on_start_(w);
        } catch (...) {
            // The hook's failure is its own (a CPU it could not pin to): the
            // worker serves all the same.
        }
    }
    server& s = *workers_[w];
    if (loop_) {
        try {
            loop_(worker_loop_context{w, s, leaving_, *this});
        } catch (...) {
            // The loop's own failure: this worker serves no more (its
            // connections' calls end at their deadlines, then the drain's).
        }
        if (drain_.load(std::memory_order_acquire) &&
            !loop_drained_[w].load(std::memory_order_relaxed))
            drained_[w].store(s.drain(drain_deadline_), std::memory_order_relaxed);
    }
    // The loop reads two atomics per wake; stop() and drain() wake it
    // through the mailbox's eventfd.
    while (!loop_ && !stop_.load(std::memory_order_acquire)) {
        if (drain_.load(std::memory_order_acquire)) {
            drained_[w].store(s.drain(drain_deadline_), std::memory_order_relaxed);
            break;
        }
        (void)s.wait(std::chrono::milliseconds(100));
    }
    final_cpu_[w].store(own_cpu_ns(), std::memory_order_relaxed);
    done_[w].store(true, std::memory_order_release);
}

void server_group::acceptor_main() noexcept {
    pollfd fds[4] = {{acceptor_wake_, POLLIN, 0},
                     {listener_.fd(), POLLIN, 0},
                     {local_listener_ ? local_listener_->fd() : -1, POLLIN, 0},
                     {tcp_listener_, POLLIN, 0}};
    auto paused_until = std::chrono::steady_clock::time_point{};
    while (!stop_acceptor_.load(std::memory_order_acquire)) {
        // Out of descriptors at accept: the local listener stays readable,
        // so it is left out of the poll a while (as rpc::server does).
        const bool paused = std::chrono::steady_clock::now() < paused_until;
        fds[2].fd = paused || !local_listener_ ? -1 : local_listener_->fd();
        fds[3].fd = paused ? -1 : tcp_listener_;
        if (::poll(fds, 4, paused ? 50 : 1000) < 0 && errno != EINTR)
            break;
        if ((fds[3].revents & POLLIN) != 0) {
            accept_tcp();
            if (tcp_paused_)
                paused_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
            tcp_paused_ = false;
        }
        if ((fds[1].revents & POLLIN) != 0)
            accept_device();
        if ((fds[2].revents & POLLIN) != 0) {
            try {
                accept_local();
            } catch (const std::system_error& e) {
                acceptor_refused_.fetch_add(1, std::memory_order_relaxed);
                if (e.code().value() == EMFILE || e.code().value() == ENFILE)
                    paused_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
            } catch (...) {
                acceptor_refused_.fetch_add(1, std::memory_order_relaxed);
            }
        }
    }
    acceptor_cpu_.store(own_cpu_ns(), std::memory_order_relaxed);
}

void server_group::accept_device() noexcept {
    for (;;) {
        try {
            std::optional<verbs::connection_request> req = listener_.poll_request();
            if (!req)
                return;
            // A client seen before goes back to the worker with its replies.
            const std::optional<ring_offer> offer = req->peer_payload_as<ring_offer>();
            const std::optional<std::size_t> owner =
                offer ? routes_->owner(offer->incarnation) : std::nullopt;
            const std::size_t w = owner.value_or(routes_->least_loaded());
            detail::handoff_item item;
            item.device.emplace(std::move(*req));
            routes_->box(w).post(std::move(item));
        } catch (...) {
            // The request (if one was taken) is rejected as it goes.
            acceptor_refused_.fetch_add(1, std::memory_order_relaxed);
        }
    }
}

void server_group::accept_local() {
    for (int k = 0; k < local_round; ++k) {
        local::unix_channel ch = local_listener_->accept(std::chrono::milliseconds(0));
        if (ch.fd() < 0)
            return;
        // Whose client it is shows in its hello, which the worker reads
        // (a reconnection is forwarded by it to the worker with the replies).
        detail::handoff_item item;
        item.local = std::move(ch);
        routes_->box(routes_->least_loaded()).post(std::move(item));
    }
}

void server_group::accept_tcp() noexcept {
    for (int k = 0; k < local_round; ++k) {
        const int fd = accept4(tcp_listener_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            const int err = errno;
            if (err == EINTR || err == ECONNABORTED)
                continue;
            if (err != EAGAIN && err != EWOULDBLOCK)
                acceptor_refused_.fetch_add(1, std::memory_order_relaxed);
            // Out of descriptors: the listener stays readable, left out a while.
            tcp_paused_ = err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
            return;
        }
        if (!tcp_tune(fd)) {
            ::close(fd);
            acceptor_refused_.fetch_add(1, std::memory_order_relaxed);
            continue;
        }
        // Its hello, which the worker reads, says whose client it is, as
        // for node-local ones.
        try {
            detail::handoff_item item;
            item.local = local::unix_channel(fd);
            item.tcp = true;
            routes_->box(routes_->least_loaded()).post(std::move(item));
        } catch (...) {
            acceptor_refused_.fetch_add(1, std::memory_order_relaxed); // closed as it goes
        }
    }
}

void server_group::stop_acceptor() noexcept {
    stop_acceptor_.store(true, std::memory_order_release);
    if (acceptor_.joinable()) {
        const std::uint64_t one = 1;
        (void)!::write(acceptor_wake_, &one, sizeof one);
        acceptor_.join();
    }
}

bool server_group::join_workers(std::chrono::steady_clock::time_point until) noexcept {
    for (std::size_t w = 0; w < threads_.size(); ++w)
        routes_->box(w).wake();
    bool all = true;
    for (std::size_t w = 0; w < threads_.size(); ++w) {
        // std::thread has no timed join: its end is an atomic, looked at
        // every millisecond until `until` (stop and drain only).
        while (!done_[w].load(std::memory_order_acquire) &&
               std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (done_[w].load(std::memory_order_acquire) && threads_[w].joinable())
            threads_[w].join();
        all = all && !threads_[w].joinable();
    }
    return all;
}

bool server_group::stop(std::chrono::milliseconds deadline) noexcept {
    if (!started_)
        return true;
    const auto until = std::chrono::steady_clock::now() + deadline;
    stop_acceptor();
    stop_.store(true, std::memory_order_release);
    leaving_.store(true, std::memory_order_release);
    return join_workers(until);
}

bool server_group::drain(std::chrono::milliseconds deadline) noexcept {
    if (!started_)
        return true;
    const auto until = std::chrono::steady_clock::now() + deadline;
    // No new connections: requests still in the backlog are refused when
    // the listeners close (a client tries elsewhere, as after a goaway).
    stop_acceptor();
    listener_ = verbs::listener();
    local_listener_.reset();
    drain_deadline_ = deadline;
    drain_until_ = until;
    drain_.store(true, std::memory_order_release);
    leaving_.store(true, std::memory_order_release);
    // Each worker's drain ends by `deadline`; a second more for it to return.
    const bool joined = join_workers(until + std::chrono::seconds(1));
    stop_.store(true, std::memory_order_release);
    bool clean = joined;
    for (std::size_t w = 0; w < threads_.size(); ++w)
        clean = clean && drained_[w].load(std::memory_order_relaxed);
    return clean;
}

bool server_group::worker_loop_context::draining() const noexcept {
    return group.drain_.load(std::memory_order_acquire);
}

std::chrono::steady_clock::time_point
server_group::worker_loop_context::drain_until() const noexcept {
    return group.drain_until_; // written before drain_ (release), read after it
}

void server_group::worker_loop_context::begin_drain() const noexcept {
    srv.begin_drain();
}

bool server_group::worker_loop_context::drained() const noexcept {
    return srv.drained();
}

void server_group::worker_loop_context::end_drain(bool clean) const noexcept {
    srv.end_drain();
    group.drained_[worker].store(clean, std::memory_order_relaxed);
    group.loop_drained_[worker].store(true, std::memory_order_relaxed);
}

std::size_t server_group::peers(std::size_t w) const noexcept {
    return routes_->box(w).load.load(std::memory_order_acquire);
}

std::size_t server_group::peers() const noexcept {
    std::size_t n = 0;
    for (std::size_t w = 0; w < workers_.size(); ++w)
        n += peers(w);
    return n;
}

rpc_counters server_group::counters(std::size_t w) const {
    const bool running = started_ && !done_[w].load(std::memory_order_acquire);
    if (running)
        return routes_->box(w).snapshot(std::chrono::seconds(1));
    // Ended (or never started): its thread wrote them before it said done.
    return workers_[w]->counters();
}

rpc_counters server_group::counters() const {
    rpc_counters sum;
    for (std::size_t w = 0; w < workers_.size(); ++w)
        add_counters(sum, counters(w));
    sum.refused += acceptor_refused_.load(std::memory_order_relaxed);
    return sum;
}

std::chrono::nanoseconds server_group::thread_cpu(std::thread& t,
                                                  const std::atomic<std::int64_t>& final) noexcept {
    if (const std::int64_t ns = final.load(std::memory_order_relaxed); ns >= 0)
        return std::chrono::nanoseconds(ns);
    clockid_t id{};
    timespec ts{};
    if (!t.joinable() || ::pthread_getcpuclockid(t.native_handle(), &id) != 0 ||
        ::clock_gettime(id, &ts) != 0)
        return std::chrono::nanoseconds(std::max<std::int64_t>(final.load(), 0));
    return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

std::chrono::nanoseconds server_group::cpu_time(std::size_t w) const noexcept {
    if (!started_)
        return {};
    return thread_cpu(const_cast<std::thread&>(threads_[w]), final_cpu_[w]);
}

std::chrono::nanoseconds server_group::acceptor_cpu_time() const noexcept {
    if (!started_)
        return {};
    return thread_cpu(const_cast<std::thread&>(acceptor_), acceptor_cpu_);
}

} // namespace rdmax::rpc
