// RPC on one node under Yama's ptrace_scope 1, where a process may use CMA
// only on its descendants or on a process that allowed it. Server and
// clients run in sibling processes as nobody (root may attach anywhere), so
// the server may not reach a client's memory unless the client grants it
// (rpc_options::ptracer). With the grant the connection is node-local and
// large bodies and replies move by CMA; without, the client says why and
// takes the device. The test sets the scope to 1 and puts it back; it needs
// root and Yama (SKIP otherwise).
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <grp.h>
#include <optional>
#include <poll.h>
#include <string>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/rpc/client.hpp>
#include <rdmax/rpc/server.hpp>
#include <rdmax/verbs/protection_domain.hpp>

#include "../support/catch.hpp"
#include "../support/child_process.hpp"
#include "../support/skip_reason.hpp"
#include "../support/test_device.hpp"

using namespace rdmax;
using namespace rdmax::test;
using namespace std::chrono_literals;

namespace {

constexpr const char* scope_file = "/proc/sys/kernel/yama/ptrace_scope";
constexpr std::uint16_t m_sum = 7; // replies with 8 bytes of the body's sum, then N bytes asked

int read_scope() {
    int v = -1;
    std::ifstream(scope_file) >> v;
    return v;
}
bool write_scope(int v) {
    std::ofstream f(scope_file);
    f << v;
    f.flush();
    return static_cast<bool>(f);
}

/// Yama's scope at 1 while it lives, as it was after.
struct scope_one {
    int before = read_scope();
    scope_one() {
        if (!write_scope(1) || read_scope() != 1)
            throw std::runtime_error("cannot set kernel.yama.ptrace_scope to 1");
    }
    ~scope_one() { (void)write_scope(before); }
    scope_one(const scope_one&) = delete;
    scope_one& operator=(const scope_one&) = delete;
};

std::string address() {
    return test_address().value_or("127.0.0.1");
}

/// Becomes an ordinary user (nobody), as two services would be: root may
/// attach to anything whatever the scope (CAP_SYS_PTRACE), and a process
/// that keeps fewer capabilities than another may not attach to it either.
/// Memory locking stays unlimited (registrations pin pages), and the
/// process stays dumpable (a uid change clears that, and a process that is
/// not dumpable cannot be attached to at all).
bool become_nobody() {
    const rlimit unlimited{RLIM_INFINITY, RLIM_INFINITY};
    return setrlimit(RLIMIT_MEMLOCK, &unlimited) == 0 && setgroups(0, nullptr) == 0 &&
           setresgid(65534, 65534, 65534) == 0 && setresuid(65534, 65534, 65534) == 0 &&
           prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) == 0;
}

/// The server, in a child process run as nobody: answers m_sum until the
/// test closes the pipe. On `on_port` (0: a free port).
pid_t start_server(int& port_fd, int& stop_fd, std::uint16_t on_port = 0) {
    int port_pipe[2], stop_pipe[2];
    if (pipe(port_pipe) != 0 || pipe(stop_pipe) != 0)
        throw std::runtime_error("pipe");
    const pid_t pid = spawn([&] {
        close(port_pipe[0]);
        close(stop_pipe[1]);
        if (!become_nobody())
            return 4;
        verbs::context ctx = open_test_device();
        verbs::protection_domain pd(ctx);
        rpc::rpc_options o;
        o.slots = 8;
        rpc::server s(pd, address(), on_port, o);
        std::vector<std::byte> rep;
        s.on(m_sum, [&rep](rpc::request_context& c) {
            std::uint64_t sum = 0;
            for (const std::byte b : c.body())
                sum += std::to_integer<std::uint8_t>(b);
            std::uint32_t want = 0;
            if (c.body().size() >= 4)
                std::memcpy(&want, c.body().data(), 4);
            rep.resize(8 + want);
            std::memcpy(rep.data(), &sum, 8);
            for (std::size_t i = 8; i < rep.size(); ++i)
                rep[i] = static_cast<std::byte>(i % 251);
            c.reply(rep);
        });
        const std::uint16_t port = s.port();
        if (write(port_pipe[1], &port, sizeof port) != sizeof port)
            return 2;
        const auto deadline = std::chrono::steady_clock::now() + 120s;
        for (;;) {
            (void)s.wait(2ms);
            std::array<pollfd, 1> p{{{stop_pipe[0], POLLIN, 0}}};
            if (poll(p.data(), 1, 0) == 1)
                return 0; // the parent is done (or gone)
            if (std::chrono::steady_clock::now() > deadline)
                return 3;
        }
    });
    close(port_pipe[1]);
    close(stop_pipe[0]);
    port_fd = port_pipe[0];
    stop_fd = stop_pipe[1];
    return pid;
}

