// The priority scheduler against a simulated send queue that drains at a set
// rate: slicing arithmetic, budgets, completion aggregation, policy order,
// fences, read limits, failures, and no allocation per request.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <new>
#include <random>
#include <vector>

#include <rdmax/sched/deficit_round_robin.hpp>
#include <rdmax/sched/priority_scheduler.hpp>

#include "../support/catch.hpp"
#include "../support/counting_new.hpp"
#include "../support/simulated_send_queue.hpp"

namespace {

using namespace rdmax;
using namespace rdmax::sched;
using rdmax::test::simulated_send_queue;

template <class Policy = strict_priority>
using sim_scheduler = basic_priority_scheduler<Policy, simulated_send_queue>;

constexpr rdmax::rights rw =
    rdmax::rights::local_write | rdmax::rights::remote_write | rdmax::rights::remote_read;

// The buffers are never touched: the simulated queue only looks at addresses.
std::byte* const local_base = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 32);
constexpr std::uint64_t remote_base = std::uint64_t{1} << 40;

local_buffer<rw> local(std::uint64_t offset, std::uint32_t length) {
    return {local_base + offset, length, 0x11};
}
remote_buffer<rw> remote(std::uint64_t length = std::uint64_t{1} << 32) {
    return {remote_base, length, 0x22, 0};
}

scheduler_options options(std::uint32_t small, std::uint32_t large, std::uint64_t budget,
                          std::uint32_t wqes = 16) {
    scheduler_options o;
    o.small_slice = small;
    o.large_slice = large;
    o.budget_bytes = budget;
    o.budget_wqes = wqes;
    o.hold = std::chrono::hours(1);
    o.max_requests = 64;
    return o;
}

/// Drains `rate` bytes per step and polls, until every request has been
/// handed back (or a step limit, which fails the test).
template <class S>
std::vector<verbs::completion> run(S& s, std::uint64_t rate, int steps = 1'000'000) {
    std::vector<verbs::completion> got;
    verbs::completion c[8];
    for (int i = 0; i < steps; ++i) {
        const int n = s.poll(c);
        got.insert(got.end(), c, c + n);
        if (s.outstanding() == 0)
            return got;
        s.port().drain(rate);
    }
    FAIL("the scheduler did not finish within the step limit");
    return got;
}

} // namespace

TEST_CASE("a large write is cut into slices that tile it, and completes once") {
    sim_scheduler<> s(options(4096, 64 * 1024, 256 * 1024), {});
    const std::uint32_t len = 1024 * 1024 + 100;
    REQUIRE(s.write(bulk, local(0, len), remote(), 4096, 42) == status::ok);
    const auto got = run(s, 8192);
    REQUIRE(got.size() == 1);
    CHECK(got[0].wr_id == 42);
    CHECK(got[0].ok());
    CHECK(got[0].byte_len == len);

    const auto& log = s.port().log;
    REQUIRE(log.size() == 17); // 16 x 64 KiB + 100 bytes: nothing more urgent, large slices
    std::uint64_t at = 0;
    for (const auto& r : log) {
        CHECK(r.slice.local == local_base + at);
        CHECK(r.slice.remote_addr == remote_base + 4096 + at);
        CHECK(r.slice.opcode == IBV_WR_RDMA_WRITE);
        CHECK(r.slice.lkey == 0x11);
        CHECK(r.slice.rkey == 0x22);
        at += r.slice.length;
    }
    CHECK(at == len);
    CHECK(log.back().slice.length == 100);
    CHECK(log.back().slice.signaled);
    // Fewer signaled than slices: only what the budget's accounting needs.
    std::size_t signaled = 0;
    for (const auto& r : log)
        signaled += r.slice.signaled ? 1 : 0;
    CHECK(signaled < log.size());
    CHECK(s.counters().completed == 1);
    CHECK(s.counters().slices == 17);
    CHECK(s.counters().bytes == len);
    CHECK(s.counters().in_flight_bytes == 0);
}

TEST_CASE("write with immediate carries the immediate on its last slice only") {
    sim_scheduler<> s(options(4096, 16384, 64 * 1024), {});
    REQUIRE(s.write_imm(normal, local(0, 50000), remote(), 0, 0xabcd, 7) == status::ok);
    const auto got = run(s, 4096);
    REQUIRE(got.size() == 1);
    CHECK(got[0].wr_id == 7);
    const auto& log = s.port().log;
    REQUIRE(log.size() == 4);
    for (std::size_t i = 0; i + 1 < log.size(); ++i) {
        CHECK(log[i].slice.opcode == IBV_WR_RDMA_WRITE);
        CHECK_FALSE(log[i].slice.has_imm);
    }
    CHECK(log.back().slice.opcode == IBV_WR_RDMA_WRITE_WITH_IMM);
    CHECK(log.back().slice.has_imm);
    CHECK(log.back().slice.imm == 0xabcd);

    SECTION("a zero-length write with immediate is one slice") {
        REQUIRE(s.write_imm(normal, local(0, 0), remote(), 0, 5, 8) == status::ok);
        const auto more = run(s, 4096);
        REQUIRE(more.size() == 1);
        CHECK(s.port().log.back().slice.length == 0);
        CHECK(s.port().log.back().slice.has_imm);
    }
}

