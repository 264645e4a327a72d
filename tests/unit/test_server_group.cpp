// rpc::server_group without a device: clients on this node reach the group
// through its node-local path (shared segments, eventfds, CMA), which needs
// no RDMA device, so real threads run real calls here, also under TSan. The
// group is built through group_test_access with no device (no rdma_cm
// listener); its acceptor, mailboxes, workers and their servers are the
// library's own.
//
// No lock on the call path: in the plain build this program interposes
// pthread_mutex_lock / trylock and pthread_rwlock_rdlock / wrlock and counts
// them per thread, on the workers' threads (marked by on_thread_start) and
// on the clients' threads, over 10^4 calls after a warm-up. Sanitizer
// runtimes intercept the same functions, so the counting is left out of
// those builds (the test case that asserts it is not compiled there).

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <dlfcn.h>
#include <memory>
#include <pthread.h>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <rdmax/rpc/server_group.hpp>

#include "../support/catch.hpp"
#include "../support/counting_new.hpp"
#include "../support/eventually.hpp"
#include "../support/fake_link.hpp"
#include "../support/group_test_access.hpp"
#include "../support/rpc_unit.hpp"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define RDMAX_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define RDMAX_TEST_SANITIZED 1
#endif
#endif

using namespace rdmax;
using namespace rdmax::test::rpc_unit;

namespace {

/// Lock acquisitions by threads that asked to be counted.
std::atomic<std::uint64_t> worker_locks{0};
std::atomic<std::uint64_t> client_locks{0};
enum class counted : std::uint8_t { no, worker, client };
thread_local counted counting = counted::no;
thread_local int worker_index = -1;

[[maybe_unused]] void count_lock() noexcept {
    if (counting == counted::worker)
        worker_locks.fetch_add(1, std::memory_order_relaxed);
    else if (counting == counted::client)
        client_locks.fetch_add(1, std::memory_order_relaxed);
}

/// What each interposer (below) does, written once: counts the acquisition,
/// then forwards to the next definition of `name` (libc's), looked up on the
/// first call. `Self`, the interposer, gives each its own lookup and the
/// function type to call it by.
template <auto Self, class Lock>
int count_then_forward(const char* name, Lock* lock) {
    static const auto next = reinterpret_cast<decltype(Self)>(::dlsym(RTLD_NEXT, name));
    count_lock();
    return next(lock);
}

constexpr std::uint16_t echo = 1; ///< replies with the worker's index, then the body

rpc::rpc_options options() {
    rpc::rpc_options o;
    o.slots = 8;
    o.slot_bytes = 256;
    o.local = true;
    o.call_timeout = 20s;
    o.connect_timeout = 5s;
    o.housekeeping = 2ms;
    // The reply cache allocates an entry's room the first time round its
    // ring of calls: a warm-up past it leaves every entry sized.
    o.reply_cache_calls = 64;
    return o;
}

/// A name of this program's own on the node-local path.
std::uint16_t unique_port() {
    return static_cast<std::uint16_t>(20000 + (::getpid() % 20000));
}

std::unique_ptr<rpc::server_group> make_group(std::size_t threads, std::uint16_t port) {
    auto g = rpc::group_test_access::make("127.0.0.3", port, threads, options());
    g->on(echo, [](rpc::request_context& c) {
        std::byte out[256];
        out[0] = static_cast<std::byte>(worker_index);
        const std::size_t n = std::min(c.body().size(), sizeof out - 1);
        std::memcpy(out + 1, c.body().data(), n);
        c.reply({out, n + 1});
    });
    g->on_thread_start([](std::size_t w) {
        worker_index = static_cast<int>(w);
        counting = counted::worker;
    });
    return g;
}

/// One call of `c` on `p`; the worker that answered, or -1 on a wrong reply.
int echo_call(rpc::client& c, peer_id p, std::uint32_t i) {
    std::uint32_t body[4] = {i, ~i, i * 7U, 42};
    const rpc::call_result r = c.call(p, echo, std::as_bytes(std::span(body)));
    if (r.status != call_status::ok || r.reply.size() != sizeof body + 1 ||
        std::memcmp(r.reply.data() + 1, body, sizeof body) != 0)
        return -1;
    return static_cast<int>(r.reply[0]);
}

/// 4 clients on their own threads, `calls` each after `warm` warm-up calls;
/// what each saw and what was counted in the measured window.
struct run_result {
    std::vector<int> worker_of; ///< per client: the one worker it saw (-1: several, or wrong)
    std::uint64_t worker_locks = 0, client_locks = 0, allocations = 0;
    bool finished = false;
};

run_result run_clients(std::uint16_t port, std::size_t clients, std::uint32_t warm,
                       std::uint32_t calls) {
    run_result out;
    out.worker_of.assign(clients, -2);
    std::atomic<std::size_t> ready{0}, done{0};
    std::atomic<bool> go{false}, leave{false};
    std::vector<std::thread> threads;
    for (std::size_t k = 0; k < clients; ++k)
        threads.emplace_back([&, k] {
            auto cli = inside::make_client(options());
            const peer_id p = cli->connect("127.0.0.3", port);
            int seen = echo_call(*cli, p, 0);
            for (std::uint32_t i = 1; i < warm; ++i)
                if (echo_call(*cli, p, i) != seen)
                    seen = -1;
            ready.fetch_add(1);
            while (!go.load())
                std::this_thread::yield();
            counting = counted::client;
            for (std::uint32_t i = 0; i < calls; ++i)
                if (echo_call(*cli, p, i) != seen)
                    seen = -1;
            counting = counted::no;
            out.worker_of[k] = seen;
            done.fetch_add(1);
            // Kept until the window closed: a client that goes ends its
            // connection, and that (not a call) may take locks.
            while (!leave.load())
                std::this_thread::yield();
        });
    const bool all_ready = test::eventually([&] { return ready.load() == clients; }, 30s);
    const std::uint64_t w0 = worker_locks.load(), c0 = client_locks.load();
    const std::uint64_t a0 = test::allocations.load();
    go.store(true);
    out.finished = all_ready && test::eventually([&] { return done.load() == clients; }, 120s);
    out.worker_locks = worker_locks.load() - w0;
    out.client_locks = client_locks.load() - c0;
    out.allocations = test::allocations.load() - a0;
    leave.store(true);
    for (std::thread& t : threads)
        t.join();
    return out;
}

/// How many clients each of the two workers answered, for the test cases
/// that spread 4 clients over 2 workers; REQUIREs that each client saw one.
std::array<int, 2> clients_per_worker(const run_result& r) {
    std::array<int, 2> n = {0, 0};
    for (int w : r.worker_of) {
        REQUIRE((w == 0 || w == 1));
        ++n[static_cast<std::size_t>(w)];
    }
    return n;
}

} // namespace

