// RPC with no RDMA device (docs/rpc.md, "Without a device"): a server and a
// client built without a protection domain, in two processes, talk through
// the node's memory (a shared segment, CMA for bodies over a slot); a client
// without a device says which peer it cannot reach and why; the transports
// an endpoint is given decide what it builds. tests/rxe/test_rpc.cpp's cases
// run this way too (test_rpc_native).

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <grp.h>
#include <optional>
#include <poll.h>
#include <span>
#include <spawn.h>
#include <string>
#include <sys/socket.h>
#include <sys/un.h>
#include <system_error>
#include <thread>
#include <unistd.h>
#include <vector>

#include <rdmax/detail/rpc/shm_link.hpp>
#include <rdmax/error.hpp>
#include <rdmax/rpc/client.hpp>
#include <rdmax/rpc/server.hpp>
#include <rdmax/rpc/server_group.hpp>

#include "../support/catch.hpp"
#include "../support/child_process.hpp"

using namespace rdmax;
using clock_type = std::chrono::steady_clock;
using Catch::Matchers::Contains;

namespace {

constexpr std::uint16_t m_echo = 1;  ///< reply = request (rpc_no_device_server.cpp)
constexpr std::uint16_t m_fill = 2;  ///< reply: as many bytes as the request's first 4 say
constexpr std::uint16_t m_never = 3; ///< deferred, never answered

rpc::rpc_options options() {
    rpc::rpc_options o;
    o.slots = 8;
    o.slot_bytes = 4096;
    o.call_timeout = std::chrono::seconds(10);
    o.housekeeping = std::chrono::microseconds(1000);
    o.reconnect_backoff = std::chrono::milliseconds(10);
    return o;
}

std::byte pattern(std::size_t i, unsigned seed) {
    return static_cast<std::byte>((i * 7 + seed) % 251);
}

std::vector<std::byte> patterned(std::size_t n, unsigned seed) {
    std::vector<std::byte> v(n);
    for (std::size_t i = 0; i < n; ++i)
        v[i] = pattern(i, seed);
    return v;
}

/// A device-less server on 127.0.0.1 in a process of its own
/// (rpc_no_device_server, started with posix_spawn: no fork of this
/// process, whose arenas run threads), and the port it serves on.
struct server_process {
    pid_t pid = -1;
    std::uint16_t port = 0;

    explicit server_process(std::uint16_t want = 0, const char* addr = "127.0.0.1") {
        const char* program = std::getenv("RDMAX_NO_DEVICE_SERVER");
        REQUIRE(program != nullptr); // meson sets it
        int fds[2];
        REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
        posix_spawn_file_actions_t acts;
        posix_spawn_file_actions_init(&acts);
        posix_spawn_file_actions_adddup2(&acts, fds[1], STDOUT_FILENO);
        const std::string port_arg = std::to_string(want);
        char* const args[] = {const_cast<char*>(program), const_cast<char*>(port_arg.c_str()),
                              const_cast<char*>(addr), nullptr};
        const int rc = ::posix_spawn(&pid, program, &acts, nullptr, args, environ);
        posix_spawn_file_actions_destroy(&acts);
        ::close(fds[1]);
        if (rc != 0)
            pid = -1;
        // Its first line, within 10 s: the port.
        std::string line;
        const auto until = clock_type::now() + std::chrono::seconds(10);
        char c = 0;
        while (rc == 0 && line.find('\n') == std::string::npos && clock_type::now() < until) {
            pollfd pf{fds[0], POLLIN, 0};
            if (::poll(&pf, 1, 100) == 1 && ::read(fds[0], &c, 1) == 1)
                line += c;
            else if ((pf.revents & POLLHUP) != 0)
                break;
        }
        ::close(fds[0]);
        port = static_cast<std::uint16_t>(std::atoi(line.c_str()));
        const bool ready = line.find('\n') != std::string::npos && port != 0;
        if (!ready)
            stop();
        REQUIRE(ready); // the server reports its port within 10 s
    }
    server_process(const server_process&) = delete;
    server_process& operator=(const server_process&) = delete;
    ~server_process() { stop(); }
    /// Kills the server (as a crash would) and waits for it.
    void stop() {
        if (pid > 0) {
            ::kill(pid, SIGKILL);
            (void)test::reap(pid, std::chrono::seconds(10));
            pid = -1;
        }
    }
};

/// One call, waited for up to 20 s; the reply copied out.
struct answer {
    rpc::call_status status = rpc::call_status::ok;
    std::vector<std::byte> reply;
};
answer call(rpc::client& c, rpc::peer_id p, std::uint16_t method, std::span<const std::byte> req,
            const rpc::call_options& o = {}) {
    const rpc::call_status st = c.start(p, method, req, o);
    if (st != rpc::call_status::ok)
        return {st, {}};
    const auto deadline = clock_type::now() + std::chrono::seconds(20);
    rpc::call_result r[1];
    while (clock_type::now() < deadline)
        if (c.wait(r, std::chrono::milliseconds(5)) == 1)
            return {r[0].status, {r[0].reply.begin(), r[0].reply.end()}};
    FAIL("no result within 20 s");
    return {};
}

/// The rdmax::error connect() throws, or nullopt when it connects.
std::optional<error> connect_error(rpc::client& c, const char* addr, std::uint16_t port) {
    try {
        (void)c.connect(addr, port);
    } catch (const error& e) {
        return e;
    }
    return std::nullopt;
}

/// A process holding a server's node-local name (rdmax-rpc/ADDR:PORT) that
/// is no rdmax server: it notes whether a client sent it anything. Started
/// by fork, its body raw system calls alone (this process runs threads);
/// `uid` nonzero: it drops to that user (and group) first, as root may.
struct squatter {
    pid_t pid = -1;
    int done[2] = {-1, -1}; ///< the test closes done[1]: nothing more will come

