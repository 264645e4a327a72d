// RPC bodies and replies in dma-buf memory (issue 30, item 4): the server
// READs a call's body from the caller's dma-buf and WRITEs its reply into
// one, through the device; the caller's CPU never copies those bytes (no
// span over them is handed out). Each range is registered on its own for its
// call and deregistered when the call ends (no window can be bound over a
// dma-buf MR). A node-local or TCP connection refuses such a call before
// anything is registered or sent. Bytes are checked in the exporter's pages
// (udmabuf: memfd pages this test maps). Each test's dmabuf_cache is made
// before its client, which it must outlive.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include <rdmax/rdmax.hpp>

#include "../support/catch.hpp"
#include "../support/pages.hpp"
#include "../support/test_device.hpp"
#include "../support/udmabuf.hpp"

using namespace rdmax;
using namespace rdmax::test;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

namespace {

constexpr std::uint16_t m_flip = 1;  ///< replies the body with every byte XOR 0xff
constexpr std::uint16_t m_small = 2; ///< replies 100 bytes of pattern 9
constexpr std::uint16_t m_hold = 3;  ///< defers: answered later by the test
constexpr std::size_t mib = std::size_t{1} << 20;

rpc::rpc_options options(rpc::transport_set t = rpc::transport_set{} | rpc::transport::rdma) {
    rpc::rpc_options o;
    o.slots = 8;
    o.slot_bytes = 4096;
    o.max_message = 4 * mib;
    o.call_timeout = 20s;
    o.housekeeping = 1ms;
    o.transports = t;
    return o;
}

/// A server on the test device's address, with this test's handlers; what
/// the handlers saw is recorded for the checks.
struct service {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd{ctx};
    rpc::server srv;
    std::vector<std::byte> last_body;
    int runs = 0;
    std::vector<rpc::deferred_call> held;

    service()
        : srv(pd, test_address().value_or("192.0.2.1"), 0, options(rpc::all_transports)) {
        srv.on(m_flip, [this](rpc::request_context& c) {
            ++runs;
            last_body.assign(c.body().begin(), c.body().end());
            std::vector<std::byte> out(last_body);
            for (std::byte& b : out)
                b ^= std::byte{0xff};
            c.reply(out);
        });
        srv.on(m_small, [this](rpc::request_context& c) {
            ++runs;
            last_body.assign(c.body().begin(), c.body().end());
            std::vector<std::byte> out(100);
            fill_pattern(out, 9);
            c.reply(out);
        });
        srv.on(m_hold, [this](rpc::request_context& c) {
            ++runs;
            held.push_back(c.defer());
        });
    }
    [[nodiscard]] std::string addr() const { return test_address().value_or("192.0.2.1"); }
};

/// A client of `s` over the transports `t` (connect() waits for the
/// server's accept, which a thread of its polls give meanwhile).
struct caller {
    rpc::client cli;
    rpc::peer_id peer;
    caller(service& s, rpc::transport_set t = rpc::transport_set{} | rpc::transport::rdma)
        : cli(s.pd, options(t)) {
        std::atomic<bool> stop{false};
        std::thread serve([&] {
            while (!stop.load())
                (void)s.srv.wait(2ms);
        });
        try {
            peer = cli.connect(s.addr(), s.srv.port());
        } catch (...) {
            stop = true;
            serve.join();
            throw;
        }
        stop = true;
        serve.join();
    }
};

/// One call, server and client polled in this thread; the result copied.
struct outcome {
    rpc::call_status status = rpc::call_status::ok;
    std::vector<std::byte> reply;
    std::uint32_t dmabuf_reply_bytes = 0;
};
outcome call(service& s, caller& c, std::uint16_t m, std::span<const std::byte> req,
             const rpc::call_options& o) {
    const rpc::call_status st = c.cli.start(c.peer, m, req, o);
    if (st != rpc::call_status::ok)
        return {st, {}, 0};
    const auto give_up = clock_type::now() + 30s;
    rpc::call_result r[1];
    while (clock_type::now() < give_up) {
        (void)s.srv.poll();
        if (c.cli.poll(r) == 1)
            return {r[0].status, {r[0].reply.begin(), r[0].reply.end()}, r[0].dmabuf_reply_bytes};
    }
    FAIL("no result within 30 s");
    return {};
}

bool all_of(std::span<const std::byte> b, std::byte v) {
    return std::all_of(b.begin(), b.end(), [v](std::byte x) { return x == v; });
}

} // namespace

