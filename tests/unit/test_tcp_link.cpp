// The tcp transport's link (tcp_link.hpp) on a socket pair, with no server
// or client around it: slots and bodies both ways, bytes checked; keys that
// fence a peer into a call's buffers and out of them when the call ends;
// urgent frames overtaking a body at a chunk's boundary; and a hostile peer
// writing raw frames, each rule it breaks ending that link alone. Then a
// server over TCP against raw sockets: a bad hello refused and counted, a
// peer that breaks the stream dropped, a good client served throughout.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <rdmax/detail/rpc/tcp_link.hpp>
#include <rdmax/rpc/client.hpp>
#include <rdmax/rpc/server.hpp>

#include "../support/catch.hpp"

using namespace rdmax;
using rpc::detail::link_event;
using rpc::detail::tcp_link;
using clock_type = std::chrono::steady_clock;

namespace {

/// grant_access of host memory, giving the two keys.
rpc::detail::access grant(rpc::detail::link& l, std::uint32_t slot, std::span<const std::byte> body,
                          std::span<std::byte> reply, std::uint32_t& body_key,
                          std::uint32_t& reply_key) {
    rpc::buffer_descriptor b;
    rpc::buffer_descriptor r;
    const rpc::detail::access a = l.grant_access(slot, {.body = body, .reply = reply}, b, r);
    body_key = b.rkey;
    reply_key = r.rkey;
    return a;
}

constexpr std::uint16_t slots = 8;
constexpr std::uint32_t slot_bytes = 4096;

std::vector<std::byte> patterned(std::size_t n, unsigned seed) {
    std::vector<std::byte> v(n);
    for (std::size_t i = 0; i < n; ++i)
        v[i] = static_cast<std::byte>((i * 7 + seed) % 251 + 1); // never 0
    return v;
}

/// Two links on a socket pair: a server's and a client's.
struct pair_of_links {
    std::unique_ptr<tcp_link> server, client;
    pair_of_links() {
        int fds[2];
        REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, fds) == 0);
        server = std::make_unique<tcp_link>(fds[0], true, slots, slot_bytes);
        client = std::make_unique<tcp_link>(fds[1], false, slots, slot_bytes);
    }
};

/// Polls both until `done` (events collected per side), for up to 10 s.
template <class Done>
bool pump(pair_of_links& p, std::vector<link_event>& at_server, std::vector<link_event>& at_client,
          Done&& done) {
    const auto until = clock_type::now() + std::chrono::seconds(10);
    link_event ev[32];
    while (clock_type::now() < until) {
        const int a = p.server->poll(ev, true);
        if (a > 0)
            at_server.insert(at_server.end(), ev, ev + a);
        const int b = p.client->poll(ev, true);
        if (b > 0)
            at_client.insert(at_client.end(), ev, ev + b);
        if (done() || a < 0 || b < 0)
            return done();
    }
    return false;
}

local_buffer<rights::local_write> local_of(std::vector<std::byte>& v) {
    return {v.data(), static_cast<std::uint32_t>(v.size()), 0};
}

rpc::buffer_descriptor remote_of(const void* p, std::size_t n, std::uint32_t key) {
    return {reinterpret_cast<std::uint64_t>(p), key, static_cast<std::uint32_t>(n)};
}

/// A link, and the raw other end of its socket (the hostile peer).
struct link_and_raw {
    std::unique_ptr<tcp_link> link;
    int raw = -1;
    explicit link_and_raw(bool server) {
        int fds[2];
        REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
        link = std::make_unique<tcp_link>(fds[0], server, slots, slot_bytes);
        raw = fds[1];
    }
    link_and_raw(const link_and_raw&) = delete;
    link_and_raw& operator=(const link_and_raw&) = delete;
    ~link_and_raw() { ::close(raw); }
    void send(std::span<const std::byte> b) const {
        REQUIRE(::send(raw, b.data(), b.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(b.size()));
    }
    /// Polls until the link says -1 (or 2 s): true if it did.
    [[nodiscard]] bool rejects() const {
        link_event ev[32];
        const auto until = clock_type::now() + std::chrono::seconds(2);
        while (clock_type::now() < until)
            if (link->poll(ev, true) < 0)
                return link->ended(rpc::detail::look::failure).has_value();
        return false;
    }
};

std::vector<std::byte> frame_bytes(tcp_link::frame type, std::uint32_t value,
                                   const tcp_link::ext* x = nullptr, std::size_t payload = 0) {
    const tcp_link::head h{type, 0, 0, value};
    std::vector<std::byte> out;
    const auto hb = std::as_bytes(std::span(&h, 1));
    out.insert(out.end(), hb.begin(), hb.end());
    if (x != nullptr) {
        const auto xb = std::as_bytes(std::span(x, 1));
        out.insert(out.end(), xb.begin(), xb.end());
    }
    out.resize(out.size() + payload, std::byte{0x5a});
    return out;
}

} // namespace