    squatter(const std::string& name, uid_t uid) {
        int ready[2];
        REQUIRE(::pipe2(ready, O_CLOEXEC) == 0);
        REQUIRE(::pipe2(done, O_CLOEXEC) == 0);
        pid = test::spawn([&] {
            ::close(ready[0]);
            ::close(done[1]);
            if (uid != 0 && (::setgroups(0, nullptr) != 0 || ::setresgid(uid, uid, uid) != 0 ||
                             ::setresuid(uid, uid, uid) != 0))
                return 2;
            sockaddr_un a{};
            a.sun_family = AF_UNIX;
            std::memcpy(a.sun_path + 1, name.data(), name.size()); // abstract
            const auto len =
                static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
            const int l = ::socket(AF_UNIX, SOCK_STREAM, 0);
            if (l < 0 || ::bind(l, reinterpret_cast<const sockaddr*>(&a), len) != 0 ||
                ::listen(l, 4) != 0)
                return 2;
            if (::write(ready[1], "r", 1) != 1)
                return 2;
            // Until the test is done: any byte a client sends is a hello
            // this process should never have seen.
            pollfd pf[2] = {{l, POLLIN, 0}, {done[0], POLLIN, 0}};
            while (::poll(pf, 2, 20000) > 0 && pf[1].revents == 0) {
                const int c = ::accept(l, nullptr, nullptr);
                if (c < 0)
                    return 2;
                pollfd pc[2] = {{c, POLLIN, 0}, {done[0], POLLIN, 0}};
                char b[64];
                if (::poll(pc, 2, 20000) > 0 && pc[0].revents != 0 && ::read(c, b, sizeof b) > 0)
                    return 1;
                ::close(c);
            }
            return 0;
        });
        ::close(ready[1]);
        ::close(done[0]);
        done[0] = -1;
        pollfd pf{ready[0], POLLIN, 0};
        char c = 0;
        const bool up = ::poll(&pf, 1, 10000) == 1 && ::read(ready[0], &c, 1) == 1;
        ::close(ready[0]);
        REQUIRE(up); // it holds the name within 10 s
    }
    squatter(const squatter&) = delete;
    squatter& operator=(const squatter&) = delete;
    ~squatter() { (void)finish(); }
    /// 0: no client sent it a byte; 1: one did.
    int finish() {
        if (done[1] >= 0) {
            ::close(done[1]);
            done[1] = -1;
        }
        const int rc = pid > 0 ? test::reap(pid, std::chrono::seconds(10)) : -1;
        pid = -1;
        return rc;
    }
};

} // namespace