TEST_CASE("sends are posted whole; reads are sliced") {
    sim_scheduler<> s(options(4096, 16384, 64 * 1024), {});
    REQUIRE(s.send(normal, local(0, 100000), 1) == status::ok);
    REQUIRE(s.read(normal, local(0, 100000), remote(), 0, 2) == status::ok);
    const auto got = run(s, 10000);
    REQUIRE(got.size() == 2);
    CHECK(got[0].wr_id == 1);
    CHECK(got[0].opcode == IBV_WC_SEND);
    CHECK(got[1].wr_id == 2);
    CHECK(got[1].opcode == IBV_WC_RDMA_READ);
    const auto& log = s.port().log;
    CHECK(log[0].slice.opcode == IBV_WR_SEND);
    CHECK(log[0].slice.length == 100000);
    CHECK(log.size() == 1 + 7);
}

TEST_CASE("bad requests are refused and post nothing") {
    sim_scheduler<> s(options(4096, 16384, 64 * 1024), {}, 256, 16, 1 << 20);
    CHECK(s.write(bulk, local(0, 0), remote(), 0, 1) == status::zero_length);
    CHECK(s.write(bulk, local(0, 100), remote(1000), 950, 1) == status::out_of_range);
    CHECK(s.write(bulk, local(0, 100), remote(1000), 1001, 1) == status::out_of_range);
    CHECK(s.read(priority{8}, local(0, 100), remote(), 0, 1) == status::out_of_range);
    CHECK(s.send(bulk, local(0, (1 << 20) + 1), 1) == status::too_long);
    // Writes longer than the port's largest message are fine: slices are not.
    CHECK(s.write(bulk, local(0, 3 << 20), remote(), 0, 1) == status::ok);
    CHECK(s.counters().requests == 1);
    const auto got = run(s, 1 << 16);
    CHECK(got.size() == 1);
}

TEST_CASE("bytes and work requests in flight stay within the budget") {
    const std::uint64_t budget = 40000;
    sim_scheduler<> s(options(4096, 8192, budget, 6), {});
    for (int i = 0; i < 10; ++i)
        REQUIRE(s.write(priority{static_cast<std::uint8_t>(i % 8)}, local(0, 100000), remote(), 0,
                        static_cast<std::uint64_t>(i)) == status::ok);
    const auto got = run(s, 3000);
    CHECK(got.size() == 10);
    // Posting stops once the budget is reached: at most one slice beyond it.
    CHECK(s.port().max_queued_bytes < budget + 8192);
    CHECK(s.port().max_queued_wqes <= 6);
    CHECK(s.counters().max_in_flight < budget + 8192);
    CHECK(s.counters().budget_stalls > 0);
}

TEST_CASE("an urgent request waits only for the bytes in flight, and bulk slices shrink") {
    const std::uint64_t budget = 32 * 1024;
    sim_scheduler<> s(options(4096, 256 * 1024, budget), {});
    REQUIRE(s.write(bulk, local(0, 8 << 20), remote(), 0, 1) == status::ok);
    verbs::completion c[4];
    for (int i = 0; i < 20; ++i) { // part of the bulk transfer goes out alone
        (void)s.poll(c);
        s.port().drain(16384);
    }
    const std::size_t before = s.port().log.size();
    // Alone, bulk used large slices, as large as the budget leaves room for
    // (not the whole 256 KiB: see "after a quiet spell" below).
    CHECK(s.port().log[before - 1].slice.length > 4096);
    CHECK(s.port().log[before - 1].slice.length <= budget);

    REQUIRE(s.write(urgent, local(0, 64), remote(), 1 << 30, 2) == status::ok);
    auto got = run(s, 16384);
    REQUIRE(got.size() == 2);
    CHECK(got[0].wr_id == 2); // the urgent write finished long before the bulk one
    const auto& log = s.port().log;
    std::size_t urgent_at = 0;
    for (std::size_t i = before; i < log.size(); ++i)
        if (log[i].slice.length == 64)
            urgent_at = i;
    REQUIRE(urgent_at >= before);
    // It waited for what was in flight: at most the budget and a small slice.
    CHECK(log[urgent_at].bytes_ahead <= budget + 4096);
    // After it, bulk slices are small (the urgent level stays active for `hold`).
    for (std::size_t i = urgent_at + 1; i < log.size(); ++i)
        CHECK(log[i].slice.length <= 4096);
    // And every urgent request that arrives now waits for at most budget + a small slice.
    REQUIRE(s.write(bulk, local(0, 4 << 20), remote(), 0, 3) == status::ok);
    std::vector<verbs::completion> all;
    for (int k = 0; k < 20; ++k) {
        for (int i = 0; i < 3; ++i) {
            const int n = s.poll(c);
            all.insert(all.end(), c, c + n);
            s.port().drain(4096);
        }
        REQUIRE(s.write(urgent, local(0, 64), remote(), 1 << 30, 100 + k) == status::ok);
    }
    for (const auto& done : run(s, 16384))
        all.push_back(done);
    CHECK(all.size() == 21);
    int urgent_posts = 0;
    for (std::size_t i = urgent_at + 1; i < log.size(); ++i)
        if (log[i].slice.length == 64) {
            ++urgent_posts;
            CHECK(log[i].bytes_ahead <= budget + 4096);
        }
    CHECK(urgent_posts == 20);
}