TEST_CASE("tcp link: slots go both ways with their immediates, every size up to a slot", "[tcp]") {
    pair_of_links p;
    for (std::uint32_t bytes : {1U, 64U, 1000U, slot_bytes}) {
        const std::uint32_t s = bytes % slots;
        const auto req = patterned(bytes, bytes);
        std::memcpy(p.client->staging(s), req.data(), bytes);
        REQUIRE(p.client->send_slot(rpc::message_kind::request, s, bytes, sched::normal, true) ==
                status::ok);
        std::vector<link_event> at_server, at_client;
        REQUIRE(pump(p, at_server, at_client, [&] { return !at_server.empty(); }));
        REQUIRE(at_server.size() == 1);
        CHECK(at_server[0].what == link_event::kind::imm);
        CHECK(at_server[0].imm() == rpc::encode_imm(rpc::message_kind::request, s, bytes, true));
        const auto got = p.server->inbound(s, bytes);
        CHECK(std::equal(got.begin(), got.end(), req.begin(), req.end()));
        // And back, as a reply.
        std::memcpy(p.server->staging(s), req.data(), bytes);
        REQUIRE(p.server->send_slot(rpc::message_kind::reply, s, bytes, sched::normal, true) ==
                status::ok);
        REQUIRE(pump(p, at_server, at_client, [&] { return !at_client.empty(); }));
        CHECK(at_client[0].imm() == rpc::encode_imm(rpc::message_kind::reply, s, bytes, true));
        const auto back = p.client->inbound(s, bytes);
        CHECK(std::equal(back.begin(), back.end(), req.begin(), req.end()));
    }
    // A slot past the geometry is refused before anything goes.
    CHECK(p.client->send_slot(rpc::message_kind::request, slots, 8, sched::normal, false) !=
          status::ok);
}

TEST_CASE("tcp link: dma-buf memory is refused (the socket could reach it only with the CPU), "
          "nothing granted",
          "[tcp]") {
    pair_of_links p;
    const rpc::dmabuf_range range{.cache = nullptr, .offset = 0, .length = 4096};
    rpc::buffer_descriptor b;
    rpc::buffer_descriptor r;
    CHECK(p.client->grant_access(3, {.dev_body = &range}, b, r) ==
          rpc::detail::access::unreachable);
    CHECK(p.client->grant_access(3, {.dev_reply = &range}, b, r) ==
          rpc::detail::access::unreachable);
    CHECK(b.rkey == 0);
    CHECK(r.rkey == 0);
}

