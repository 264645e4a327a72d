// RPC over write-with-immediate on a real device: echo of every size, many
// calls and clients on one server thread, bodies and replies over a slot,
// deadlines and late replies, deferred answers, priorities, a server that
// goes away, hand-crafted bad peers, and no allocation on the call path.
#include <algorithm>
#include <arpa/inet.h>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <functional>
#include <map>
#include <mutex>
#include <new>
#include <numeric>
#include <optional>
#include <poll.h>
#include <string>
#include <string_view>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <thread>
#include <vector>

#include <rdmax/detail/rpc/rdma_link.hpp>
#include <rdmax/detail/rpc/shm_link.hpp>

#include "../support/child_process.hpp"
#include "../support/counting_new.hpp" // every operator new of this program, counted
#include "../support/descriptors.hpp"
#include "../support/loopback.hpp"

using namespace rdmax;
using namespace rdmax::test;
using clock_type = std::chrono::steady_clock;

namespace {

constexpr std::uint16_t m_echo = 1;    // reply = request
constexpr std::uint16_t m_sum = 2;     // reply = 8-byte sum of the bytes, then `n` pattern bytes
constexpr std::uint16_t m_defer = 3;   // answered later (or never)
constexpr std::uint16_t m_throw = 4;   // the handler throws
constexpr std::uint16_t m_reverse = 5; // reply = request reversed, built in place

// A deadline for a call the server must take (and defer) before it passes,
// under any load. Over tcp and node-local, a caller whose deadline passed
// first gives the call up on the wire, and a server that reads the request
// and the abandon together rightly never runs it: a 50 ms deadline lost so
// once under ASan on a loaded host.
constexpr std::chrono::milliseconds server_takes_it{1000};

#ifndef RDMAX_TEST_NATIVE
#define RDMAX_TEST_NATIVE 0
#endif

std::string test_addr() {
    if (RDMAX_TEST_NATIVE)
        return "127.0.0.1"; // any address of this node: the peers are all here
    return test_address().value_or("192.0.2.1");
}

/// The protection domain of a test's servers and clients: the test device's,
/// or none in the native build (tests/unit: no device; RDMAX_TEST_NATIVE),
/// whose endpoints are built without one and talk through the node's memory.
struct test_domain {
    std::optional<verbs::context> ctx;
    std::optional<verbs::protection_domain> own;
    const verbs::protection_domain* pd = nullptr;
    test_domain() {
        if (RDMAX_TEST_NATIVE)
            return;
        ctx.emplace(open_test_device());
        own.emplace(*ctx);
        pd = &*own;
    }
    // NOLINTNEXTLINE(google-explicit-constructor): device-only tests pass their own
    test_domain(const verbs::protection_domain& domain)
        : pd(&domain) {}
    /// None, in any build: an endpoint built without a device.
    struct none_t {};
    explicit test_domain(none_t) {}
    test_domain(const test_domain&) = delete;
    test_domain& operator=(const test_domain&) = delete;
    ~test_domain() = default;
};

#ifndef RDMAX_TEST_TCP
#define RDMAX_TEST_TCP 0
#endif

/// The options as the build under test takes them: over TCP alone in the
/// tcp build (RDMAX_TEST_TCP), as given otherwise.
rpc::rpc_options under_test(rpc::rpc_options o) {
    if (RDMAX_TEST_TCP)
        o.transports = rpc::transport_set{} | rpc::transport::tcp;
    return o;
}

rpc::server make_server(const test_domain& d, std::string_view addr, std::uint16_t port,
                        const rpc::rpc_options& o) {
    if (d.pd != nullptr)
        return rpc::server(*d.pd, addr, port, under_test(o));
    return rpc::server(addr, port, under_test(o));
}

rpc::client make_client(const test_domain& d, const rpc::rpc_options& o) {
    if (d.pd != nullptr)
        return rpc::client(*d.pd, under_test(o));
    return rpc::client(under_test(o));
}

std::span<const std::byte> bytes_of(const std::vector<std::byte>& v) {
    return {v.data(), v.size()};
}

/// The path under test: through the device unless RDMAX_RPC_LOCAL says
/// otherwise (meson runs this program both ways).
bool local_path() {
    if (RDMAX_TEST_NATIVE)
        return !RDMAX_TEST_TCP;
    const char* v = std::getenv("RDMAX_RPC_LOCAL");
    return v != nullptr && std::string_view(v) == "1";
}

rpc::rpc_options small_options() {
    rpc::rpc_options o;
    o.local = local_path();
    o.slots = 16;
    o.slot_bytes = 4096;
    o.call_timeout = std::chrono::seconds(20);
    o.housekeeping = std::chrono::microseconds(1000);
    return o;
}

/// The server's handlers for these tests.
struct handlers {
    std::vector<rpc::deferred_call> deferred;
    std::vector<std::byte> big_reply;

    void install(rpc::server& s) {
        s.on(m_echo, [](rpc::request_context& c) { c.reply(c.body()); });
        s.on(m_reverse, [](rpc::request_context& c) {
            const auto in = c.body();
            auto out = c.reply_space();
            if (in.size() > out.size())
                return c.fail(rpc::call_status::reply_too_large);
            for (std::size_t i = 0; i < in.size(); ++i)
                out[i] = in[in.size() - 1 - i];
            c.reply_in_place(in.size());
        });
        s.on(m_sum, [this](rpc::request_context& c) {
            std::uint64_t sum = 0;
            for (std::byte b : c.body())
                sum += static_cast<std::uint8_t>(b);
            // The size of the reply's pattern part is in the request's first 4 bytes.
            std::uint32_t n = 0;
            if (c.body().size() >= 4)
                std::memcpy(&n, c.body().data(), 4);
            big_reply.resize(8 + n);
            std::memcpy(big_reply.data(), &sum, 8);
            fill_pattern(std::span(big_reply).subspan(8), 3);
            c.reply(big_reply);
        });
        s.on(m_defer, [this](rpc::request_context& c) { deferred.push_back(c.defer()); });
        s.on(m_throw, [](rpc::request_context&) { throw std::runtime_error("no"); });
    }
};

/// Runs server and clients in this thread until `done` or the deadline.
template <class Done>
bool pump(rpc::server& s, std::initializer_list<rpc::client*> clients,
          std::vector<rpc::call_result>& results, Done done,
          std::chrono::milliseconds limit = std::chrono::seconds(30)) {
    const auto deadline = clock_type::now() + limit;
    rpc::call_result out[16];
    while (!done()) {
        if (clock_type::now() > deadline)
            return false;
        (void)s.poll();
        for (rpc::client* c : clients) {
            const int n = c->poll(out);
            for (int i = 0; i < n; ++i) {
                results.push_back(out[i]);
                // The reply is valid until the next poll: keep a copy in the test.
            }
        }
    }
    return true;
}

/// Polls the server until it has `n` peers.
void accept_peers(rpc::server& s, std::size_t n) {
    const auto deadline = clock_type::now() + std::chrono::seconds(10);
    while (s.peers() < n && clock_type::now() < deadline)
        (void)s.wait(std::chrono::milliseconds(5));
    REQUIRE(s.peers() == n);
}

/// A client connected to `s` (the server must accept: it polls meanwhile).
struct connected_client {
    rpc::client cli;
    rpc::peer_id peer;
    connected_client(const test_domain& pd, rpc::server& s, rpc::rpc_options o = small_options())
        : cli(make_client(pd, o)) {
        // connect() waits for the accept, which the server gives in its poll.
        std::atomic<bool> stop{false};
        std::thread serve([&] {
            while (!stop.load())
                (void)s.wait(std::chrono::milliseconds(2));
        });
        try {
            peer = cli.connect(test_addr(), s.port());
        } catch (...) {
            stop = true;
            serve.join();
            throw;
        }
        const auto deadline = clock_type::now() + std::chrono::seconds(10);
        const std::size_t before = s.peers();
        (void)before;
        stop = true;
        serve.join();
        while (clock_type::now() < deadline && s.counters().connected == 0)
            (void)s.poll();
    }
};

/// One call, server and client in this thread; the reply copied out.
struct answer {
    rpc::call_status status;
    std::vector<std::byte> reply;
};
answer call_once(rpc::server& s, connected_client& c, std::uint16_t method,
                 std::span<const std::byte> req, rpc::call_options o = {}) {
    const rpc::call_status st = c.cli.start(c.peer, method, req, o);
    if (st != rpc::call_status::ok)
        return {st, {}};
    const auto deadline = clock_type::now() + std::chrono::seconds(30);
    rpc::call_result r[1];
    while (clock_type::now() < deadline) {
        (void)s.poll();
        if (c.cli.poll(r) == 1)
            return {r[0].status, {r[0].reply.begin(), r[0].reply.end()}};
    }
    FAIL("no result within 30 s");
    return {};
}

} // namespace

TEST_CASE("echo: every size up to a slot comes back byte for byte") {
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, small_options());
    handlers h;
    h.install(s);
    connected_client c(pd, s);
    REQUIRE(c.cli.connected(c.peer));
    REQUIRE(c.cli.slots(c.peer) == 16);
    CHECK(c.cli.is_local(c.peer) == local_path()); // the path this run tests
    const std::size_t room = c.cli.slot_bytes(c.peer) - sizeof(rpc::message_header);
    for (const std::size_t n :
         {std::size_t{0}, std::size_t{1}, std::size_t{64}, std::size_t{1000}, room}) {
        std::vector<std::byte> req(n);
        fill_pattern(req, static_cast<unsigned>(n));
        const answer a = call_once(s, c, m_echo, req);
        REQUIRE(a.status == rpc::call_status::ok);
        CHECK(a.reply == req);
        const answer r = call_once(s, c, m_reverse, req);
        REQUIRE(r.status == rpc::call_status::ok);
        CHECK(std::equal(r.reply.begin(), r.reply.end(), req.rbegin(), req.rend()));
    }
    CHECK(s.counters().calls == 10);
    CHECK(s.counters().rejected() == 0);
    CHECK(c.cli.counters().completed == 10);
    INFO(fmt::format("server: {}", s.counters()));
}

TEST_CASE("node-local path: taken when both ends are on this node, not when switched off",
          "[device]") {
    test_domain pd;
    rpc::rpc_options on = small_options();
    on.local = true;
    rpc::server s = make_server(pd, test_addr(), 0, on);
    handlers h;
    h.install(s);
    connected_client here(pd, s, on);
    rpc::rpc_options off = on;
    off.local = false;
    connected_client device(pd, s, off);
    CHECK(here.cli.is_local(here.peer));
    CHECK_FALSE(device.cli.is_local(device.peer));
    // Both answered byte for byte; the large body and reply go by CMA on one, RDMA on the other.
    std::vector<std::byte> req(300'000);
    fill_pattern(req, 8);
    const std::uint32_t want = 100'000;
    std::memcpy(req.data(), &want, 4);
    std::vector<std::byte> buf(128 * 1024);
    for (connected_client* c : {&here, &device}) {
        const answer a = call_once(s, *c, m_sum, req, {.reply_into = buf});
        REQUIRE(a.status == rpc::call_status::ok);
        REQUIRE(a.reply.size() == 8 + want);
        CHECK(has_pattern(std::span(a.reply).subspan(8), 3));
        std::vector<std::byte> small(200);
        fill_pattern(small, 2);
        const answer e = call_once(s, *c, m_echo, small);
        CHECK(e.reply == small);
    }
    CHECK(s.counters().external_bodies == 2);
    CHECK(s.counters().external_replies == 2);
    CHECK(s.counters().rejected() == 0);
    // Only the device's connection has a scheduler to show.
    CHECK_FALSE(here.cli.scheduler_counters(here.peer).has_value());
    const auto sc = device.cli.scheduler_counters(device.peer);
    REQUIRE(sc.has_value());
    CHECK(sc->completed + sc->requests > 0);
    CHECK(sc->budget_bytes > 0);
    // The server's side likewise, found by the peer a deferred call names.
    std::vector<std::byte> none(8);
    REQUIRE(here.cli.start(here.peer, m_defer, none) == rpc::call_status::ok);
    REQUIRE(device.cli.start(device.peer, m_defer, none) == rpc::call_status::ok);
    std::vector<rpc::call_result> results;
    REQUIRE(pump(s, {&here.cli, &device.cli}, results, [&] { return h.deferred.size() == 2; }));
    int with_scheduler = 0;
    for (const rpc::deferred_call& d : h.deferred) {
        with_scheduler += s.scheduler_counters(d.peer).has_value() ? 1 : 0;
        CHECK(s.reply(d, none));
    }
    CHECK(with_scheduler == 1);
    REQUIRE(pump(s, {&here.cli, &device.cli}, results, [&] { return results.size() == 2; }));
}

TEST_CASE("a server on the wildcard address is found on this node by the node's address") {
    test_domain pd;
    rpc::rpc_options o = small_options();
    rpc::server s = make_server(pd, "0.0.0.0", 0, o);
    handlers h;
    h.install(s);
    connected_client c(pd, s, o); // to test_addr(), one of this node's
    CHECK(c.cli.is_local(c.peer) == local_path());
    std::vector<std::byte> req(100);
    fill_pattern(req, 5);
    const answer a = call_once(s, c, m_echo, req);
    REQUIRE(a.status == rpc::call_status::ok);
    CHECK(a.reply == req);
}

TEST_CASE("many calls in flight from many clients, one server thread, no reply mixed up") {
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, small_options());
    handlers h;
    h.install(s);
    constexpr int clients = 4;
    std::vector<std::unique_ptr<connected_client>> cs;
    cs.reserve(clients);
    for (int i = 0; i < clients; ++i)
        cs.push_back(std::make_unique<connected_client>(pd, s));
    accept_peers(s, clients);
    // Each client: rounds of all 16 slots in flight, each request distinct.
    constexpr int rounds = 8;
    std::vector<std::vector<std::byte>> reqs(clients * 16);
    for (std::size_t i = 0; i < reqs.size(); ++i) {
        reqs[i].resize(32 + i * 7);
        fill_pattern(reqs[i], static_cast<unsigned>(i));
    }
    int good = 0;
    for (int round = 0; round < rounds; ++round) {
        for (int ci = 0; ci < clients; ++ci)
            for (int k = 0; k < 16; ++k) {
                const auto i = (static_cast<std::size_t>(ci) * 16) + static_cast<std::size_t>(k);
                REQUIRE(cs[ci]->cli.start(cs[ci]->peer, m_echo, bytes_of(reqs[i]), {.cookie = i}) ==
                        rpc::call_status::ok);
            }
        // Every slot is taken: one more is refused, and nothing is sent.
        CHECK(cs[0]->cli.start(cs[0]->peer, m_echo, bytes_of(reqs[0])) ==
              rpc::call_status::no_credit);
        int done = 0;
        const auto deadline = clock_type::now() + std::chrono::seconds(30);
        rpc::call_result out[8];
        while (done < clients * 16 && clock_type::now() < deadline) {
            (void)s.poll();
            for (auto& c : cs) {
                const int n = c->cli.poll(out);
                for (int j = 0; j < n; ++j) {
                    ++done;
                    REQUIRE(out[j].status == rpc::call_status::ok);
                    REQUIRE(out[j].cookie < reqs.size());
                    const auto& want = reqs[out[j].cookie];
                    if (std::equal(out[j].reply.begin(), out[j].reply.end(), want.begin(),
                                   want.end()))
                        ++good;
                }
            }
        }
        REQUIRE(done == clients * 16);
        for (auto& c : cs)
            c->cli.release(); // the slots of the results handed out, back now
    }
    CHECK(good == rounds * clients * 16);
    CHECK(s.counters().calls == static_cast<std::uint64_t>(rounds * clients * 16));
    CHECK(s.counters().rejected() == 0);
}