TEST_CASE("after a quiet spell, a lone bulk transfer stays within the byte budget") {
    // Nothing urgent within `hold`: bulk goes in large slices. Posted whole,
    // a 1 MiB slice would sit in the send queue ahead of the first urgent
    // request to come, which would wait for all of it instead of the budget.
    const std::uint64_t budget = 32 * 1024;
    auto o = options(4096, 1024 * 1024, budget);
    o.hold = std::chrono::microseconds(0);
    sim_scheduler<> s(o, {});
    REQUIRE(s.write(bulk, local(0, 8 << 20), remote(), 0, 1) == status::ok);
    verbs::completion c[4];
    for (int i = 0; i < 10; ++i) {
        (void)s.poll(c);
        s.port().drain(8192);
    }
    CHECK(s.counters().small_slices == 0); // large slices: nothing urgent around
    CHECK(s.port().max_queued_bytes <= budget + 4096);
    REQUIRE(s.write(urgent, local(0, 64), remote(), 1 << 30, 2) == status::ok);
    const auto& log = s.port().log;
    REQUIRE(log.back().slice.length == 64);
    CHECK(log.back().bytes_ahead <= budget + 4096);
    const auto got = run(s, 65536);
    CHECK(got.size() == 2);
}

TEST_CASE("a level that never had work does not count as active, however long the hold") {
    // `hold` longer than the steady clock has run (on Linux, the time since
    // boot: a machine or VM booted less than `hold` ago). Nothing more urgent
    // ever had work, so a lone bulk request must use large slices.
    auto o = options(4096, 64 * 1024, 256 * 1024);
    o.hold = std::chrono::duration_cast<std::chrono::microseconds>(
                 std::chrono::steady_clock::now().time_since_epoch()) +
             std::chrono::hours(1);
    sim_scheduler<> s(o, {});
    REQUIRE(s.write(bulk, local(0, 1 << 20), remote(), 0, 1) == status::ok);
    const auto got = run(s, 65536);
    REQUIRE(got.size() == 1);
    CHECK(s.counters().small_slices == 0);
    CHECK(s.port().log.size() == 16);
}

TEST_CASE("strict priority: more urgent levels go first, FIFO within a level") {
    // A budget of one slice: the order of posting is the order of choosing.
    sim_scheduler<> s(options(1000, 1000, 1000, 1), {});
    REQUIRE(s.write(bulk, local(0, 1000), remote(), 0, 0) == status::ok); // posted at once
    REQUIRE(s.write(bulk, local(0, 1000), remote(), 0, 1) == status::ok);
    REQUIRE(s.write(normal, local(0, 1000), remote(), 0, 2) == status::ok);
    REQUIRE(s.write(urgent, local(0, 1000), remote(), 0, 3) == status::ok);
    REQUIRE(s.write(normal, local(0, 1000), remote(), 0, 4) == status::ok);
    REQUIRE(s.write(urgent, local(0, 1000), remote(), 0, 5) == status::ok);
    const auto got = run(s, 1000);
    std::vector<std::uint64_t> order;
    order.reserve(got.size());
    for (const auto& c : got)
        order.push_back(c.wr_id);
    CHECK(order == std::vector<std::uint64_t>{0, 3, 5, 2, 4, 1});
}

TEST_CASE("deficit round robin shares bytes by weight") {
    std::array<std::uint32_t, priority_levels> w{1, 1, 1, 1, 1, 1, 1, 1};
    w[1] = 3;
    w[6] = 1;
    sim_scheduler<deficit_round_robin> s(options(4096, 4096, 4096, 1),
                                         deficit_round_robin(w, 4096));
    // Both levels always have work; count the bytes each got while both do.
    for (int i = 0; i < 8; ++i) {
        REQUIRE(s.write(priority{1}, local(0, 256 * 1024), remote(), 0, 10 + i) == status::ok);
        REQUIRE(s.write(priority{6}, local(0, 256 * 1024), remote(), 0, 20 + i) == status::ok);
    }
    const auto got = run(s, 4096);
    REQUIRE(got.size() == 16);
    // Level 1 (weight 3) finishes its 2 MiB when level 6 (weight 1) has done
    // about a third as much: two or three of its eight requests.
    std::size_t sixes_before_last_one = 0;
    for (const auto& done : got) {
        if (done.wr_id == 17)
            break;
        sixes_before_last_one += done.wr_id >= 20 ? 1 : 0;
    }
    CHECK(sixes_before_last_one >= 2);
    CHECK(sixes_before_last_one <= 3);
}

