// Coroutine handlers on rpc::server (include/rdmax/asio/server.hpp), without
// a device: a real rpc::client and rpc::server joined by fake links
// (tests/support/fake_link.hpp), their messages landed by hand, the
// coroutines run by an asio::io_context on this thread. Handlers that
// co_await a timer (several calls interleaved), throw, return without an
// answer, or never finish (their frame destroyed with the io_context); a
// body still right after the ring slot it came in was overwritten;
// async_server driving the server from the io_context alone; and a
// server_group whose two workers run coroutine handlers on io_contexts of
// their own, for clients on their own threads through the node-local path
// (which needs no device: real shared segments and eventfds, so the
// reactor's wake-ups are the real ones). A handler that co_awaits another
// call (rpc::async_client) is in test_asio_chain.cpp.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <unistd.h>
#include <vector>

#include <rdmax/asio/server.hpp>

#include "../support/catch.hpp"
#include "../support/fake_link.hpp"
#include "../support/group_test_access.hpp"
#include "../support/rpc_unit.hpp"

using namespace rdmax;
using namespace rdmax::test::rpc_unit;

namespace {

constexpr std::uint16_t delayed_echo = 1; ///< waits the ms its body's first byte says, echoes
constexpr std::uint16_t throws = 2;       ///< throws after a wait
constexpr std::uint16_t returns = 3;      ///< returns without an answer
constexpr std::uint16_t forever = 4;      ///< waits on a timer that never fires

/// A client and a server on a node-local fake link (immediates come out of
/// the link's poll, so the server's poll() takes them), and an io_context.
struct rig {
    std::unique_ptr<rpc::server> srv = inside::make_server(asio_options());
    std::unique_ptr<rpc::client> cli = inside::make_client(asio_options());
    std::shared_ptr<fake_end> c = std::make_shared<fake_end>(fake_path::node_local, 8, 256);
    std::shared_ptr<fake_end> s = std::make_shared<fake_end>(fake_path::node_local, 8, 256);
    peer_id p;
    std::vector<call_result> got;
    std::vector<std::string> replies;
    /// Last: destroyed first, with any coroutine frame left (whose
    /// async_request answers through the server).
    ::asio::io_context io;

    rig() {
        c->peer = s.get();
        s->peer = c.get();
        p = inside::adopt(*cli, c);
        (void)inside::adopt(*srv, s);
    }
    /// Messages land both ways; the server and the client take theirs.
    void pump(bool poll_server = true) {
        while (c->land_one() || !c->outbox.empty()) {
        }
        if (poll_server)
            (void)srv->poll();
        while (s->land_one() || !s->outbox.empty()) {
        }
        std::array<call_result, 16> out;
        const int n = cli->poll(out);
        for (int i = 0; i < n; ++i) {
            got.push_back(out[static_cast<std::size_t>(i)]);
            replies.push_back(text(out[static_cast<std::size_t>(i)].reply));
        }
        cli->release();
    }
    /// Pumps and runs the io_context until `n` results came (or 5 s passed).
    bool until_results(std::size_t n, bool poll_server = true) {
        const auto end = std::chrono::steady_clock::now() + 5s;
        while (got.size() < n && std::chrono::steady_clock::now() < end) {
            pump(poll_server);
            io.restart(); // run_for() stops the context when it ran out of work
            io.run_for(1ms);
        }
        return got.size() >= n;
    }
    void start(std::uint16_t method, std::string_view body, std::uint64_t cookie = 0) {
        rpc::call_options o;
        o.cookie = cookie;
        REQUIRE(cli->start(p, method, bytes_of(body), o) == call_status::ok);
    }
};

/// Waits `ms` milliseconds on the coroutine's executor.
::asio::awaitable<void> pause(std::chrono::milliseconds ms) {
    ::asio::steady_timer t(co_await ::asio::this_coro::executor, ms);
    co_await t.async_wait(::asio::use_awaitable);
}

void serve(rig& r) {
    const auto ex = r.io.get_executor();
    rdmax::rpc::on(*r.srv, delayed_echo, ex,
                   [](rdmax::rpc::async_request q) -> ::asio::awaitable<void> {
                       const auto ms = std::chrono::milliseconds(
                           q.body().empty() ? 0 : static_cast<int>(q.body()[0]) - '0');
                       co_await pause(ms * 30); // 30 ms apart: in order even when timers run late
                       q.reply(q.body());
                   });
    rdmax::rpc::on(*r.srv, throws, ex, [](rdmax::rpc::async_request) -> ::asio::awaitable<void> {
        co_await pause(1ms);
        throw std::runtime_error("no");
    });
    rdmax::rpc::on(*r.srv, returns, ex, [](rdmax::rpc::async_request) -> ::asio::awaitable<void> {
        co_await pause(1ms);
    });
    rdmax::rpc::on(*r.srv, forever, ex, [](rdmax::rpc::async_request) -> ::asio::awaitable<void> {
        co_await pause(std::chrono::hours(1));
    });
}

} // namespace