TEST_CASE("one client, calls to two servers in flight at once, each answered by its own") {
    test_domain pd;
    rpc::server a = make_server(pd, test_addr(), 0, small_options());
    rpc::server b = make_server(pd, test_addr(), 0, small_options());
    a.on(m_echo, [](rpc::request_context& c) { c.reply(c.body()); });
    b.on(m_echo, [](rpc::request_context& c) {
        // b answers with its name before the bytes: replies cannot be mixed up unseen.
        auto room = c.reply_space();
        if (c.body().size() + 1 > room.size())
            return c.fail(rpc::call_status::reply_too_large);
        room[0] = std::byte{'b'};
        std::memcpy(room.data() + 1, c.body().data(), c.body().size());
        c.reply_in_place(c.body().size() + 1);
    });
    rpc::client cli = make_client(pd, small_options());
    rpc::peer_id pa, pb;
    {
        std::atomic<bool> stop{false};
        std::thread serve([&] {
            while (!stop.load()) {
                (void)a.wait(std::chrono::milliseconds(1));
                (void)b.wait(std::chrono::milliseconds(1));
            }
        });
        pa = cli.connect(test_addr(), a.port());
        pb = cli.connect(test_addr(), b.port());
        stop = true;
        serve.join();
    }
    CHECK(pa != pb);
    std::vector<std::vector<std::byte>> reqs(32, std::vector<std::byte>(100));
    for (std::size_t i = 0; i < reqs.size(); ++i) {
        fill_pattern(reqs[i], static_cast<unsigned>(i));
        REQUIRE(cli.start(i % 2 == 0 ? pa : pb, m_echo, bytes_of(reqs[i]), {.cookie = i}) ==
                rpc::call_status::ok);
    }
    int right = 0, done = 0;
    const auto deadline = clock_type::now() + std::chrono::seconds(30);
    rpc::call_result out[8];
    while (done < 32 && clock_type::now() < deadline) {
        (void)a.poll();
        (void)b.poll();
        const int n = cli.poll(out);
        for (int j = 0; j < n; ++j, ++done) {
            const auto& want = reqs[out[j].cookie];
            const bool from_b = out[j].cookie % 2 == 1;
            CHECK(out[j].peer == (from_b ? pb : pa));
            auto got = out[j].reply;
            if (from_b && !got.empty() && got[0] == std::byte{'b'})
                got = got.subspan(1);
            else if (from_b)
                continue;
            if (out[j].status == rpc::call_status::ok &&
                std::equal(got.begin(), got.end(), want.begin(), want.end()))
                ++right;
        }
    }
    CHECK(done == 32);
    CHECK(right == 32);
    CHECK(a.counters().calls == 16);
    CHECK(b.counters().calls == 16);
}

TEST_CASE("a body over a slot is read from the caller; a reply over it lands in the caller's "
          "buffer") {
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, small_options());
    handlers h;
    h.install(s);
    connected_client c(pd, s);
    std::vector<std::byte> req(1 << 20);
    fill_pattern(req, 11);
    const std::uint32_t want_reply = 200'000;
    std::memcpy(req.data(), &want_reply, 4);
    const std::uint64_t sum =
        std::accumulate(req.begin(), req.end(), std::uint64_t{0}, [](std::uint64_t a, std::byte b) {
            return a + static_cast<std::uint8_t>(b);
        });
    std::vector<std::byte> reply_buf(256 * 1024);
    const answer a = call_once(s, c, m_sum, req, {.reply_into = reply_buf});
    REQUIRE(a.status == rpc::call_status::ok);
    REQUIRE(a.reply.size() == 8 + want_reply);
    std::uint64_t got = 0;
    std::memcpy(&got, a.reply.data(), 8);
    CHECK(got == sum);
    CHECK(has_pattern(std::span(a.reply).subspan(8), 3));
    CHECK(s.counters().external_bodies == 1);
    CHECK(s.counters().external_replies == 1);

    // The same buffers again: the registration cache has them.
    const answer again = call_once(s, c, m_sum, req, {.reply_into = reply_buf});
    CHECK(again.status == rpc::call_status::ok);

    // A reply too large for the slot, with no buffer offered: said so, nothing else broken.
    std::vector<std::byte> small(16);
    const std::uint32_t big = 10'000;
    std::memcpy(small.data(), &big, 4);
    CHECK(call_once(s, c, m_sum, small).status == rpc::call_status::reply_too_large);
    // A body over max_message is refused before anything is sent.
    rpc::rpc_options tight = small_options();
    tight.max_message = 1024;
    connected_client t(pd, s, tight);
    std::vector<std::byte> two_k(2048);
    CHECK(t.cli.start(t.peer, m_echo, bytes_of(two_k)) == rpc::call_status::too_large);
    CHECK(call_once(s, c, m_echo, small).status == rpc::call_status::ok);
}

TEST_CASE("unknown methods and failing handlers are answered so; method 0 is refused") {
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, small_options());
    handlers h;
    h.install(s);
    connected_client c(pd, s);
    std::vector<std::byte> req(8);
    CHECK(call_once(s, c, 999, req).status == rpc::call_status::unknown_method);
    CHECK(call_once(s, c, m_throw, req).status == rpc::call_status::handler_failed);
    CHECK(c.cli.start(c.peer, 0, req) == rpc::call_status::invalid_method);
    CHECK(c.cli.start(rpc::peer_id{77, 1}, m_echo, req) == rpc::call_status::bad_peer);
    CHECK(call_once(s, c, m_echo, req).status == rpc::call_status::ok);
    CHECK(s.counters().unknown_method == 1);
    CHECK(s.counters().rejected() == 0);
}

TEST_CASE("a call past its deadline ends timed_out; its slot comes back with the late reply") {
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, small_options());
    handlers h;
    h.install(s);
    rpc::rpc_options o = small_options();
    o.slots = 2;
    connected_client c(pd, s, o);
    REQUIRE(c.cli.slots(c.peer) == 2);
    std::vector<std::byte> req(100, std::byte{7});
    const auto t0 = clock_type::now();
    const answer a = call_once(s, c, m_defer, req, {.timeout = server_takes_it});
    const auto took = clock_type::now() - t0;
    CHECK(a.status == rpc::call_status::timed_out);
    CHECK(took >= server_takes_it);
    CHECK(took < std::chrono::seconds(5));
    REQUIRE(h.deferred.size() == 1);
    // The slot is the caller's again at once; a new call takes the other one first.
    std::vector<rpc::call_result> results;
    CHECK(c.cli.start(c.peer, m_defer, req, {.cookie = 2}) == rpc::call_status::ok);
    REQUIRE(pump(s, {&c.cli}, results, [&] { return h.deferred.size() == 2; }));
    // Now the late answer (dropped unread), then the second deferred call's.
    CHECK(s.reply(h.deferred[0], req));
    REQUIRE(pump(s, {&c.cli}, results, [&] { return c.cli.counters().late_replies == 1; }));
    CHECK(s.reply(h.deferred[1], req));
    CHECK_FALSE(s.reply(h.deferred[1], req)); // answered already
    REQUIRE(pump(s, {&c.cli}, results, [&] { return results.size() == 1; }));
    CHECK(results[0].cookie == 2);
    CHECK(results[0].status == rpc::call_status::ok);
    // Both slots are free again.
    CHECK(call_once(s, c, m_echo, req).status == rpc::call_status::ok);
    CHECK(c.cli.counters().timed_out == 1);
}

TEST_CASE("slots whose calls all timed out against a silent server are taken back: the "
          "connection still calls, and a late answer is dropped unread",
          "[rpccall][i18]") {
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, small_options());
    handlers h;
    h.install(s);
    rpc::rpc_options o = small_options();
    o.slots = 2;
    connected_client c(pd, s, o);
    REQUIRE(c.cli.slots(c.peer) == 2);
    std::vector<std::byte> req(100);
    fill_pattern(req, 9);
    // Every slot's call times out: the server defers them and never answers.
    for (std::uint64_t cookie : {1U, 2U})
        REQUIRE(c.cli.start(c.peer, m_defer, req, {.timeout = server_takes_it, .cookie = cookie}) ==
                rpc::call_status::ok);
    std::vector<rpc::call_result> results;
    REQUIRE(pump(s, {&c.cli}, results, [&] { return results.size() == 2; }));
    for (const auto& r : results)
        CHECK(r.status == rpc::call_status::timed_out);
    REQUIRE(h.deferred.size() == 2);
    // The connection still calls, byte for byte, again and again.
    for (int i = 0; i < 4; ++i) {
        const answer a = call_once(s, c, m_echo, req);
        CHECK(a.status == rpc::call_status::ok);
        CHECK(a.reply == req);
    }
    // The server dropped the calls the new ones superseded: their answers find them gone.
    CHECK_FALSE(s.reply(h.deferred[0], req));
    CHECK_FALSE(s.reply(h.deferred[1], req));
    CHECK(s.counters().rejected() == 0);
    CHECK(c.cli.connected(c.peer));
    CHECK(c.cli.counters().timed_out == 2);

    // One slot: a late answer posted before the server sees the slot's next
    // call reaches the client first; it is dropped unread, the next call's
    // reply is whole.
    rpc::rpc_options one = small_options();
    one.slots = 1;
    connected_client c1(pd, s, one);
    REQUIRE(c1.cli.slots(c1.peer) == 1);
    const answer t = call_once(s, c1, m_defer, req, {.timeout = server_takes_it});
    CHECK(t.status == rpc::call_status::timed_out);
    REQUIRE(h.deferred.size() == 3);
    std::vector<std::byte> stale(req.size(), std::byte{0xee});
    CHECK(s.reply(h.deferred[2], stale)); // late: the client has given up on it
    std::vector<std::byte> fresh(200);
    fill_pattern(fresh, 21);
    const answer a = call_once(s, c1, m_echo, fresh);
    CHECK(a.status == rpc::call_status::ok);
    CHECK(a.reply == fresh);
    CHECK(c1.cli.counters().late_replies == 1);
    CHECK(c1.cli.connected(c1.peer));
    CHECK(s.counters().rejected() == 0);

    // A server slower than the deadline: the request it takes late finds
    // the slot holding the caller's next call already. It runs that call
    // once, under the next call's own immediate, not twice.
    constexpr std::uint16_t m_count = 7;
    std::vector<std::vector<std::byte>> ran; // the bodies the handler saw
    s.on(m_count, [&](rpc::request_context& cx) {
        ran.emplace_back(cx.body().begin(), cx.body().end());
        cx.reply(cx.body());
    });
    c1.cli.release(); // the last result's slot
    REQUIRE(c1.cli.start(c1.peer, m_count, req, {.timeout = std::chrono::milliseconds(50)}) ==
            rpc::call_status::ok);
    rpc::call_result r1[1];
    const auto until = clock_type::now() + std::chrono::seconds(10);
    int got = 0;
    while (got == 0 && clock_type::now() < until)
        got = c1.cli.poll(r1); // the server does not poll meanwhile
    REQUIRE(got == 1);
    CHECK(r1[0].status == rpc::call_status::timed_out);
    const answer again = call_once(s, c1, m_count, fresh);
    INFO(fmt::format("client: {}", c1.cli.counters()));
    INFO(fmt::format("server: {}", s.counters()));
    CHECK(again.status == rpc::call_status::ok);
    CHECK(again.reply == fresh);
    // Each call runs at most once, the answered one exactly once. Where the
    // device delivers the next call's WRITE only after the server took the
    // late immediate (7.x soft-RoCE posts from a work queue), the timed-out
    // call runs too, once; never the next call twice.
    CHECK(std::count(ran.begin(), ran.end(), fresh) == 1);
    CHECK(std::count(ran.begin(), ran.end(), req) <= 1);
    CHECK(ran.size() <= 2);
    CHECK(c1.cli.connected(c1.peer));
}

TEST_CASE("after timed_out, a slow server's late reply does not reach the caller's buffer",
          "[rpccall][i14]") {
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, small_options());
    handlers h;
    h.install(s);
    connected_client c(pd, s);
    std::vector<std::byte> req(100, std::byte{1});
    std::vector<std::byte> reply_into(64 * 1024, std::byte{0xaa});
    const auto t0 = clock_type::now();
    const answer t =
        call_once(s, c, m_defer, req, {.timeout = server_takes_it, .reply_into = reply_into});
    CHECK(t.status == rpc::call_status::timed_out);
    REQUIRE(h.deferred.size() == 1);
    // The server answers 300 ms after the deadline, with 64 KiB (over the
    // slot: for the caller's reply buffer). Both sides keep polling meanwhile.
    rpc::call_result r[4];
    while (clock_type::now() - t0 < server_takes_it + std::chrono::milliseconds(300)) {
        (void)s.poll();
        (void)c.cli.poll(r);
    }
    const std::vector<std::byte> late(64 * 1024, std::byte{0x55});
    (void)s.reply(h.deferred[0], late);
    // Dropped by the client (node-local: the server saw the call given up and
    // wrote nothing), or refused by the device (the window's key is dead,
    // which ends that connection).
    std::vector<rpc::call_result> results;
    REQUIRE(pump(s, {&c.cli}, results,
                 [&] { return c.cli.counters().late_replies == 1 || !c.cli.connected(c.peer); }));
    CHECK(std::all_of(reply_into.begin(), reply_into.end(),
                      [](std::byte x) { return x == std::byte{0xaa}; }));
    CHECK(std::count(reply_into.begin(), reply_into.end(), std::byte{0x55}) == 0);
}

// [i23-2] A call's windows must be dead before its cache handles go: a
// region with a window still bound cannot be deregistered (rxe: EINVAL),
// which leaked it. Reply buffers unmapped right after each call (the cache
// drops their entries), timeouts among them: no deregistration fails.
TEST_CASE("no deregistration fails across calls whose buffers are unmapped after",
          "[rpccall][i23-2]") {
    test_domain pd;
    const std::uint64_t failed = verbs_registrar::failed_deregs();
    {
        rpc::server s = make_server(pd, test_addr(), 0, small_options());
        handlers h;
        h.install(s);
        connected_client c(pd, s);
        std::vector<std::byte> req(16 * 1024);
        fill_pattern(req, 9);
        constexpr std::size_t len = 64 * 1024;
        for (int i = 0; i < 24; ++i) {
            void* m =
                ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            REQUIRE(m != MAP_FAILED);
            const std::span<std::byte> into(static_cast<std::byte*>(m), len);
            if (i % 4 == 3) {
                const answer t =
                    call_once(s, c, m_defer, req,
                              {.timeout = std::chrono::milliseconds(20), .reply_into = into});
                CHECK(t.status == rpc::call_status::timed_out);
            } else {
                const answer a = call_once(s, c, m_echo, req, {.reply_into = into});
                CHECK(a.status == rpc::call_status::ok);
                CHECK(a.reply == req);
            }
            REQUIRE(::munmap(m, len) == 0);
        }
    }
    CHECK(verbs_registrar::failed_deregs() == failed);
}

