// rpc::server_group on a real device: clients through the device (rdma_cm)
// and through this node's memory, spread over two workers, each served on
// its worker's thread, bodies over a slot included; and the server's CPU
// time per call with 1 and 2 workers (printed, not gated: on the VM's two
// shared cores it measures contention as much as work).
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include <rdmax/rpc/client.hpp>
#include <rdmax/rpc/server_group.hpp>

#include "../support/catch.hpp"
#include "../support/eventually.hpp"
#include "../support/test_device.hpp"

using namespace rdmax;
using namespace std::chrono_literals;

namespace {

constexpr std::uint16_t echo = 1; ///< replies with the worker's index, then the body
thread_local int worker_index = -1;

std::string test_addr() {
    return test::test_address().value_or("192.0.2.1");
}

rpc::rpc_options options(bool local) {
    rpc::rpc_options o;
    o.local = local;
    o.slots = 16;
    o.slot_bytes = 4096;
    o.call_timeout = 20s;
    o.housekeeping = 1ms;
    return o;
}

std::unique_ptr<rpc::server_group> make_group(const verbs::protection_domain& pd,
                                              std::size_t threads) {
    auto g = std::make_unique<rpc::server_group>(pd, test_addr(), 0, threads, options(true));
    g->on(echo, [](rpc::request_context& c) {
        // Built in a buffer of the handler's: bodies may be over a slot.
        thread_local std::vector<std::byte> out(64 << 10);
        out[0] = static_cast<std::byte>(worker_index);
        const std::size_t n = std::min(c.body().size(), out.size() - 1);
        std::memcpy(out.data() + 1, c.body().data(), n);
        c.reply({out.data(), n + 1});
    });
    g->on_thread_start([](std::size_t w) { worker_index = static_cast<int>(w); });
    return g;
}

/// A client on its own connection; `local` picks the node-local path.
struct caller {
    rpc::client cli;
    rpc::peer_id peer;
    std::vector<std::byte> reply_buf = std::vector<std::byte>(64 << 10);
    caller(const verbs::protection_domain& pd, std::uint16_t port, bool local)
        : cli(pd, options(local))
        , peer(cli.connect(test_addr(), port)) {}

    /// One call of `bytes` bytes; the worker that answered, -1 on a wrong reply.
    int call(std::size_t bytes, std::uint32_t seed) {
        std::vector<std::byte> body(bytes);
        for (std::size_t i = 0; i < bytes; ++i)
            body[i] = static_cast<std::byte>((i * 31 + seed) & 0xff);
        rpc::call_options o;
        o.reply_into = reply_buf;
        const rpc::call_result r = cli.call(peer, echo, body, o);
        if (r.status != rpc::call_status::ok || r.reply.size() != bytes + 1 ||
            std::memcmp(r.reply.data() + 1, body.data(), bytes) != 0)
            return -1;
        return static_cast<int>(r.reply[0]);
    }
};

/// Each caller on a thread of its own makes `calls` calls; the worker each
/// saw (-1: several, or a wrong reply).
std::vector<int> run(std::vector<std::unique_ptr<caller>>& callers, std::uint32_t calls,
                     std::size_t bytes) {
    std::vector<int> seen(callers.size(), -2);
    std::vector<std::thread> threads;
    for (std::size_t k = 0; k < callers.size(); ++k)
        threads.emplace_back([&, k] {
            int w = callers[k]->call(bytes, 0);
            for (std::uint32_t i = 1; i < calls; ++i)
                if (callers[k]->call(bytes, i) != w)
                    w = -1;
            seen[k] = w;
        });
    for (std::thread& t : threads)
        t.join();
    return seen;
}

} // namespace