TEST_CASE("a fenced request waits until every earlier request is posted whole") {
    sim_scheduler<> s(options(4096, 4096, 8192, 2), {});
    REQUIRE(s.write(bulk, local(0, 64 * 1024), remote(), 0, 1) == status::ok);
    REQUIRE(s.read(urgent, local(0, 4096), remote(), 0, 2, {.fence = true}) == status::ok);
    REQUIRE(s.write(high, local(0, 64), remote(), 0, 3) == status::ok);
    const auto got = run(s, 2048);
    REQUIRE(got.size() == 3);
    const auto& log = s.port().log;
    std::size_t read_at = 0;
    std::size_t last_bulk = 0;
    std::size_t small_write = 0;
    for (std::size_t i = 0; i < log.size(); ++i) {
        if (log[i].slice.opcode == IBV_WR_RDMA_READ)
            read_at = i;
        else if (log[i].slice.length == 64)
            small_write = i;
        else
            last_bulk = i;
    }
    CHECK(read_at > last_bulk);
    CHECK(log[read_at].slice.fence);
    // Another level is not held by the fence: its write overtakes bulk.
    CHECK(small_write < last_bulk);
    CHECK(got.back().wr_id == 2);
}

TEST_CASE("read slices in flight stay within max_rd_atomic") {
    sim_scheduler<> s(options(4096, 4096, 1 << 20, 64), {}, 256, 2);
    REQUIRE(s.read(normal, local(0, 64 * 1024), remote(), 0, 1) == status::ok);
    REQUIRE(s.write(bulk, local(0, 64 * 1024), remote(), 0, 2) == status::ok);
    const auto got = run(s, 1024);
    CHECK(got.size() == 2);
    CHECK(s.port().max_queued_reads <= 2);
}

TEST_CASE("a failed slice fails exactly its request; later ones are flushed") {
    sim_scheduler<> s(options(4096, 4096, 16384, 8), {});
    // Each request's buffer at its own address, so that a slice tells its request.
    for (std::uint64_t id = 1; id <= 3; ++id)
        REQUIRE(s.write(bulk, local(id << 20, 20000), remote(), 0, id) == status::ok);
    REQUIRE(s.write(normal, local(std::uint64_t{4} << 20, 20000), remote(), 0, 4) == status::ok);
    // Posting order: 4 slices of request 1 at once, then request 4 (more
    // urgent), then the rest of 1, then 2 and 3. Slice 12 is request 2's.
    s.port().fail_slice = 12;
    const auto got = run(s, 4096);
    const auto& log = s.port().log;
    REQUIRE(log.size() > 12);
    REQUIRE(log[12].slice.id == 12);
    const std::uint64_t failing = (log[12].slice.local - local_base) >> 20;
    CHECK(failing == 2);
    std::map<std::uint64_t, int> count;
    std::map<std::uint64_t, ibv_wc_status> st;
    for (const auto& c : got) {
        ++count[c.wr_id];
        st[c.wr_id] = c.status;
    }
    CHECK(count.size() == 4);
    for (auto [id, n] : count)
        CHECK(n == 1);
    CHECK(st[1] == IBV_WC_SUCCESS);
    CHECK(st[4] == IBV_WC_SUCCESS);
    CHECK(st[2] == IBV_WC_REM_ACCESS_ERR);
    CHECK(st[3] == IBV_WC_WR_FLUSH_ERR);
    CHECK(s.failed());
    // Why it failed is the first error, not the flushes that followed it.
    CHECK(s.failure() == IBV_WC_REM_ACCESS_ERR);
    CHECK(s.counters().failed == 2);
    CHECK(s.counters().completed == 2);
    CHECK(s.write(bulk, local(0, 100), remote(), 0, 9) == status::qp_failed);
}

TEST_CASE("a refused post fails its requests instead of leaving them waiting") {
    sim_scheduler<> s(options(4096, 4096, 1 << 20, 8), {});
    s.port().refuse_after = 2; // of the first request's 5 slices, the device takes 2
    CHECK(s.failure() == IBV_WC_SUCCESS);
    REQUIRE(s.write(bulk, local(0, 20000), remote(), 0, 1) == status::ok);
    CHECK(s.failed());
    CHECK(s.failure() == IBV_WC_LOC_QP_OP_ERR);
    CHECK(s.write(bulk, local(0, 100), remote(), 0, 2) == status::qp_failed);
    const auto got = run(s, 4096);
    REQUIRE(got.size() == 1);
    CHECK(got[0].wr_id == 1);
    CHECK_FALSE(got[0].ok());
    CHECK(s.counters().in_flight_bytes == 0);
}