TEST_CASE("RPC with a 1 MiB body and a 1 MiB reply in dma-buf memory") {
    service s;
    dmabuf_cache dev(s.pd);
    caller c(s);
    REQUIRE(c.cli.transport(c.peer) == rpc::transport::rdma);
    udmabuf buf(2 * mib);
    fill_pattern(buf.bytes(0, mib), 5);
    std::memset(buf.cpu + mib, 0xaa, mib);
    const auto b = dev.add(buf.fd);
    const rpc::call_options o{.body_dmabuf = {&dev, b, 0, static_cast<std::uint32_t>(mib)},
                              .reply_dmabuf = {&dev, b, mib, static_cast<std::uint32_t>(mib)}};
    const auto before = c.cli.counters();
    const auto served = s.srv.counters();
    const outcome r = call(s, c, m_flip, {}, o);
    REQUIRE(r.status == rpc::call_status::ok);
    CHECK(r.reply.empty()); // no span over device memory
    CHECK(r.dmabuf_reply_bytes == mib);
    REQUIRE(s.last_body.size() == mib);
    CHECK(has_pattern(s.last_body, 5)); // the handler saw the dma-buf's bytes
    std::vector<std::byte> want(buf.cpu, buf.cpu + mib);
    for (std::byte& x : want)
        x ^= std::byte{0xff};
    CHECK(std::equal(want.begin(), want.end(), buf.cpu + mib)); // the reply landed there
    // Only the slots' bytes went through the rings: the header and two
    // descriptors out, a header back.
    const auto after = c.cli.counters();
    CHECK(after.external_bodies == before.external_bodies + 1);
    CHECK(after.external_replies == before.external_replies + 1);
    CHECK(after.bytes_out - before.bytes_out ==
          sizeof(rpc::message_header) + 2 * sizeof(rpc::buffer_descriptor));
    CHECK(after.bytes_in - before.bytes_in == sizeof(rpc::message_header));
    CHECK(s.srv.counters().external_replies == served.external_replies + 1);
    // Registered for the call alone, outside the cache (no merged or shared
    // key reaches the server); the same ranges again work the same.
    CHECK(dev.counters().registrations == 0);
    std::memset(buf.cpu + mib, 0xaa, mib);
    fill_pattern(buf.bytes(0, mib), 6);
    const outcome again = call(s, c, m_flip, {}, o);
    REQUIRE(again.status == rpc::call_status::ok);
    CHECK(again.dmabuf_reply_bytes == mib);
    CHECK(has_pattern(s.last_body, 6));
    CHECK(buf.cpu[mib] == (buf.cpu[0] ^ std::byte{0xff}));
}

TEST_CASE("a small dma-buf body is READ and a small reply is written into the dma-buf, never "
          "inline; a host body with a dma-buf reply too") {
    service s;
    dmabuf_cache dev(s.pd);
    caller c(s);
    udmabuf buf(64 * 1024);
    fill_pattern(buf.bytes(0, 100), 3);
    std::memset(buf.cpu + 4096, 0xaa, 4096);
    const auto b = dev.add(buf.fd);
    const outcome r =
        call(s, c, m_small, {},
             {.body_dmabuf = {&dev, b, 0, 100}, .reply_dmabuf = {&dev, b, 4096, 4096}});
    REQUIRE(r.status == rpc::call_status::ok);
    CHECK(r.reply.empty());
    CHECK(r.dmabuf_reply_bytes == 100);
    REQUIRE(s.last_body.size() == 100);
    CHECK(has_pattern(s.last_body, 3));
    CHECK(has_pattern(buf.bytes(4096, 100), 9));
    CHECK(all_of(buf.bytes(4096 + 100, 4096 - 100), std::byte{0xaa})); // nothing past the reply
    // A host request with the reply in the dma-buf.
    std::vector<std::byte> req(32);
    fill_pattern(req, 4);
    std::memset(buf.cpu + 8192, 0xaa, 4096);
    const outcome h = call(s, c, m_small, req, {.reply_dmabuf = {&dev, b, 8192, 4096}});
    REQUIRE(h.status == rpc::call_status::ok);
    CHECK(h.dmabuf_reply_bytes == 100);
    CHECK(s.last_body == req);
    CHECK(has_pattern(buf.bytes(8192, 100), 9));
    // A reply over the range: refused by the server, nothing written.
    std::memset(buf.cpu + 12288, 0xaa, 4096);
    const outcome over = call(s, c, m_small, req, {.reply_dmabuf = {&dev, b, 12288, 64}});
    CHECK(over.status == rpc::call_status::reply_too_large);
    CHECK(over.dmabuf_reply_bytes == 0);
    CHECK(all_of(buf.bytes(12288, 4096), std::byte{0xaa}));
}