TEST_CASE("tcp link: a body is read and a reply written only under the call's keys, and only "
          "while the call lasts",
          "[tcp]") {
    pair_of_links p;
    std::vector<link_event> at_server, at_client;
    const auto body = patterned(1 << 20, 3); // 2 chunks
    std::vector<std::byte> reply(300 * 1024);
    std::uint32_t body_key = 0, reply_key = 0;
    REQUIRE(grant(*p.client, 3, body, reply, body_key, reply_key) == rpc::detail::access::ok);
    REQUIRE(body_key != 0);
    REQUIRE(reply_key != 0);
    REQUIRE(body_key != reply_key);

    // The server reads the body straight into its buffer.
    std::vector<std::byte> into(body.size());
    REQUIRE(p.server->move_body(rpc::detail::body_way::read, sched::normal, local_of(into),
                                remote_of(body.data(), body.size(), body_key), 7,
                                {}) == rpc::detail::transfer::started);
    REQUIRE(pump(p, at_server, at_client, [&] { return !at_server.empty(); }));
    CHECK(at_server[0].what == link_event::kind::transfer);
    CHECK(at_server[0].wr_id == 7);
    CHECK(at_server[0].ok());
    CHECK(into == body);

    // Outside the grant (one byte past it, or under another key): the read
    // ends failed, and the link goes on.
    std::vector<std::byte> small(4096);
    for (const rpc::buffer_descriptor bad :
         {remote_of(body.data() + body.size() - 4095, 4096, body_key),
          remote_of(body.data(), 4096, reply_key), remote_of(body.data(), 4096, body_key + 1)}) {
        at_server.clear();
        REQUIRE(p.server->move_body(rpc::detail::body_way::read, sched::normal, local_of(small),
                                    bad, 8, {}) == rpc::detail::transfer::started);
        REQUIRE(pump(p, at_server, at_client, [&] { return !at_server.empty(); }));
        CHECK_FALSE(at_server[0].ok());
        CHECK_FALSE(p.server->ended(rpc::detail::look::failure));
        CHECK_FALSE(p.client->ended(rpc::detail::look::failure));
    }

    // The reply lands in the caller's buffer.
    auto out = patterned(reply.size(), 5);
    at_server.clear();
    REQUIRE(p.server->move_body(rpc::detail::body_way::write, sched::normal, local_of(out),
                                remote_of(reply.data(), reply.size(), reply_key), 9,
                                {}) == rpc::detail::transfer::started);
    REQUIRE(pump(p, at_server, at_client, [&] { return !at_server.empty(); }));
    CHECK(at_server[0].wr_id == 9);
    CHECK(at_server[0].ok());
    // The write is done for the server once its bytes are on the stream; a
    // message after it (as the reply's) comes after them.
    REQUIRE(p.server->send_slot(rpc::message_kind::reply, 3, 64, sched::normal, false) ==
            status::ok);
    REQUIRE(pump(p, at_server, at_client, [&] { return !at_client.empty(); }));
    CHECK(reply == out);

    // The call ends: its keys die with it. A late write is read and dropped.
    (void)p.client->end_access(3, rpc::detail::access_end::now);
    std::fill(reply.begin(), reply.end(), std::byte{0});
    at_server.clear();
    at_client.clear();
    REQUIRE(p.server->move_body(rpc::detail::body_way::write, sched::normal, local_of(out),
                                remote_of(reply.data(), reply.size(), reply_key), 10,
                                {}) == rpc::detail::transfer::started);
    REQUIRE(p.server->send_slot(rpc::message_kind::reply, 3, 64, sched::normal, false) ==
            status::ok);
    REQUIRE(pump(p, at_server, at_client, [&] { return !at_client.empty(); }));
    CHECK(std::all_of(reply.begin(), reply.end(), [](std::byte b) { return b == std::byte{0}; }));
    CHECK_FALSE(p.client->ended(rpc::detail::look::failure));
}

TEST_CASE("tcp link: an urgent message overtakes a bulk body at a chunk's boundary", "[tcp]") {
    pair_of_links p;
    std::vector<link_event> at_server, at_client;
    std::vector<std::byte> reply(8 << 20, std::byte{0});
    std::uint32_t body_key = 0, reply_key = 0;
    REQUIRE(grant(*p.client, 1, {}, reply, body_key, reply_key) == rpc::detail::access::ok);
    auto out = patterned(reply.size(), 11);
    // The socket fills at once: most of the body waits in the queue.
    REQUIRE(p.server->move_body(rpc::detail::body_way::write, sched::bulk, local_of(out),
                                remote_of(reply.data(), reply.size(), reply_key), 1,
                                {}) == rpc::detail::transfer::started);
    REQUIRE(p.server->send_slot(rpc::message_kind::reply, 2, 64, sched::urgent, false) ==
            status::ok);
    std::size_t landed_when_urgent = 0;
    REQUIRE(pump(p, at_server, at_client, [&] {
        if (landed_when_urgent == 0 && !at_client.empty())
            landed_when_urgent = static_cast<std::size_t>(
                std::count_if(reply.begin(), reply.end(),
                              [](std::byte b) { return b != std::byte{0}; }) +
                1);
        return !at_server.empty() && !at_client.empty();
    }));
    INFO("body bytes in when the urgent message came: " << landed_when_urgent - 1);
    CHECK(landed_when_urgent - 1 < reply.size() / 2);
    CHECK(reply == out); // and the body whole in the end
}

