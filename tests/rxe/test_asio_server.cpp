// Coroutine handlers on a real device (include/rdmax/asio/server.hpp): an
// rpc::server driven by async_server on an io_context's thread, its fd() on
// the reactor (completion events through the completion channel, node-local
// peers' eventfds), a handler that co_awaits a timer; a client through the
// device and one through this node's memory, on their own threads. And a
// server_group whose two workers run their coroutines on io_contexts of
// their own (serve_with_asio).
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <rdmax/asio/server.hpp> // Asio too (with the warning it needs off)
#include <rdmax/rpc/client.hpp>

#include "../support/catch.hpp"
#include "../support/test_device.hpp"

using namespace rdmax;
using namespace std::chrono_literals;

namespace {

constexpr std::uint16_t echo = 1;

std::string test_addr() {
    return test::test_address().value_or("192.0.2.1");
}

rpc::rpc_options options(bool local) {
    rpc::rpc_options o;
    o.local = local;
    o.slots = 16;
    o.slot_bytes = 4096;
    o.call_timeout = 20s;
    // Housekeeping every 200 ms: the calls go at the pace of the reactor's
    // wake-ups, not of async_server's timer.
    o.housekeeping = 200ms;
    return o;
}

::asio::awaitable<void> pause(std::chrono::milliseconds ms) {
    ::asio::steady_timer t(co_await ::asio::this_coro::executor, ms);
    co_await t.async_wait(::asio::use_awaitable);
}

/// `calls` echo calls on `p` (through `local` or the device), each checked;
/// with `worker` >= 0, the reply's first byte must name it.
bool call_many(rpc::client& cli, rpc::peer_id p, bool local, int calls, int worker = -1) {
    if (cli.is_local(p) != local)
        return false;
    for (int i = 0; i < calls; ++i) {
        const std::string body = "call " + std::to_string(i) + (local ? " local" : " device");
        const rpc::call_result r = cli.call(p, echo, std::as_bytes(std::span(body)));
        const std::size_t skip = worker >= 0 ? 1 : 0;
        if (r.status != rpc::call_status::ok || r.reply.size() != body.size() + skip ||
            std::memcmp(r.reply.data() + skip, body.data(), body.size()) != 0 ||
            (worker >= 0 && static_cast<int>(r.reply[0]) != worker))
            return false;
    }
    return true;
}

/// A device client and a node-local one, connected in that order.
struct two_clients {
    rpc::client dc, lc;
    rpc::peer_id dp, lp;
    two_clients(const verbs::protection_domain& pd, std::uint16_t port)
        : dc(pd, options(false))
        , lc(pd, options(true))
        , dp(dc.connect(test_addr(), port))
        , lp(lc.connect(test_addr(), port)) {}
    /// Both call at once, each on its own thread.
    std::pair<bool, bool> run(int calls, int device_worker = -1, int local_worker = -1) {
        bool d_ok = false, l_ok = false;
        std::thread d([&] { d_ok = call_many(dc, dp, false, calls, device_worker); });
        std::thread l([&] { l_ok = call_many(lc, lp, true, calls, local_worker); });
        d.join();
        l.join();
        return {d_ok, l_ok};
    }
};

} // namespace

TEST_CASE("asio: coroutine handlers on a device server, device and node-local clients") {
    verbs::context ctx = test::open_test_device();
    verbs::protection_domain pd(ctx);
    rpc::server srv(pd, test_addr(), 0, options(true));
    ::asio::io_context io;
    rdmax::rpc::async_server a(srv, io.get_executor());
    a.on(echo, [](rdmax::rpc::async_request q) -> ::asio::awaitable<void> {
        co_await pause(1ms);
        q.reply(q.body());
    });
    std::thread runner([&io] {
        auto guard = ::asio::make_work_guard(io);
        io.run_for(120s);
    });
    two_clients c(pd, srv.port());
    const auto t0 = std::chrono::steady_clock::now();
    const auto [device_ok, local_ok] = c.run(100);
    const auto took = std::chrono::steady_clock::now() - t0;
    ::asio::post(io, [&] {
        a.stop();
        io.stop();
    });
    runner.join();
    CHECK(device_ok);
    CHECK(local_ok);
    // 200 calls at a housekeeping tick each would take 40 s.
    CHECK(took < 20s);
    CHECK(srv.counters().calls == 200);
}

TEST_CASE("asio: coroutine handlers on a server_group's two workers") {
    verbs::context ctx = test::open_test_device();
    verbs::protection_domain pd(ctx);
    rpc::server_group g(pd, test_addr(), 0, 2, options(true));
    rdmax::rpc::serve_with_asio(g, [](rdmax::rpc::async_server& a, std::size_t w) {
        a.on(echo, [w](rdmax::rpc::async_request q) -> ::asio::awaitable<void> {
            co_await pause(1ms);
            std::vector<std::byte> out(q.body().size() + 1);
            out[0] = static_cast<std::byte>(w);
            std::memcpy(out.data() + 1, q.body().data(), q.body().size());
            q.reply(out);
        });
    });
    g.start();
    // The device client goes to worker 0, the node-local one to worker 1.
    two_clients c(pd, g.port());
    const auto [device_ok, local_ok] = c.run(100, 0, 1);
    CHECK(device_ok);
    CHECK(local_ok);
    CHECK(g.counters().calls == 200);
    CHECK(g.drain(5s));
}