TEST_CASE("a client without a device reaches a server with one over TCP, large bodies too",
          "[device][tcp]") {
    test_domain pd;
    rpc::rpc_options o = small_options();
    o.local = false; // as from another node: not through this node's memory
    rpc::server s = make_server(pd, test_addr(), 0, o);
    handlers h;
    h.install(s);
    const test_domain none{test_domain::none_t{}};
    connected_client c(none, s, o);
    REQUIRE(c.cli.transport(c.peer) == rpc::transport::tcp);
    CHECK(s.counters().connected_tcp == 1);
    CHECK(c.cli.counters().connected_tcp == 1);
    std::vector<std::byte> small(64);
    fill_pattern(small, 1);
    const answer a = call_once(s, c, m_echo, small);
    CHECK(a.status == rpc::call_status::ok);
    CHECK(a.reply == small);
    // 1 MiB each way: the body read from the caller, the reply written into its buffer.
    std::vector<std::byte> big(1 << 20);
    fill_pattern(big, 2);
    std::vector<std::byte> into(big.size());
    const answer b = call_once(s, c, m_echo, big, {.reply_into = into});
    CHECK(b.status == rpc::call_status::ok);
    CHECK(b.reply == big);
}

TEST_CASE("a client with a device reaches a server without one over TCP, and again after "
          "the server restarts (the fallback dialled on its thread)",
          "[device][tcp]") {
    test_domain pd;
    const test_domain none{test_domain::none_t{}};
    rpc::rpc_options so = small_options();
    so.local = false;
    so.transports = rpc::transport_set{} | rpc::transport::tcp;
    // A server cannot move: make_unique could not take make_server's result.
    auto s = std::unique_ptr<rpc::server>( // NOLINT(modernize-make-unique)
        new rpc::server(make_server(none, test_addr(), 0, so)));
    handlers h;
    h.install(*s);
    rpc::rpc_options co = small_options();
    co.local = false; // every transport but the node's memory: the device first
    connected_client c(pd, *s, co);
    REQUIRE(c.cli.transport(c.peer) == rpc::transport::tcp);
    std::vector<std::byte> req(64);
    fill_pattern(req, 3);
    CHECK(call_once(*s, c, m_echo, req).status == rpc::call_status::ok);
    // The server restarts on its port: the client's device again finds no
    // listener, and the reconnect goes on over TCP.
    const std::uint16_t port = s->port();
    s.reset();
    s = std::unique_ptr<rpc::server>( // NOLINT(modernize-make-unique)
        new rpc::server(make_server(none, test_addr(), port, so)));
    h.install(*s);
    std::vector<rpc::call_result> results;
    // Idempotent: it may go out on the old connection before the client
    // sees it closed, and is sent again after the reconnect.
    REQUIRE(c.cli.start(c.peer, m_echo, req,
                        {.timeout = std::chrono::seconds(20), .idempotent = true}) ==
            rpc::call_status::ok);
    REQUIRE(pump(*s, {&c.cli}, results, [&] { return results.size() == 1; }));
    CHECK(results[0].status == rpc::call_status::ok);
    CHECK(c.cli.counters().reconnects >= 1);
    CHECK(c.cli.transport(c.peer) == rpc::transport::tcp);
}

TEST_CASE("priorities: an urgent call overtakes bulk calls on the same connection",
          "[priorities]") {
    test_domain pd;
    // Priorities are the device path's and TCP's (the node-local one takes
    // calls in order): the native node-local build leaves this case out.
    rpc::rpc_options o = small_options();
    o.local = false;
    rpc::server s = make_server(pd, test_addr(), 0, o);
    handlers h;
    h.install(s);
    connected_client c(pd, s, o);
    REQUIRE_FALSE(c.cli.is_local(c.peer));
    // Bulk: 8 calls of 2 MiB each, whose bodies the server reads in slices.
    std::vector<std::vector<std::byte>> bulk(8, std::vector<std::byte>(2 << 20));
    for (std::size_t i = 0; i < bulk.size(); ++i) {
        fill_pattern(bulk[i], static_cast<unsigned>(i));
        const std::uint32_t zero = 0;
        std::memcpy(bulk[i].data(), &zero, 4);
        REQUIRE(c.cli.start(c.peer, m_sum, bytes_of(bulk[i]),
                            {.priority = sched::bulk, .cookie = i}) == rpc::call_status::ok);
    }
    std::vector<std::byte> small(64, std::byte{1});
    REQUIRE(c.cli.start(c.peer, m_echo, small, {.priority = sched::urgent, .cookie = 100}) ==
            rpc::call_status::ok);
    std::vector<rpc::call_result> results;
    REQUIRE(pump(s, {&c.cli}, results, [&] { return results.size() == 9; }));
    std::size_t urgent_at = results.size();
    for (std::size_t i = 0; i < results.size(); ++i) {
        CHECK(results[i].status == rpc::call_status::ok);
        if (results[i].cookie == 100)
            urgent_at = i;
    }
    INFO("the urgent call finished " << urgent_at + 1 << " of 9");
    CHECK(urgent_at < 8); // not behind every bulk call
}

TEST_CASE("a server that goes away for good: calls in flight end peer_gone once reconnecting "
          "gives up, well before their deadline") {
    test_domain pd;
    // A server cannot move: make_unique could not take make_server's result.
    auto s = std::unique_ptr<rpc::server>( // NOLINT(modernize-make-unique)
        new rpc::server(make_server(pd, test_addr(), 0, small_options())));
    handlers h;
    h.install(*s);
    rpc::rpc_options co = small_options();
    co.reconnect_give_up = std::chrono::milliseconds(300);
    connected_client c(pd, *s, co);
    std::vector<std::byte> req(64);
    for (std::uint64_t i = 0; i < 4; ++i)
        REQUIRE(c.cli.start(c.peer, m_defer, req, {.cookie = i}) == rpc::call_status::ok);
    std::vector<rpc::call_result> results;
    REQUIRE(pump(*s, {&c.cli}, results, [&] { return h.deferred.size() == 4; }));
    const auto t0 = clock_type::now();
    s.reset();
    rpc::call_result out[8];
    while (results.size() < 4 && clock_type::now() - t0 < std::chrono::seconds(10)) {
        const int n = c.cli.wait(out, std::chrono::milliseconds(10));
        results.insert(results.end(), out, out + n);
    }
    REQUIRE(results.size() == 4);
    for (const auto& r : results)
        CHECK(r.status == rpc::call_status::peer_gone);
    CHECK(clock_type::now() - t0 < std::chrono::seconds(10)); // the call deadline is 20 s
    CHECK_FALSE(c.cli.connected(c.peer));
    CHECK(c.cli.counters().reconnect_attempts > 0); // refused: nobody listens any more
    CHECK(c.cli.state(c.peer) == rpc::peer_state::closed);
    // Why, in the counters: nothing failed here; through the device, the
    // server's side ended it. A node-local link has no rdma_cm. The server
    // takes a connection as established by its first message, before its
    // CM may have seen the client's RTU (slow under TCG); a CM still waiting
    // for the RTU ends the connection by a REJ, not a DREQ: REJECTED then.
    // Over TCP, no rdma_cm either: the server closed its socket.
    CHECK(c.cli.counters().link_failures == 0);
    const int ended_by = c.cli.counters().last_link_event;
    if (local_path() || RDMAX_TEST_TCP)
        CHECK(ended_by == -1);
    else
        CHECK((ended_by == static_cast<int>(RDMA_CM_EVENT_DISCONNECTED) ||
               ended_by == static_cast<int>(RDMA_CM_EVENT_REJECTED)));
    CHECK(c.cli.start(c.peer, m_echo, req) != rpc::call_status::ok);
}

TEST_CASE("keepalive and reconnect: idle links are probed and answered; a server that stops "
          "polling is declared gone within keepalive_timeout; the call is re-sent and runs once") {
    test_domain pd;
    rpc::rpc_options o = small_options();
    o.keepalive = std::chrono::milliseconds(50);
    o.keepalive_timeout = std::chrono::milliseconds(600);
    o.reconnect_backoff = std::chrono::milliseconds(20);
    o.connect_timeout = std::chrono::milliseconds(3000);
    rpc::server s = make_server(pd, test_addr(), 0, o);
    std::mutex mu;
    std::map<std::uint64_t, int> runs; // executions per call id
    s.on(m_echo, [&](rpc::request_context& c) {
        const std::lock_guard lock(mu);
        ++runs[c.call_id()];
        c.reply(c.body());
    });
    // The server in a thread of its own (a reconnect waits for its accept),
    // paused to play a server that stopped (SIGSTOP: no poll, no answer).
    std::atomic<bool> paused{false}, still{false}, stop{false};
    std::thread serve([&] {
        while (!stop.load()) {
            still = paused.load(); // seen: no poll from here on
            if (still.load())
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
            else
                (void)s.wait(std::chrono::milliseconds(2));
        }
    });
    struct joiner {
        std::atomic<bool>& stop;
        std::thread& t;
        ~joiner() {
            stop = true;
            t.join();
        }
    } join{stop, serve};
    rpc::client cli = make_client(pd, o);
    const rpc::peer_id p = cli.connect(test_addr(), s.port());
    rpc::call_result out[4];
    const auto idle_until = clock_type::now() + std::chrono::milliseconds(400);
    while (clock_type::now() < idle_until)
        (void)cli.wait(out, std::chrono::milliseconds(5));
    CHECK(cli.counters().keepalive_timeouts == 0); // probed and answered:
    CHECK(cli.state(p) == rpc::peer_state::ready);

    paused = true;
    const auto t_pause = clock_type::now();
    while (!still.load() && clock_type::now() - t_pause < std::chrono::seconds(10))
        (void)cli.wait(out, std::chrono::milliseconds(1)); // (nothing in flight: no result)
    REQUIRE(still.load());
    // Either side may probe: a side that hears the other's probes is not
    // silent, so it never probes itself (which side goes first is timing).
    // The server is read once it polls no more (`still` orders it).
    CHECK(cli.counters().keepalive_probes + s.counters().keepalive_probes > 0);
    CHECK(s.counters().keepalive_timeouts == 0);
    std::vector<std::byte> req(48, std::byte{7});
    REQUIRE(cli.start(p, m_echo, req, {.cookie = 1}) == rpc::call_status::ok);
    const auto t0 = clock_type::now();
    std::vector<rpc::call_result> results;
    while (cli.state(p) == rpc::peer_state::ready &&
           clock_type::now() - t0 < std::chrono::seconds(10)) {
        const int n = cli.wait(out, std::chrono::milliseconds(5));
        results.insert(results.end(), out, out + n);
    }
    CHECK(results.empty()); // the server is stopped: nothing came
    const auto detected = clock_type::now() - t0;
    REQUIRE(cli.state(p) != rpc::peer_state::ready);
    CHECK(cli.counters().keepalive_timeouts == 1);
    // Counted from the last message heard, which may precede the pause by up
    // to a keepalive interval (its last pong); the bound itself is gated on
    // a virtual clock (tests/unit/test_rpc_resilience.cpp).
    CHECK(detected >= o.keepalive_timeout - o.keepalive - std::chrono::milliseconds(20));
    std::printf("keepalive: silent server detected after %lld ms (keepalive_timeout %lld ms)\n",
                static_cast<long long>(
                    std::chrono::duration_cast<std::chrono::milliseconds>(detected).count()),
                static_cast<long long>(o.keepalive_timeout.count()));

    paused = false; // it resumes: the client connects again and sends the call again
    const auto t1 = clock_type::now();
    while (results.empty() && clock_type::now() - t1 < std::chrono::seconds(20)) {
        const int n = cli.wait(out, std::chrono::milliseconds(5));
        for (int i = 0; i < n; ++i) {
            results.push_back(out[i]);
            CHECK(std::equal(out[i].reply.begin(), out[i].reply.end(), req.begin(), req.end()));
        }
    }
    // Not the server's counters: its thread still writes them (TSan).
    INFO(fmt::format("client: {}", cli.counters()));
    REQUIRE(results.size() == 1);
    CHECK(results[0].status == rpc::call_status::ok);
    CHECK(results[0].cookie == 1);
    CHECK(cli.state(p) == rpc::peer_state::ready);
    CHECK(cli.counters().reconnects >= 1);
    CHECK(cli.counters().retried_calls >= 1);
    const std::lock_guard lock(mu);
    REQUIRE(runs.size() == 1);
    CHECK(runs.begin()->second == 1); // answered from the reply cache, if it ran before
}

TEST_CASE("a client that goes away is dropped; the others are served") {
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, small_options());
    handlers h;
    h.install(s);
    connected_client stays(pd, s);
    {
        connected_client leaves(pd, s);
        accept_peers(s, 2);
        std::vector<std::byte> req(64);
        REQUIRE(leaves.cli.start(leaves.peer, m_defer, req) == rpc::call_status::ok);
        std::vector<rpc::call_result> results;
        REQUIRE(pump(s, {&leaves.cli}, results, [&] { return h.deferred.size() == 1; }));
    }
    const auto deadline = clock_type::now() + std::chrono::seconds(10);
    while (s.peers() != 1 && clock_type::now() < deadline)
        (void)s.wait(std::chrono::milliseconds(5));
    CHECK(s.peers() == 1);
    CHECK_FALSE(s.reply(h.deferred[0], {})); // its peer is gone
    std::vector<std::byte> req(300, std::byte{3});
    const answer a = call_once(s, stays, m_echo, req);
    CHECK(a.status == rpc::call_status::ok);
    CHECK(a.reply == req);
}

// ---- hand-crafted bad peers -------------------------------------------------------------------

namespace {

/// A client written on raw rdmax verbs: it speaks rdma_cm and offers a ring,
/// then writes whatever the test wants into the server's ring.
struct raw_peer {
    registered ring;
    registered out;
    verbs::connection conn;
    rpc::ring_offer server;

    static rpc::ring_offer offer_of(const registered& r) {
        rpc::ring_offer o;
        o.slots = 16;
        o.slot_bytes = 4096;
        o.addr = reinterpret_cast<std::uint64_t>(r.bytes.data());
        o.rkey = r.mr.rkey();
        o.incarnation = 0x5eed;
        return o;
    }
    raw_peer(const verbs::protection_domain& pd, rpc::server& s)
        : ring(pd, 16 * 4096)
        , out(pd, 8192)
        , conn(connect(pd, s, offer_of(ring)))
        , server(*conn.peer_payload_as<rpc::ring_offer>()) {}

    static verbs::connection connect(const verbs::protection_domain& pd, rpc::server& s,
                                     const rpc::ring_offer& o) {
        std::atomic<bool> stop{false};
        std::thread serve([&] {
            while (!stop.load())
                (void)s.wait(std::chrono::milliseconds(2));
        });
        std::optional<verbs::connection> c;
        try {
            c.emplace(verbs::connection::connect(pd, test_addr(), s.port(), verbs::payload_of(o)));
        } catch (...) {
            stop = true;
            serve.join();
            throw;
        }
        stop = true;
        serve.join();
        return std::move(*c);
    }