TEST_CASE("tcp link: a peer that breaks the stream's rules ends that link, and nothing is written",
          "[tcp][hostile]") {
    SECTION("an unknown frame type") {
        link_and_raw s(true);
        s.send(frame_bytes(static_cast<tcp_link::frame>(9), 0));
        CHECK(s.rejects());
    }
    SECTION("a slot message longer than a slot (a lying length)") {
        link_and_raw s(true);
        s.send(frame_bytes(tcp_link::frame::slot,
                           rpc::encode_imm(rpc::message_kind::request, 1, slot_bytes + 8)));
        CHECK(s.rejects());
    }
    SECTION("a slot past the geometry") {
        link_and_raw s(true);
        s.send(frame_bytes(tcp_link::frame::slot,
                           rpc::encode_imm(rpc::message_kind::request, slots, 8), nullptr, 8));
        CHECK(s.rejects());
    }
    SECTION("a request to a client") {
        link_and_raw c(false);
        c.send(frame_bytes(tcp_link::frame::slot, rpc::encode_imm(rpc::message_kind::request, 1, 8),
                           nullptr, 8));
        CHECK(c.rejects());
    }
    SECTION("a read answer nobody asked for") {
        link_and_raw s(true);
        const tcp_link::ext x{42, 0, 0, 0};
        s.send(frame_bytes(tcp_link::frame::read_data, 16, &x, 16));
        CHECK(s.rejects());
    }
    SECTION("a read's end that says ok before its bytes came") {
        link_and_raw s(true);
        std::vector<std::byte> into(4096);
        REQUIRE(s.link->move_body(rpc::detail::body_way::read, sched::normal, local_of(into),
                                  remote_of(nullptr, 4096, 1), 5,
                                  {}) == rpc::detail::transfer::started);
        std::array<std::byte, 64> req{};
        REQUIRE(::recv(s.raw, req.data(), req.size(), 0) == tcp_link::full_head);
        const tcp_link::ext x{5, 0, 0, 1};
        s.send(frame_bytes(tcp_link::frame::read_end, 0, &x));
        CHECK(s.rejects());
    }
    SECTION("a read's chunk of another size than a sender cuts (a trickle)") {
        link_and_raw s(true);
        std::vector<std::byte> into(1 << 20);
        REQUIRE(s.link->move_body(rpc::detail::body_way::read, sched::normal, local_of(into),
                                  remote_of(nullptr, into.size(), 1), 5,
                                  {}) == rpc::detail::transfer::started);
        std::array<std::byte, 64> req{};
        REQUIRE(::recv(s.raw, req.data(), req.size(), 0) == tcp_link::full_head);
        const tcp_link::ext x{5, 0, 0, 0};
        s.send(frame_bytes(tcp_link::frame::read_data, 1, &x, 1));
        CHECK(s.rejects());
    }
    SECTION("a write longer than a chunk, to a key never granted") {
        link_and_raw c(false);
        std::vector<std::byte> mine(1 << 20, std::byte{0});
        const tcp_link::ext x{0, reinterpret_cast<std::uint64_t>(mine.data()), 1, 0};
        c.send(frame_bytes(tcp_link::frame::write_data, tcp_link::chunk_bytes + 1, &x));
        CHECK(c.rejects());
        CHECK(std::all_of(mine.begin(), mine.end(), [](std::byte b) { return b == std::byte{0}; }));
    }
    SECTION("a frame with its reserved bytes set") {
        link_and_raw s(true);
        const tcp_link::head h{tcp_link::frame::abandon, 0, 1, 0};
        s.send(std::as_bytes(std::span(&h, 1)));
        CHECK(s.rejects());
    }
    SECTION("a reply chunk half in when its call ends: the rest is dropped, not written") {
        link_and_raw c(false);
        std::vector<std::byte> reply(64 * 1024, std::byte{0});
        std::uint32_t body_key = 0, reply_key = 0;
        REQUIRE(grant(*c.link, 2, {}, reply, body_key, reply_key) == rpc::detail::access::ok);
        const tcp_link::ext x{0, reinterpret_cast<std::uint64_t>(reply.data()), reply_key, 0};
        auto f = frame_bytes(tcp_link::frame::write_data, static_cast<std::uint32_t>(reply.size()),
                             &x, reply.size());
        const std::size_t half = tcp_link::full_head + reply.size() / 2;
        c.send(std::span(f).first(half));
        link_event ev[8];
        const auto until = clock_type::now() + std::chrono::seconds(2);
        while (reply[reply.size() / 2 - 1] == std::byte{0} && clock_type::now() < until)
            REQUIRE(c.link->poll(ev, true) >= 0);
        REQUIRE(reply[reply.size() / 2 - 1] == std::byte{0x5a}); // the first half landed
        // The call ends (timed out, say): the buffer is the caller's again.
        (void)c.link->end_access(2, rpc::detail::access_end::abandon);
        c.send(std::span(f).subspan(half));
        for (int k = 0; k < 50; ++k)
            REQUIRE(c.link->poll(ev, true) >= 0);
        CHECK(std::all_of(reply.begin() + static_cast<std::ptrdiff_t>(reply.size() / 2),
                          reply.end(), [](std::byte b) { return b == std::byte{0}; }));
        CHECK_FALSE(c.link->ended(rpc::detail::look::failure));
    }
    SECTION("a peer that closes half-way into a message: the link ends, no event") {
        link_and_raw s(true);
        auto f = frame_bytes(tcp_link::frame::slot,
                             rpc::encode_imm(rpc::message_kind::request, 1, 4000), nullptr, 10);
        s.send(f);
        ::shutdown(s.raw, SHUT_WR);
        link_event ev[8];
        const auto until = clock_type::now() + std::chrono::seconds(2);
        int n = 0;
        while (clock_type::now() < until && !s.link->ended(rpc::detail::look::events))
            n += std::max(0, s.link->poll(ev, true));
        CHECK(n == 0);
        CHECK(s.link->ended(rpc::detail::look::events).has_value());
        CHECK_FALSE(s.link->ended(rpc::detail::look::failure)); // the peer left: not a failure
    }
}

