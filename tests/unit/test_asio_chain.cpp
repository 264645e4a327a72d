// A coroutine handler that co_awaits another call (issue 26): server A's
// handler, for each request, calls server B through an rpc::async_client
// (co_await ... asio::use_awaitable) and answers A's caller with B's reply.
// Two real rpc::client / rpc::server pairs joined by node-local fake links
// (tests/support/fake_link.hpp), without a device. Everything runs on ONE
// io_context on this thread: both servers are driven by rpc::async_server,
// both clients (the test's caller of A, and A's client of B) by
// rpc::async_client; the test polls nothing itself. The "network" is a
// handler on the same context that lands what each side sent and wakes the
// receiving side's descriptor, as a node-local peer would.

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

// First: it declares Asio's awaitable for clang (see there), and its Asio
// includes quiet a GCC warning in Asio's own code.
#include <rdmax/asio/client.hpp>
#include <rdmax/asio/server.hpp>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference"
#include <asio/co_spawn.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>
#pragma GCC diagnostic pop

#include "../support/catch.hpp"
#include "../support/fake_link.hpp"
#include "../support/rpc_unit.hpp"

using namespace rdmax;
using namespace rdmax::test::rpc_unit;
using awaitable = ::asio::awaitable<void>;

namespace {

// Server A's methods.
constexpr std::uint16_t chain = 1;          ///< B's upper, answered "a:" + B's reply
constexpr std::uint16_t chain_throwing = 2; ///< B's missing; the error as an exception
constexpr std::uint16_t chain_tuple = 3;    ///< B's missing; the error as a tuple
// Server B's.
constexpr std::uint16_t upper = 1;   ///< waits 10 ms x its body's first digit, uppercases
constexpr std::uint16_t missing = 9; ///< no handler: unknown_method

std::string uppercase(std::string s) {
    std::transform(s.begin(), s.end(), s.begin(),
                   [](unsigned char ch) { return static_cast<char>(std::toupper(ch)); });
    return s;
}

rpc::rpc_options options() {
    rpc::rpc_options o = asio_options();
    o.keepalive = 100s; // nothing here is about keepalive
    o.keepalive_timeout = 1000s;
    return o;
}

/// Waits `ms` on the coroutine's executor.
awaitable pause(std::chrono::milliseconds ms) {
    ::asio::steady_timer t(co_await ::asio::this_coro::executor, ms);
    co_await t.async_wait(::asio::use_awaitable);
}

/// A connection: the client's end and the server's.
struct wire {
    std::shared_ptr<fake_end> c = std::make_shared<fake_end>(fake_path::node_local, 8, 256);
    std::shared_ptr<fake_end> s = std::make_shared<fake_end>(fake_path::node_local, 8, 256);
    wire() {
        c->peer = s.get();
        s->peer = c.get();
    }
    /// Lands what both ends sent, and wakes the side that got something.
    void shuttle() const {
        bool to_server = false, to_client = false;
        while (!c->outbox.empty()) {
            (void)c->land_one();
            to_server = true;
        }
        while (!s->outbox.empty()) {
            (void)s->land_one();
            to_client = true;
        }
        if (to_server)
            s->wake();
        if (to_client)
            c->wake();
    }
};

struct outcome {
    std::uint64_t cookie = 0;
    call_status status = call_status::ok;
    std::string reply;
};

/// The caller -> A -> B chain, on one io_context.
struct chain_world {
    std::unique_ptr<rpc::server> a = inside::make_server(options());
    std::unique_ptr<rpc::server> b = inside::make_server(options());
    std::unique_ptr<rpc::client> caller_core = inside::make_client(options());
    std::unique_ptr<rpc::client> a_to_b_core = inside::make_client(options());
    wire to_a_wire, to_b_wire;
    peer_id to_a, to_b;
    std::deque<std::string> bodies;         ///< the caller's requests, unchanged while out
    std::vector<outcome> results;           ///< the caller's, in the order they completed
    std::vector<std::error_code> seen_by_a; ///< B's errors, as A's handlers saw them
    std::size_t peak_to_b = 0;              ///< most calls A had out to B at once
    std::thread::id io_thread = std::this_thread::get_id();
    bool off_thread = false; ///< a handler ran on another thread
    bool net_on = false;
    /// After the servers and clients (destroyed before them: the coroutine
    /// frames it still holds answer through their servers).
    ::asio::io_context io;
    /// After the context: their waits go before the context they are queued on.
    std::optional<rpc::async_server> drive_a, drive_b;
    std::optional<rpc::async_client> caller, a_to_b;