TEST_CASE("host memory over windows beside dma-buf memory by its own key, in one call") {
    service s;
    dmabuf_cache dev(s.pd);
    caller c(s);
    udmabuf buf(256 * 1024);
    // A host body over the slot (READ through a window) with the reply in the dma-buf.
    std::vector<std::byte> big(64 * 1024);
    fill_pattern(big, 11);
    std::memset(buf.cpu, 0xaa, 128 * 1024);
    const outcome a =
        call(s, c, m_flip, big, {.reply_dmabuf = {&dev, dev.add(buf.fd), 0, 128 * 1024}});
    REQUIRE(a.status == rpc::call_status::ok);
    CHECK(a.dmabuf_reply_bytes == big.size());
    CHECK(s.last_body == big);
    CHECK(buf.cpu[0] == (big[0] ^ std::byte{0xff}));
    CHECK(buf.cpu[big.size() - 1] == (big.back() ^ std::byte{0xff}));
    // A dma-buf body with the reply into host memory (a window).
    fill_pattern(buf.bytes(128 * 1024, 64 * 1024), 12);
    std::vector<std::byte> into(64 * 1024);
    const auto b = dev.add(buf.fd);
    const outcome r = call(s, c, m_flip, {},
                           {.reply_into = into, .body_dmabuf = {&dev, b, 128 * 1024, 64 * 1024}});
    REQUIRE(r.status == rpc::call_status::ok);
    REQUIRE(r.reply.size() == 64 * 1024);
    CHECK(r.dmabuf_reply_bytes == 0);
    CHECK(has_pattern(s.last_body, 12));
    CHECK(r.reply[5] == (buf.cpu[128 * 1024 + 5] ^ std::byte{0xff}));
    dev.forget(b);
    dev.forget(b);
}

TEST_CASE("a dma-buf call on a node-local or TCP connection is refused dmabuf_unreachable, "
          "nothing registered or sent") {
    service s;
    dmabuf_cache dev(s.pd);
    // A client that has no RDMA refuses at once; one that has it but reached
    // this server another way (node-local first) refuses on that connection.
    const auto t = GENERATE(rpc::transport_set{} | rpc::transport::shm,
                            rpc::transport_set{} | rpc::transport::tcp,
                            rpc::transport_set{} | rpc::transport::rdma | rpc::transport::shm);
    caller c(s, t);
    REQUIRE(c.cli.transport(c.peer) != rpc::transport::rdma);
    udmabuf buf(64 * 1024);
    const auto b = dev.add(buf.fd);
    const auto before = c.cli.counters();
    const rpc::call_status st =
        c.cli.start(c.peer, m_flip, {}, {.body_dmabuf = {&dev, b, 0, 4096}});
    CHECK(st == rpc::call_status::dmabuf_unreachable);
    CHECK(rpc::to_string(st).find("RDMA") != std::string_view::npos);
    CHECK(c.cli.start(c.peer, m_flip, {}, {.reply_dmabuf = {&dev, b, 0, 4096}}) ==
          rpc::call_status::dmabuf_unreachable);
    CHECK(c.cli.counters().calls == before.calls);
    CHECK(c.cli.counters().bytes_out == before.bytes_out);
    CHECK(dev.counters().registrations == 0);
    CHECK(c.cli.in_flight() == 0);
    // The connection still calls.
    const std::vector<std::byte> req(8, std::byte{1});
    CHECK(call(s, c, m_small, req, {}).status == rpc::call_status::ok);
    CHECK(s.runs == 1);
}