TEST_CASE("a server over TCP refuses a bad hello, drops a peer that breaks the stream, and "
          "serves a good client throughout",
          "[tcp][hostile]") {
    rpc::rpc_options o;
    o.transports = rpc::transport_set{} | rpc::transport::tcp;
    o.slots = slots;
    o.slot_bytes = slot_bytes;
    o.housekeeping = std::chrono::microseconds(1000);
    o.connect_timeout = std::chrono::milliseconds(500);
    rpc::server s("127.0.0.1", 0, o);
    s.on(1, [](rpc::request_context& c) { c.reply(c.body()); });
    rpc::client good(o);
    rpc::peer_id peer;
    {
        // connect() waits for the welcome, which the server gives from its poll.
        std::atomic<bool> stop{false};
        std::thread serve([&] {
            while (!stop.load())
                (void)s.wait(std::chrono::milliseconds(2));
        });
        try {
            peer = good.connect("127.0.0.1", s.port());
        } catch (...) {
            stop = true;
            serve.join();
            throw;
        }
        stop = true;
        serve.join();
    }
    CHECK(good.transport(peer) == rpc::transport::tcp);
    const auto echo_ok = [&] {
        const auto req = patterned(20000, 1);    // over a slot: the body is read...
        std::vector<std::byte> into(req.size()); // ...and the reply written
        if (good.start(peer, 1, req, {.reply_into = into}) != rpc::call_status::ok)
            return false;
        rpc::call_result r[1];
        const auto until = clock_type::now() + std::chrono::seconds(10);
        while (clock_type::now() < until) {
            (void)s.poll();
            if (good.poll(r) == 1) {
                INFO("status " << rpc::to_string(r[0].status) << ", " << r[0].reply.size()
                               << " bytes");
                CHECK(r[0].status == rpc::call_status::ok);
                return r[0].status == rpc::call_status::ok &&
                       std::equal(r[0].reply.begin(), r[0].reply.end(), req.begin(), req.end());
            }
        }
        return false;
    };
    REQUIRE(echo_ok());

    // A hello that is not an rdmax client's: refused, counted.
    const auto refused = s.counters().refused;
    {
        local::unix_channel raw(rpc::tcp_connect("127.0.0.1", s.port(), std::chrono::seconds(5)));
        const std::array<std::byte, 8> junk{};
        raw.send(junk);
        const auto until = clock_type::now() + std::chrono::seconds(5);
        while (s.counters().refused == refused && clock_type::now() < until)
            (void)s.poll();
    }
    CHECK(s.counters().refused == refused + 1);
    CHECK_THAT(std::string(s.counters().last_refusal.what()),
               Catch::Matchers::Contains("tcp handshake"));

    // A peer that shakes hands, then sends nonsense: dropped as malformed.
    {
        local::unix_channel raw(rpc::tcp_connect("127.0.0.1", s.port(), std::chrono::seconds(5)));
        rpc::tcp_hello hello;
        hello.slots = slots;
        hello.slot_bytes = slot_bytes;
        hello.incarnation = 77;
        raw.send(std::as_bytes(std::span(&hello, 1)));
        rpc::tcp_welcome w;
        std::vector<int> fds;
        std::size_t n = 0;
        const auto until = clock_type::now() + std::chrono::seconds(5);
        while (s.peers() < 2 && clock_type::now() < until)
            (void)s.poll();
        REQUIRE(s.peers() == 2);
        n = raw.receive(std::as_writable_bytes(std::span(&w, 1)), fds, std::chrono::seconds(5));
        REQUIRE(n == sizeof w);
        REQUIRE(w.status == rpc::tcp_ok);
        const auto bad = frame_bytes(static_cast<tcp_link::frame>(200), 0);
        REQUIRE(::send(raw.fd(), bad.data(), bad.size(), MSG_NOSIGNAL) ==
                static_cast<ssize_t>(bad.size()));
        while (s.peers() > 1 && clock_type::now() < until + std::chrono::seconds(5))
            (void)s.poll();
        CHECK(s.peers() == 1);
        CHECK(s.counters().rejected_malformed >= 1);
    }
    CHECK(echo_ok()); // the good client never noticed
}