TEST_CASE("no device: a server in another process answers over shm, bodies over a slot by CMA",
          "[no-device]") {
    server_process srv;
    rpc::client cli(options());
    const rpc::peer_id p = cli.connect("127.0.0.1", srv.port);
    REQUIRE(cli.transport(p) == rpc::transport::shm);
    CHECK(cli.is_local(p));
    CHECK(cli.counters().connected == 1);
    CHECK(cli.counters().connected_local == 1);
    const std::size_t room = cli.slot_bytes(p) - sizeof(rpc::message_header);
    for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{777}, room}) {
        const std::vector<std::byte> req = patterned(n, static_cast<unsigned>(n));
        const answer a = call(cli, p, m_echo, req);
        REQUIRE(a.status == rpc::call_status::ok);
        CHECK(a.reply == req);
    }
    // 1 MiB each way: the request stays in this process (the server reads it
    // by CMA), the reply lands in the buffer offered (written by CMA).
    std::vector<std::byte> big = patterned(std::size_t{1} << 20, 4);
    const std::uint32_t want = 1U << 20;
    std::memcpy(big.data(), &want, 4);
    std::vector<std::byte> into(want);
    const answer b = call(cli, p, m_fill, big, {.reply_into = into});
    REQUIRE(b.status == rpc::call_status::ok);
    CHECK(b.reply == patterned(want, 9));
    const answer e = call(cli, p, m_echo, big, {.reply_into = into});
    REQUIRE(e.status == rpc::call_status::ok);
    CHECK(e.reply == big);
    CHECK(cli.counters().external_bodies == 2);
    CHECK(cli.counters().completed == 6);
}

TEST_CASE("no device: a call past its deadline ends timed_out, the connection keeps calling",
          "[no-device]") {
    server_process srv;
    rpc::client cli(options());
    const rpc::peer_id p = cli.connect("127.0.0.1", srv.port);
    const std::vector<std::byte> req = patterned(32, 1);
    const auto t0 = clock_type::now();
    const answer a = call(cli, p, m_never, req, {.timeout = std::chrono::milliseconds(100)});
    const auto took = clock_type::now() - t0;
    CHECK(a.status == rpc::call_status::timed_out);
    CHECK(took >= std::chrono::milliseconds(100));
    CHECK(took < std::chrono::seconds(3));
    const answer b = call(cli, p, m_echo, req);
    REQUIRE(b.status == rpc::call_status::ok);
    CHECK(b.reply == req);
    CHECK(cli.counters().timed_out == 1);
}

TEST_CASE("no device: a server that goes away ends the calls peer_gone; one that comes back on "
          "the same port is reached again",
          "[no-device]") {
    std::optional<server_process> srv(std::in_place);
    const std::uint16_t port = srv->port;
    rpc::rpc_options o = options();
    o.reconnect_give_up = std::chrono::milliseconds(300);
    rpc::client cli(o);
    const rpc::peer_id p = cli.connect("127.0.0.1", port);
    const std::vector<std::byte> req = patterned(64, 2);
    REQUIRE(call(cli, p, m_echo, req).status == rpc::call_status::ok);
    REQUIRE(cli.start(p, m_never, req, {.cookie = 7}) == rpc::call_status::ok);
    srv.reset(); // killed: its end of the segment and socket go with it
    const auto t0 = clock_type::now();
    rpc::call_result r[1];
    int got = 0;
    while (got == 0 && clock_type::now() - t0 < std::chrono::seconds(10))
        got = cli.wait(r, std::chrono::milliseconds(5));
    REQUIRE(got == 1);
    CHECK(r[0].cookie == 7);
    CHECK(r[0].status == rpc::call_status::peer_gone);
    CHECK(clock_type::now() - t0 < std::chrono::seconds(5)); // its deadline was 10 s
    CHECK(cli.counters().reconnect_attempts > 0);            // nobody answers the name
    CHECK(cli.state(p) == rpc::peer_state::closed);
    CHECK_FALSE(cli.transport(p).has_value());
    // Where nobody serves on this node any more, connect() says so.
    const std::optional<error> gone = connect_error(cli, "127.0.0.1", port);
    REQUIRE(gone.has_value());
    CHECK_THAT(gone->what(),
               Contains("no RDMA device here") &&
                   Contains("no node-local server at 127.0.0.1:" + std::to_string(port)));
    // A server on the same port again: a new connection reaches it.
    server_process again(port);
    REQUIRE(again.port == port);
    const rpc::peer_id q = cli.connect("127.0.0.1", port);
    const answer a = call(cli, q, m_echo, req);
    REQUIRE(a.status == rpc::call_status::ok);
    CHECK(a.reply == req);
}