    /// Writes a request with `body` into server slot `slot`, the immediate as given.
    void write(std::uint32_t slot, const rpc::message_header& h, std::size_t body,
               std::optional<std::uint32_t> imm = std::nullopt, std::uint64_t at = UINT64_MAX) {
        std::memcpy(out.bytes.data(), &h, sizeof h);
        const auto n = static_cast<std::uint32_t>(sizeof h + body);
        // Twice the ring: rdmax's own check would refuse a write past it
        // before posting, and this peer wants to try the device's.
        const remote_buffer<rights::remote_write> dst{
            server.addr, 2 * std::uint64_t{server.slots} * server.slot_bytes, server.rkey, 0};
        const std::uint64_t offset =
            at != UINT64_MAX ? at : std::uint64_t{slot} * server.slot_bytes;
        REQUIRE(
            conn.qp().write_imm(out.mr.local(0, n), dst, offset,
                                imm.value_or(rpc::encode_imm(rpc::message_kind::request, slot, n)),
                                1) == status::ok);
    }
    /// Receives for the server's replies (each write with immediate takes one).
    void post_receives(int n) {
        for (int i = 0; i < n; ++i)
            REQUIRE(conn.qp().post_recv(out.mr.local(4096, 64), 100 + i) == status::ok);
    }
    /// Writes a request into `slot` whose one-byte body is `fill`, offering
    /// [reply_at, reply_at + reply_len) of `reply` for the answer.
    void request_into(std::uint32_t slot, std::uint16_t method, const registered& reply,
                      std::byte fill, std::uint64_t reply_at = 0,
                      std::uint32_t reply_len = UINT32_MAX) {
        rpc::message_header h = request(method, 1);
        h.call_seq = ++seq; // the server takes a slot's call_seq once
        h.flags = rpc::flag_reply_buffer;
        const rpc::buffer_descriptor d{
            reinterpret_cast<std::uint64_t>(reply.bytes.data()) + reply_at, reply.mr.rkey(),
            reply_len != UINT32_MAX ? reply_len
                                    : static_cast<std::uint32_t>(reply.bytes.size() - reply_at)};
        std::memcpy(out.bytes.data() + sizeof h, &d, sizeof d);
        out.bytes[sizeof h + sizeof d] = fill;
        write(slot, h, sizeof d + 1);
    }
    /// Waits for `n` of this peer's writes to complete (the server's device has them).
    void wait_sent(int n) {
        verbs::completion c[8];
        for (int got = 0; got < n;) {
            const int k = conn.qp().wait_send(c, std::chrono::seconds(10));
            REQUIRE(k > 0);
            for (int i = 0; i < k; ++i)
                REQUIRE(c[i].ok());
            got += k;
        }
    }
    /// Replies that arrived so far (their immediates), counted.
    int replies() {
        verbs::completion c[8];
        const int k = conn.qp().poll_recv(c);
        for (int i = 0; i < k; ++i)
            if (c[i].ok())
                ++replies_seen;
        return replies_seen;
    }
    int replies_seen = 0;
    std::uint32_t seq = 0;

    static rpc::message_header request(std::uint16_t method, std::uint32_t body) {
        rpc::message_header h;
        h.call_seq = 1;
        h.method = method;
        h.body_bytes = body;
        return h;
    }
};

/// Runs the server until `pred` or 10 s.
template <class Pred>
bool serve_until(rpc::server& s, Pred pred) {
    const auto deadline = clock_type::now() + std::chrono::seconds(10);
    while (!pred()) {
        if (clock_type::now() > deadline)
            return false;
        (void)s.wait(std::chrono::milliseconds(2));
    }
    return true;
}

} // namespace

TEST_CASE("bad peers: each rejection counted, the peer dropped, the good client unharmed",
          "[device]") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    rpc::server s = make_server(pd, test_addr(), 0, small_options());
    handlers h;
    h.install(s);
    connected_client good(pd, s);
    std::vector<std::byte> req(500);
    fill_pattern(req, 5);
    // The good client has a call in flight, deferred, across every attack.
    REQUIRE(good.cli.start(good.peer, m_defer, req, {.cookie = 42}) == rpc::call_status::ok);
    REQUIRE(serve_until(s, [&] { return h.deferred.size() == 1; }));
    const rpc::deferred_call pending = h.deferred[0];

    const auto attack = [&](const char* what, std::uint64_t rpc::rpc_counters::*counter,
                            auto&& act) {
        INFO(what);
        const std::uint64_t before = s.counters().*counter;
        const std::size_t peers = s.peers();
        raw_peer bad(pd, s);
        REQUIRE(serve_until(s, [&] { return s.peers() == peers + 1; }));
        act(bad);
        CHECK(serve_until(s, [&] { return s.counters().*counter == before + 1; }));
        CHECK(serve_until(s, [&] { return s.peers() == peers; })); // dropped
        // The good client: still connected, and served byte for byte.
        const answer a = call_once(s, good, m_echo, req);
        CHECK(a.status == rpc::call_status::ok);
        CHECK(a.reply == req);
    };
    attack("slot out of range", &rpc::rpc_counters::rejected_slot, [](raw_peer& b) {
        b.write(0, raw_peer::request(m_echo, 0), 0,
                rpc::encode_imm(rpc::message_kind::request, 16, 16));
    });
    attack("slot far out of range", &rpc::rpc_counters::rejected_slot, [](raw_peer& b) {
        b.write(0, raw_peer::request(m_echo, 0), 0,
                rpc::encode_imm(rpc::message_kind::request, rpc::max_slots - 1, 16));
    });
    attack("length past the slot", &rpc::rpc_counters::rejected_length, [](raw_peer& b) {
        b.write(0, raw_peer::request(m_echo, 0), 0,
                rpc::encode_imm(rpc::message_kind::request, 0, 4097));
    });
    attack("length under a header", &rpc::rpc_counters::rejected_length, [](raw_peer& b) {
        b.write(0, raw_peer::request(m_echo, 0), 0,
                rpc::encode_imm(rpc::message_kind::request, 0, 8));
    });
    attack("a reply where a request belongs", &rpc::rpc_counters::rejected_kind, [](raw_peer& b) {
        b.write(0, raw_peer::request(m_echo, 0), 0,
                rpc::encode_imm(rpc::message_kind::reply, 0, 16));
    });
    attack("method 0", &rpc::rpc_counters::rejected_malformed,
           [](raw_peer& b) { b.write(0, raw_peer::request(0, 0), 0); });
    attack("a request into a slot still being answered", &rpc::rpc_counters::rejected_credit,
           [&](raw_peer& b) {
               b.write(3, raw_peer::request(m_defer, 0), 0);
               REQUIRE(serve_until(s, [&] { return h.deferred.size() == 2; }));
               rpc::message_header next = raw_peer::request(m_echo, 0);
               next.call_seq = 2; // a new call (the same call_seq is a replay, dropped)
               b.write(3, next, 0);
           });
    attack("a send instead of a write with immediate", &rpc::rpc_counters::rejected_opcode,
           [](raw_peer& b) { REQUIRE(b.conn.qp().send(b.out.mr.local(0, 64), 1) == status::ok); });
    h.deferred.pop_back(); // the credit attacker's, gone with it

    // A write past its own ring: the device refuses it (the key covers that
    // ring alone); the attacker's connection breaks, nobody else's.
    CHECK(s.counters().rejected() == 8);
    {
        const std::size_t peers = s.peers();
        raw_peer bad(pd, s);
        REQUIRE(serve_until(s, [&] { return s.peers() == peers + 1; }));
        bad.write(0, raw_peer::request(m_echo, 0), 0, std::nullopt,
                  std::uint64_t{bad.server.slots} * bad.server.slot_bytes);
        verbs::completion cq[1];
        const int n = bad.conn.wait_send(cq, std::chrono::seconds(10));
        REQUIRE(n == 1);
        CHECK_FALSE(cq[0].ok());
        CHECK(serve_until(s, [&] { return s.peers() == peers; }));
    }
    // Offers the server refuses: not an rdmax peer, a ring that wraps.
    {
        const std::uint64_t refused = s.counters().refused;
        std::atomic<bool> stop{false};
        std::thread serve([&] {
            while (!stop.load())
                (void)s.wait(std::chrono::milliseconds(2));
        });
        registered r(pd, 4096);
        rpc::ring_offer wraps = raw_peer::offer_of(r);
        wraps.addr = UINT64_MAX - 4096;
        const std::array<std::byte, 7> junk{};
        CHECK_THROWS(verbs::connection::connect(pd, test_addr(), s.port(), junk, {},
                                                std::chrono::seconds(5)));
        CHECK_THROWS(verbs::connection::connect(pd, test_addr(), s.port(), verbs::payload_of(wraps),
                                                {}, std::chrono::seconds(5)));
        stop = true;
        serve.join();
        CHECK(s.counters().refused == refused + 2);
    }
    // The good client's call, in flight all along, is answered intact.
    CHECK(s.reply(pending, req));
    std::vector<rpc::call_result> results;
    REQUIRE(pump(s, {&good.cli}, results, [&] { return !results.empty(); }));
    CHECK(results[0].cookie == 42);
    CHECK(results[0].status == rpc::call_status::ok);
    CHECK(s.peers() == 1);
    // The write past the ring may reach the server as a receive in error
    // (counted as an opcode rejection) before the connection goes.
    CHECK(s.counters().rejected() <= 10);
    INFO(fmt::format("server: {}", s.counters()));
}

TEST_CASE("a reply body stays the server's until its WRITE completes: a slot reused early gets "
          "no other connection's reply",
          "[rpccall][i13][device]") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    rpc::rpc_options o = small_options();
    o.local = false; // raw peers speak the device path (node-local replies are copied at once)
    // A small fixed budget: a 64 KiB reply goes out 4 KiB at a time, over many polls.
    o.scheduler.budget_bytes = 4096;
    o.scheduler.small_slice = 4096;
    o.scheduler.large_slice = 4096;
    rpc::server s = make_server(pd, test_addr(), 0, o);
    constexpr std::uint16_t m_fill = 6; // a 64 KiB reply of the request's one byte
    constexpr std::size_t reply_bytes = 64 * 1024;
    std::vector<std::byte> fill(reply_bytes);
    s.on(m_fill, [&](rpc::request_context& c) {
        std::fill(fill.begin(), fill.end(), c.body()[0]);
        c.reply(fill);
    });
    raw_peer a(pd, s);
    raw_peer b(pd, s);
    REQUIRE(serve_until(s, [&] { return s.peers() == 2; }));
    registered a_first(pd, reply_bytes), a_second(pd, reply_bytes), b_reply(pd, reply_bytes);
    a.post_receives(4);
    b.post_receives(4);
    // A asks in slot 0; the server answers (one poll: the first 4 KiB slice
    // of the reply's WRITE goes, the rest stays queued, the slot is free).
    a.request_into(0, m_fill, a_first, std::byte{0xa1});
    a.wait_sent(1);
    REQUIRE(s.poll() == 1);
    // A asks again in slot 0 at once, then B asks: both in the server's queue
    // before its next poll, which answers both.
    a.request_into(0, m_fill, a_second, std::byte{0xa2});
    a.wait_sent(1);
    b.request_into(0, m_fill, b_reply, std::byte{0xb2});
    b.wait_sent(1);
    REQUIRE(serve_until(s, [&] { return a.replies() == 2 && b.replies() == 1; }));
    const auto all = [](const registered& r, std::byte v) {
        return std::all_of(r.bytes.begin(), r.bytes.end(), [&](std::byte x) { return x == v; });
    };
    CHECK(std::count(a_first.bytes.begin(), a_first.bytes.end(), std::byte{0xb2}) == 0);
    CHECK(all(a_first, std::byte{0xa1})); // never B's bytes
    CHECK(all(a_second, std::byte{0xa2}));
    CHECK(all(b_reply, std::byte{0xb2}));
    CHECK(s.counters().external_replies == 3);
}

// [i23-1] The slot epoch is one bit: a late immediate two calls back
// carries the same one. A client gave up A (epoch 1) and B (epoch 0) in slot
// 0, then called C (epoch 1, A's length); the server, stalled, takes A's
// immediate against C's bytes. C must run once, not once per immediate.
TEST_CASE("a stale immediate of the same epoch does not run a call twice",
          "[rpccall][i23-1][device]") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    rpc::rpc_options o = small_options();
    o.local = false; // raw peers speak the device path
    rpc::server s = make_server(pd, test_addr(), 0, o);
    constexpr std::uint16_t m_note = 7; // notes its one-byte body, answers empty
    std::vector<std::byte> ran;
    s.on(m_note, [&](rpc::request_context& c) {
        ran.push_back(c.body()[0]);
        c.reply({});
    });
    raw_peer p(pd, s);
    REQUIRE(serve_until(s, [&] { return s.peers() == 1; }));
    p.post_receives(8);
    const auto send = [&](std::uint32_t seq, bool epoch, std::size_t body, std::byte mark) {
        rpc::message_header h = raw_peer::request(m_note, static_cast<std::uint32_t>(body));
        h.call_seq = seq;
        h.flags = epoch ? rpc::flag_epoch : 0;
        std::fill_n(p.out.bytes.data() + sizeof h, body, mark);
        p.write(0, h, body,
                rpc::encode_imm(rpc::message_kind::request, 0,
                                static_cast<std::uint32_t>(sizeof h + body), epoch));
        p.wait_sent(1);
    };
    // The server does not poll until all are in its ring and queue.
    send(1, true, 8, std::byte{0xa});  // A, given up
    send(2, false, 4, std::byte{0xb}); // B, given up
    send(3, true, 8, std::byte{0xc});  // C: A's epoch and length, now in the slot
    // E in slot 1, behind C's immediate (one receive queue, in order): when
    // E has run, every immediate of slot 0 was taken.
    rpc::message_header e = raw_peer::request(m_note, 1);
    e.call_seq = 4;
    p.out.bytes[sizeof e] = std::byte{0xe};
    p.write(1, e, 1);
    p.wait_sent(1);
    REQUIRE(serve_until(s, [&] { return !ran.empty() && ran.back() == std::byte{0xe}; }));
    CHECK(ran == std::vector<std::byte>{std::byte{0xc}, std::byte{0xe}});
    CHECK(s.counters().rejected() == 0);
    CHECK(s.peers() == 1);
}

namespace {

/// A server written on raw rdmax verbs that takes what a client's request
/// offers (its body's and reply buffer's descriptors) and then tries to use
/// them as it likes: inside the call's bytes, around them, and after the call.
struct raw_server {
    verbs::listener listener{test_addr(), 0};
    registered ring;
    registered scratch;
    std::optional<verbs::connection> conn;
    rpc::ring_offer client{};
    rpc::parsed_request req;
    std::uint32_t slot = 0;
    bool epoch = false;

    explicit raw_server(const verbs::protection_domain& pd)
        : ring(pd, 4 * 4096)
        , scratch(pd, 64 * 1024) {}

