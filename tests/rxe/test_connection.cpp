// rdma_cm connections: payload exchange, data over them, clean disconnect,
// refusals and deadlines, and a peer that vanishes.
#include <cstdlib>
#include <cstring>
#include <future>
#include <signal.h> // NOLINT(modernize-deprecated-headers): kill() is POSIX, not <csignal>
#include <spawn.h>
#include <string>
#include <sys/wait.h>
#include <unistd.h>

#include "../support/loopback.hpp"

extern char** environ;

using namespace rdmax;
using namespace rdmax::test;
using clock_type = std::chrono::steady_clock;

namespace {

std::string test_addr() {
    return test_address().value_or("192.0.2.1");
}

struct hello {
    std::uint32_t magic;
    std::uint32_t rank;
};

/// The rxe_peer program (RDMAX_TEST_PEER, set by meson) connecting to this
/// process from another one; killed and reaped however the test ends.
class peer_process {
public:
    peer_process(const std::string& addr, std::uint16_t port) {
        const char* peer = std::getenv("RDMAX_TEST_PEER");
        REQUIRE(peer != nullptr);
        const std::string port_text = std::to_string(port);
        char* args[] = {const_cast<char*>(peer), const_cast<char*>(addr.c_str()),
                        const_cast<char*>(port_text.c_str()), nullptr};
        REQUIRE(posix_spawn(&pid_, peer, nullptr, nullptr, args, environ) == 0);
    }
    peer_process(const peer_process&) = delete;
    peer_process& operator=(const peer_process&) = delete;
    ~peer_process() { kill_now(); }

    /// SIGKILL, and wait until it is gone.
    void kill_now() {
        if (pid_ <= 0)
            return;
        kill(pid_, SIGKILL);
        waitpid(pid_, nullptr, 0);
        pid_ = 0;
    }

private:
    pid_t pid_ = 0;
};

} // namespace

TEST_CASE("a device opens by the IP address of its port") {
    std::uint8_t port = 0;
    verbs::context ctx = verbs::context::open_by_address(test_addr(), &port);
    CHECK(port == 1);
    if (auto name = std::getenv("RDMAX_TEST_DEVICE"))
        CHECK(ctx.name() == name);
    CHECK_THROWS_WITH(verbs::context::open_by_address("not-an-ip"),
                      Catch::Matchers::Contains("not an IP address"));
    CHECK_THROWS_AS(verbs::context::open_by_address("203.0.113.77"), rdmax::error);
}

TEST_CASE("connect and accept exchange payloads; data flows; disconnect reaches the peer") {
    verbs::listener l(test_addr(), 0);
    REQUIRE(l.port() != 0);
    verbs::context ctx = l.device();
    verbs::protection_domain pd(ctx);
    registered server_mem(pd, 8192), client_mem(pd, 8192);
    const remote_buffer<all_rights> server_token = server_mem.mr.remote();

    auto accepted = std::async(
        std::launch::async, [&] { return l.accept(pd, verbs::payload_of(server_token), {}, 10s); });
    const hello hi{0x72646d78, 3};
    verbs::connection client =
        verbs::connection::connect(pd, test_addr(), l.port(), verbs::payload_of(hi), {}, 10s);
    verbs::connection server = accepted.get();

    auto got_hi = server.peer_payload_as<hello>();
    REQUIRE(got_hi.has_value());
    CHECK(got_hi->magic == 0x72646d78);
    CHECK(got_hi->rank == 3);
    auto token = client.peer_payload_as<remote_buffer<all_rights>>();
    REQUIRE(token.has_value());
    CHECK(token->addr == server_token.addr);
    CHECK(token->rkey == server_token.rkey);
    CHECK(!client.peer_payload_as<hello>().has_value()); // wrong size: refused, not misread

    fill_pattern(client_mem.bytes, 17);
    REQUIRE(client.qp().write(client_mem.mr.local(), *token, 0, 1) == status::ok);
    CHECK(wait_send(client.qp()).ok());
    CHECK(has_pattern(server_mem.bytes, 17));

    // Send and receive over the connection, both ways.
    REQUIRE(server.qp().post_recv(server_mem.mr.local(0, 64), 5) == status::ok);
    REQUIRE(client.qp().send(client_mem.mr.local(0, 64), 6) == status::ok);
    CHECK(wait_send(client.qp()).ok());
    CHECK(wait_recv(server.qp()).wr_id == 5);

    CHECK(!server.peer_disconnected());
    const auto t0 = clock_type::now();
    client.disconnect(0ms);              // the request, without waiting for the answer
    CHECK(server.wait_disconnected(5s)); // seen, and answered
    CHECK(client.wait_disconnected(5s)); // the answer came back
    // Unanswered, the request would end at its own timeout, over 5 s on rxe.
    CHECK(clock_type::now() - t0 < 3s);
}