TEST_CASE("server_group: device and node-local clients spread over 2 workers") {
    verbs::context ctx = test::open_test_device();
    verbs::protection_domain pd(ctx);
    auto g = make_group(pd, 2);
    g->start();
    // Connected one after another: device, device, local, local go to
    // workers 0, 1, 0, 1 (the fewest connections; ties to the lowest).
    std::vector<std::unique_ptr<caller>> callers;
    callers.reserve(5);
    for (bool local : {false, false, true, true})
        callers.push_back(std::make_unique<caller>(pd, g->port(), local));
    CHECK_FALSE(callers[0]->cli.is_local(callers[0]->peer));
    CHECK(callers[2]->cli.is_local(callers[2]->peer));
    REQUIRE(test::eventually([&] { return g->peers(0) == 2 && g->peers(1) == 2; }));
    const std::vector<int> small = run(callers, 300, 64);
    CHECK(small == std::vector<int>{0, 1, 0, 1});
    // Bodies and replies over a slot: READ from the caller, WRITE into its
    // reply buffer, by the worker's own connection.
    const std::vector<int> large = run(callers, 20, 12 << 10);
    CHECK(large == std::vector<int>{0, 1, 0, 1});
    const rpc::rpc_counters c0 = g->counters(0), c1 = g->counters(1);
    CHECK(c0.connected == 2);
    CHECK(c1.connected == 2);
    CHECK(c0.calls + c1.calls == 4U * 320U);
    CHECK(c0.external_bodies + c1.external_bodies >= 2U * 20U); // the device callers'
    CHECK(g->drain(5s));
}

TEST_CASE("server_group: a device client that reconnects goes back to its worker") {
    verbs::context ctx = test::open_test_device();
    verbs::protection_domain pd(ctx);
    auto g = make_group(pd, 2);
    g->start();
    std::vector<std::unique_ptr<caller>> callers;
    callers.reserve(5);
    for (int k = 0; k < 3; ++k) // workers 0, 1, 0
        callers.push_back(std::make_unique<caller>(pd, g->port(), false));
    CHECK(callers[1]->call(64, 1) == 1);
    callers[1]->cli.disconnect(callers[1]->peer);
    REQUIRE(test::eventually([&] { return g->peers(1) == 0; }));
    // Worker 1 is the lightest, and so the choice anyway: load it first.
    callers.push_back(std::make_unique<caller>(pd, g->port(), false)); // -> 1
    callers.push_back(std::make_unique<caller>(pd, g->port(), false)); // -> 1 (2 and 1)
    REQUIRE(test::eventually([&] { return g->peers(0) == 2 && g->peers(1) == 2; }));
    callers[1]->peer = callers[1]->cli.connect(test_addr(), g->port());
    CHECK(callers[1]->call(64, 2) == 1);
    CHECK(std::make_unique<caller>(pd, g->port(), false)->call(64, 3) == 0);
    CHECK(g->stop(5s));
}

TEST_CASE("server_group: server CPU time per call, 1 and 2 workers", "[cpu]") {
    verbs::context ctx = test::open_test_device();
    verbs::protection_domain pd(ctx);
    constexpr std::uint32_t calls = 2000;
    for (const bool local : {false, true}) {
        for (const std::size_t workers : {std::size_t{1}, std::size_t{2}}) {
            auto g = make_group(pd, workers);
            g->start();
            std::vector<std::unique_ptr<caller>> callers;
            callers.reserve(5);
            for (int k = 0; k < 4; ++k)
                callers.push_back(std::make_unique<caller>(pd, g->port(), local));
            (void)run(callers, 100, 64); // warm
            std::chrono::nanoseconds before{0};
            for (std::size_t w = 0; w < workers; ++w)
                before += g->cpu_time(w);
            const auto t0 = std::chrono::steady_clock::now();
            const std::vector<int> seen = run(callers, calls, 64);
            const auto wall = std::chrono::steady_clock::now() - t0;
            std::chrono::nanoseconds cpu{0};
            for (std::size_t w = 0; w < workers; ++w)
                cpu += g->cpu_time(w);
            cpu -= before;
            for (int w : seen)
                CHECK(w >= 0);
            const double total = 4.0 * calls;
            fmt::print(
                "server_group {} workers, 4 {} clients, 64 B echo: server CPU {:.2f} us/call, "
                "{:.0f} calls/s\n",
                workers, local ? "node-local" : "device",
                static_cast<double>(cpu.count()) / 1e3 / total,
                total / std::chrono::duration<double>(wall).count());
            CHECK(g->stop(5s));
        }
    }
}
