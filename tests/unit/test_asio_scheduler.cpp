// sched::async_scheduler (include/rdmax/asio/scheduler.hpp) on the simulated
// send queue: a coroutine awaits a write, a read and a send; an urgent write
// awaited beside a bulk one completes first; a failed slice fails its
// request's operation with the completion's status; a refused request
// completes at once; no allocation per request once warm; out of memory at
// submission leaves nothing out. The "wire" is a handler on the same
// io_context that drains the queue a little each turn.
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <optional>
#include <stdexcept>
#include <system_error>
#include <vector>

#include <rdmax/asio/scheduler.hpp>
#include <rdmax/status_error.hpp>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference"
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/use_awaitable.hpp>
#pragma GCC diagnostic pop

#include <rdmax/sched/basic_priority_scheduler.hpp>
#include <rdmax/sched/strict_priority.hpp>

#include "../support/catch.hpp"
#include "../support/counting_new.hpp"
#include "../support/simulated_send_queue.hpp"

namespace {
/// Fault injection: the next aligned_alloc fails (Asio takes the memory of
/// a handler it queues outside a running context from aligned_alloc).
std::atomic<bool> fail_next_aligned_alloc{false};
} // namespace

// Replaces the C library's for this program (the tests above use it through
// Asio's recycling allocator only).
extern "C" void* aligned_alloc(std::size_t align, std::size_t size) noexcept {
    if (fail_next_aligned_alloc.exchange(false))
        return nullptr;
    void* p = nullptr;
    return posix_memalign(&p, align, size) == 0 ? p : nullptr;
}

using namespace rdmax;
using namespace rdmax::sched;
using namespace std::chrono_literals;
using rdmax::test::simulated_send_queue;

namespace {

using sim_scheduler = basic_priority_scheduler<strict_priority, simulated_send_queue>;

constexpr rights rw = rights::local_write | rights::remote_write | rights::remote_read;
std::byte* const local_base = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 32);
constexpr std::uint64_t remote_base = std::uint64_t{1} << 40;

local_buffer<rw> lbuf(std::uint64_t offset, std::uint32_t length) {
    return {local_base + offset, length, 0x11};
}
remote_buffer<rw> remote() {
    return {remote_base, std::uint64_t{1} << 32, 0x22, 0};
}

scheduler_options options() {
    scheduler_options o;
    o.small_slice = 4096;
    o.large_slice = 64 * 1024;
    o.budget_bytes = 256 * 1024;
    o.budget_wqes = 16;
    o.hold = std::chrono::hours(1);
    o.max_requests = 64;
    return o;
}

/// The scheduler, its adapter, and the wire (drains `rate` bytes a turn).
struct rig {
    asio::io_context io;
    sim_scheduler s{options(), {}};
    async_scheduler<sim_scheduler> a{io, s, {.spin_polls = 4}};
    std::uint64_t rate = 8192;
    bool wire_on = false;

    void wire() {
        if (wire_on)
            return;
        wire_on = true;
        asio::post(io, [this] { turn(); });
    }
    void turn() {
        s.port().drain(rate);
        if (a.outstanding() == 0 && s.outstanding() == 0) {
            wire_on = false;
            return;
        }
        asio::post(io, [this] { turn(); });
    }
    /// Runs until `done()` or 10 s pass.
    template <class P>
    bool run_until(P done) {
        const auto end = std::chrono::steady_clock::now() + 10s;
        while (!done() && std::chrono::steady_clock::now() < end) {
            io.restart();
            (void)io.run_for(5ms);
        }
        return done();
    }
};

} // namespace

TEST_CASE("async_scheduler: a coroutine awaits a write, a read and a send") {
    rig r;
    std::vector<ibv_wc_opcode> seen;
    bool finished = false;
    asio::co_spawn(
        r.io,
        [&]() -> asio::awaitable<void> {
            r.wire();
            verbs::completion c = co_await r.a.async_write(bulk, lbuf(0, 200 * 1024), remote(), 0,
                                                           asio::use_awaitable);
            seen.push_back(c.opcode);
            c = co_await r.a.async_read(normal, lbuf(0, 10 * 1024), remote(), 4096,
                                        asio::use_awaitable);
            seen.push_back(c.opcode);
            c = co_await r.a.async_send(urgent, lbuf(0, 64), asio::use_awaitable);
            seen.push_back(c.opcode);
            finished = true;
        },
        asio::detached);
    REQUIRE(r.run_until([&] { return finished; }));
    CHECK(seen == std::vector<ibv_wc_opcode>{IBV_WC_RDMA_WRITE, IBV_WC_RDMA_READ, IBV_WC_SEND});
    CHECK(r.a.outstanding() == 0);
}