TEST_CASE("asio coroutine handlers: calls interleave over co_await, each answered its own") {
    rig r;
    serve(r);
    // Waits of 90, 30, 60 ms: answered in the order 2, 3, 1.
    r.start(delayed_echo, "3-first", 1);
    r.start(delayed_echo, "1-second", 2);
    r.start(delayed_echo, "2-third", 3);
    REQUIRE(r.until_results(3));
    REQUIRE(r.got.size() == 3);
    CHECK(r.got[0].cookie == 2);
    CHECK(r.got[1].cookie == 3);
    CHECK(r.got[2].cookie == 1);
    CHECK(r.replies == std::vector<std::string>{"1-second", "2-third", "3-first"});
    for (const call_result& c : r.got)
        CHECK(c.status == call_status::ok);
}

TEST_CASE("asio coroutine handlers: the body is the request's own copy") {
    rig r;
    serve(r);
    r.start(delayed_echo, "2-original");
    r.pump(); // the handler ran; its coroutine waits 20 ms
    // The bytes in the server's ring slot change under it (as a caller that
    // gave the call up would write its next request there).
    std::memset(r.s->ring.data(), 'x', r.s->ring.size());
    REQUIRE(r.until_results(1));
    CHECK(r.got[0].status == call_status::ok);
    CHECK(r.replies[0] == "2-original");
}

TEST_CASE("asio coroutine handlers: one that throws or returns unanswered ends handler_failed") {
    rig r;
    serve(r);
    r.start(throws, "a", 1);
    r.start(returns, "b", 2);
    REQUIRE(r.until_results(2));
    for (const call_result& c : r.got)
        CHECK(c.status == call_status::handler_failed);
    // The slots came back: the next call is served.
    r.start(delayed_echo, "0-after", 3);
    const bool third = r.until_results(3);
    INFO(fmt::format("server: {}\nclient: {}", r.srv->counters(), r.cli->counters()));
    REQUIRE(third);
    CHECK(r.got[2].status == call_status::ok);
    CHECK(r.replies[2] == "0-after");
}

TEST_CASE("asio coroutine handlers: one never finished ends handler_failed with its frame") {
    rig r;
    {
        auto io = std::make_unique<::asio::io_context>();
        rdmax::rpc::on(*r.srv, forever, io->get_executor(),
                       [](rdmax::rpc::async_request) -> ::asio::awaitable<void> {
                           co_await pause(std::chrono::hours(1));
                       });
        r.start(forever, "z");
        r.pump();
        (void)io->run_for(20ms); // the coroutine starts, and waits
        r.pump();
        CHECK(r.got.empty()); // not answered while it waits
        io.reset();           // its frame goes with the io_context
    }
    REQUIRE(r.until_results(1));
    CHECK(r.got[0].status == call_status::handler_failed);
}

TEST_CASE("asio coroutine handlers: async_server drives the server from the io_context") {
    rig r;
    rdmax::rpc::async_server a(*r.srv, r.io.get_executor());
    a.on(delayed_echo, [](rdmax::rpc::async_request q) -> ::asio::awaitable<void> {
        co_await pause(1ms);
        q.reply(q.body());
    });
    for (int i = 0; i < 8; ++i) // a call per slot
        r.start(delayed_echo, "0-" + std::to_string(i), static_cast<std::uint64_t>(i));
    // The test lands the messages only; async_server's polls (its timer,
    // each housekeeping interval) take them and run the handlers.
    REQUIRE(r.until_results(8, false));
    for (std::size_t i = 0; i < 8; ++i) {
        CHECK(r.got[i].status == call_status::ok);
        CHECK(r.replies[i] == "0-" + std::to_string(r.got[i].cookie));
    }
    a.stop();
}