TEST_CASE("no device: a client names the peer and the reason when the server is not on this node",
          "[no-device]") {
    rpc::rpc_options o = options();
    o.connect_timeout = std::chrono::milliseconds(1000); // TCP: refused here, or silence
    rpc::client cli(o);
    const std::optional<error> far = connect_error(cli, "192.0.2.1", 7471);
    REQUIRE(far.has_value());
    CHECK(far->code().value() == EHOSTUNREACH);
    CHECK_THAT(far->what(), Contains("192.0.2.1:7471") && Contains("no RDMA device here") &&
                                Contains("no node-local server at 192.0.2.1:7471") &&
                                Contains("over tcp: connect(tcp)"));
    CHECK(cli.counters().connected == 0);
}

TEST_CASE("no device: a client does not hand its calls to another user's process on a "
          "server's name",
          "[no-device][squat]") {
    // The abstract namespace has no owners: any process here may take the
    // name a server would listen on before it does.
    if (::geteuid() != 0) {
        WARN("not root: no second user to squat the name with");
        return;
    }
    const auto port = static_cast<std::uint16_t>(40000 + ::getpid() % 20000);
    squatter sq(rpc::local_name("127.0.0.6", port), 65534);
    rpc::client cli(options());
    const std::optional<error> e = connect_error(cli, "127.0.0.6", port);
    REQUIRE(e.has_value());
    CHECK(e->code().value() == EHOSTUNREACH);
    CHECK_THAT(e->what(), Contains("uid 65534"));
    CHECK(sq.finish() == 0); // it got no hello
    CHECK(cli.counters().connected == 0);
}

TEST_CASE("no device: another user's process on an address's name does not hide the server on "
          "the wildcard address",
          "[no-device][squat]") {
    if (::geteuid() != 0) {
        WARN("not root: no second user to squat the name with");
        return;
    }
    server_process srv(0, "0.0.0.0");
    squatter sq(rpc::local_name("127.0.0.8", srv.port), 65534);
    rpc::client cli(options());
    const rpc::peer_id p = cli.connect("127.0.0.8", srv.port);
    CHECK(cli.transport(p) == rpc::transport::shm);
    const std::vector<std::byte> req = patterned(100, 3);
    const answer a = call(cli, p, m_echo, req);
    CHECK(a.status == rpc::call_status::ok);
    CHECK(a.reply == req);
    CHECK(sq.finish() == 0); // it got no hello
}

TEST_CASE("no device: a client does not look for a node-local server of another node's address",
          "[no-device][squat]") {
    // A name for an address not of this node is never a real server's:
    // whoever took it (here a process of this very user) is not asked.
    const auto port = static_cast<std::uint16_t>(40000 + (::getpid() + 1) % 20000);
    squatter sq(rpc::local_name("192.0.2.1", port), 0);
    rpc::client cli(options());
    const std::optional<error> e = connect_error(cli, "192.0.2.1", port);
    REQUIRE(e.has_value());
    CHECK(e->code().value() == EHOSTUNREACH);
    CHECK(sq.finish() == 0); // it got no hello
}

TEST_CASE("no device: a server whose name another user holds says who holds it",
          "[no-device][squat]") {
    if (::geteuid() != 0) {
        WARN("not root: no second user to squat the name with");
        return;
    }
    const auto port = static_cast<std::uint16_t>(40000 + (::getpid() + 2) % 20000);
    squatter sq(rpc::local_name("127.0.0.7", port), 65534);
    try {
        rpc::server s("127.0.0.7", port, options());
        FAIL("a server was made on a name another process holds");
    } catch (const error& e) {
        CHECK(e.code().value() == EADDRINUSE);
        CHECK_THAT(e.what(), Contains("127.0.0.7:" + std::to_string(port)) &&
                                 Contains("of uid 65534") &&
                                 Contains("pid " + std::to_string(sq.pid)));
    }
}