/// Waits up to 30 s for a byte on `fd`.
bool byte_within_30s(int fd) {
    pollfd p{fd, POLLIN, 0};
    char c = 0;
    return poll(&p, 1, 30'000) == 1 && read(fd, &c, 1) == 1;
}

/// A call with a body and a reply over a slot (CMA on the node-local path), checked.
bool big_call(rpc::client& c, rpc::peer_id p) {
    std::vector<std::byte> req(200'000);
    for (std::size_t i = 0; i < req.size(); ++i)
        req[i] = static_cast<std::byte>((i * 7) % 256);
    const std::uint32_t want = 50'000;
    std::memcpy(req.data(), &want, 4);
    std::uint64_t sum = 0;
    for (const std::byte b : req)
        sum += std::to_integer<std::uint8_t>(b);
    std::vector<std::byte> into(64 * 1024);
    const rpc::call_result r = c.call(p, m_sum, req, {.reply_into = into});
    if (r.status != rpc::call_status::ok || r.reply.size() != 8 + want)
        return false;
    std::uint64_t got = 0;
    std::memcpy(&got, r.reply.data(), 8);
    for (std::size_t i = 8; i < r.reply.size(); ++i)
        if (r.reply[i] != static_cast<std::byte>(i % 251))
            return false;
    return got == sum;
}

} // namespace

std::optional<std::string> rdmax::test::skip_reason() {
    // The device is looked at in a child: librdmacm keeps the device files it
    // opens for the process, and a child that inherited them as root could
    // not use them as nobody (the kernel refuses a uverbs file opened under
    // other credentials).
    int fds[2];
    if (pipe(fds) != 0)
        return std::string("pipe");
    const pid_t probe = spawn([&] {
        const auto why = device_unavailable();
        const std::string text = why.value_or("");
        return ::write(fds[1], text.data(), text.size()) == static_cast<ssize_t>(text.size()) ? 0
                                                                                              : 1;
    });
    close(fds[1]);
    std::string why(512, '\0');
    const ssize_t n = ::read(fds[0], why.data(), why.size());
    close(fds[0]);
    if (reap(probe) != 0)
        return std::string("the device probe failed");
    if (n > 0)
        return why.substr(0, static_cast<std::size_t>(n));
    if (read_scope() < 0)
        return std::string("no Yama here (") + scope_file + ")";
    if (geteuid() != 0)
        return std::string("setting ") + scope_file + " needs root";
    return std::nullopt;
}

/// A client in a child process run as nobody (a sibling of the server:
/// neither descends from the other). Exit 0: local as expected and the
/// call's bytes right; 2: the wrong path; 3: the call failed.
int client_run(std::uint16_t port, rpc::rpc_options::ptracer_grant grant, bool want_local) {
    return reap(spawn([&] {
        if (!become_nobody())
            return 4;
        verbs::context ctx = open_test_device();
        verbs::protection_domain pd(ctx);
        rpc::rpc_options o;
        o.ptracer = grant;
        rpc::client c(pd, o);
        const rpc::peer_id p = c.connect(address(), port);
        if (c.is_local(p) != want_local)
            return 2;
        if (!big_call(c, p) || c.counters().external_bodies != 1)
            return 3;
        return 0;
    }));
}

TEST_CASE("Yama scope 1: a client grants its node-local server CMA, or takes the device") {
    scope_one yama;
    int port_fd = -1, stop_fd = -1;
    const pid_t server = start_server(port_fd, stop_fd);
    std::uint16_t port = 0;
    REQUIRE(read(port_fd, &port, sizeof port) == sizeof port);
    using grant = rpc::rpc_options::ptracer_grant;
    // No grant: the server may not reach the client's memory: the device.
    CHECK(client_run(port, grant::off, false) == 0);
    // The grant to the server's process: node-local, body and reply by CMA.
    CHECK(client_run(port, grant::peer, true) == 0);
    // Any process of the user.
    CHECK(client_run(port, grant::any, true) == 0);
    close(stop_fd);
    CHECK(reap(server) == 0);
    close(port_fd);
}

TEST_CASE("Yama scope 1: a client grants a node-local server restarted on its port CMA again") {
    scope_one yama;
    int port_fd = -1, stop_fd = -1;
    const pid_t first = start_server(port_fd, stop_fd);
    std::uint16_t port = 0;
    REQUIRE(read(port_fd, &port, sizeof port) == sizeof port);
    close(port_fd);
    int called[2], restarted[2];
    REQUIRE(pipe(called) == 0);
    REQUIRE(pipe(restarted) == 0);
    // The client, as nobody (a sibling of both servers): exit 0 when its
    // calls went node-local to the first server and, once that one is
    // gone, to the second on the same port; 5: the second took the device.
    const pid_t client = spawn([&] {
        close(stop_fd); // the first server stops when the test alone closes it
        close(called[0]);
        close(restarted[1]);
        if (!become_nobody())
            return 4;
        verbs::context ctx = open_test_device();
        verbs::protection_domain pd(ctx);
        rpc::rpc_options o;
        o.ptracer = rpc::rpc_options::ptracer_grant::peer;
        o.reconnect_backoff = 10ms;
        o.reconnect_backoff_max = 100ms;
        rpc::client c(pd, o);
        const rpc::peer_id p = c.connect(address(), port);
        if (!c.is_local(p))
            return 2;
        if (!big_call(c, p))
            return 3;
        if (write(called[1], "c", 1) != 1 || !byte_within_30s(restarted[0]))
            return 4;
        // The first server is gone: wait for the connection to its successor.
        const auto until = std::chrono::steady_clock::now() + 30s;
        std::array<rpc::call_result, 1> r;
        while (std::chrono::steady_clock::now() < until &&
               (c.counters().reconnects == 0 || !c.connected(p)))
            (void)c.wait(r, 10ms);
        if (!c.connected(p))
            return 6;
        if (!c.is_local(p))
            return 5;
        return big_call(c, p) ? 0 : 3;
    });
    close(called[1]);
    close(restarted[0]);
    REQUIRE(byte_within_30s(called[0]));
    close(stop_fd);
    CHECK(reap(first) == 0);
    const pid_t second = start_server(port_fd, stop_fd, port);
    std::uint16_t again = 0;
    REQUIRE(read(port_fd, &again, sizeof again) == sizeof again);
    CHECK(again == port);
    REQUIRE(write(restarted[1], "r", 1) == 1);
    CHECK(reap(client, 90s) == 0);
    close(stop_fd);
    CHECK(reap(second) == 0);
    close(port_fd);
    close(called[0]);
    close(restarted[1]);
}