    /// Accepts `c`'s connect (made on a thread of its own meanwhile).
    rpc::peer_id accept(const verbs::protection_domain& pd, rpc::client& c) {
        rpc::ring_offer mine;
        mine.slots = 4;
        mine.slot_bytes = 4096;
        mine.addr = reinterpret_cast<std::uint64_t>(ring.bytes.data());
        mine.rkey = ring.mr.rkey();
        mine.incarnation = 0x5eed;
        rpc::peer_id id;
        std::thread t([&] { id = c.connect(test_addr(), listener.port()); });
        try {
            conn.emplace(listener.accept(pd, verbs::payload_of(mine)));
        } catch (...) {
            t.join();
            throw;
        }
        t.join();
        client = *conn->peer_payload_as<rpc::ring_offer>();
        for (int i = 0; i < 4; ++i)
            REQUIRE(conn->qp().post_recv(scratch.mr.local(0, 64), 50 + i) == status::ok);
        return id;
    }
    /// Waits for the client's request and parses it.
    void take_request() {
        verbs::completion c[1];
        const auto deadline = clock_type::now() + std::chrono::seconds(10);
        int n = 0;
        while (n == 0 && clock_type::now() < deadline)
            n = conn->qp().poll_recv(c);
        REQUIRE(n == 1);
        REQUIRE(c[0].ok());
        const rpc::imm_fields f = rpc::decode_imm(c[0].imm);
        slot = f.slot;
        epoch = f.epoch;
        REQUIRE(
            rpc::parse_request(
                std::span<const std::byte>(ring.bytes).subspan(std::size_t{f.slot} * 4096, f.bytes),
                req) == rpc::violation::none);
    }
    /// READs `len` bytes at `addr` under `rkey` into scratch; the completion's status.
    ibv_wc_status read(std::uint64_t addr, std::uint32_t rkey, std::uint32_t len) {
        const remote_buffer<rights::remote_read> from{addr, len, rkey, 0};
        REQUIRE(conn->qp().read(scratch.mr.local(0, len), from, 0, 7) == status::ok);
        return wait_send(conn->qp()).status;
    }
    ibv_wc_status write(std::uint64_t addr, std::uint32_t rkey, std::uint32_t len) {
        const remote_buffer<rights::remote_write> to{addr, len, rkey, 0};
        REQUIRE(conn->qp().write(scratch.mr.local(0, len), to, 0, 8) == status::ok);
        return wait_send(conn->qp()).status;
    }
    /// Answers the call: an empty reply into the client's slot.
    void answer() {
        rpc::message_header h;
        h.call_seq = req.header.call_seq;
        std::memcpy(scratch.bytes.data(), &h, sizeof h);
        const remote_buffer<rights::remote_write> to{
            client.addr, std::uint64_t{client.slots} * client.slot_bytes, client.rkey, 0};
        REQUIRE(conn->qp().write_imm(
                    scratch.mr.local(0, sizeof h), to, std::uint64_t{slot} * client.slot_bytes,
                    rpc::encode_imm(rpc::message_kind::reply, slot, sizeof h, epoch),
                    9) == status::ok);
        REQUIRE(wait_send(conn->qp()).ok());
    }
};

/// Whether this device keeps a type-2 window to the range it was bound over
/// (the verbs specification says so; soft-RoCE checks the region's range).
bool windows_bound_exactly() {
    loopback lp;
    std::vector<std::byte> mem(8192);
    registered local(lp.pd, 64);
    memory_region<all_rights | rights::mw_bind> mr(lp.pd, mem.data(), mem.size());
    ibv_mw* mw = ibv_alloc_mw(lp.pd.get(), IBV_MW_TYPE_2);
    REQUIRE(mw != nullptr);
    const std::uint32_t key = ibv_inc_rkey(mw->rkey);
    const auto at = reinterpret_cast<std::uint64_t>(mem.data());
    // Bound through b over [4096, 8192); a reads [0, 64) with its key.
    REQUIRE(lp.b.bind_mw(mw, key, mr.get(), at + 4096, 4096, rights::remote_read, 1) == status::ok);
    REQUIRE(wait_send(lp.b).ok());
    const remote_buffer<rights::remote_read> around{at, 8192, key, 0};
    REQUIRE(lp.a.read(local.mr.local(0, 64), around, 0, 2) == status::ok);
    const bool refused = !wait_send(lp.a).ok();
    ibv_dealloc_mw(mw);
    return refused;
}

/// `n` bytes at a page's offset 512 in `v` (so the page's registration
/// covers bytes on both sides of them).
std::span<std::byte> inside_a_page(std::vector<std::byte>& v, std::size_t n) {
    const auto base = (reinterpret_cast<std::uintptr_t>(v.data()) + 4095) & ~std::uintptr_t{4095};
    return {reinterpret_cast<std::byte*>(base + 512), n};
}

} // namespace

TEST_CASE("a server sees exactly the call's bytes, and only while the call lasts",
          "[rpccall][i15][device]") {
    // The device path's keys, whatever RDMAX_RPC_LOCAL says (the raw server
    // has no node-local name; docs/rpc.md says what the node-local path keeps).
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    REQUIRE(ctx.limits().memory_windows); // soft-RoCE has type 2
    rpc::rpc_options o = small_options();
    o.local = false;
    std::vector<std::byte> body_mem(6 * 4096), reply_mem(6 * 4096, std::byte{0xaa});
    const std::span<std::byte> body = inside_a_page(body_mem, 8192);
    const std::span<std::byte> reply = inside_a_page(reply_mem, 8192);
    fill_pattern(body, 17);
    const auto addr = [](std::span<std::byte> b) {
        return reinterpret_cast<std::uint64_t>(b.data());
    };

    // 1. Around the call's bytes: refused, though the pages are registered.
    {
        rpc::client c = make_client(pd, o);
        raw_server srv(pd);
        const rpc::peer_id p = srv.accept(pd, c);
        REQUIRE(c.start(p, m_echo, body, {.reply_into = reply}) == rpc::call_status::ok);
        srv.take_request();
        REQUIRE(srv.req.external_body);
        REQUIRE(srv.req.reply_buffer);
        const rpc::buffer_descriptor b = *srv.req.external_body;
        const rpc::buffer_descriptor r = *srv.req.reply_buffer;
        CHECK(b.addr == addr(body));
        CHECK(b.length == body.size());
        // Inside: the call's own bytes, read and written.
        CHECK(srv.read(b.addr, b.rkey, b.length) == IBV_WC_SUCCESS);
        CHECK(std::equal(body.begin(), body.end(), srv.scratch.bytes.begin()));
        CHECK(srv.write(r.addr, r.rkey, 4096) == IBV_WC_SUCCESS);
        // 256 bytes before the body: in its registered page, not in the call.
        if (windows_bound_exactly()) {
            CHECK(srv.read(b.addr - 256, b.rkey, 256) != IBV_WC_SUCCESS);
        } else {
            // The device checks the region's range for a window's key: the
            // window's own bounds hold on devices that keep them, not here.
            WARN("this device (soft-RoCE on this kernel) does not hold a type-2 window to its "
                 "range: not checked that bytes around the call's are refused");
        }
        CHECK(std::equal(reply.begin(), reply.begin() + 4096, body.begin())); // it landed
    }
    // 2. After the call ended timed_out: the body's and reply's keys are dead
    // (a late READ, then on another connection a late WRITE).
    for (const bool late_read : {true, false}) {
        std::fill(reply_mem.begin(), reply_mem.end(), std::byte{0xaa});
        fill_pattern(body, 17);
        rpc::client c = make_client(pd, o);
        raw_server srv(pd);
        const rpc::peer_id p = srv.accept(pd, c);
        REQUIRE(c.start(p, m_echo, body,
                        {.timeout = std::chrono::milliseconds(50), .reply_into = reply}) ==
                rpc::call_status::ok);
        srv.take_request();
        const rpc::buffer_descriptor b = *srv.req.external_body;
        const rpc::buffer_descriptor r = *srv.req.reply_buffer;
        rpc::call_result res[1];
        const auto deadline = clock_type::now() + std::chrono::seconds(10);
        int n = 0;
        while (n == 0 && clock_type::now() < deadline)
            n = c.poll(res);
        REQUIRE(n == 1);
        CHECK(res[0].status == rpc::call_status::timed_out);
        // The caller reuses its buffers: a late READ must not see them, a
        // late WRITE must not land.
        fill_pattern(body, 99);
        if (late_read) {
            CHECK(srv.read(b.addr, b.rkey, b.length) != IBV_WC_SUCCESS);
            CHECK_FALSE(has_pattern(std::span(srv.scratch.bytes).first(body.size()), 99));
        } else {
            CHECK(srv.write(r.addr, r.rkey, 4096) != IBV_WC_SUCCESS);
        }
        CHECK(std::all_of(reply.begin(), reply.end(),
                          [](std::byte x) { return x == std::byte{0xaa}; }));
    }
    // 3. After the call was answered: the body's key is dead.
    {
        rpc::client c = make_client(pd, o);
        raw_server srv(pd);
        const rpc::peer_id p = srv.accept(pd, c);
        REQUIRE(c.start(p, m_echo, body) == rpc::call_status::ok);
        srv.take_request();
        const rpc::buffer_descriptor b = *srv.req.external_body;
        CHECK(srv.read(b.addr, b.rkey, b.length) == IBV_WC_SUCCESS);
        srv.answer();
        rpc::call_result res[1];
        const auto deadline = clock_type::now() + std::chrono::seconds(10);
        int n = 0;
        while (n == 0 && clock_type::now() < deadline)
            n = c.poll(res);
        REQUIRE(n == 1);
        CHECK(res[0].status == rpc::call_status::ok);
        CHECK(srv.read(b.addr, b.rkey, b.length) != IBV_WC_SUCCESS);
    }
}

namespace {

/// A client that sends a connection request with a valid ring offer, then
/// never answers the server's reply (it never reads its rdma_cm events, so
/// librdmacm sends no RTU): a handshake that stalls.
class stalled_handshake {
public:
    stalled_handshake(const std::string& addr, std::uint16_t port, const rpc::ring_offer& offer) {
        ch_ = rdma_create_event_channel();
        REQUIRE(ch_ != nullptr);
        REQUIRE(rdma_create_id(ch_, &id_, nullptr, RDMA_PS_TCP) == 0);
        sockaddr_in to{};
        to.sin_family = AF_INET;
        to.sin_port = htons(port);
        REQUIRE(inet_pton(AF_INET, addr.c_str(), &to.sin_addr) == 1);
        REQUIRE(rdma_resolve_addr(id_, nullptr, reinterpret_cast<sockaddr*>(&to), 2000) == 0);
        REQUIRE(next_event_is(RDMA_CM_EVENT_ADDR_RESOLVED));
        REQUIRE(rdma_resolve_route(id_, 2000) == 0);
        REQUIRE(next_event_is(RDMA_CM_EVENT_ROUTE_RESOLVED));
        pd_ = ibv_alloc_pd(id_->verbs);
        REQUIRE(pd_ != nullptr);
        ibv_qp_init_attr qa{};
        qa.qp_type = IBV_QPT_RC;
        qa.cap.max_send_wr = qa.cap.max_recv_wr = 4;
        qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
        REQUIRE(rdma_create_qp(id_, pd_, &qa) == 0);
        // rdmax's private data: a length byte, then the payload.
        std::array<std::byte, 1 + sizeof(rpc::ring_offer)> pdata{};
        pdata[0] = static_cast<std::byte>(sizeof(rpc::ring_offer));
        std::memcpy(pdata.data() + 1, &offer, sizeof offer);
        rdma_conn_param param{};
        param.private_data = pdata.data();
        param.private_data_len = static_cast<std::uint8_t>(pdata.size());
        param.responder_resources = param.initiator_depth = 1;
        param.retry_count = param.rnr_retry_count = 3;
        REQUIRE(rdma_connect(id_, &param) == 0);
    }
    stalled_handshake(const stalled_handshake&) = delete;
    stalled_handshake& operator=(const stalled_handshake&) = delete;
    ~stalled_handshake() {
        if (id_->qp != nullptr)
            rdma_destroy_qp(id_);
        // rdma_destroy_id waits for unacknowledged events: take them first.
        rdma_cm_event* ev = nullptr;
        pollfd p{ch_->fd, POLLIN, 0};
        while (poll(&p, 1, 0) == 1 && rdma_get_cm_event(ch_, &ev) == 0)
            rdma_ack_cm_event(ev);
        rdma_destroy_id(id_);
        if (pd_ != nullptr)
            ibv_dealloc_pd(pd_);
        rdma_destroy_event_channel(ch_);
    }

private:
    bool next_event_is(rdma_cm_event_type want) {
        pollfd p{ch_->fd, POLLIN, 0};
        if (poll(&p, 1, 5000) != 1)
            return false;
        rdma_cm_event* ev = nullptr;
        if (rdma_get_cm_event(ch_, &ev) != 0)
            return false;
        const bool ok = ev->event == want;
        rdma_ack_cm_event(ev);
        return ok;
    }
    rdma_event_channel* ch_ = nullptr;
    rdma_cm_id* id_ = nullptr;
    ibv_pd* pd_ = nullptr;
};

} // namespace

TEST_CASE("a peer that stalls in its handshake holds nobody, and is dropped at the deadline",
          "[device]") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    rpc::rpc_options o = small_options();
    o.connect_timeout = std::chrono::milliseconds(1500);
    rpc::server s = make_server(pd, test_addr(), 0, o);
    handlers h;
    h.install(s);
    registered ring(pd, 16 * 4096);
    const auto t0 = clock_type::now();
    stalled_handshake stalled(test_addr(), s.port(), raw_peer::offer_of(ring));
    REQUIRE(serve_until(s, [&] { return s.peers() == 1; })); // accepted, not established
    // A good client connects and is served meanwhile, well before the deadline.
    connected_client c(pd, s);
    std::vector<std::byte> req(100, std::byte{4});
    const answer a = call_once(s, c, m_echo, req);
    CHECK(a.status == rpc::call_status::ok);
    CHECK(a.reply == req);
    CHECK(clock_type::now() - t0 < std::chrono::milliseconds(1500));
    // The stalled one goes at its deadline; the good one stays.
    REQUIRE(serve_until(s, [&] { return s.peers() == 1 && s.counters().disconnected == 1; }));
    CHECK(clock_type::now() - t0 >= std::chrono::milliseconds(1400));
    CHECK(call_once(s, c, m_echo, req).status == rpc::call_status::ok);
}

TEST_CASE("the call path allocates nothing (server and client in one thread)") {
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, small_options());
    handlers h;
    h.install(s);
    connected_client c(pd, s);
    std::vector<std::byte> req(64, std::byte{9});
    rpc::call_result out[16];
    const auto run = [&](int calls) {
        int done = 0, ok = 0, started = 0;
        while (done < calls) {
            while (started < calls && started - done < 8 &&
                   c.cli.start(c.peer, m_echo, req) == rpc::call_status::ok)
                ++started;
            (void)s.poll();
            const int n = c.cli.poll(out);
            for (int i = 0; i < n; ++i)
                ok += out[i].status == rpc::call_status::ok && out[i].reply.size() == 64 ? 1 : 0;
            done += n;
        }
        return ok;
    };
    // Warm: everything sized, the server's reply cache round its ring once
    // (each entry keeps its room for the next reply).
    const int warm = static_cast<int>(small_options().reply_cache_calls) + 200;
    REQUIRE(run(warm) == warm);
    const std::uint64_t before = allocations.load();
    const int ok = run(2000);
    const std::uint64_t during = allocations.load() - before;
    CHECK(ok == 2000);
    CHECK(during == 0);
}

/// The server on a thread of its own, asleep in wait() between messages,
/// until this goes.
class serving_thread {
public:
    serving_thread(rpc::server& s, std::chrono::milliseconds sleep)
        : thread_([this, &s, sleep] {
            while (!stop_.load())
                (void)s.wait(sleep);
        }) {}
    serving_thread(const serving_thread&) = delete;
    serving_thread& operator=(const serving_thread&) = delete;
    ~serving_thread() {
        stop_ = true;
        thread_.join();
    }

private:
    std::atomic<bool> stop_{false};
    std::thread thread_;
};

TEST_CASE("call() from a client thread against a server thread that sleeps on its descriptor") {
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, small_options());
    handlers h;
    h.install(s);
    {
        serving_thread serve(s, std::chrono::milliseconds(20));
        rpc::client cli = make_client(pd, small_options());
        const rpc::peer_id p = cli.connect(test_addr(), s.port());
        for (int i = 0; i < 50; ++i) {
            std::vector<std::byte> req(static_cast<std::size_t>(10 + i * 40));
            fill_pattern(req, static_cast<unsigned>(i));
            const rpc::call_result r = cli.call(p, m_echo, req);
            REQUIRE(r.status == rpc::call_status::ok);
            CHECK(std::equal(r.reply.begin(), r.reply.end(), req.begin(), req.end()));
        }
    }
    CHECK(s.counters().calls == 50);
}