TEST_CASE("no device: what a server is given decides what it builds", "[no-device]") {
    rpc::rpc_options shm_only = options();
    shm_only.transports = rpc::transport_set{} | rpc::transport::shm;
    rpc::server any("0.0.0.0", 0, shm_only); // a wildcard: found by any address of this node
    CHECK(any.port() != 0);
    rpc::client cli(shm_only);
    {
        // The server answers the handshake from its poll: in a thread meanwhile.
        std::atomic<bool> stop{false};
        std::thread serve([&] {
            while (!stop.load())
                (void)any.wait(std::chrono::milliseconds(2));
        });
        std::optional<rpc::peer_id> p;
        try {
            p = cli.connect("127.0.0.1", any.port());
        } catch (...) {
        }
        stop = true;
        serve.join();
        REQUIRE(p.has_value());
        CHECK(cli.transport(*p) == rpc::transport::shm);
    }
    // Another server here on the same name is refused; so is an address
    // this node does not have.
    CHECK_THROWS_AS(rpc::server("0.0.0.0", any.port(), options()), error);
    try {
        rpc::server elsewhere("192.0.2.1", 0, options());
        FAIL("a server on an address of another node");
    } catch (const error& e) {
        CHECK(e.code().value() == EADDRNOTAVAIL);
        CHECK_THAT(e.what(), Contains("not an address of this node"));
    }
    // Nothing left to use: refused at construction, saying why.
    rpc::rpc_options rdma_only = options();
    rdma_only.transports = rpc::transport_set{} | rpc::transport::rdma;
    rpc::rpc_options local_off = options();
    local_off.local = false;
    local_off.transports = rpc::transport_set{} | rpc::transport::rdma | rpc::transport::shm;
    for (const rpc::rpc_options& o : {rdma_only, local_off}) {
        CHECK_THROWS_WITH(rpc::server("127.0.0.1", 0, o), Contains("no transport"));
        CHECK_THROWS_WITH(rpc::client(o), Contains("no transport"));
    }
    rpc::rpc_options none = options();
    none.transports = {};
    CHECK_THROWS_WITH(rpc::client(none), Contains("transports"));
}

TEST_CASE("no device: a server group serves clients on this node and over TCP from its workers",
          "[no-device][group]") {
    rpc::server_group g("127.0.0.1", 0, 2, options());
    REQUIRE(g.port() != 0);
    g.on(m_echo, [](rpc::request_context& c) { c.reply(c.body()); });
    g.start();
    // Two clients (one thread each, as clients are): the group spreads
    // them over its workers; every reply is the caller's own.
    std::vector<std::thread> callers;
    std::atomic<int> good{0};
    for (unsigned k = 0; k < 2; ++k)
        callers.emplace_back([&, k] {
            rpc::client cli(options());
            const rpc::peer_id p = cli.connect("127.0.0.1", g.port());
            if (cli.transport(p) != rpc::transport::shm)
                return;
            for (unsigned i = 0; i < 50; ++i) {
                const std::vector<std::byte> req = patterned(100 + i, k * 100 + i);
                const rpc::call_result r = cli.call(p, m_echo, req);
                if (r.status == rpc::call_status::ok &&
                    std::equal(r.reply.begin(), r.reply.end(), req.begin(), req.end()))
                    ++good;
            }
        });
    // And one over TCP (as a client on another node would come).
    callers.emplace_back([&] {
        rpc::rpc_options o = options();
        o.transports = rpc::transport_set{} | rpc::transport::tcp;
        rpc::client cli(o);
        const rpc::peer_id p = cli.connect("127.0.0.1", g.port());
        if (cli.transport(p) != rpc::transport::tcp)
            return;
        for (unsigned i = 0; i < 50; ++i) {
            const std::vector<std::byte> req = patterned(5000 + i, 300 + i); // over a slot
            std::vector<std::byte> into(req.size());
            const rpc::call_result r = cli.call(p, m_echo, req, {.reply_into = into});
            if (r.status == rpc::call_status::ok &&
                std::equal(r.reply.begin(), r.reply.end(), req.begin(), req.end()))
                ++good;
        }
    });
    for (std::thread& t : callers)
        t.join();
    CHECK(good.load() == 150);
    const rpc::rpc_counters c = g.counters();
    CHECK(c.calls == 150);
    CHECK(c.connected == 3);
    CHECK(c.connected_local == 2);
    CHECK(c.connected_tcp == 1);
    CHECK(g.drain(std::chrono::seconds(5)));
}