#ifndef RDMAX_TEST_SANITIZED
// The interposers: the program's own definitions come before libc's in the
// lookup, also for the library's calls; each forwards to the next (libc).
extern "C" {
int pthread_mutex_lock(pthread_mutex_t* m) {
    return count_then_forward<&pthread_mutex_lock>("pthread_mutex_lock", m);
}
int pthread_mutex_trylock(pthread_mutex_t* m) {
    return count_then_forward<&pthread_mutex_trylock>("pthread_mutex_trylock", m);
}
int pthread_rwlock_rdlock(pthread_rwlock_t* l) {
    return count_then_forward<&pthread_rwlock_rdlock>("pthread_rwlock_rdlock", l);
}
int pthread_rwlock_wrlock(pthread_rwlock_t* l) {
    return count_then_forward<&pthread_rwlock_wrlock>("pthread_rwlock_wrlock", l);
}
}

TEST_CASE("server_group: the counting hook sees a lock taken on a counted thread") {
    // Shows the hook works (else a count of 0 below would prove nothing):
    // a std::mutex, which locks through pthread_mutex_lock.
    std::mutex m;
    counting = counted::client;
    const std::uint64_t before = client_locks.load();
    { const std::lock_guard<std::mutex> hold(m); }
    counting = counted::no;
    CHECK(client_locks.load() - before == 1);
}