TEST_CASE("a server asleep in wait() moves a large reply held to a small budget at full pace") {
    // The reply goes in slices, at most one budget in flight: each slice past
    // the first waits for a send completion. A server that slept through those
    // (its wait() woke only for receives, at most every 50 ms) took 6.4 s a
    // call on Linux 7.3's soft-RoCE, which completes from a work queue; the
    // send queue's events now wake it: 0.31 s for the whole case. (On 6.1,
    // soft-RoCE completes a loopback send inside the post: no sleep to miss.)
    test_domain pd;
    rpc::rpc_options o = small_options();
    o.scheduler.budget_bytes = 4096;
    o.scheduler.small_slice = 4096;
    rpc::server s = make_server(pd, test_addr(), 0, o);
    handlers h;
    h.install(s);
    {
        serving_thread serve(s, std::chrono::seconds(1));
        rpc::client cli = make_client(pd, o);
        const rpc::peer_id p = cli.connect(test_addr(), s.port());
        std::vector<std::byte> req(16);
        const std::uint32_t want = 1 << 20;
        std::memcpy(req.data(), &want, 4);
        std::vector<std::byte> reply_buf(8 + want);
        for (int round = 0; round < 2; ++round) { // the second with the registration cached
            const auto t0 = clock_type::now();
            const rpc::call_result r = cli.call(p, m_sum, req, {.reply_into = reply_buf});
            const auto took = clock_type::now() - t0;
            REQUIRE(r.status == rpc::call_status::ok);
            REQUIRE(r.reply.size() == 8 + want);
            CHECK(has_pattern(r.reply.subspan(8), 3));
            CHECK(took < std::chrono::seconds(2));
        }
    }
}

// ---- hostile peers on this node -------------------------------------------------------------
// These take the node-local path in both runs (it is what they are about).

namespace {

rpc::rpc_options local_options() {
    rpc::rpc_options o = small_options();
    o.local = true;
    return o;
}

/// local_options() for a test that measures how little CPU a sleeping server
/// uses: wait() also wakes once a housekeeping interval, and at
/// small_options()' 1 ms those 300 wake-ups in 300 ms cost the TCG guest
/// 60-80 ms of CPU (79 ms in CI at e24b683), as much as the bound the tests
/// set. At 100 ms a sleeping server wakes a few times; one that spins still
/// burns all 300 ms, so the bound keeps telling the two apart.
rpc::rpc_options quiet_local_options() {
    rpc::rpc_options o = local_options();
    o.housekeeping = std::chrono::milliseconds(100);
    return o;
}

/// The CPU time (user and system) this thread has used.
std::chrono::microseconds thread_cpu() {
    rusage u{};
    REQUIRE(getrusage(RUSAGE_THREAD, &u) == 0);
    return std::chrono::seconds(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           std::chrono::microseconds(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

/// A node-local client written by hand: the server's Unix name, a hello as
/// rpc::client sends it (this process lets the server read its probe by
/// CMA: the server is this process), then whatever the test does.
struct raw_local_peer {
    local::unix_channel ch;
    std::uint64_t probe = 0x5eed5eed5eedULL;
    rpc::local_welcome welcome;
    std::vector<int> fds; ///< segment, wake the server, wake the client

    explicit raw_local_peer(std::uint16_t port)
        : ch(local::unix_channel::connect(rpc::local_name(test_addr(), port))) {}
    raw_local_peer(const raw_local_peer&) = delete;
    raw_local_peer& operator=(const raw_local_peer&) = delete;
    ~raw_local_peer() {
        for (int fd : fds)
            ::close(fd);
    }
    /// Says hello and takes the welcome, serving `s` meanwhile.
    void handshake(rpc::server& s) {
        rpc::local_hello hello;
        hello.slots = 16;
        hello.slot_bytes = 4096;
        hello.probe_addr = reinterpret_cast<std::uint64_t>(&probe);
        hello.probe_value = probe;
        hello.incarnation = 0x5eed;
        ch.send(std::as_bytes(std::span(&hello, 1)));
        pollfd p{ch.fd(), POLLIN, 0};
        REQUIRE(serve_until(s, [&] { return ::poll(&p, 1, 0) == 1; }));
        REQUIRE(ch.receive(std::as_writable_bytes(std::span(&welcome, 1)), fds,
                           std::chrono::seconds(5)) == sizeof welcome);
        REQUIRE(welcome.status == rpc::local_ok);
        REQUIRE(fds.size() == 3);
    }
};

} // namespace

TEST_CASE("a node-local peer cannot truncate its shared segment under the server",
          "[hostile-local][seal]") {
    // It used to: ftruncate(0) of the memfd it was handed, and the server died
    // of SIGBUS at its next look at the rings (every peer lost).
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, local_options());
    handlers h;
    h.install(s);
    raw_local_peer bad(s.port());
    bad.handshake(s);
    REQUIRE(serve_until(s, [&] { return s.peers() == 1; }));
    errno = 0;
    // REQUIRE: on a segment that did shrink, the server must not look again.
    REQUIRE(ftruncate(bad.fds[0], 0) == -1);
    CHECK(errno == EPERM);
    CHECK(ftruncate(bad.fds[0], 1 << 30) == -1); // nor grow it
    // The server goes on: the truncating peer's connection and a good one.
    connected_client good(pd, s, local_options());
    std::vector<std::byte> req(3000);
    fill_pattern(req, 11);
    for (int i = 0; i < 20; ++i) {
        const answer a = call_once(s, good, m_echo, req);
        REQUIRE(a.status == rpc::call_status::ok);
        CHECK(a.reply == req);
    }
    CHECK(s.peers() == 2);
}

TEST_CASE("node-local handshakes that fail leave none of their descriptors in the server",
          "[hostile-local][fd-leak]") {
    // 200 connections that send 1 byte (a length prefix cut short) and 16
    // descriptors, then close (half) or go silent past the deadline (half).
    // Each used to leave its 16 descriptors open in the server for good.
    test_domain pd;
    rpc::rpc_options o = local_options();
    o.connect_timeout = std::chrono::milliseconds(500);
    rpc::server s = make_server(pd, test_addr(), 0, o);
    const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    REQUIRE(devnull >= 0);
    std::array<int, 16> sixteen{};
    sixteen.fill(devnull);
    (void)s.poll();
    const std::size_t before = open_fds();
    std::vector<local::unix_channel> silent;
    for (int batch = 0; batch < 10; ++batch) {
        for (int i = 0; i < 20; ++i) {
            local::unix_channel ch =
                local::unix_channel::connect(rpc::local_name(test_addr(), s.port()));
            send_raw(ch.fd(), 1, sixteen);
            if (i % 2 == 0)
                silent.push_back(std::move(ch));
        }
        // Within the listen backlog: served before the next batch connects.
        const std::uint64_t want = 20 * (std::uint64_t(batch) + 1);
        REQUIRE(serve_until(s, [&] { return s.counters().refused == want; }));
        silent.clear();
    }
    CHECK(s.counters().refused == 200);
    CHECK(s.peers() == 0);
    CHECK(open_fds() == before);
    ::close(devnull);
}

TEST_CASE("node-local connections that never say hello do not stall the server's peers",
          "[hostile-local][silent-hello]") {
    // Each used to hold the serving thread for 200 ms in its handshake: ten of
    // them, two seconds without an answer for anyone.
    test_domain pd;
    rpc::rpc_options o = local_options();
    o.connect_timeout = std::chrono::seconds(2);
    rpc::server s = make_server(pd, test_addr(), 0, o);
    handlers h;
    h.install(s);
    std::chrono::nanoseconds worst{0};
    int calls = 0;
    {
        serving_thread serve(s, std::chrono::milliseconds(20));
        rpc::client cli = make_client(pd, o);
        const rpc::peer_id p = cli.connect(test_addr(), s.port());
        std::vector<std::byte> req(64, std::byte{6});
        REQUIRE(cli.call(p, m_echo, req).status == rpc::call_status::ok);
        std::vector<local::unix_channel> silent;
        silent.reserve(10);
        for (int i = 0; i < 10; ++i)
            silent.push_back(local::unix_channel::connect(rpc::local_name(test_addr(), s.port())));
        const auto until = clock_type::now() + std::chrono::milliseconds(800);
        while (clock_type::now() < until) {
            const auto t0 = clock_type::now();
            const rpc::call_result r = cli.call(p, m_echo, req);
            worst = std::max<std::chrono::nanoseconds>(worst, clock_type::now() - t0);
            REQUIRE(r.status == rpc::call_status::ok);
            ++calls;
        }
    }
    INFO(calls << " calls, the slowest " << worst.count() / 1000 << " us");
    // The bug held each call for 200 ms per silent peer (>= 2 s); a slow
    // (TCG) guest may take tens of ms for one call on its own.
    CHECK(worst < std::chrono::seconds(1));
    // The silent ones end when `silent` is destroyed above (a reset), well
    // before their deadline.
    CHECK(serve_until(s, [&] { return s.counters().refused == 10; }));
}

TEST_CASE("a node-local hello sent a byte at a time with descriptors installs none in the "
          "server",
          "[hostile-local][no-fds]") {
    // 36 one-byte pieces (the hello's prefix and body), each with 16
    // descriptors: the server used to install every one, 576 per connection,
    // held until connect_timeout.
    test_domain pd;
    rpc::rpc_options o = local_options();
    o.connect_timeout = std::chrono::seconds(5);
    rpc::server s = make_server(pd, test_addr(), 0, o);
    const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    REQUIRE(devnull >= 0);
    std::array<int, 16> sixteen{};
    sixteen.fill(devnull);
    (void)s.poll();
    local::unix_channel ch = local::unix_channel::connect(rpc::local_name(test_addr(), s.port()));
    // The connection's own socket in the server, nothing more.
    const std::size_t base = open_fds() + 1;
    std::size_t most = 0;
    for (int i = 0; i < 36; ++i) {
        if (send_with_fds(ch.fd(), 1, sixteen) != 1)
            break; // refused and closed: what the fix does at the first piece
        // Served a while (housekeeping reads the socket when it is readable).
        const auto until = clock_type::now() + std::chrono::milliseconds(20);
        while (clock_type::now() < until && s.counters().refused == 0)
            (void)s.wait(std::chrono::milliseconds(2));
        most = std::max(most, open_fds());
    }
    INFO("base " << base << ", most " << most);
    CHECK(most <= base);
    REQUIRE(serve_until(s, [&] { return s.counters().refused == 1; }));
    CHECK(s.counters().last_refusal.error == EPROTO);
    CHECK(open_fds() < base);
    ::close(devnull);
}

TEST_CASE("out of descriptors at a node-local accept, the server does not spin",
          "[hostile-local][emfile]") {
    // accept4 failed with EMFILE and left the connection in the backlog: the
    // listener stayed readable and every wait() returned at once (a serving
    // thread at 100% CPU for as long as descriptors were short).
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, quiet_local_options());
    (void)s.poll();
    local::unix_channel waiting =
        local::unix_channel::connect(rpc::local_name(test_addr(), s.port()));
    rlimit old{};
    REQUIRE(getrlimit(RLIMIT_NOFILE, &old) == 0);
    rlimit low = old;
    low.rlim_cur = std::min<rlim_t>(old.rlim_cur, open_fds() + 64);
    REQUIRE(setrlimit(RLIMIT_NOFILE, &low) == 0);
    std::vector<int> filler;
    for (int i = 0; i < 100000; ++i) {
        const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            break;
        filler.push_back(fd);
    }
    const std::uint64_t refused = s.counters().refused;
    const auto cpu0 = thread_cpu();
    const auto until = clock_type::now() + std::chrono::milliseconds(300);
    while (clock_type::now() < until)
        (void)s.wait(std::chrono::milliseconds(20));
    const auto cpu = thread_cpu() - cpu0;
    for (int fd : filler)
        ::close(fd);
    REQUIRE(setrlimit(RLIMIT_NOFILE, &old) == 0);
    INFO(filler.size() << " descriptors filled the table; " << cpu.count()
                       << " us of CPU in 300 ms");
    REQUIRE(s.counters().refused > refused);
    CHECK(s.counters().last_refusal.error == EMFILE);
    CHECK(cpu < std::chrono::milliseconds(100));
    // Its reason says the error's text once (the printer adds it after the errno).
    const std::string printed = fmt::format("{}", s.counters());
    const std::string text = std::strerror(EMFILE);
    const std::size_t first = printed.find(text);
    CHECK(first != std::string::npos);
    CHECK(printed.find(text, first + 1) == std::string::npos);
    // With descriptors back, the waiting connection is taken (and its junk refused).
    const std::array<std::byte, 8> junk{};
    waiting.send(junk);
    REQUIRE(serve_until(s, [&] { return s.counters().last_refusal.error == EPROTO; }));
}

TEST_CASE("one user's silent node-local handshakes leave room for another's",
          "[hostile-local][per-uid]") {
    if (geteuid() != 0) {
        WARN("not root: cannot connect from another uid, not tried");
        return;
    }
    test_domain pd;
    rpc::rpc_options o = local_options();
    o.max_peers = 8; // handshakes per uid: at most 4
    o.connect_timeout = std::chrono::seconds(20);
    rpc::server s = make_server(pd, test_addr(), 0, o);
    handlers h;
    h.install(s);
    (void)s.poll();
    const std::string name = rpc::local_name(test_addr(), s.port());
    int ready[2];
    int hold[2];
    REQUIRE(::pipe2(ready, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(hold, O_CLOEXEC) == 0);
    const pid_t child = rdmax::test::spawn([&] {
        ::close(ready[0]);
        ::close(hold[1]);
        if (setgid(65534) != 0 || setuid(65534) != 0)
            return 2;
        std::vector<local::unix_channel> silent;
        silent.reserve(8);
        for (int i = 0; i < 8; ++i)
            silent.push_back(local::unix_channel::connect(name)); // never a hello
        if (::write(ready[1], "r", 1) != 1)
            return 3;
        pollfd p{hold[0], POLLIN, 0};
        (void)::poll(&p, 1, 30000); // until the parent closes its end
        return 0;
    });
    ::close(ready[1]);
    ::close(hold[0]);
    char r = 0;
    pollfd p{ready[0], POLLIN, 0};
    REQUIRE(::poll(&p, 1, 10000) == 1);
    REQUIRE(::read(ready[0], &r, 1) == 1);
    // Four of the eight are refused at once; the other four wait for a hello.
    REQUIRE(serve_until(s, [&] { return s.counters().refused == 4; }));
    CHECK(s.counters().last_refusal.error == EBUSY);
    // A client of another user still gets the node-local path.
    {
        connected_client good(pd, s, local_options());
        CHECK(good.cli.is_local(good.peer));
        std::vector<std::byte> req(64, std::byte{5});
        CHECK(call_once(s, good, m_echo, req).status == rpc::call_status::ok);
    }
    ::close(hold[1]);
    ::close(ready[0]);
    CHECK(rdmax::test::reap(child) == 0);
}

TEST_CASE("a client whose node-local handshake is refused takes the device",
          "[hostile-local][fallback][device]") {
    test_domain pd;
    rpc::rpc_options o = local_options();
    o.max_peers = 8; // handshakes per uid: at most 4
    o.connect_timeout = std::chrono::seconds(20);
    rpc::server s = make_server(pd, test_addr(), 0, o);
    handlers h;
    h.install(s);
    (void)s.poll();
    // This user holds its share of handshakes (a fifth is refused): the
    // client's own is refused, the socket closed without a welcome.
    std::vector<local::unix_channel> silent;
    silent.reserve(5);
    for (int i = 0; i < 5; ++i)
        silent.push_back(local::unix_channel::connect(rpc::local_name(test_addr(), s.port())));
    REQUIRE(serve_until(s, [&] { return s.counters().refused == 1; }));
    connected_client c(pd, s, local_options()); // used to throw: "handshake failed"
    CHECK_FALSE(c.cli.is_local(c.peer));
    std::vector<std::byte> req(64, std::byte{9});
    CHECK(call_once(s, c, m_echo, req).status == rpc::call_status::ok);
    CHECK(c.cli.counters().refused == 1);
    const int err = c.cli.counters().last_refusal.error;
    CHECK((err == ECONNRESET || err == EPIPE));
}

TEST_CASE("a client takes the device when a node-local server's segment is not sealed",
          "[hostile-local][unsealed][device]") {
    // What a server from before sealed segments hands over: the client threw
    // rdmax::error("mmap", EPERM) from connect() instead of taking the device.
    test_domain pd;
    rpc::rpc_options device_only = small_options();
    device_only.local = false;
    rpc::server s = make_server(pd, test_addr(), 0, device_only);
    handlers h;
    h.install(s);
    local::unix_listener old_server(rpc::local_name(test_addr(), s.port()));
    std::thread answer([&] {
        local::unix_channel ch = old_server.accept(std::chrono::seconds(10));
        if (ch.fd() < 0)
            return;
        rpc::local_hello hello;
        std::vector<int> got;
        (void)ch.receive(std::as_writable_bytes(std::span(&hello, 1)), got,
                         std::chrono::seconds(10));
        for (int fd : got)
            ::close(fd);
        rpc::local_welcome w;
        w.slots = 16;
        w.slot_bytes = 4096;
        w.segment_bytes = rpc::detail::shm_link::segment_bytes(16, 4096);
        w.incarnation = 0x5eed;
        const int seg = memfd_create("unsealed", MFD_CLOEXEC);
        const int e1 = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        const int e2 = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (seg >= 0 && ftruncate(seg, static_cast<off_t>(w.segment_bytes)) == 0 && e1 >= 0 &&
            e2 >= 0) {
            const std::array<int, 3> fds{seg, e1, e2};
            ch.send(std::as_bytes(std::span(&w, 1)), fds);
        }
        for (int fd : {seg, e1, e2})
            if (fd >= 0)
                ::close(fd);
    });
    std::optional<connected_client> c;
    try {
        c.emplace(pd, s, local_options());
    } catch (...) {
        answer.join();
        throw;
    }
    answer.join();
    CHECK_FALSE(c->cli.is_local(c->peer));
    std::vector<std::byte> req(64, std::byte{3});
    CHECK(call_once(s, *c, m_echo, req).status == rpc::call_status::ok);
    CHECK(c->cli.counters().last_refusal.error == EPERM);
    CHECK_THAT(std::string(c->cli.counters().last_refusal.what()),
               Catch::Matchers::Contains("not sealed"));
}

TEST_CASE("a node-local peer that writes on its socket after the handshake is dropped; the "
          "server sleeps",
          "[hostile-local][stray-byte]") {
    // One unread byte used to keep the server's epoll readable: wait() never
    // slept again (a core at 100 % for as long as that peer stayed).
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, quiet_local_options());
    handlers h;
    h.install(s);
    connected_client good(pd, s, local_options());
    raw_local_peer bad(s.port());
    bad.handshake(s);
    REQUIRE(serve_until(s, [&] { return s.peers() == 2; }));
    const char stray = 'x';
    REQUIRE(::send(bad.ch.fd(), &stray, 1, MSG_NOSIGNAL) == 1);
    const auto cpu0 = thread_cpu();
    const auto t0 = clock_type::now();
    while (clock_type::now() - t0 < std::chrono::milliseconds(300))
        (void)s.wait(std::chrono::milliseconds(100));
    const auto cpu = thread_cpu() - cpu0;
    INFO("the server's thread used " << cpu.count() << " us of CPU in 300 ms of wait()");
    CHECK(cpu < std::chrono::milliseconds(60));
    CHECK(s.peers() == 1); // the writer went, the good one stays
    std::vector<std::byte> req(100, std::byte{2});
    const answer a = call_once(s, good, m_echo, req);
    CHECK(a.status == rpc::call_status::ok);
    CHECK(a.reply == req);
}

// ---- the server's bookkeeping ----------------------------------------------------------------

namespace rdmax::rpc {
/// The tests' way to server::add_link (a friend of the server): a failure
/// no peer can cause from outside, injected.
struct server_test_access {
    static std::uint32_t add_link(server& s, std::unique_ptr<detail::link> w, std::uint16_t slots) {
        return s.add_link(std::move(w), slots, 1, 1);
    }
};
} // namespace rdmax::rpc

namespace {

/// A connection whose descriptor epoll refuses (a memfd has no poll:
/// EPERM): the server cannot watch it, so add_link fails after it took the
/// wire. Ended as far as anyone asks, so that a server that kept it tears it
/// down at its next housekeeping.
class unwatchable_wire final : public rpc::detail::link {
public:
    unwatchable_wire()
        : link(4, 4096, rpc::transport::rdma)
        , fd_(memfd_create("unwatchable", MFD_CLOEXEC)) {
        REQUIRE(fd_ >= 0);
        lay_out(staging_.data(), staging_.data());
        set_fds(fd_, -1);
    }
    unwatchable_wire(const unwatchable_wire&) = delete;
    unwatchable_wire& operator=(const unwatchable_wire&) = delete;
    ~unwatchable_wire() override { ::close(fd_); }