TEST_CASE("a failure of another request on the queue pair refuses submissions and flushes the "
          "queued ones") {
    sim_scheduler<> s(options(4096, 4096, 16384, 8), {});
    REQUIRE(s.write(bulk, local(0, 64 * 1024), remote(), 0, 1) == status::ok);
    REQUIRE(s.write(bulk, local(1 << 20, 64 * 1024), remote(), 0, 2) == status::ok);
    REQUIRE(s.port().log.size() == 4); // the budget holds the rest back
    // A window's bind, posted by a handle issuer on the same queue pair, fails:
    // the queue pair is in the error state, the slices in flight are flushed.
    s.port().inject(0x4d57000000000001ULL, IBV_WC_MW_BIND_ERR);
    CHECK(s.write(urgent, local(2 << 20, 64), remote(), 0, 3) == status::qp_failed);
    const auto got = run(s, 4096);
    REQUIRE(got.size() == 2);
    for (const auto& c : got)
        CHECK(c.status == IBV_WC_WR_FLUSH_ERR);
    CHECK(s.port().log.size() == 4); // nothing posted after the failure
    CHECK(s.failed());
    CHECK(s.failure() == IBV_WC_MW_BIND_ERR);
    CHECK(s.counters().in_flight_bytes == 0);
}

TEST_CASE("a queue pair that failed unseen by the scheduler: the next submission is refused "
          "qp_failed and nothing waits") {
    sim_scheduler<> s(options(4096, 4096, 16384, 8), {});
    REQUIRE(s.write(bulk, local(0, 64 * 1024), remote(), 0, 1) == status::ok);
    // Its owner took the failed completion (wait_send_for): the scheduler sees
    // only the port's state and its own slices' flushes.
    s.port().fail();
    CHECK(s.write(bulk, local(1 << 20, 100), remote(), 0, 2) == status::qp_failed);
    const std::size_t posted = s.port().log.size();
    const auto got = run(s, 4096);
    REQUIRE(got.size() == 1);
    CHECK(got[0].wr_id == 1);
    CHECK(got[0].status == IBV_WC_WR_FLUSH_ERR);
    CHECK(s.port().log.size() == posted);
    CHECK(s.failed());
}

TEST_CASE("unsignaled requests report only failures; the pool refuses when full") {
    auto o = options(4096, 4096, 1 << 20, 8);
    o.max_requests = 4;
    sim_scheduler<> s(o, {});
    for (int i = 0; i < 4; ++i)
        REQUIRE(s.write(bulk, local(0, 100), remote(), 0, static_cast<std::uint64_t>(i),
                        {.signaled = i != 1}) == status::ok);
    CHECK(s.write(bulk, local(0, 100), remote(), 0, 9) == status::queue_full);
    const auto got = run(s, 4096);
    REQUIRE(got.size() == 3);
    for (const auto& c : got)
        CHECK(c.wr_id != 1);
    CHECK(s.write(bulk, local(0, 100), remote(), 0, 9) == status::ok);
}

TEST_CASE("randomized: every request completes once and its slices tile it exactly") {
    std::mt19937_64 rng(20261121);
    sim_scheduler<> s(options(1000, 30000, 50000, 8), {}, 64, 4);
    struct want {
        std::uint64_t local_off;
        std::uint32_t length;
        ibv_wr_opcode op;
    };
    std::map<std::uint64_t, want> wants;
    std::map<std::uint64_t, int> seen;
    std::uint64_t next_id = 0;
    verbs::completion c[8];
    for (int step = 0; step < 20000; ++step) {
        if (rng() % 4 == 0) {
            const auto len = static_cast<std::uint32_t>(1 + rng() % 200000);
            const std::uint64_t off = (next_id % 64) << 20;
            const priority p{static_cast<std::uint8_t>(rng() % priority_levels)};
            status st = status::ok;
            const int kind = static_cast<int>(rng() % 3);
            if (kind == 0)
                st = s.write(p, local(off, len), remote(), off, next_id);
            else if (kind == 1)
                st = s.read(p, local(off, len), remote(), off, next_id, {.fence = rng() % 8 == 0});
            else
                st = s.write_imm(p, local(off, len), remote(), off, 1, next_id);
            if (st == status::ok)
                wants[next_id] = {off, len, kind == 1 ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE};
            else
                REQUIRE(st == status::queue_full);
            ++next_id;
        }
        const int n = s.poll(c);
        for (int i = 0; i < n; ++i) {
            CHECK(c[i].ok());
            ++seen[c[i].wr_id];
        }
        s.port().drain(rng() % 20000);
    }
    for (const auto& done : run(s, 20000))
        ++seen[done.wr_id];
    CHECK(seen.size() == wants.size());
    for (auto [id, n] : seen)
        CHECK(n == 1);
    // Tiling: each request's bytes were posted once, in order, and nothing else.
    std::uint64_t total = 0;
    for (const auto& [id, w] : wants)
        total += w.length;
    std::uint64_t posted = 0;
    for (const auto& r : s.port().log)
        posted += r.slice.length;
    CHECK(posted == total);
    CHECK(s.port().max_queued_reads <= 4);
}