TEST_CASE("contradicting dma-buf options are refused bad_options") {
    service s;
    dmabuf_cache dev(s.pd);
    caller c(s);
    udmabuf buf(64 * 1024);
    const auto b = dev.add(buf.fd);
    std::vector<std::byte> req(8), into(4096);
    CHECK(c.cli.start(c.peer, m_flip, req, {.body_dmabuf = {&dev, b, 0, 4096}}) ==
          rpc::call_status::bad_options);
    CHECK(c.cli.start(c.peer, m_flip, req,
                      {.reply_into = into, .reply_dmabuf = {&dev, b, 0, 4096}}) ==
          rpc::call_status::bad_options);
    CHECK(c.cli.start(c.peer, m_flip, {}, {.body_dmabuf = {nullptr, b, 0, 4096}}) ==
          rpc::call_status::bad_options);
    // A cache in another protection domain: its keys mean nothing on this queue pair.
    verbs::protection_domain other(s.ctx);
    dmabuf_cache elsewhere(other);
    const auto e = elsewhere.add(buf.fd);
    CHECK(c.cli.start(c.peer, m_flip, {}, {.body_dmabuf = {&elsewhere, e, 0, 4096}}) ==
          rpc::call_status::bad_options);
    CHECK(elsewhere.counters().registrations == 0);
    // Outside the buffer, or a token forgotten: the registration is refused.
    CHECK(c.cli.start(c.peer, m_flip, {}, {.body_dmabuf = {&dev, b, 60 * 1024, 8192}}) ==
          rpc::call_status::registration_failed);
    const auto gone = dev.add(buf.fd);
    dev.forget(gone);
    dev.forget(b);
    CHECK(c.cli.start(c.peer, m_flip, {}, {.body_dmabuf = {&dev, b, 0, 4096}}) ==
          rpc::call_status::registration_failed);
    CHECK(c.cli.in_flight() == 0);
    CHECK(c.cli.counters().calls == 0);
    CHECK(s.runs == 0);
}

TEST_CASE("a dma-buf call given up loses its key at once, while a call on the next range of "
          "the same buffer is still in flight; the server's late reply does not land") {
    service s;
    dmabuf_cache dev(s.pd);
    caller c(s);
    udmabuf buf(64 * 1024);
    std::memset(buf.cpu, 0xaa, 16384);
    const auto b = dev.add(buf.fd);
    const std::vector<std::byte> req(16, std::byte{2});
    // Two held calls on touching ranges (a merging cache would give them one key).
    REQUIRE(c.cli.start(c.peer, m_hold, req,
                        {.timeout = 100ms, .cookie = 1, .reply_dmabuf = {&dev, b, 0, 8192}}) ==
            rpc::call_status::ok);
    REQUIRE(c.cli.start(c.peer, m_hold, req,
                        {.timeout = 2s, .cookie = 2, .reply_dmabuf = {&dev, b, 8192, 8192}}) ==
            rpc::call_status::ok);
    rpc::call_result res[2];
    int first = 0;
    const auto give_up = clock_type::now() + 10s;
    while (first == 0 && clock_type::now() < give_up) {
        (void)s.srv.poll();
        if (c.cli.poll(res) == 1) {
            CHECK(res[0].cookie == 1);
            CHECK(res[0].status == rpc::call_status::timed_out);
            first = 1;
        }
    }
    REQUIRE(first == 1);
    REQUIRE(s.held.size() == 2);
    // The server answers the given-up call now, 8 KiB (a WRITE with the key
    // the call had, deregistered when it timed out).
    const std::vector<std::byte> late(8192, std::byte{0x55});
    REQUIRE(s.srv.reply(s.held.front(), late));
    const auto until = clock_type::now() + 500ms;
    while (clock_type::now() < until) {
        (void)s.srv.poll();
        (void)c.cli.poll(res);
    }
    CHECK(all_of(buf.bytes(0, 8192), std::byte{0xaa}));
}

TEST_CASE("after a dma-buf call timed out, the server's late reply does not reach the dma-buf") {
    service s;
    dmabuf_cache dev(s.pd);
    caller c(s);
    udmabuf buf(64 * 1024);
    std::memset(buf.cpu, 0xaa, 8192);
    const auto b = dev.add(buf.fd);
    const std::vector<std::byte> req(16, std::byte{2});
    const outcome r =
        call(s, c, m_hold, req, {.timeout = 100ms, .reply_dmabuf = {&dev, b, 0, 8192}});
    CHECK(r.status == rpc::call_status::timed_out);
    REQUIRE(s.held.size() == 1);
    // The server answers now, 8 KiB (over the slot: a WRITE into the caller's
    // range, whose registration went at the timeout).
    std::vector<std::byte> late(8192, std::byte{0x55});
    REQUIRE(s.srv.reply(s.held.front(), late));
    const auto until = clock_type::now() + 500ms;
    rpc::call_result res[1];
    while (clock_type::now() < until) {
        (void)s.srv.poll();
        (void)c.cli.poll(res);
    }
    CHECK(all_of(buf.bytes(0, 8192), std::byte{0xaa}));
    // The connection (or its successor) still calls.
    const outcome next = call(s, c, m_small, req, {.reply_dmabuf = {&dev, b, 0, 8192}});
    CHECK(next.status == rpc::call_status::ok);
    CHECK(has_pattern(buf.bytes(0, 100), 9));
}