TEST_CASE("async_scheduler: an urgent write awaited beside a bulk one completes first") {
    rig r;
    std::vector<int> order;
    const auto one = [&](priority p, std::uint32_t len, int tag) -> asio::awaitable<void> {
        (void)co_await r.a.async_write(p, lbuf(0, len), remote(), 0, asio::use_awaitable);
        order.push_back(tag);
    };
    asio::co_spawn(r.io, one(bulk, 4 * 1024 * 1024, 1), asio::detached);
    asio::co_spawn(r.io, one(urgent, 64, 2), asio::detached);
    r.wire();
    REQUIRE(r.run_until([&] { return order.size() == 2; }));
    CHECK(order == std::vector<int>{2, 1});
}

TEST_CASE("async_scheduler: a failed request's operation ends with its status") {
    rig r;
    r.s.port().fail_slice = 0; // the first slice posted fails; the rest flush
    std::error_code got;
    bool finished = false;
    asio::co_spawn(
        r.io,
        [&]() -> asio::awaitable<void> {
            auto [ec, c] =
                co_await r.a.async_write(bulk, lbuf(0, 4096), remote(), 0,
                                         asio::experimental::as_tuple(asio::use_awaitable));
            got = ec;
            finished = true;
        },
        asio::detached);
    r.wire();
    REQUIRE(r.run_until([&] { return finished; }));
    CHECK(got);
    CHECK(got.category() == verbs::wc_category());
}

TEST_CASE("async_scheduler: a request refused at submission completes at once, posted") {
    rig r;
    bool called = false;
    std::error_code got;
    // Zero length: refused by the scheduler before anything is queued.
    r.a.async_write(bulk, lbuf(0, 0), remote(), 0, [&](std::error_code ec, verbs::completion) {
        called = true;
        got = ec;
    });
    CHECK_FALSE(called); // never inside the initiating function
    REQUIRE(r.run_until([&] { return called; }));
    // The error is the refusal itself, not a device's completion status.
    CHECK(got == make_error_code(status::zero_length));
    CHECK(got.category() == status_category());
    CHECK(got == std::errc::invalid_argument);
}

TEST_CASE("async_scheduler: a handler that throws loses none of its poll's other completions") {
    rig r;
    r.rate = 1 << 20; // all three complete in one turn of the wire: one poll
    std::vector<int> ran;
    const auto handler = [&](int tag) {
        return [&ran, tag](std::error_code, verbs::completion) {
            ran.push_back(tag);
            if (tag == 1)
                throw std::runtime_error("handler 1 throws");
        };
    };
    for (int tag = 1; tag <= 3; ++tag)
        r.a.async_write(urgent, lbuf(0, 64), remote(), 0, handler(tag));
    r.wire();
    bool thrown = false;
    const auto end = std::chrono::steady_clock::now() + 10s;
    while (ran.size() < 3 && std::chrono::steady_clock::now() < end) {
        r.io.restart();
        try {
            (void)r.io.run_for(5ms);
        } catch (const std::runtime_error&) {
            thrown = true; // Asio's rule: a handler's exception leaves run()
        }
    }
    CHECK(thrown);
    CHECK(ran == std::vector<int>{1, 2, 3});
    CHECK(r.a.outstanding() == 0);
}

TEST_CASE("async_scheduler: a request made while the adapter sleeps on its timer is polled now") {
    rig r;
    // A long idle wait: without the kick, the second request's completion
    // would be seen only when that wait ends.
    async_scheduler<sim_scheduler> a{
        r.io, r.s, {.spin_polls = 8, .idle_wait = 2s, .max_idle_wait = 2s}};
    bool first = false, second = false;
    a.async_write(bulk, lbuf(0, 64), remote(), 0,
                  [&](std::error_code, verbs::completion) { first = true; });
    // No wire yet: the adapter polls 8 turns, finds nothing and sleeps 2 s.
    r.io.restart();
    (void)r.io.run_for(50ms);
    REQUIRE_FALSE(first);
    const auto t0 = std::chrono::steady_clock::now();
    a.async_write(urgent, lbuf(0, 64), remote(), 0,
                  [&](std::error_code, verbs::completion) { second = true; });
    r.wire();
    REQUIRE(r.run_until([&] { return first && second; }));
    CHECK(std::chrono::steady_clock::now() - t0 < 1s);
}