TEST_CASE("the data path allocates nothing") {
    sim_scheduler<> s(options(4096, 65536, 65536, 8), {});
    verbs::completion c[8];
    // Warm up (the simulator's own containers grow).
    for (int i = 0; i < 100; ++i) {
        REQUIRE(s.write(priority{static_cast<std::uint8_t>(i % 8)}, local(0, 100000), remote(), 0,
                        1) == status::ok);
        (void)run(s, 50000);
    }
    s.port().log.clear();
    s.port().log.reserve(100000);
    const std::uint64_t before = test::allocations.load();
    for (int i = 0; i < 100; ++i) {
        REQUIRE(s.write(priority{static_cast<std::uint8_t>(i % 8)}, local(0, 100000), remote(), 0,
                        1) == status::ok);
        for (int k = 0; k < 100 && s.outstanding() != 0; ++k) {
            (void)s.poll(c);
            s.port().drain(50000);
        }
    }
    CHECK(test::allocations.load() == before);
}

TEST_CASE("a small urgent request goes at once, past a full byte budget") {
    const std::uint64_t budget = 16 * 1024;
    sim_scheduler<> s(options(4096, 4096, budget), {});
    REQUIRE(s.write(bulk, local(0, 1 << 20), remote(), 0, 1) == status::ok);
    REQUIRE(s.port().max_queued_bytes >= budget); // the budget is full
    const std::size_t before = s.port().log.size();
    REQUIRE(s.write(urgent, local(0, 64), remote(), 1 << 30, 2) == status::ok);
    // Posted by the submission itself, behind only what was in flight.
    REQUIRE(s.port().log.size() == before + 1);
    CHECK(s.port().log.back().slice.length == 64);
    CHECK(s.port().log.back().bytes_ahead <= budget + 4096);
    // A large urgent request is not let through: it waits for the budget.
    REQUIRE(s.write(urgent, local(0, 8192), remote(), 1 << 30, 3) == status::ok);
    CHECK(s.port().log.size() == before + 1);
    // Nor is a small request of a level below a busy one.
    REQUIRE(s.write(normal, local(0, 64), remote(), 1 << 30, 4) == status::ok);
    CHECK(s.port().log.size() == before + 1);
    const auto got = run(s, 4096);
    REQUIRE(got.size() == 4);
    CHECK(got[0].wr_id == 2);
}

TEST_CASE("a completion that is not a slice's retires nothing") {
    sim_scheduler<> s(options(4096, 4096, 16384, 8), {});
    REQUIRE(s.write(bulk, local(0, 64 * 1024), remote(), 0, 1) == status::ok);
    const std::uint64_t in_flight = s.counters().in_flight_bytes;
    REQUIRE(in_flight > 0);
    // Someone else's request on the queue pair, with a wr_id of its own.
    s.port().inject(0x4d57000000000001ULL, IBV_WC_SUCCESS);
    verbs::completion c[4];
    CHECK(s.poll(c) == 0);
    CHECK(s.counters().in_flight_bytes == in_flight);
    CHECK(s.counters().foreign_completions == 1);
    const auto got = run(s, 4096);
    REQUIRE(got.size() == 1);
    CHECK(got[0].ok());
}

TEST_CASE("a doorbell with urgent slices carries no bulk, and finished requests go back first") {
    // On soft-RoCE a doorbell transmits what it carries in the caller's
    // thread: urgent slices must not bring bulk ones along, and poll() must
    // hand back a finished urgent request before it posts more bulk.
    const std::uint64_t budget = 16 * 1024;
    sim_scheduler<> s(options(4096, 4096, budget), {});
    REQUIRE(s.write(bulk, local(0, 1 << 20), remote(), 0, 1) == status::ok);
    // Larger than one small slice: it waits for the budget to come back.
    REQUIRE(s.write(urgent, local(0, 8192), remote(), 1 << 30, 2) == status::ok);
    const auto is_urgent = [](const simulated_send_queue::record& r) {
        return r.slice.remote_addr >= remote_base + (1 << 30);
    };
    const std::size_t before = s.port().log.size();
    CHECK_FALSE(is_urgent(s.port().log.back()));
    s.port().drain(budget);

    verbs::completion c[4];
    const std::uint64_t doorbells = s.port().doorbells;
    CHECK(s.poll(c) == 0);
    CHECK(s.port().doorbells == doorbells + 1);
    // That doorbell carried the urgent request's two slices, and only them,
    // although the budget had room for bulk slices after them.
    REQUIRE(s.port().log.size() == before + 2);
    CHECK(is_urgent(s.port().log[before]));
    CHECK(is_urgent(s.port().log[before + 1]));

    s.port().drain(8192);
    // The urgent request comes back, and this call posts nothing.
    REQUIRE(s.poll(c) == 1);
    CHECK(c[0].wr_id == 2);
    CHECK(s.port().doorbells == doorbells + 1);
    // The next call posts bulk.
    CHECK(s.poll(c) == 0);
    CHECK(s.port().doorbells == doorbells + 2);
    REQUIRE(s.port().log.size() > before + 2);
    CHECK_FALSE(is_urgent(s.port().log.back()));
    const auto got = run(s, 16384);
    REQUIRE(got.size() == 1);
    CHECK(got[0].wr_id == 1);
}