    status send_slot(rpc::message_kind, std::uint32_t, std::uint32_t, sched::priority,
                     bool) noexcept override {
        return status::qp_failed;
    }
    rpc::detail::transfer move_body(rpc::detail::body_way, sched::priority,
                                    local_buffer<rights::local_write>,
                                    const rpc::buffer_descriptor&, std::uint64_t,
                                    std::span<const std::uint32_t>) noexcept override {
        return rpc::detail::transfer::failed;
    }
    bool cancel(std::uint64_t) noexcept override { return false; }
    int poll(std::span<rpc::detail::link_event>, bool) noexcept override { return 0; }
    std::optional<rpc::link_end> ended(rpc::detail::look) noexcept override {
        return rpc::link_end{};
    }
    bool sleep(bool) noexcept override { return true; }
    void close() noexcept override {}
    bool established(bool) noexcept override { return true; }
    rpc::detail::access grant_access(std::uint32_t, const rpc::detail::call_ranges&,
                                     rpc::buffer_descriptor&,
                                     rpc::buffer_descriptor&) noexcept override {
        return rpc::detail::access::no_room;
    }
    bool end_access(std::uint32_t, rpc::detail::access_end) noexcept override { return true; }

private:
    int fd_;
    std::array<std::byte, 4096> staging_{};
};

} // namespace

TEST_CASE("a connection that fails half-way into the server's table leaves the peer count right",
          "[bookkeeping][add-link]") {
    // It used to keep the wire without counting it; its teardown then took
    // the live-peer count below zero (it wrapped) and every peer was refused.
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, small_options());
    handlers h;
    h.install(s);
    for (int i = 0; i < 3; ++i)
        CHECK_THROWS(rpc::server_test_access::add_link(s, std::make_unique<unwatchable_wire>(), 4));
    CHECK(s.peers() == 0);
    // Housekeeping, which tore down what add_link had left behind.
    const auto until = clock_type::now() + std::chrono::milliseconds(50);
    while (clock_type::now() < until)
        (void)s.wait(std::chrono::milliseconds(5));
    CHECK(s.peers() == 0);
    CHECK(s.counters().disconnected == 0);
    connected_client good(pd, s);
    accept_peers(s, 1);
    std::vector<std::byte> req(200, std::byte{8});
    const answer a = call_once(s, good, m_echo, req);
    CHECK(a.status == rpc::call_status::ok);
    CHECK(a.reply == req);
}

TEST_CASE("a buffer that cannot be registered is registration_failed, not too_large",
          "[bookkeeping][registration-failed]") {
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, small_options());
    handlers h;
    h.install(s);
    connected_client c(pd, s);
    // Over a slot, so it goes by the caller's buffer, across a page that is
    // not mapped: nothing there to pin, on any kernel (PROT_NONE memory would
    // not do: 6.1's ib_umem_get still forces read-only pins; nor the [vvar]
    // pages, which 7.3 lets a registration pin).
    const std::size_t page = 4096;
    auto* base = static_cast<std::byte*>(
        mmap(nullptr, 3 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    REQUIRE(base != MAP_FAILED);
    REQUIRE(::munmap(base + page, page) == 0);
    const std::span<const std::byte> req(base, 3 * page);
    if (!local_path() && !RDMAX_TEST_TCP) {
        CHECK(c.cli.start(c.peer, m_echo, req) == rpc::call_status::registration_failed);
    } else {
        // No registration on these paths: the server's CMA read fails, or
        // (tcp) the client's answer to its read, and says so.
        CHECK(call_once(s, c, m_echo, req).status == rpc::call_status::read_failed);
    }
    ::munmap(base, page);
    ::munmap(base + 2 * page, page);
    // The connection is unharmed.
    std::vector<std::byte> ok(1000);
    fill_pattern(ok, 9);
    const answer a = call_once(s, c, m_echo, ok);
    CHECK(a.status == rpc::call_status::ok);
    CHECK(a.reply == ok);
}

TEST_CASE("a refused connection leaves its reason in last_refusal",
          "[bookkeeping][last-refusal][device]") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    rpc::rpc_options o = local_options();
    o.connect_timeout = std::chrono::milliseconds(300);
    rpc::server s = make_server(pd, test_addr(), 0, o);
    CHECK(s.counters().last_refusal.error == 0);
    CHECK(s.counters().last_refusal.what().empty());
    CHECK_THAT(fmt::format("{}", s.counters()),
               Catch::Matchers::Contains("refused 0 (last: none)"));
    const auto name = rpc::local_name(test_addr(), s.port());
    {
        // A hello that is not an rdmax client's.
        local::unix_channel ch = local::unix_channel::connect(name);
        const std::array<std::byte, 8> junk{};
        ch.send(junk);
        REQUIRE(serve_until(s, [&] { return s.counters().refused == 1; }));
        CHECK(s.counters().last_refusal.error == EPROTO);
        CHECK_THAT(std::string(s.counters().last_refusal.what()),
                   Catch::Matchers::Contains("not an rdmax client"));
    }
    {
        // Silent past the deadline.
        local::unix_channel ch = local::unix_channel::connect(name);
        REQUIRE(serve_until(s, [&] { return s.counters().refused == 2; }));
        CHECK(s.counters().last_refusal.error == ETIMEDOUT);
        CHECK_THAT(std::string(s.counters().last_refusal.what()),
                   Catch::Matchers::Contains("no hello"));
        CHECK_THAT(fmt::format("{}", s.counters()), Catch::Matchers::Contains("no hello"));
    }
    {
        // Through rdma_cm: a request with no ring offer.
        std::atomic<bool> stop{false};
        std::thread serve([&] {
            while (!stop.load())
                (void)s.wait(std::chrono::milliseconds(2));
        });
        const std::array<std::byte, 7> junk{};
        CHECK_THROWS(verbs::connection::connect(pd, test_addr(), s.port(), junk, {},
                                                std::chrono::seconds(5)));
        stop = true;
        serve.join();
        CHECK(s.counters().refused == 3);
        CHECK(s.counters().last_refusal.error == EPROTO);
        CHECK_THAT(std::string(s.counters().last_refusal.what()),
                   Catch::Matchers::Contains("no ring offer"));
    }
}

namespace {

/// Options for the tests of the device path's windows (whatever
/// RDMAX_RPC_LOCAL says: the node-local path has none).
rpc::rpc_options device_options() {
    rpc::rpc_options o = small_options();
    o.local = false;
    return o;
}

/// Waits (polling server and client in this thread) for `n` results.
std::vector<rpc::call_result> results_of(rpc::server& s, rpc::client& c, std::size_t n,
                                         const std::function<void(const rpc::call_result&)>& each) {
    std::vector<rpc::call_result> got;
    const auto deadline = clock_type::now() + std::chrono::seconds(60);
    rpc::call_result out[16];
    while (got.size() < n && clock_type::now() < deadline) {
        (void)s.poll();
        const int k = c.poll(out);
        for (int i = 0; i < k; ++i) {
            each(out[i]); // the reply is valid until the next poll
            got.push_back(out[i]);
        }
    }
    return got;
}

} // namespace

TEST_CASE("an answered call's windows are invalidated on the send queue, not reallocated",
          "[rpccall][fence][device]") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    REQUIRE(ctx.limits().memory_windows);
    rpc::server s = make_server(pd, test_addr(), 0, device_options());
    handlers h;
    h.install(s);
    connected_client c(pd, s, device_options());
    std::vector<std::byte> req(16 * 1024), reply(16 * 1024);
    for (unsigned i = 0; i < 20; ++i) {
        fill_pattern(req, 40 + i);
        const answer a = call_once(s, c, m_echo, req, {.reply_into = reply});
        REQUIRE(a.status == rpc::call_status::ok);
        CHECK(a.reply == req);
    }
    CHECK(c.cli.counters().external_bodies == 20);
    // Each call's two windows died by a signaled invalidation whose
    // completion came before the result: no dealloc + alloc per call (which
    // is two verbs calls each, a firmware command on a NIC).
    CHECK(c.cli.counters().window_reallocs == 0);
    CHECK(c.cli.counters().windows_unavailable == 0);
    // A timeout keeps the synchronous revocation (the server may still hold
    // the keys): two windows deallocated and replaced.
    const answer late = call_once(s, c, m_defer, req,
                                  {.timeout = std::chrono::milliseconds(20), .reply_into = reply});
    CHECK(late.status == rpc::call_status::timed_out);
    CHECK(c.cli.counters().window_reallocs == 2);
    h.deferred.clear();
    fill_pattern(req, 77);
    const answer after = call_once(s, c, m_echo, req, {.reply_into = reply});
    CHECK(after.status == rpc::call_status::ok);
    CHECK(after.reply == req);
}

