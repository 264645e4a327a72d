// sched::async_scheduler (include/rdmax/asio/scheduler.hpp) on the device:
// coroutines await a sliced write, a read and a send through a real queue
// pair and check every byte; an urgent write awaited beside a bulk one
// completes first; a request the scheduler refuses ends with the refusal as
// its error; no allocation per awaited request once warm. (The unit suite
// covers the rest on the simulated queue: throwing handlers, the idle
// timer, the adapter going with requests out.)
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <system_error>
#include <vector>

#include <rdmax/asio/scheduler.hpp>
#include <rdmax/sched/priority_scheduler.hpp>
#include <rdmax/status_error.hpp>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference"
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/use_awaitable.hpp>
#pragma GCC diagnostic pop

#include "../support/counting_new.hpp"
#include "../support/loopback.hpp"

using namespace rdmax;
using namespace rdmax::test;
namespace sched = rdmax::sched;

namespace {

constexpr std::uint32_t KiB = 1024;
constexpr std::uint32_t MiB = 1024 * KiB;

using scheduler = sched::priority_scheduler<>;
using adapter = sched::async_scheduler<scheduler>;

/// Small slices, so that the transfers here really are cut.
sched::scheduler_options small_slices() {
    sched::scheduler_options o;
    o.small_slice = 4 * KiB;
    o.large_slice = 64 * KiB;
    o.budget_bytes = 64 * KiB;
    o.budget_wqes = 16;
    o.max_requests = 256;
    return o;
}

/// Runs the context until `done()` or 30 s pass (then the test fails).
template <class P>
bool run_until(asio::io_context& io, P done) {
    const auto end = std::chrono::steady_clock::now() + 30s;
    while (!done() && std::chrono::steady_clock::now() < end) {
        io.restart();
        (void)io.run_for(10ms);
    }
    return done();
}

} // namespace

TEST_CASE("async_scheduler (device): a coroutine awaits a sliced write, a read and a send") {
    loopback lp;
    scheduler s(lp.a, small_slices());
    asio::io_context io(1);
    adapter a(io, s);
    const std::uint32_t len = 4 * MiB + 123; // not a multiple of any slice
    registered src(lp.pd, len), dst(lp.pd, len), back(lp.pd, len), rbuf(lp.pd, 64 * KiB);
    fill_pattern(src.bytes, 41);
    REQUIRE(lp.b.post_recv(rbuf.mr.local(), 7) == status::ok);

    std::vector<verbs::completion> got;
    bool finished = false;
    asio::co_spawn(
        io,
        [&]() -> asio::awaitable<void> {
            got.push_back(co_await a.async_write(sched::bulk, src.mr.local(), dst.mr.remote(), 0,
                                                 asio::use_awaitable));
            got.push_back(co_await a.async_read(sched::normal, back.mr.local(), dst.mr.remote(), 0,
                                                asio::use_awaitable));
            got.push_back(
                co_await a.async_send(sched::urgent, src.mr.local(0, 3000), asio::use_awaitable));
            finished = true;
        },
        asio::detached);
    REQUIRE(run_until(io, [&] { return finished; }));

    REQUIRE(got.size() == 3);
    CHECK(got[0].ok());
    CHECK(got[0].opcode == IBV_WC_RDMA_WRITE);
    CHECK(got[0].byte_len == len);
    CHECK(got[1].ok());
    CHECK(got[1].opcode == IBV_WC_RDMA_READ);
    CHECK(got[2].ok());
    CHECK(got[2].opcode == IBV_WC_SEND);
    CHECK(has_pattern(dst.bytes, 41));
    CHECK(has_pattern(back.bytes, 41));
    const verbs::completion r = wait_recv(lp.b);
    CHECK(r.ok());
    CHECK(r.byte_len == 3000);
    CHECK(has_pattern(std::span(rbuf.bytes).first(3000), 41));
    CHECK(a.outstanding() == 0);
    CHECK(s.counters().slices >= len / (64 * KiB)); // really sliced
}

TEST_CASE("async_scheduler (device): an urgent write awaited beside a bulk one completes first") {
    loopback lp;
    scheduler s(lp.a, small_slices());
    asio::io_context io(1);
    adapter a(io, s);
    registered big(lp.pd, 8 * MiB), small(lp.pd, 64), dst(lp.pd, 8 * MiB + 4 * KiB);
    std::vector<int> order;
    const auto one = [&](sched::priority p, local_buffer<all_rights> from, std::uint64_t at,
                         int tag) -> asio::awaitable<void> {
        const verbs::completion c =
            co_await a.async_write(p, from, dst.mr.remote(), at, asio::use_awaitable);
        CHECK(c.ok());
        order.push_back(tag);
    };
    asio::co_spawn(io, one(sched::bulk, big.mr.local(), 0, 1), asio::detached);
    asio::co_spawn(io, one(sched::urgent, small.mr.local(), 8 * MiB, 2), asio::detached);
    REQUIRE(run_until(io, [&] { return order.size() == 2; }));
    CHECK(order == std::vector<int>{2, 1});
}

TEST_CASE("async_scheduler (device): a refused request ends with the refusal, posted") {
    loopback lp;
    scheduler s(lp.a, small_slices());
    asio::io_context io(1);
    adapter a(io, s);
    registered src(lp.pd, 4096), dst(lp.pd, 4096);
    std::error_code got;
    bool called = false;
    // Past the end of the remote buffer: refused before anything is posted.
    a.async_write(sched::normal, src.mr.local(), dst.mr.remote(), 1,
                  [&](std::error_code ec, verbs::completion) {
                      called = true;
                      got = ec;
                  });
    CHECK_FALSE(called);
    REQUIRE(run_until(io, [&] { return called; }));
    CHECK(got == make_error_code(status::out_of_range));
    CHECK(a.outstanding() == 0);
    CHECK(s.counters().requests == 0);
}

TEST_CASE("async_scheduler (device): no allocation per awaited request once warm") {
    loopback lp;
    scheduler s(lp.a, small_slices());
    asio::io_context io(1);
    adapter a(io, s);
    registered src(lp.pd, 64), dst(lp.pd, 64);
    std::uint64_t during = 0;
    int failed = 0;
    bool finished = false;
    asio::co_spawn(
        io,
        [&]() -> asio::awaitable<void> {
            for (int i = 0; i < 500; ++i) // warm: the table, Asio's recycled frames
                failed += !(co_await a.async_write(sched::urgent, src.mr.local(), dst.mr.remote(),
                                                   0, asio::use_awaitable))
                               .ok();
            const std::uint64_t before = allocations.load();
            for (int i = 0; i < 5000; ++i)
                failed += !(co_await a.async_write(sched::urgent, src.mr.local(), dst.mr.remote(),
                                                   0, asio::use_awaitable))
                               .ok();
            during = allocations.load() - before;
            finished = true;
        },
        asio::detached);
    REQUIRE(run_until(io, [&] { return finished; }));
    CHECK(failed == 0);
    CHECK(during == 0);
}