TEST_CASE("bulk keeps moving for a caller that finds a finished urgent request at every poll") {
    // Each poll() here has an urgent request to hand back; returning it
    // before posting must not stall the stream for good.
    sim_scheduler<> s(options(4096, 4096, 16 * 1024), {});
    REQUIRE(s.write(bulk, local(0, 1 << 20), remote(), 0, 1) == status::ok);
    verbs::completion c[4];
    std::uint64_t urgent_done = 0;
    for (std::uint64_t k = 0; k < 200; ++k) {
        REQUIRE(s.write(urgent, local(0, 64), remote(), 1 << 30, 100 + k) == status::ok);
        s.port().drain(1 << 20); // everything posted so far completes
        const int n = s.poll(c);
        REQUIRE(n >= 1);
        for (int i = 0; i < n; ++i)
            urgent_done += c[i].wr_id >= 100 ? 1U : 0U;
    }
    CHECK(urgent_done == 200);
    // 200 calls, posting at every second one, 16 KiB each: the whole 1 MiB
    // stream was posted during them, not only after the urgent ones stopped.
    CHECK(s.counters().bytes == (1 << 20) + 200 * 64);
    const auto got = run(s, 1 << 20);
    REQUIRE(got.size() <= 1);
}

TEST_CASE("a request not yet posted can be withdrawn by its wr_id; one under way cannot") {
    // A budget of one slice: the first request is posted, the others wait.
    sim_scheduler<> s(options(1000, 1000, 1000, 1), {});
    REQUIRE(s.read(bulk, local(0, 3000), remote(), 0, 10) == status::ok); // under way
    REQUIRE(s.read(bulk, local(0, 1000), remote(), 0, 11) == status::ok);
    REQUIRE(s.read(normal, local(0, 1000), remote(), 0, 12) == status::ok);
    REQUIRE(s.write(bulk, local(0, 1000), remote(), 0, 13) == status::ok);
    const std::uint64_t posted_before = s.counters().slices;
    CHECK_FALSE(s.cancel(10)); // its first slice is on the queue: it runs its course
    CHECK(s.cancel(11));
    CHECK(s.cancel(12));
    CHECK_FALSE(s.cancel(12)); // gone already
    CHECK_FALSE(s.cancel(99)); // never submitted
    CHECK(s.outstanding() == 2);
    const auto got = run(s, 1000);
    std::vector<std::uint64_t> ids;
    for (const auto& c : got) {
        CHECK(c.ok());
        ids.push_back(c.wr_id);
    }
    // No completion for the withdrawn ones, and none of their bytes posted:
    // 3 slices of the first, 1 of the last.
    CHECK(ids == std::vector<std::uint64_t>{10, 13});
    CHECK(s.counters().slices - posted_before == 3);
    CHECK(s.counters().bytes == 4000);
    // Their places in the pool are free again.
    for (std::uint64_t i = 0; i < 64; ++i)
        REQUIRE(s.write(urgent, local(0, 100), remote(), 0, 100 + i) == status::ok);
    CHECK(s.write(urgent, local(0, 100), remote(), 0, 200) == status::queue_full);
}

TEST_CASE("deferred requests wait for flush(), and go out together with one doorbell") {
    sim_scheduler<> s(options(4096, 16384, 64 * 1024, 32), {});
    constexpr request_flags deferred{.signaled = false, .deferred = true};
    for (std::uint32_t i = 0; i < 8; ++i)
        REQUIRE(s.write_imm(normal, local(i * 64, 64), remote(), i * 64, i, i, deferred) ==
                status::ok);
    // Queued, not posted: no doorbell yet.
    CHECK(s.queued());
    CHECK(s.port().log.empty());
    CHECK(s.counters().doorbells == 0);
    CHECK(s.port().doorbells == 0);
    s.flush();
    CHECK_FALSE(s.queued());
    REQUIRE(s.port().log.size() == 8);
    CHECK(s.counters().doorbells == 1);
    CHECK(s.port().doorbells == 1);
    for (std::uint32_t i = 0; i < 8; ++i) {
        CHECK(s.port().log[i].slice.imm == i); // in submission order
        CHECK(s.port().log[i].slice.has_imm);
    }
    // The same eight, not deferred: one doorbell each.
    sim_scheduler<> t(options(4096, 16384, 64 * 1024, 32), {});
    for (std::uint32_t i = 0; i < 8; ++i)
        REQUIRE(t.write_imm(normal, local(i * 64, 64), remote(), i * 64, i, i,
                            {.signaled = false}) == status::ok);
    CHECK(t.counters().doorbells == 8);
}

TEST_CASE("a poll, or a submission that is not deferred, posts the deferred requests too") {
    sim_scheduler<> s(options(4096, 16384, 64 * 1024, 32), {});
    constexpr request_flags deferred{.deferred = true};
    REQUIRE(s.write(normal, local(0, 100), remote(), 0, 1, deferred) == status::ok);
    REQUIRE(s.write(normal, local(0, 100), remote(), 0, 2, deferred) == status::ok);
    CHECK(s.port().log.empty());
    verbs::completion c[4];
    CHECK(s.poll(c) == 0);
    CHECK(s.port().log.size() == 2);
    CHECK(s.counters().doorbells == 1);

    REQUIRE(s.write(normal, local(0, 100), remote(), 0, 3, deferred) == status::ok);
    CHECK(s.port().log.size() == 2);
    REQUIRE(s.write(normal, local(0, 100), remote(), 0, 4) == status::ok);
    REQUIRE(s.port().log.size() == 4); // the deferred one first, in the same doorbell
    CHECK(s.port().log[2].slice.local == local_base);
    CHECK(s.counters().doorbells == 2);
    const auto got = run(s, 1000);
    std::vector<std::uint64_t> ids;
    for (const auto& g : got) {
        CHECK(g.ok());
        ids.push_back(g.wr_id);
    }
    CHECK(ids == std::vector<std::uint64_t>{1, 2, 3, 4});
}