TEST_CASE("calls with windows fill every slot without no_credit: the send queue has room for "
          "their binds",
          "[rpccall][sq-depth][device]") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    REQUIRE(ctx.limits().memory_windows);
    constexpr std::size_t n = 1024; // a send queue of 4 x 1024 WQEs before: less than needed
    rpc::rpc_options o = device_options();
    o.slots = n;
    o.slot_bytes = 1024;
    rpc::server s = make_server(pd, test_addr(), 0, o);
    handlers h;
    h.install(s);
    connected_client c(pd, s, o);
    REQUIRE(c.cli.slots(c.peer) == n);
    REQUIRE(c.cli.counters().windows_unavailable == 0); // rxe has windows enough
    constexpr std::size_t body = 2048; // over a slot: a window for it and one for the reply
    std::vector<std::byte> reqs(n * body), replies(n * body);
    for (std::size_t k = 0; k < n; ++k)
        fill_pattern(std::span(reqs).subspan(k * body, body), static_cast<unsigned>(k));
    // Every slot at once, no poll in between: 2n binds and n requests.
    std::size_t started = 0;
    for (std::size_t k = 0; k < n; ++k) {
        const rpc::call_status st =
            c.cli.start(c.peer, m_echo, std::span(reqs).subspan(k * body, body),
                        {.reply_into = std::span(replies).subspan(k * body, body), .cookie = k});
        if (st != rpc::call_status::ok) {
            FAIL_CHECK("call " << k << " of " << n << " refused: " << rpc::to_string(st));
            break;
        }
        ++started;
    }
    CHECK(started == n);
    CHECK(c.cli.counters().no_credit == 0);
    std::size_t right = 0;
    std::array<std::size_t, 32> wrong{};
    const auto got = results_of(s, c.cli, started, [&](const rpc::call_result& r) {
        const auto k = static_cast<std::size_t>(r.cookie);
        if (r.status == rpc::call_status::ok && r.reply.size() == body &&
            has_pattern(r.reply, static_cast<unsigned>(k)))
            ++right;
        else
            ++wrong[std::min<std::size_t>(static_cast<std::size_t>(r.status), wrong.size() - 1)];
    });
    for (std::size_t st = 0; st < wrong.size(); ++st)
        if (wrong[st] != 0)
            WARN(wrong[st] << " calls ended " << rpc::to_string(static_cast<rpc::call_status>(st)));
    CHECK(got.size() == started);
    CHECK(right == started);
}

TEST_CASE("a client that cannot allocate memory windows says so and counts it",
          "[rpccall][windows-unavailable][device]") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    REQUIRE(ctx.limits().memory_windows);
    rpc::server s = make_server(pd, test_addr(), 0, device_options());
    handlers h;
    h.install(s);
    auto& hooks = rdmax::detail::rdma_link_test_hooks();
    struct restore {
        ~restore() { rdmax::detail::rdma_link_test_hooks().alloc_mw = nullptr; }
    } restore_hooks;
    // A device out of windows (rxe has a limit): ibv_alloc_mw fails.
    static std::atomic<int> allowed{0};
    hooks.alloc_mw = [](ibv_pd* p, ibv_mw_type t) -> ibv_mw* {
        if (allowed.fetch_sub(1) > 0)
            return ibv_alloc_mw(p, t);
        errno = ENOMEM;
        return nullptr;
    };
    std::vector<std::byte> req(16 * 1024), reply(16 * 1024);
    fill_pattern(req, 5);
    {
        allowed = 0;
        connected_client c(pd, s, device_options());
        CHECK(c.cli.counters().windows_unavailable == 1);
        // Still served, under the registration's own key.
        const answer a = call_once(s, c, m_echo, req, {.reply_into = reply});
        CHECK(a.status == rpc::call_status::ok);
        CHECK(a.reply == req);
    }
    {
        // Windows at connect (2 per slot), none to replace them later: the
        // link gives them up at its first timeout, and says so.
        allowed = 2 * device_options().slots;
        connected_client c(pd, s, device_options());
        CHECK(c.cli.counters().windows_unavailable == 0);
        CHECK(call_once(s, c, m_defer, req, {.timeout = std::chrono::milliseconds(20)}).status ==
              rpc::call_status::timed_out);
        CHECK(c.cli.counters().windows_unavailable == 1);
        h.deferred.clear();
        const answer a = call_once(s, c, m_echo, req, {.reply_into = reply});
        CHECK(a.status == rpc::call_status::ok);
        CHECK(a.reply == req);
    }
}

TEST_CASE("an invalidation the send queue cannot take waits for room; the window is not "
          "deallocated under its queued bind",
          "[rpccall][owed-invalidation][device]") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    REQUIRE(ctx.limits().memory_windows);
    rpc::server s = make_server(pd, test_addr(), 0, device_options());
    handlers h;
    h.install(s);
    rpc::rpc_options o = device_options();
    o.scheduler.max_requests = 1; // a second request is refused until the first completes
    connected_client c(pd, s, o);
    REQUIRE(c.cli.counters().windows_unavailable == 0);
    std::vector<std::byte> one(16 * 1024), two(16 * 1024), reply(16 * 1024);
    fill_pattern(one, 1);
    fill_pattern(two, 2);
    REQUIRE(c.cli.start(c.peer, m_echo, one, {.reply_into = reply, .cookie = 1}) ==
            rpc::call_status::ok);
    {
        // The second call binds its windows, then its request is refused
        // (the scheduler is full): its windows are revoked, and the send
        // queue "has no room" for the invalidations. Deallocating them
        // instead would kill the binds still queued, and the connection.
        rdmax::detail::rdma_link_test_hooks().refuse_invalidate = [] { return true; };
        struct restore {
            ~restore() { rdmax::detail::rdma_link_test_hooks().refuse_invalidate = nullptr; }
        } restore_hooks;
        CHECK(c.cli.start(c.peer, m_echo, two, {.cookie = 2}) == rpc::call_status::no_credit);
    }
    bool first_ok = false;
    (void)results_of(s, c.cli, 1, [&](const rpc::call_result& r) {
        first_ok = r.status == rpc::call_status::ok && r.reply.size() == one.size() &&
                   std::equal(r.reply.begin(), r.reply.end(), one.begin());
    });
    CHECK(first_ok);
    // The slot whose invalidations were owed is used again once they are posted.
    for (unsigned i = 0; i < 4; ++i) {
        fill_pattern(two, 10 + i);
        const answer a = call_once(s, c, m_echo, two, {.reply_into = reply});
        CHECK(a.status == rpc::call_status::ok);
        CHECK(a.reply == two);
    }
    CHECK(c.cli.counters().link_failures == 0);
    CHECK(c.cli.counters().disconnected == 0);
    CHECK(c.cli.connected(c.peer));
}

TEST_CASE("an answered call whose fence cannot be posted has its windows deallocated before its "
          "result goes",
          "[rpccall][fence][device]") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    REQUIRE(ctx.limits().memory_windows);
    rpc::server s = make_server(pd, test_addr(), 0, device_options());
    handlers h;
    h.install(s);
    connected_client c(pd, s, device_options());
    REQUIRE(c.cli.counters().windows_unavailable == 0);
    std::vector<std::byte> req(16 * 1024), reply(16 * 1024);
    fill_pattern(req, 5);
    {
        rdmax::detail::rdma_link_test_hooks().refuse_invalidate = [] { return true; };
        struct restore {
            ~restore() { rdmax::detail::rdma_link_test_hooks().refuse_invalidate = nullptr; }
        } restore_hooks;
        const answer a = call_once(s, c, m_echo, req, {.reply_into = reply});
        CHECK(a.status == rpc::call_status::ok);
        CHECK(a.reply == req);
    }
    // Its two windows (body, reply buffer) were replaced: the keys the
    // server had are dead although no invalidation ran.
    CHECK(c.cli.counters().window_reallocs == 2);
    fill_pattern(req, 6);
    const answer after = call_once(s, c, m_echo, req, {.reply_into = reply});
    CHECK(after.status == rpc::call_status::ok);
    CHECK(after.reply == req);
}

TEST_CASE("a superseded call's READ still queued at the server is withdrawn, not posted against "
          "its dead window",
          "[rpccall][cancel-read][device]") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    REQUIRE(ctx.limits().memory_windows);
    rpc::rpc_options so = device_options();
    // A server that moves one 4 KiB slice at a time: a large READ keeps the
    // others waiting in its scheduler.
    so.scheduler.budget_bytes = 4096;
    so.scheduler.budget_wqes = 1;
    so.scheduler.small_slice = 4096;
    so.scheduler.large_slice = 4096;
    rpc::server s = make_server(pd, test_addr(), 0, so);
    handlers h;
    h.install(s);
    rpc::rpc_options co = device_options();
    co.slots = 2; // the call that times out leaves the only free slot
    connected_client c(pd, s, co);
    std::vector<std::byte> big(8 << 20), mid(256 * 1024), big_reply(8 << 20), mid_reply(256 * 1024);
    fill_pattern(big, 21);
    fill_pattern(mid, 22);
    // The big one first (its READ under way, slice by slice), then one at
    // the bulk level whose READ waits behind it, and gives up soon.
    REQUIRE(c.cli.start(c.peer, m_echo, big, {.reply_into = big_reply, .cookie = 1}) ==
            rpc::call_status::ok);
    REQUIRE(c.cli.start(c.peer, m_echo, mid,
                        {.priority = sched::bulk,
                         .timeout = std::chrono::milliseconds(20),
                         .reply_into = mid_reply,
                         .cookie = 2}) == rpc::call_status::ok);
    std::vector<rpc::call_result> results;
    bool big_ok = false;
    const auto collect = [&](const rpc::call_result& r) {
        if (r.cookie == 1)
            big_ok = r.status == rpc::call_status::ok && r.reply.size() == big.size() &&
                     std::equal(r.reply.begin(), r.reply.end(), big.begin());
        results.push_back(r);
    };
    // Until the bulk call times out (the server takes both requests meanwhile).
    const auto deadline = clock_type::now() + std::chrono::seconds(30);
    rpc::call_result out[4];
    bool timed_out = false;
    while (!timed_out && clock_type::now() < deadline) {
        (void)s.poll();
        const int n = c.cli.poll(out);
        for (int i = 0; i < n; ++i) {
            collect(out[i]);
            timed_out =
                timed_out || (out[i].cookie == 2 && out[i].status == rpc::call_status::timed_out);
        }
    }
    REQUIRE(timed_out);
    INFO("the large READ must still be under way when the bulk call times out");
    REQUIRE_FALSE(big_ok);
    // The next call goes into the timed-out call's slot, with the other
    // epoch: the server drops that call, and its READ that never went.
    std::vector<std::byte> small(100);
    fill_pattern(small, 23);
    REQUIRE(c.cli.start(c.peer, m_echo, small, {.cookie = 3}) == rpc::call_status::ok);
    bool small_ok = false;
    const auto more = results_of(s, c.cli, 2, [&](const rpc::call_result& r) {
        collect(r);
        if (r.cookie == 3)
            small_ok = r.status == rpc::call_status::ok &&
                       std::equal(r.reply.begin(), r.reply.end(), small.begin(), small.end());
    });
    CHECK(more.size() == 2);
    CHECK(small_ok);
    CHECK(big_ok);
    // A READ at the bulk level goes after the withdrawn one would have (FIFO
    // within a level): the connection is still whole then.
    fill_pattern(mid, 24);
    const answer after =
        call_once(s, c, m_echo, mid, {.priority = sched::bulk, .reply_into = mid_reply});
    CHECK(after.status == rpc::call_status::ok);
    CHECK(after.reply == mid);
    CHECK(s.counters().cancelled_reads == 1);
    CHECK(s.counters().disconnected == 0);
    CHECK(c.cli.counters().disconnected == 0);
}

// ring_held() posts what the held connections queued, every level of it: a
// pass of the pump stops at a less urgent level once an urgent slice is
// staged, which left a normal call held behind an urgent one queued until
// the client's next poll.
TEST_CASE("ring_held posts every held call, whatever its priority", "[rpccall][device]") {
    test_domain pd;
    rpc::server s = make_server(pd, test_addr(), 0, device_options());
    handlers h;
    h.install(s);
    connected_client c(pd, s, device_options());
    const std::vector<std::byte> req(16, std::byte{1});
    c.cli.hold_doorbells();
    REQUIRE(c.cli.start(c.peer, m_defer, req, {.priority = sched::normal}) == rpc::call_status::ok);
    REQUIRE(c.cli.start(c.peer, m_defer, req, {.priority = sched::urgent}) == rpc::call_status::ok);
    c.cli.ring_held();
    // Only the server polls now (the client waits for something else).
    const auto deadline = clock_type::now() + std::chrono::milliseconds(500);
    while (h.deferred.size() < 2 && clock_type::now() < deadline)
        (void)s.poll();
    INFO("calls at the server after ring_held: " << h.deferred.size());
    CHECK(h.deferred.size() == 2);
    // The client's next poll posts the rest.
    rpc::call_result out[4];
    (void)c.cli.poll(out);
    const auto again = clock_type::now() + std::chrono::seconds(5);
    while (h.deferred.size() < 2 && clock_type::now() < again)
        (void)s.poll();
    CHECK(h.deferred.size() == 2);
    for (auto& d : h.deferred)
        (void)s.reply(d, req);
}

TEST_CASE("transports: a server given the device but not rdma takes node-local peers only; a "
          "client given shm alone names the peer it cannot reach, and why",
          "[transports][device]") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    rpc::rpc_options shm_only = small_options();
    shm_only.local = true;
    shm_only.transports = rpc::transport_set{} | rpc::transport::shm;
    rpc::server s(pd, test_addr(), 0, shm_only);
    handlers h;
    h.install(s);
    REQUIRE(s.port() != 0); // picked without rdma_cm
    connected_client here(pd, s, shm_only);
    CHECK(here.cli.transport(here.peer) == rpc::transport::shm);
    std::vector<std::byte> req(100);
    fill_pattern(req, 4);
    const answer a = call_once(s, here, m_echo, req);
    REQUIRE(a.status == rpc::call_status::ok);
    CHECK(a.reply == req);
    // No rdma_cm listener: a client through the device finds nobody there.
    rpc::rpc_options quick = device_options();
    quick.connect_timeout = std::chrono::milliseconds(2000);
    rpc::client dev(pd, quick);
    CHECK_THROWS_AS(dev.connect(test_addr(), s.port()), error);
    CHECK(s.counters().connected == 1);
    CHECK(s.counters().connected_local == 1);
    // A server through the device only, and a client that may not use it.
    rpc::server d(pd, test_addr(), 0, device_options());
    rpc::client cli(pd, shm_only);
    try {
        (void)cli.connect(test_addr(), d.port());
        FAIL("a client with shm alone reached a server through the device");
    } catch (const error& e) {
        CHECK(e.code().value() == EHOSTUNREACH);
        CHECK_THAT(e.what(), Catch::Matchers::Contains("rdma is left out") &&
                                 Catch::Matchers::Contains(fmt::format(
                                     "no node-local server at {}:{}", test_addr(), d.port())));
    }
    // Given the device, but neither rdma nor shm: refused at construction.
    rpc::rpc_options nothing = shm_only;
    nothing.local = false;
    CHECK_THROWS_WITH(rpc::client(pd, nothing), Catch::Matchers::Contains("no transport"));
    CHECK_THROWS_WITH(rpc::server(pd, test_addr(), 0, nothing),
                      Catch::Matchers::Contains("no transport"));
    // A group given the device but not rdma: node-local peers only, as the server.
    rpc::server_group g(pd, test_addr(), 0, 1, shm_only);
    REQUIRE(g.port() != 0);
    g.on(m_echo, [](rpc::request_context& c) { c.reply(c.body()); });
    g.start();
    rpc::client gc(pd, shm_only);
    const rpc::peer_id gp = gc.connect(test_addr(), g.port());
    CHECK(gc.transport(gp) == rpc::transport::shm);
    const rpc::call_result r = gc.call(gp, m_echo, req);
    REQUIRE(r.status == rpc::call_status::ok);
    CHECK(std::equal(r.reply.begin(), r.reply.end(), req.begin(), req.end()));
    rpc::client gdev(pd, quick);
    CHECK_THROWS_AS(gdev.connect(test_addr(), g.port()), error);
    CHECK(g.stop());
}
