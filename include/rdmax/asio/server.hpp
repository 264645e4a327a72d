#pragma once
// Coroutine handlers for rpc::server on standalone Asio (built when Asio is
// found; the library itself does not need it). A handler is a function
// returning asio::awaitable<void>; it gets an async_request, which owns the
// call (deferred: rpc::request_context::defer) and a copy of the body:
//
//     rpc::server srv(pd, "0.0.0.0", 7471);
//     asio::io_context io;                       // after srv: its frames answer through srv
//     rdmax::rpc::async_server a(srv, io.get_executor());   // srv.fd() on io's reactor
//     a.on(1, [&](rdmax::rpc::async_request r) -> asio::awaitable<void> {
//         co_await other_service(r.body());                  // anything awaitable
//         r.reply(answer);
//     });
//     io.run();                                              // one thread
//
// Why a copy: request_context::body() is valid only while the handler runs
// (a body read from the caller's memory goes back to its block when the
// handler returns, deferred or not; one in the ring slot can be overwritten
// once the caller gives the call up). The copy costs one allocation per
// call, besides the coroutine's frame (Asio recycles frames per thread).
//
// How a call ends (as with a plain handler): reply() or fail() answers it;
// a coroutine that returns or throws without answering, or whose frame is
// destroyed before it finished (its io_context stopped and was destroyed),
// answers handler_failed (async_request's destructor). A call whose caller
// gave up (its deadline) or whose connection went is answered into nothing:
// reply() returns false (its answer is kept for a re-sent copy, as
// server::reply keeps it).
//
// Threads: the server is not thread-safe. Every coroutine runs on the
// executor given here, which must be the thread that drives the server
// (async_server drives it there). Destroy or run dry the io_context (the
// coroutine frames) before the server: a frame's destructor answers its call.
// On a server_group, serve_with_asio() runs each worker on an io_context of
// its own thread, and its handlers' coroutines there; rdmax::rpc::on()
// registers a coroutine handler on a server driven some other way.

// GCC 12 reports, where Asio 1.22's scheduler is inlined into the caller's
// code, a null thread_info it never dereferences (-Wnull-dereference is on
// here, and warnings are errors): not reported for Asio's own lines.
//
// Asio 1.22 knows clang's coroutines only as the TS's (__cpp_coroutines,
// <experimental/coroutine>), which clang 16 in C++20 mode no longer has; it
// has the standard's, as GCC, so awaitable is declared for it too (clang-tidy
// reads this header with clang). Include this header before Asio's own then.
#if defined(__clang__) && !defined(ASIO_HAS_CO_AWAIT) && defined(__cpp_impl_coroutine)
#if __cpp_impl_coroutine >= 201902 && __has_include(<coroutine>)
#define ASIO_HAS_CO_AWAIT 1
#endif
#endif
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference"
#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/posix/stream_descriptor.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>
#pragma GCC diagnostic pop
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <rdmax/rpc/server.hpp>
#include <rdmax/rpc/server_group.hpp>

namespace rdmax::rpc {

/// A call a coroutine handler answers: the request's fields and a copy of
/// its body, and the deferred call. Move-only; answers handler_failed when
/// destroyed unanswered.
class async_request {
public:
    /// Defers `c`'s call and copies its body (throws std::bad_alloc: then
    /// the call is answered handler_failed, as a throwing handler's is).
    async_request(rpc::server& srv, rpc::request_context& c)
        : srv_(&srv)
        , method_(c.method())
        , peer_(c.peer())
        , priority_(c.priority())
        , client_(c.client_incarnation())
        , call_id_(c.call_id())
        , idempotent_(c.idempotent())
        , body_(c.body().begin(), c.body().end())
        , call_(c.defer()) {}
    async_request(async_request&& o) noexcept
        : srv_(std::exchange(o.srv_, nullptr))
        , method_(o.method_)
        , peer_(o.peer_)
        , priority_(o.priority_)
        , client_(o.client_)
        , call_id_(o.call_id_)
        , idempotent_(o.idempotent_)
        , body_(std::move(o.body_))
        , call_(o.call_) {}
    async_request& operator=(async_request&& o) noexcept {
        if (this != &o) {
            end_unanswered();
            srv_ = std::exchange(o.srv_, nullptr);
            method_ = o.method_;
            peer_ = o.peer_;
            priority_ = o.priority_;
            client_ = o.client_;
            call_id_ = o.call_id_;
            idempotent_ = o.idempotent_;
            body_ = std::move(o.body_);
            call_ = o.call_;
        }
        return *this;
    }
    async_request(const async_request&) = delete;
    async_request& operator=(const async_request&) = delete;
    ~async_request() { end_unanswered(); }