TEST_CASE("async_scheduler: requests out when the adapter goes end with operation_aborted") {
    rig r;
    std::error_code got;
    bool called = false;
    {
        async_scheduler<sim_scheduler> a{r.io, r.s};
        a.async_write(bulk, lbuf(0, 64), remote(), 0, [&](std::error_code ec, verbs::completion) {
            called = true;
            got = ec;
        });
        CHECK_FALSE(called);
    }                    // no wire: the request is still out
    CHECK_FALSE(called); // never inside the destructor
    r.io.restart();
    (void)r.io.run_for(50ms);
    REQUIRE(called);
    CHECK(got == asio::error::operation_aborted);
}

TEST_CASE("async_scheduler: a request submitted directly with a small wr_id is not its") {
    rig r;
    bool called = false;
    std::size_t left_at_call = 0; // requests the scheduler still held when the handler ran
    r.a.async_write(bulk, lbuf(0, 1024 * 1024), remote(), 0,
                    [&](std::error_code, verbs::completion) {
                        called = true;
                        left_at_call = r.s.outstanding();
                    });
    // Beside the adapter, a caller of the scheduler itself, with wr_id 0 (as
    // a plain verbs program numbers its requests): its completion is dropped,
    // never taken for the adapter's request's.
    REQUIRE(r.s.write(urgent, lbuf(0, 64), remote(), 0, 0) == status::ok);
    r.wire();
    REQUIRE(r.run_until([&] { return called; }));
    CHECK(left_at_call == 0); // called for its own completion, not the direct one's
}

TEST_CASE("async_scheduler: a request whose wake-up cannot be queued leaves nothing behind") {
    rig r;
    bool first = false, second = false;
    // Out of memory as the adapter queues its poll: the initiating function
    // throws, and so the request must not be out (nor its handler kept).
    fail_next_aligned_alloc = true;
    CHECK_THROWS_AS(r.a.async_write(urgent, lbuf(0, 64), remote(), 0,
                                    [&](std::error_code, verbs::completion) { first = true; }),
                    std::bad_alloc);
    CHECK(r.s.outstanding() == 0);
    CHECK(r.a.outstanding() == 0);
    // And the adapter still works.
    r.a.async_write(urgent, lbuf(0, 64), remote(), 0,
                    [&](std::error_code, verbs::completion) { second = true; });
    r.wire();
    REQUIRE(r.run_until([&] { return second; }));
    CHECK_FALSE(first);
}

TEST_CASE("async_scheduler: a handler that runs the context itself leaves one pump, not two") {
    rig r;
    bool ran = false;
    // The handler makes a request that stays out (nothing drains it), then
    // turns the context itself (a nested wait): the adapter's own pumps run
    // inside it and go to sleep on the timer.
    r.a.async_write(urgent, lbuf(0, 64), remote(), 0, [&](std::error_code, verbs::completion) {
        r.a.async_write(bulk, lbuf(0, 64), remote(), 0, [](std::error_code, verbs::completion) {});
        for (int i = 0; i < 16; ++i)
            (void)r.io.poll_one();
        ran = true;
    });
    const auto end = std::chrono::steady_clock::now() + 10s;
    while (!ran && std::chrono::steady_clock::now() < end) {
        r.s.port().drain(1 << 20); // not after the handler ran: its request stays out
        (void)r.io.poll_one();
    }
    REQUIRE(ran);
    // Asleep on the timer (50 us doubling to 1 ms): about a hundred turns in
    // 100 ms. Two pumps at once (a queued one beside the timer's) cancel
    // each other's waits and turn the context without end.
    r.io.restart();
    const std::size_t turns = r.io.run_for(100ms);
    CHECK(turns < 5000);
}

TEST_CASE("async_scheduler: requests none of which was posted are withdrawn when it goes") {
    rig r;
    const auto nothing = [](std::error_code, verbs::completion) {};
    std::error_code second_ec;
    {
        async_scheduler<sim_scheduler> a{r.io, r.s};
        a.async_write(bulk, lbuf(0, 1024 * 1024), remote(), 0, nothing);
        a.async_write(bulk, lbuf(0, 1024 * 1024), remote(), 0,
                      [&](std::error_code ec, verbs::completion) { second_ec = ec; });
        verbs::completion none[4];
        REQUIRE(r.s.poll(none) == 0); // posts the first's first slices; the second waits
        REQUIRE(r.s.outstanding() == 2);
    }
    // The second never reached the device: told operation_aborted, it must not
    // reach it later (its buffer is its owner's again). The first, partly
    // posted, runs its course.
    CHECK(r.s.outstanding() == 1);
    r.io.restart();
    (void)r.io.run_for(50ms);
    CHECK(second_ec == asio::error::operation_aborted);
}