TEST_CASE("a payload larger than the private data is refused before connecting") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    std::vector<std::byte> big(verbs::max_connect_payload + 1);
    CHECK_THROWS_WITH(verbs::connection::connect(pd, test_addr(), 1, big),
                      Catch::Matchers::Contains("at most 55"));
}

TEST_CASE("connecting where nobody listens fails within the deadline") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    const auto t0 = clock_type::now();
    CHECK_THROWS_AS(verbs::connection::connect(pd, test_addr(), 1, {}, {}, 5s), rdmax::error);
    CHECK(clock_type::now() - t0 < 6s);
}

TEST_CASE("accept gives up at its deadline") {
    verbs::listener l(test_addr(), 0);
    verbs::context ctx = l.device();
    verbs::protection_domain pd(ctx);
    const auto t0 = clock_type::now();
    CHECK_THROWS_WITH(l.accept(pd, {}, {}, 300ms), Catch::Matchers::Contains("deadline"));
    CHECK(clock_type::now() - t0 >= 250ms);
    CHECK(clock_type::now() - t0 < 3s);
}

TEST_CASE("a peer process that vanishes becomes an error here within the deadline") {
    verbs::listener l(test_addr(), 0);
    verbs::context ctx = l.device();
    verbs::protection_domain pd(ctx);
    registered mem(pd, 4096);
    peer_process peer(test_addr(), l.port());

    verbs::connection c = l.accept(pd, {}, {}, 20s);
    auto token = c.peer_payload_as<remote_buffer<rights::local_write | rights::remote_write>>();
    REQUIRE(token.has_value());
    REQUIRE(c.qp().write(mem.mr.local(0, 64), *token, 0, 1) == status::ok);
    CHECK(wait_send(c.qp()).ok()); // the peer is alive: the write lands

    peer.kill_now();
    const auto t0 = clock_type::now();
    CHECK(c.wait_disconnected(20s)); // the kernel tore the dead peer's connection down
    CHECK(clock_type::now() - t0 < 20s);

    // The QP is in the error state now: new work is refused at once.
    CHECK(c.qp().state() == IBV_QPS_ERR);
    CHECK(c.qp().write(mem.mr.local(0, 64), *token, 0, 2) == status::not_connected);
}

TEST_CASE("work in flight when the peer vanishes completes with an error, not a hang") {
    verbs::listener l(test_addr(), 0);
    verbs::context ctx = l.device();
    verbs::protection_domain pd(ctx);
    registered mem(pd, 4096);
    peer_process peer(test_addr(), l.port());
    verbs::qp_config cfg;
    cfg.ack_timeout = 12; // 16.8 ms per try
    cfg.retry_count = 3;
    verbs::connection c = l.accept(pd, {}, cfg, 20s);
    auto token = c.peer_payload_as<remote_buffer<rights::local_write | rights::remote_write>>();
    REQUIRE(token.has_value());

    // Kill the peer, then write before this side hears of it: nothing acks.
    peer.kill_now();
    const status s = c.qp().write(mem.mr.local(0, 64), *token, 0, 3);
    if (s == status::ok) {
        verbs::completion done[1];
        const auto t0 = clock_type::now();
        REQUIRE(c.wait_send(done, 30s) == 1);
        CHECK(clock_type::now() - t0 < 30s);
        CHECK(!done[0].ok());
        CHECK((done[0].status == IBV_WC_RETRY_EXC_ERR || done[0].status == IBV_WC_WR_FLUSH_ERR));
    } else {
        CHECK(s == status::not_connected); // the disconnect was seen first
    }
}