    [[nodiscard]] std::uint16_t method() const noexcept { return method_; }
    [[nodiscard]] rpc::peer_id peer() const noexcept { return peer_; }
    [[nodiscard]] sched::priority priority() const noexcept { return priority_; }
    [[nodiscard]] std::uint64_t client_incarnation() const noexcept { return client_; }
    [[nodiscard]] std::uint64_t call_id() const noexcept { return call_id_; }
    [[nodiscard]] bool idempotent() const noexcept { return idempotent_; }
    /// The request's body: this object's copy, valid as long as it lives.
    [[nodiscard]] std::span<const std::byte> body() const noexcept { return body_; }
    /// The deferred call (for server::reply / server::fail by hand).
    [[nodiscard]] const rpc::deferred_call& call() const noexcept { return call_; }
    [[nodiscard]] bool answered() const noexcept { return srv_ == nullptr; }

    /// Answers with `bytes` (server::reply): false when the call's caller or
    /// connection is gone, or it was answered already.
    bool reply(std::span<const std::byte> bytes) noexcept {
        rpc::server* s = std::exchange(srv_, nullptr);
        return s != nullptr && s->reply(call_, bytes);
    }
    /// Answers with a status (server::fail: one a handler may say, else
    /// handler_failed).
    bool fail(rpc::call_status st) noexcept {
        rpc::server* s = std::exchange(srv_, nullptr);
        return s != nullptr && s->fail(call_, st);
    }

private:
    void end_unanswered() noexcept {
        if (rpc::server* s = std::exchange(srv_, nullptr))
            (void)s->fail(call_, rpc::call_status::handler_failed);
    }

    rpc::server* srv_; ///< null once answered (or moved from)
    std::uint16_t method_;
    rpc::peer_id peer_;
    sched::priority priority_;
    std::uint64_t client_;
    std::uint64_t call_id_;
    bool idempotent_;
    std::vector<std::byte> body_;
    rpc::deferred_call call_;
};

/// A coroutine handler: invocable with an async_request, returning
/// asio::awaitable<void>.
template <class F>
concept coroutine_handler = std::is_invocable_r_v<::asio::awaitable<void>, F&, async_request>;

/// Serves `method` on `srv` with coroutine handler `f`, each call's
/// coroutine spawned on `ex` (the thread that drives `srv`). The coroutine
/// starts when `ex` next runs: after the poll() that received the request.
template <coroutine_handler F>
void on(rpc::server& srv, std::uint16_t method, ::asio::any_io_executor ex, F f) {
    srv.on(method, [&srv, ex = std::move(ex), f = std::move(f)](rpc::request_context& c) mutable {
        // A throw here (no memory for the copy, or for the frame) leaves
        // the call to the server, which answers handler_failed.
        async_request r(srv, c);
        ::asio::co_spawn(ex, f(std::move(r)), [](const std::exception_ptr&) {
            // What the coroutine threw ends its frame, and the frame's
            // async_request answers handler_failed: nothing more to do.
        });
    });
}

/// Drives an rpc::server on an Asio executor's thread: its fd() on the
/// reactor (poll() when readable, arm() before each wait) and a timer each
/// housekeeping interval (connections, deadlines, keepalive). Not copyable;
/// stop() or the destructor leaves the server alone (its fd stays open).
/// Stop or destroy it on the executor's thread, or once that stopped running.
class async_server {
public:
    async_server(rpc::server& srv, const ::asio::any_io_executor& ex)
        : srv_(srv)
        , ex_(ex)
        , fd_(ex, srv.fd())
        , timer_(ex) {
        ::asio::post(ex_, [this, alive = std::weak_ptr<bool>(alive_)] {
            if (alive.lock())
                start();
        });
    }
    async_server(const async_server&) = delete;
    async_server& operator=(const async_server&) = delete;
    ~async_server() { stop(); }