TEST_CASE("tcp link: completions past the link's room end the link; none is lost silently",
          "[tcp]") {
    // A server posting small writes and never polling: each is done once its
    // bytes are on the stream, so completions pile up past what the link
    // made room for. As a completion queue that overruns, the link must fail
    // rather than drop one.
    pair_of_links p;
    std::vector<std::byte> body(64), reply(64 * 1024);
    std::uint32_t body_key = 0, reply_key = 0;
    REQUIRE(grant(*p.client, 1, body, reply, body_key, reply_key) == rpc::detail::access::ok);
    auto out = patterned(64, 1);
    std::size_t started = 0;
    link_event ev[32];
    for (std::uint64_t id = 1; id <= 2000; ++id) {
        if (p.server->move_body(rpc::detail::body_way::write, sched::normal, local_of(out),
                                remote_of(reply.data() + (id % 1000) * 64, 64, reply_key), id,
                                {}) != rpc::detail::transfer::started)
            break;
        ++started;
        if (id % 32 == 0)
            (void)p.client->poll(ev, true); // the client drains the stream
    }
    // More than the link's room for events: its pool (8 a slot + 64) and 256.
    REQUIRE(started > std::size_t{slots} * 8 + 64 + 256);
    std::vector<link_event> at_server, at_client;
    (void)pump(p, at_server, at_client, [&] {
        return at_server.size() == started || p.server->ended(rpc::detail::look::failure);
    });
    // The overrun is said (the link fails), not hidden: every completion up
    // to it was handed out, none after it made up.
    CHECK(p.server->ended(rpc::detail::look::failure));
    CHECK(at_server.size() <= started);
}