TEST_CASE("a deferred request is not lost when the flush comes late") {
    sim_scheduler<> s(options(4096, 16384, 64 * 1024, 32), {});
    REQUIRE(s.write(normal, local(0, 5000), remote(), 0, 1) == status::ok);
    REQUIRE(s.write(normal, local(0, 100), remote(), 0, 2, {.deferred = true}) == status::ok);
    // The wire runs dry and the first request completes: the deferred one
    // is still queued (nothing posts it but the scheduler's own calls).
    s.port().drain(1'000'000);
    CHECK(s.port().idle());
    CHECK(s.queued());
    CHECK(s.outstanding() == 2);
    const std::size_t posted = s.port().log.size(); // the first request's slices
    s.flush();
    CHECK(s.port().log.size() == posted + 1);
    const auto got = run(s, 1000);
    REQUIRE(got.size() == 2);
    CHECK(got[0].wr_id == 1);
    CHECK(got[1].wr_id == 2);
    CHECK(s.counters().completed == 2);
    // A flush with nothing queued rings nothing.
    const std::uint64_t rung = s.counters().doorbells;
    s.flush();
    CHECK(s.counters().doorbells == rung);
}

// A pass of the pump stops at a less urgent level once a more urgent slice is
// staged (the urgent one's completion comes first); a flush must not: a
// deferred request behind a more urgent deferred one would stay queued until
// the next poll() or submission that is not deferred.
TEST_CASE("flush() posts deferred requests of every level") {
    sim_scheduler<> s(options(4096, 16384, 64 * 1024, 32), {});
    constexpr request_flags deferred{.signaled = false, .deferred = true};
    REQUIRE(s.write_imm(normal, local(0, 64), remote(), 0, 1, 1, deferred) == status::ok);
    REQUIRE(s.write_imm(urgent, local(64, 64), remote(), 64, 2, 2, deferred) == status::ok);
    s.flush();
    CHECK(s.port().log.size() == 2);
    CHECK_FALSE(s.queued());
    CHECK(s.counters().doorbells == 1);
}

namespace {
/// A fine clock that counts its reads (each a system call on an HPET guest)
/// and moves 1 us a read.
struct counted_clock {
    using duration = std::chrono::nanoseconds;
    using rep = duration::rep;
    using period = duration::period;
    using time_point = std::chrono::time_point<counted_clock>;
    [[nodiscard]] static time_point now() noexcept {
        ++reads;
        return time_point(duration(reads * 1000));
    }
    static inline std::int64_t reads = 0;
};
using counted_scheduler =
    basic_priority_scheduler<strict_priority, simulated_send_queue, coarse_clock, counted_clock>;
} // namespace

TEST_CASE("a measured budget times bulk slices and never reads the fine clock for small ones") {
    // Issue 27: 0.8 clock_gettime system calls per 64 B RPC echo in a TCG
    // guest (HPET), all of them this scheduler's samples, four fine-clock
    // reads each, of an RPC link's small messages, which the budget never
    // holds back.
    auto o = options(4096, 64 * 1024, 0); // budget_bytes 0: measured
    REQUIRE(o.budget_bytes == 0);
    counted_scheduler s(o, {});
    counted_clock::reads = 0;
    for (std::uint64_t i = 0; i < 200; ++i) { // one at a time
        REQUIRE(s.write_imm(normal, local(0, 96), remote(), 0, 7, i) == status::ok);
        CHECK(run(s, 4096).size() == 1);
    }
    for (std::uint64_t round = 0; round < 20; ++round) { // 16 in flight, past the budget
        for (std::uint64_t i = 0; i < 16; ++i)
            REQUIRE(s.write_imm(normal, local(0, 1000), remote(), 0, 7, 1000 + 16 * round + i) ==
                    status::ok);
        CHECK(run(s, 512).size() == 16);
    }
    CHECK(s.counters().slices == 200 + 20 * 16);
    CHECK(s.counters().budget_samples == 0);
    CHECK(counted_clock::reads == 0);

    // Bulk: its probe (1 KiB with nothing ahead) gives the base latency,
    // and its slices are timed one round trip after another.
    REQUIRE(s.write(bulk, local(0, 4 << 20), remote(), 0, 1) == status::ok);
    CHECK(run(s, 4096).size() == 1);
    CHECK(s.counters().budget_samples >= 50);
    CHECK(s.counters().base_latency_ns > 0);
    CHECK(counted_clock::reads >= 4 * 50);
}