    /// Serves `method` with coroutine handler `f`, spawned on this executor.
    template <coroutine_handler F>
    void on(std::uint16_t method, F f) {
        rdmax::rpc::on(srv_, method, ex_, std::move(f));
    }
    /// Stops driving the server (pending waits end; the fd is not closed).
    void stop() noexcept {
        alive_.reset();
        try {
            (void)timer_.cancel();
        } catch (const std::system_error&) {
            // The reactor refused: the wait ends at its expiry, finding alive_ gone.
        }
        if (fd_.is_open()) {
            ::asio::error_code ignored;
            fd_.cancel(ignored);
            (void)fd_.release(); // the server's descriptor: it closes it
        }
    }
    [[nodiscard]] rpc::server& server() noexcept { return srv_; }

private:
    void start() {
        serve();
        tick();
    }
    /// Polls until nothing is left and the server is armed, then waits for
    /// the fd; a flood that leaves it unarmed goes on after the executor's
    /// other work (posted), since no readiness would come to wake it.
    void serve() {
        if (!drive()) {
            if (posted_)
                return;
            posted_ = true;
            ::asio::post(ex_, [this, alive = std::weak_ptr<bool>(alive_)] {
                if (!alive.lock())
                    return;
                posted_ = false;
                serve();
            });
            return;
        }
        if (fd_waiting_)
            return;
        fd_waiting_ = true;
        fd_.async_wait(::asio::posix::stream_descriptor::wait_read,
                       [this, alive = std::weak_ptr<bool>(alive_)](const ::asio::error_code& ec) {
                           if (!alive.lock())
                               return;
                           fd_waiting_ = false;
                           if (ec != ::asio::error::operation_aborted)
                               serve(); // another error: the timer's ticks go on
                       });
    }
    /// Housekeeping is due each interval even when nothing arrives.
    void tick() {
        timer_.expires_after(srv_.options().housekeeping);
        timer_.async_wait(
            [this, alive = std::weak_ptr<bool>(alive_)](const ::asio::error_code& ec) {
                if (ec || !alive.lock())
                    return;
                serve();
                tick();
            });
    }
    /// True once the server is armed (nothing left); false after 64 rounds
    /// of a flood, which then yields to the executor's other work (the
    /// coroutines the handlers spawned).
    bool drive() noexcept {
        for (int round = 0; round < 64; ++round) {
            while (srv_.poll() > 0) {
            }
            if (srv_.arm())
                return true;
        }
        return false;
    }

    rpc::server& srv_;
    ::asio::any_io_executor ex_;
    ::asio::posix::stream_descriptor fd_;
    ::asio::steady_timer timer_;
    bool fd_waiting_ = false; ///< a wait for the fd is queued
    bool posted_ = false;     ///< a serve() is posted (a flood's next turn)
    std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

/// Runs each worker of `g` (before g.start()) on an io_context of its own
/// thread: `setup(a, worker)` registers the worker's handlers on its
/// async_server `a` (a.on(...) for coroutines, a.server().on(...) for plain
/// ones), on that thread, before it serves; then the io_context runs until
/// the group stops (looked at every 10 ms), or until a drain ends (every
/// call answered, coroutines included, or the drain's deadline). Coroutines
/// still waiting then are destroyed with the io_context: their calls answer
/// handler_failed. `setup` is called from every worker's thread at once.
template <class Setup>
    requires std::is_invocable_v<const Setup&, async_server&, std::size_t>
void serve_with_asio(rpc::server_group& g, Setup setup) {
    g.set_worker_loop([setup = std::move(setup)](rpc::server_group::worker_loop_context c) {
        ::asio::io_context io(1);
        async_server a(c.srv, io.get_executor());
        setup(a, c.worker);
        ::asio::steady_timer watch(io);
        bool draining = false;
        std::function<void()> look = [&] {
            watch.expires_after(std::chrono::milliseconds(10));
            watch.async_wait([&](const ::asio::error_code& ec) {
                if (ec)
                    return;
                if (!c.stopping.load(std::memory_order_acquire))
                    return look();
                // Draining: the coroutines keep running until every call
                // is answered (or the deadline), as server::drain's would.
                if (c.draining() && !draining) {
                    draining = true;
                    c.begin_drain();
                }
                if (draining) {
                    const bool clean = c.drained();
                    if (!clean && std::chrono::steady_clock::now() < c.drain_until())
                        return look();
                    c.end_drain(clean);
                }
                a.stop();
                io.stop();
            });
        };
        look();
        io.run();
        // `a` goes before `io`: the handlers io still holds are destroyed
        // with it, not run; the coroutine frames answer through c.srv.
    });
}

} // namespace rdmax::rpc