TEST_CASE("server_group: 4 clients x 2 workers, 10^4 calls, no lock and no allocation on the "
          "call path") {
    const std::uint16_t port = unique_port();
    auto g = make_group(2, port);
    g->start();
    const run_result r = run_clients(port, 4, 200, 2500);
    REQUIRE(r.finished);
    INFO("locks on the workers' threads " << r.worker_locks << ", on the clients' "
                                          << r.client_locks << ", allocations " << r.allocations);
    CHECK(r.worker_locks == 0);
    CHECK(r.client_locks == 0);
    CHECK(r.allocations == 0);
    // Spread: two connections each; each client answered by one worker.
    const std::array<int, 2> per_worker = clients_per_worker(r);
    CHECK(per_worker[0] == 2);
    CHECK(per_worker[1] == 2);
    CHECK(g->counters().calls == 4U * 2700U);
    CHECK(g->counters(0).calls + g->counters(1).calls == 4U * 2700U);
    CHECK(g->stop(5s));
}
#endif

TEST_CASE("server_group: 4 clients x 2 workers, handlers on their connection's worker") {
    // The sanitizers' run of the same traffic (fewer calls under TSan).
    const auto port = static_cast<std::uint16_t>(unique_port() + 1);
    auto g = make_group(2, port);
    g->start();
    const run_result r = run_clients(port, 4, 20, 500);
    REQUIRE(r.finished);
    const std::array<int, 2> per_worker = clients_per_worker(r);
    CHECK(per_worker[0] == 2);
    CHECK(per_worker[1] == 2);
    // The clients are gone with their threads: each worker saw its two go.
    CHECK(test::eventually([&] { return g->peers() == 0; }));
    const rpc::rpc_counters sum = g->counters();
    CHECK(sum.calls == 4U * 520U);
    CHECK(sum.connected == 4);
    CHECK(sum.disconnected == 4);
    CHECK(g->counters(0).connected == 2);
    CHECK(g->counters(1).connected == 2);
    CHECK(g->cpu_time(0).count() > 0);
    CHECK(g->cpu_time(1).count() > 0);
    CHECK(g->drain(5s));
}

TEST_CASE("server_group: a client that reconnects goes back to the worker with its replies") {
    const auto port = static_cast<std::uint16_t>(unique_port() + 2);
    auto g = make_group(2, port);
    g->start();
    auto connect = [&] {
        auto c = inside::make_client(options());
        const peer_id p = c->connect("127.0.0.3", port);
        return std::pair{std::move(c), p};
    };
    // x -> 0, a -> 1, y -> 0, z -> 1, w -> 1 after a left: loads 2 and 2.
    auto [x, px] = connect();
    auto [a, pa] = connect();
    auto [y, py] = connect();
    auto [z, pz] = connect();
    CHECK(echo_call(*x, px, 1) == 0);
    CHECK(echo_call(*a, pa, 1) == 1);
    CHECK(echo_call(*y, py, 1) == 0);
    CHECK(echo_call(*z, pz, 1) == 1);
    a->disconnect(pa);
    REQUIRE(test::eventually([&] { return g->peers(1) == 1; }));
    auto [w, pw] = connect();
    CHECK(echo_call(*w, pw, 1) == 1);
    REQUIRE(test::eventually([&] { return g->peers(1) == 2; }));
    // Loads 2 and 2: a new client would go to worker 0; `a` goes back to 1.
    const peer_id again = a->connect("127.0.0.3", port);
    CHECK(echo_call(*a, again, 2) == 1);
    auto [n, pn] = connect();
    CHECK(echo_call(*n, pn, 1) == 0);
    CHECK(g->stop(5s));
}

TEST_CASE("server_group: refuses what it cannot do, with why") {
    CHECK_THROWS_WITH(rpc::group_test_access::make("127.0.0.3", unique_port(), 0, options()),
                      Catch::Matchers::Contains("0 worker threads asked"));
    const auto port = static_cast<std::uint16_t>(unique_port() + 3);
    auto g = make_group(1, port);
    g->start();
    CHECK_THROWS_WITH(g->on(2, [](rpc::request_context&) {}),
                      Catch::Matchers::Contains("before start()"));
    CHECK(g->stop(5s));
}