    chain_world() {
        to_a = inside::adopt(*caller_core, to_a_wire.c);
        (void)inside::adopt(*a, to_a_wire.s);
        to_b = inside::adopt(*a_to_b_core, to_b_wire.c);
        (void)inside::adopt(*b, to_b_wire.s);
        drive_a.emplace(*a, io.get_executor());
        drive_b.emplace(*b, io.get_executor());
        caller.emplace(io, *caller_core);
        a_to_b.emplace(io, *a_to_b_core);
        serve_b();
        serve_a();
    }
    void serve_b() {
        drive_b->on(upper, [](rpc::async_request q) -> awaitable {
            const int digit = q.body().empty() ? 0 : static_cast<int>(q.body()[0]) - '0';
            co_await pause(10ms * digit);
            const std::string out = uppercase(text(q.body()));
            q.reply(bytes_of(out));
        });
    }
    void serve_a() {
        drive_a->on(chain, [this](rpc::async_request q) -> awaitable {
            off_thread = off_thread || std::this_thread::get_id() != io_thread;
            // q's body is its own copy: it stays unchanged while B's call is out.
            const call_result r =
                co_await a_to_b->async_call(to_b, upper, q.body(), {}, ::asio::use_awaitable);
            // B's reply is valid until this coroutine next suspends: used now.
            const std::string out = "a:" + text(r.reply);
            q.reply(bytes_of(out));
        });
        drive_a->on(chain_throwing, [this](rpc::async_request q) -> awaitable {
            try {
                (void)co_await a_to_b->async_call(to_b, missing, q.body(), {},
                                                  ::asio::use_awaitable);
                q.reply(bytes_of("B answered"));
            } catch (const std::system_error& e) {
                seen_by_a.push_back(e.code());
                q.fail(call_status::handler_failed);
            }
        });
        drive_a->on(chain_tuple, [this](rpc::async_request q) -> awaitable {
            auto [ec, r] = co_await a_to_b->async_call(
                to_b, missing, q.body(), {}, ::asio::experimental::as_tuple(::asio::use_awaitable));
            seen_by_a.push_back(ec);
            if (ec)
                q.fail(r.status); // B's status, passed on to A's caller
            else
                q.reply(r.reply);
        });
    }

    /// The caller's call of A's `method` with `body`, its outcome kept.
    void call(std::uint16_t method, std::string_view body, std::uint64_t cookie) {
        rpc::call_options o;
        o.cookie = cookie;
        const std::string& kept = bodies.emplace_back(body);
        caller->async_call(to_a, method, bytes_of(kept), o,
                           [this](std::error_code, const call_result& r) {
                               results.push_back({r.cookie, r.status, text(r.reply)});
                           });
    }

    /// The network, a handler that runs again each turn while net_on.
    void net() {
        if (!net_on)
            return;
        peak_to_b = std::max(peak_to_b, a_to_b->outstanding());
        to_a_wire.shuttle();
        to_b_wire.shuttle();
        ::asio::post(io, [this] { net(); });
    }
    /// Runs the context until `n` results came (or 10 s: a hang fails).
    void run_until(std::size_t n) {
        net_on = true;
        net();
        const auto deadline = std::chrono::steady_clock::now() + 10s;
        while (results.size() < n && std::chrono::steady_clock::now() < deadline)
            (void)io.run_one_for(10ms);
        net_on = false;
        io.restart();
        (void)io.poll(); // the network's last turn
        io.restart();
        INFO(fmt::format("A: {}\nB: {}\ncaller: {}\nA's client: {}", a->counters(), b->counters(),
                         caller_core->counters(), a_to_b_core->counters()));
        REQUIRE(results.size() >= n);
    }
};

} // namespace

TEST_CASE("asio chain: a handler co_awaits another call, six in flight at once", "[asio][chain]") {
    chain_world w;
    // B waits 60, 50, ... 10 ms, so its replies tend to come in reverse; the
    // order is not checked (a loaded machine, TSan, may run timers late): that
    // each answer is its own B reply, and that A had every B call out at once.
    const std::vector<std::string> sent{"6 alpha", "5 bravo", "4 charlie",
                                        "3 delta", "2 echo",  "1 foxtrot"};
    for (std::size_t i = 0; i < sent.size(); ++i)
        w.call(chain, sent[i], i);
    w.run_until(sent.size());
    REQUIRE(w.results.size() == sent.size());
    for (std::size_t k = 0; k < w.results.size(); ++k) {
        const outcome& r = w.results[k];
        INFO("result " << k << ", cookie " << r.cookie);
        CHECK(r.status == call_status::ok);
        REQUIRE(r.cookie < sent.size());
        CHECK(r.reply == "a:" + uppercase(sent[r.cookie])); // its own B reply
    }
    CHECK(w.peak_to_b == sent.size()); // A had every B call out at once
    CHECK(w.b->counters().calls == sent.size());
    CHECK(w.a->counters().calls == sent.size());
    CHECK(w.a_to_b->outstanding() == 0);
    CHECK_FALSE(w.off_thread);
    CHECK(w.seen_by_a.empty());

    // Again, on the same chain: the slots of both links came back.
    w.call(chain, "1 again", 100);
    w.run_until(sent.size() + 1);
    CHECK(w.results.back().status == call_status::ok);
    CHECK(w.results.back().reply == "a:1 AGAIN");
}

TEST_CASE("asio chain: B's call fails, A's handler sees it and fails its own call",
          "[asio][chain]") {
    chain_world w;
    w.call(chain_throwing, "x", 1);
    w.run_until(1);
    w.call(chain_tuple, "y", 2);
    w.run_until(2);
    w.call(chain, "0 still fine", 3); // the chain goes on after the failures
    w.run_until(3);
    REQUIRE(w.results.size() == 3);
    // An exception (asio::system_error): the handler answered handler_failed.
    CHECK(w.results[0].cookie == 1);
    CHECK(w.results[0].status == call_status::handler_failed);
    // A tuple: the handler passed B's status on.
    CHECK(w.results[1].cookie == 2);
    CHECK(w.results[1].status == call_status::unknown_method);
    CHECK(w.results[2].status == call_status::ok);
    CHECK(w.results[2].reply == "a:0 STILL FINE");
    // Both handlers saw B's error itself.
    REQUIRE(w.seen_by_a.size() == 2);
    for (const std::error_code& ec : w.seen_by_a)
        CHECK(ec == call_status::unknown_method);
    CHECK(w.a_to_b->outstanding() == 0);
    CHECK(w.caller->outstanding() == 0);
}