TEST_CASE("asio coroutine handlers on a server_group: each worker's own io_context") {
    rpc::rpc_options o = asio_options();
    o.local = true;
    // Housekeeping (async_server's timer) every 200 ms: the calls go at the
    // pace of the reactor's wake-ups (the links' eventfds), or not at all.
    o.housekeeping = 200ms;
    const auto port = static_cast<std::uint16_t>(30000 + (::getpid() % 20000));
    auto g = rpc::group_test_access::make("127.0.0.4", port, 2, o);
    std::atomic<int> setups{0};
    rdmax::rpc::serve_with_asio(*g, [&setups](rdmax::rpc::async_server& a, std::size_t w) {
        ++setups;
        a.on(delayed_echo, [w](rdmax::rpc::async_request q) -> ::asio::awaitable<void> {
            co_await pause(1ms);
            std::vector<std::byte> out(q.body().size() + 1);
            out[0] = static_cast<std::byte>(w);
            std::memcpy(out.data() + 1, q.body().data(), q.body().size());
            q.reply(out);
        });
    });
    g->start();
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<int> seen(4, -2);
    std::vector<std::thread> clients;
    for (std::size_t k = 0; k < 4; ++k)
        clients.emplace_back([&, k] {
            auto cli = inside::make_client(o);
            const peer_id p = cli->connect("127.0.0.4", port);
            int w = -2;
            for (std::uint32_t i = 0; i < 200; ++i) {
                const std::string body = "call " + std::to_string(i);
                const call_result r = cli->call(p, delayed_echo, bytes_of(body));
                const bool right = r.status == call_status::ok &&
                                   r.reply.size() == body.size() + 1 &&
                                   text(r.reply.subspan(1)) == body;
                const int by = right ? static_cast<int>(r.reply[0]) : -1;
                w = (w == -2 || w == by) ? by : -1;
            }
            seen[k] = w;
        });
    for (std::thread& t : clients)
        t.join();
    // 200 calls per client: 40 s if each waited for a housekeeping tick.
    CHECK(std::chrono::steady_clock::now() - t0 < 10s);
    CHECK(setups.load() == 2);
    std::sort(seen.begin(), seen.end());
    CHECK(seen == std::vector<int>{0, 0, 1, 1});
    CHECK(g->counters().calls == 800);
    CHECK(g->drain(5s));
}

TEST_CASE("asio coroutine handlers on a server_group: drain waits for the coroutines") {
    rpc::rpc_options o = asio_options();
    o.local = true;
    const auto port = static_cast<std::uint16_t>(31000 + (::getpid() % 20000));
    auto g = rpc::group_test_access::make("127.0.0.5", port, 2, o);
    rdmax::rpc::serve_with_asio(*g, [](rdmax::rpc::async_server& a, std::size_t) {
        a.on(delayed_echo, [](rdmax::rpc::async_request q) -> ::asio::awaitable<void> {
            co_await pause(300ms); // still waiting when the drain begins
            q.reply(q.body());
        });
    });
    g->start();
    // Two clients (one per worker), four calls in flight each.
    std::vector<std::unique_ptr<rpc::client>> clis;
    std::vector<peer_id> peers;
    for (int k = 0; k < 2; ++k) {
        clis.push_back(inside::make_client(o));
        peers.push_back(clis.back()->connect("127.0.0.5", port));
        for (int i = 0; i < 4; ++i)
            REQUIRE(clis.back()->start(peers.back(), delayed_echo, bytes_of("0-in flight")) ==
                    call_status::ok);
    }
    // The clients poll on threads of their own while the group drains.
    std::atomic<int> ok{0}, other{0};
    std::vector<std::thread> pollers;
    pollers.reserve(2);
    for (int k = 0; k < 2; ++k)
        pollers.emplace_back([&, k] {
            const auto end = std::chrono::steady_clock::now() + 5s;
            int got = 0;
            while (got < 4 && std::chrono::steady_clock::now() < end) {
                std::array<call_result, 8> out;
                const int n = clis[static_cast<std::size_t>(k)]->poll(out);
                for (int i = 0; i < n; ++i) {
                    const bool right =
                        out[static_cast<std::size_t>(i)].status == call_status::ok &&
                        text(out[static_cast<std::size_t>(i)].reply) == "0-in flight";
                    ++(right ? ok : other);
                }
                got += n;
            }
        });
    CHECK(g->drain(5s));
    for (std::thread& t : pollers)
        t.join();
    CHECK(ok.load() == 8);
    CHECK(other.load() == 0);
}