TEST_CASE("async_scheduler: a successor on the same scheduler does not take its forerunner's") {
    rig r;
    {
        async_scheduler<sim_scheduler> a{r.io, r.s};
        a.async_write(bulk, lbuf(0, 1024 * 1024), remote(), 0,
                      [](std::error_code, verbs::completion) {});
        verbs::completion none[4];
        REQUIRE(r.s.poll(none) == 0); // partly posted: it runs its course
    }
    async_scheduler<sim_scheduler> b{r.io, r.s};
    bool called = false;
    std::size_t left_at_call = 0;
    // Behind the first in its level: its completion comes second.
    b.async_write(bulk, lbuf(0, 1024 * 1024), remote(), 0, [&](std::error_code, verbs::completion) {
        called = true;
        left_at_call = r.s.outstanding();
    });
    r.wire();
    REQUIRE(r.run_until([&] { return called; }));
    CHECK(left_at_call == 0); // its own completion, not the forerunner's
}

TEST_CASE(
    "async_scheduler: a handler that destroys the adapter mid-poll: the rest, as they ended") {
    rig r;
    r.rate = 1 << 20; // all three complete in one turn of the wire: one poll
    std::optional<async_scheduler<sim_scheduler>> a;
    a.emplace(r.io, r.s);
    std::vector<int> ran;
    std::vector<std::error_code> errors;
    for (int tag = 1; tag <= 3; ++tag)
        a->async_write(urgent, lbuf(0, 64), remote(), 0,
                       [&, tag](std::error_code ec, verbs::completion) {
                           ran.push_back(tag);
                           errors.push_back(ec);
                           if (tag == 1)
                               a.reset(); // from inside its completion, the pump looping
                       });
    // The wire without the rig's adapter check: the scheduler's own count.
    for (int i = 0; i < 64 && r.s.outstanding() > 0; ++i)
        r.s.port().drain(r.rate);
    REQUIRE(r.run_until([&] { return ran.size() == 3; }));
    (void)r.io.run_for(20ms); // nothing more may come
    REQUIRE(ran.size() == 3);
    CHECK(ran[0] == 1);
    // The other two had finished (their completions were in the adapter's
    // hands, polled): they say so, not operation_aborted (a caller told
    // "aborted" would send again what its peer already has).
    CHECK_FALSE(errors[0]);
    CHECK_FALSE(errors[1]);
    CHECK_FALSE(errors[2]);
}

TEST_CASE("async_scheduler: a handler that runs the context and throws leaves one pump") {
    rig r;
    bool ran = false;
    r.a.async_write(urgent, lbuf(0, 64), remote(), 0, [&](std::error_code, verbs::completion) {
        r.a.async_write(bulk, lbuf(0, 64), remote(), 0, [](std::error_code, verbs::completion) {});
        for (int i = 0; i < 16; ++i)
            (void)r.io.poll_one(); // the adapter's pumps run here and go to sleep
        ran = true;
        throw std::runtime_error("the handler throws");
    });
    bool thrown = false;
    const auto end = std::chrono::steady_clock::now() + 10s;
    while (!ran && std::chrono::steady_clock::now() < end) {
        r.s.port().drain(1 << 20); // not after the handler ran: its request stays out
        try {
            (void)r.io.poll_one();
        } catch (const std::runtime_error&) {
            thrown = true;
        }
    }
    REQUIRE(ran);
    CHECK(thrown);
    r.io.restart();
    const std::size_t turns = r.io.run_for(100ms);
    CHECK(turns < 5000); // asleep on the timer, not two pumps cancelling each other
}

TEST_CASE("async_scheduler: no allocation per awaited request once warm") {
    rig r;
    r.rate = 1 << 20;
    // The simulated queue logs every slice (test machinery): room for all.
    r.s.port().log.reserve(1 << 15);
    std::uint64_t during = 0;
    bool finished = false;
    asio::co_spawn(
        r.io,
        [&]() -> asio::awaitable<void> {
            r.wire();
            for (int i = 0; i < 1000; ++i) // warm: the table, Asio's recycled frames
                (void)co_await r.a.async_write(urgent, lbuf(0, 64), remote(), 0,
                                               asio::use_awaitable);
            const std::uint64_t before = rdmax::test::allocations.load();
            for (int i = 0; i < 10000; ++i)
                (void)co_await r.a.async_write(urgent, lbuf(0, 64), remote(), 0,
                                               asio::use_awaitable);
            during = rdmax::test::allocations.load() - before;
            finished = true;
        },
        asio::detached);
    REQUIRE(r.run_until([&] { return finished; }));
    CHECK(during == 0);
}
