// Options passed to an RPC client and server are all they use: with every
// variable below them set to a value that would be refused (or would pick a
// monitor this machine lacks), the endpoints are built, connect and carry a
// body over a slot through the registration cache. Before rpc_options carried
// the arena's and the cache's options, the server's constructor threw
// "RDMAX_ARENA_AREA_BYTES='3M': expected ...".
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <vector>

#include <rdmax/rpc/client.hpp>
#include <rdmax/rpc/server.hpp>

#include "../support/loopback.hpp"

using namespace rdmax;
using namespace rdmax::test;

TEST_CASE("rpc: explicit options read no environment below them") {
    // Each would make with_env() throw, or the cache fail at its first use.
    setenv("RDMAX_ARENA_AREA_BYTES", "3M", 1);
    setenv("RDMAX_RCACHE_MONITOR", "bogus", 1);
    setenv("RDMAX_RCACHE_MAX_COUNT", "many", 1);
    setenv("RDMAX_SCHED_SMALL_SLICE", "0", 1);
    setenv("RDMAX_RPC_LOCAL", "1", 1);
    CHECK_THROWS(rpc::rpc_options{}.with_env()); // asked for: refused

    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    rpc::rpc_options o;
    o.local = false; // through the device, whatever RDMAX_RPC_LOCAL says
    o.slots = 8;
    o.slot_bytes = 1024;
    rpc::server s(pd, test_address().value_or("192.0.2.1"), 0, o);
    s.on(1, [](rpc::request_context& c) { c.reply(c.body()); });
    std::atomic<bool> stop{false};
    std::thread serve([&] {
        while (!stop.load())
            (void)s.wait(std::chrono::milliseconds(2));
    });
    std::vector<std::byte> req(64 * 1024); // over a slot: READ from a cached registration
    fill_pattern(req, 7);
    std::vector<std::byte> reply;
    rpc::call_status status = rpc::call_status::timed_out;
    bool local = true;
    try {
        rpc::client c(pd, o);
        const rpc::peer_id p = c.connect(test_address().value_or("192.0.2.1"), s.port());
        local = c.is_local(p);
        std::vector<std::byte> into(req.size());
        const rpc::call_result r = c.call(p, 1, req, {.reply_into = into});
        status = r.status;
        reply.assign(r.reply.begin(), r.reply.end());
    } catch (...) {
        stop = true;
        serve.join();
        throw;
    }
    stop = true;
    serve.join();
    CHECK_FALSE(local);
    REQUIRE(status == rpc::call_status::ok);
    CHECK(reply == req);
    for (const char* v : {"RDMAX_ARENA_AREA_BYTES", "RDMAX_RCACHE_MONITOR",
                          "RDMAX_RCACHE_MAX_COUNT", "RDMAX_SCHED_SMALL_SLICE", "RDMAX_RPC_LOCAL"})
        unsetenv(v);
}