TEST_CASE("tcp link: a call given up before its request went sends none of its body, whatever "
          "level the peer asked for it at",
          "[tcp]") {
    // A hostile server predicts the call's body key and asks for the body at
    // the least urgent level, behind the request still queued at `normal`.
    // The call is given up: its request is withdrawn, and the answer queued
    // at the other level must end failed, not carry the caller's bytes.
    link_and_raw c(false);
    std::vector<std::byte> body(8192, std::byte{0xc3}), reply(64);
    std::uint32_t body_key = 0, reply_key = 0;
    REQUIRE(grant(*c.link, 0, body, reply, body_key, reply_key) == rpc::detail::access::ok);
    REQUIRE(c.link->hold_doorbell(true)); // the request waits in the link's queue
    REQUIRE(c.link->send_slot(rpc::message_kind::request, 0, 64, sched::normal, false) ==
            status::ok);
    tcp_link::head h{tcp_link::frame::read_req,
                     static_cast<std::uint8_t>(sched::priority_levels - 1), 0,
                     static_cast<std::uint32_t>(body.size())};
    const tcp_link::ext x{77, reinterpret_cast<std::uint64_t>(body.data()), body_key, 0};
    std::vector<std::byte> req(tcp_link::full_head);
    std::memcpy(req.data(), &h, sizeof h);
    std::memcpy(req.data() + sizeof h, &x, sizeof x);
    c.send(req);
    link_event ev[8];
    const auto until = clock_type::now() + std::chrono::milliseconds(200);
    while (clock_type::now() < until)
        (void)c.link->poll(ev, true); // takes the read_req; the hold keeps its answer queued
    (void)c.link->end_access(0, rpc::detail::access_end::abandon);
    (void)c.link->hold_doorbell(false); // what is left goes now
    // Whatever comes is frames, not the body: no 0xc3 run, no frame longer
    // than a read's end.
    std::vector<std::byte> got(64 * 1024);
    std::size_t n = 0;
    const auto stop = clock_type::now() + std::chrono::milliseconds(300);
    while (clock_type::now() < stop) {
        const ssize_t r = ::recv(c.raw, got.data() + n, got.size() - n, MSG_DONTWAIT);
        if (r > 0)
            n += static_cast<std::size_t>(r);
    }
    CHECK(std::count(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(n), std::byte{0xc3}) ==
          0);
    CHECK(n <= tcp_link::full_head); // at most the read's failed end
}

TEST_CASE("tcp link: a server's transfer the peer stops moving ends the link after the stall "
          "limit, either way",
          "[tcp]") {
    using std::chrono::milliseconds;
    // A server link with a 200 ms stall limit and one transfer its raw peer
    // never moves: how long until the link ends, from before the transfer
    // started (its stall clock starts there); max() if not within 3 s.
    const auto time_to_end = [](rpc::detail::body_way way, std::size_t bytes) {
        link_and_raw s(true);
        s.link->set_stall(milliseconds(200));
        std::vector<std::byte> buf(bytes, std::byte{1});
        const auto t0 = clock_type::now();
        REQUIRE(s.link->move_body(way, sched::normal, local_of(buf), remote_of(nullptr, bytes, 1),
                                  5, {}) == rpc::detail::transfer::started);
        link_event ev[8];
        while (clock_type::now() - t0 < std::chrono::seconds(3))
            if (s.link->poll(ev, true) < 0 || s.link->ended(rpc::detail::look::failure))
                return clock_type::now() - t0;
        return clock_type::duration::max();
    };
    // The stall clock is the coarse one, which lags the time by a jiffy or
    // more (7.8 ms seen with 4 ms jiffies): the link may end that much early.
    const auto stall_floor = milliseconds(200) - milliseconds(40);
    SECTION("a body read the peer never answers") {
        const auto took = time_to_end(rpc::detail::body_way::read, 4096);
        CHECK(took >= stall_floor);
        CHECK(took < std::chrono::seconds(3));
    }
    SECTION("a reply the peer never reads (more than the socket holds)") {
        const auto took = time_to_end(rpc::detail::body_way::write, 8 << 20);
        CHECK(took >= stall_floor);
        CHECK(took < std::chrono::seconds(3));
    }
    SECTION("a peer that reads, slowly: the link lives") {
        link_and_raw s(true);
        s.link->set_stall(milliseconds(200));
        std::vector<std::byte> out(2 << 20, std::byte{1});
        REQUIRE(s.link->move_body(rpc::detail::body_way::write, sched::normal, local_of(out),
                                  remote_of(nullptr, out.size(), 1), 9,
                                  {}) == rpc::detail::transfer::started);
        std::vector<std::byte> sink(64 * 1024);
        link_event ev[8];
        std::size_t got = 0;
        bool done = false;
        const auto until = clock_type::now() + std::chrono::seconds(20);
        while (!done && clock_type::now() < until) {
            const int n = s.link->poll(ev, true);
            REQUIRE(n >= 0);
            done = n > 0 && ev[0].wr_id == 9;
            const ssize_t r = ::recv(s.raw, sink.data(), sink.size(), MSG_DONTWAIT);
            got += r > 0 ? static_cast<std::size_t>(r) : 0;
            std::this_thread::sleep_for(milliseconds(20)); // 3 MB/s at most
        }
        CHECK(done);
        CHECK(got > out.size() / 2); // the peer took it, at its pace
        CHECK_FALSE(s.link->ended(rpc::detail::look::failure));
    }
}
