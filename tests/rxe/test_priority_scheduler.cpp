// The priority scheduler on a real device: sliced transfers arrive intact,
// one completion per request with the caller's wr_id, mixed priorities,
// fences, and a failed slice that fails exactly its request. Checked at the
// destination's bytes, not only by the completions.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <vector>

#include <fmt/format.h>

#include <rdmax/sched/deficit_round_robin.hpp>
#include <rdmax/sched/priority_scheduler.hpp>

#include "../support/loopback.hpp"

using namespace rdmax;
using namespace rdmax::test;
namespace sched = rdmax::sched;

namespace {

using clock_type = std::chrono::steady_clock;

constexpr std::uint32_t KiB = 1024;
constexpr std::uint32_t MiB = 1024 * KiB;

/// Small slices and a small budget, so that every transfer here really is cut.
sched::scheduler_options small_slices() {
    sched::scheduler_options o;
    o.small_slice = 4 * KiB;
    o.large_slice = 64 * KiB;
    o.budget_bytes = 32 * KiB;
    o.budget_wqes = 16;
    o.max_requests = 256;
    return o;
}

/// A poll's result, checked without counting one assertion per poll.
int polled(int n) {
    if (n < 0)
        FAIL("polling a completion queue failed: " << n);
    return n;
}

/// Drives the scheduler until every request was handed back, or `limit`
/// passed (which fails the test): the finished requests, in order.
template <class S>
std::vector<verbs::completion> finish_all(S& s, std::chrono::seconds limit = 30s) {
    std::vector<verbs::completion> got;
    verbs::completion c[16];
    const auto deadline = clock_type::now() + limit;
    while (s.outstanding() != 0 && clock_type::now() < deadline) {
        const int n = polled(s.wait(c, 100ms));
        got.insert(got.end(), c, c + n);
    }
    INFO(fmt::format("{}", s.counters()));
    REQUIRE(s.outstanding() == 0);
    verbs::completion more[4];
    CHECK(s.poll(more) == 0); // nothing beyond one completion per request
    return got;
}

/// Receive completions that arrive within `t` (0 if none).
std::vector<verbs::completion> receives_within(verbs::queue_pair_base& qp,
                                               std::chrono::milliseconds t) {
    std::vector<verbs::completion> got;
    verbs::completion c[8];
    const auto deadline = clock_type::now() + t;
    while (clock_type::now() < deadline) {
        const int n = polled(qp.poll_recv(c));
        got.insert(got.end(), c, c + n);
    }
    return got;
}

bool all_equal(std::span<const std::byte> in, std::byte b) {
    return std::all_of(in.begin(), in.end(), [b](std::byte x) { return x == b; });
}

} // namespace

TEST_CASE("scheduler: a sliced write of several MiB arrives intact, one completion") {
    loopback lp;
    sched::priority_scheduler<> s(lp.a, small_slices());
    const std::uint32_t len = 4 * MiB + 123; // not a multiple of any slice
    const std::uint32_t at = 4096 + 7;
    registered src(lp.pd, len), dst(lp.pd, len + 8192, std::byte{0xee});
    fill_pattern(src.bytes, 31);

    REQUIRE(s.write(sched::normal, src.mr.local(), dst.mr.remote(), at, 4242) == status::ok);
    // A second, unsignaled request: it finishes without a completion.
    REQUIRE(s.write(sched::normal, src.mr.local(0, 1000), dst.mr.remote(), 0, 4343,
                    {.signaled = false}) == status::ok);
    const auto got = finish_all(s);

    REQUIRE(got.size() == 1);
    CHECK(got[0].wr_id == 4242);
    CHECK(got[0].ok());
    CHECK(got[0].opcode == IBV_WC_RDMA_WRITE);
    CHECK(got[0].byte_len == len);
    CHECK(has_pattern(std::span(dst.bytes).subspan(at, len), 31));
    CHECK(has_pattern(std::span(dst.bytes).first(1000), 31));
    CHECK(all_equal(std::span(dst.bytes).subspan(1000, at - 1000), std::byte{0xee}));
    CHECK(all_equal(std::span(dst.bytes).subspan(at + len), std::byte{0xee}));

    const auto& k = s.counters();
    INFO(fmt::format("{}", k));
    CHECK(k.requests == 2);
    CHECK(k.completed == 2);
    CHECK(k.failed == 0);
    CHECK(k.bytes == std::uint64_t{len} + 1000);
    CHECK(k.slices >= len / (64 * KiB)); // really sliced: 64 slices at the large size
    CHECK(k.in_flight_bytes == 0);
    CHECK(k.max_in_flight <= 32 * KiB + 64 * KiB); // the budget plus one slice
    CHECK_FALSE(s.failed());
}

TEST_CASE("scheduler: a sliced write with immediate gives one receive, after all its bytes") {
    loopback lp;
    sched::priority_scheduler<> s(lp.a, small_slices());
    const std::uint32_t len = 2 * MiB + 1000;
    registered src(lp.pd, len), dst(lp.pd, len), rbuf(lp.pd, 128);
    fill_pattern(src.bytes, 17);
    // Two receives: the transfer must consume exactly one.
    REQUIRE(lp.b.post_recv(rbuf.mr.local(0, 64), 700) == status::ok);
    REQUIRE(lp.b.post_recv(rbuf.mr.local(64, 64), 701) == status::ok);

    REQUIRE(s.write_imm(sched::normal, src.mr.local(), dst.mr.remote(), 0, 0xfeedf00d, 55) ==
            status::ok);
    std::vector<verbs::completion> sent, received;
    bool intact_at_receive = false;
    verbs::completion c[8];
    const auto deadline = clock_type::now() + 30s;
    while ((sent.empty() || received.empty()) && clock_type::now() < deadline) {
        const int n = polled(s.poll(c));
        sent.insert(sent.end(), c, c + n);
        const int r = polled(lp.b.poll_recv(c));
        if (r > 0 && received.empty())
            intact_at_receive = has_pattern(dst.bytes, 17); // every byte there already
        received.insert(received.end(), c, c + r);
    }
    REQUIRE(sent.size() == 1);
    REQUIRE(received.size() == 1);
    CHECK(intact_at_receive);
    CHECK(sent[0].wr_id == 55);
    CHECK(sent[0].ok());
    CHECK(sent[0].byte_len == len);
    const auto& r = received[0];
    CHECK(r.ok());
    CHECK(r.wr_id == 700);
    CHECK(r.opcode == IBV_WC_RECV_RDMA_WITH_IMM);
    CHECK(r.has_imm);
    CHECK(r.imm == 0xfeedf00d);
    // The receive reports the last slice's bytes at most, not the request's.
    CHECK(r.byte_len <= 64 * KiB);
    fmt::print("write with immediate: the receive reports byte_len {}\n", r.byte_len);
    CHECK(has_pattern(dst.bytes, 17));

    (void)finish_all(s);
    CHECK(receives_within(lp.b, 200ms).empty()); // no second receive consumed
    CHECK(s.counters().slices >= len / (64 * KiB));
}

TEST_CASE("scheduler: a sliced read brings back the remote bytes intact") {
    loopback lp;
    sched::priority_scheduler<> s(lp.a, small_slices());
    const std::uint32_t len = 3 * MiB + 77;
    const std::uint32_t from = 512 + 3;
    registered remote(lp.pd, len + from), local(lp.pd, len + 4096, std::byte{0xee});
    fill_pattern(remote.bytes, 5);

    REQUIRE(s.read(sched::normal, local.mr.local(0, len), remote.mr.remote(), from, 9) ==
            status::ok);
    const auto got = finish_all(s);
    REQUIRE(got.size() == 1);
    CHECK(got[0].wr_id == 9);
    CHECK(got[0].ok());
    CHECK(got[0].opcode == IBV_WC_RDMA_READ);
    CHECK(has_pattern(std::span(local.bytes).first(len), 5 + from));
    CHECK(all_equal(std::span(local.bytes).subspan(len), std::byte{0xee}));
    CHECK(s.counters().slices >= len / (64 * KiB));
    CHECK(s.counters().bytes == len);
}

TEST_CASE("scheduler: urgent writes overtake a bulk write; all arrive, each completes once") {
    loopback lp;
    sched::priority_scheduler<> s(lp.a, small_slices());
    const std::uint32_t bulk_len = 4 * MiB;
    constexpr unsigned n_urgent = 100;
    registered bulk_src(lp.pd, bulk_len), bulk_dst(lp.pd, bulk_len);
    registered urgent_src(lp.pd, n_urgent * 64), urgent_dst(lp.pd, n_urgent * 64);
    fill_pattern(bulk_src.bytes, 1);
    fill_pattern(urgent_src.bytes, 2);
    constexpr std::uint64_t bulk_id = 1;

    REQUIRE(s.write(sched::bulk, bulk_src.mr.local(), bulk_dst.mr.remote(), 0, bulk_id) ==
            status::ok);
    // Urgent writes spread over the bulk transfer: the i-th once about i/(n+1)
    // of it was posted. One that is submitted while the bulk request still has
    // bytes to post is posted before the rest of them (strict priority), so
    // it completes before the bulk request does (an RC send queue completes
    // in order): that is what is guaranteed. Those submitted later are not.
    std::set<std::uint64_t> guaranteed;
    std::map<std::uint64_t, clock_type::time_point> submitted;
    std::map<std::uint64_t, int> times;
    std::vector<std::uint64_t> order;
    std::chrono::nanoseconds urgent_worst{0};
    clock_type::duration bulk_took{};
    const auto start = clock_type::now();
    unsigned next = 0;
    verbs::completion c[16];
    const auto deadline = start + 30s;
    while ((next < n_urgent || s.outstanding() != 0) && clock_type::now() < deadline) {
        if (next < n_urgent &&
            s.counters().bytes >= std::uint64_t{bulk_len} * next / (n_urgent + 1)) {
            const std::uint64_t id = 100 + next;
            // counters().bytes counts the bulk bytes posted and then some.
            const bool bulk_unposted = s.counters().bytes < bulk_len;
            submitted[id] = clock_type::now();
            REQUIRE(s.write(sched::urgent, urgent_src.mr.local(next * 64, 64),
                            urgent_dst.mr.remote(), next * 64, id) == status::ok);
            if (bulk_unposted)
                guaranteed.insert(id);
            ++next;
        }
        const int n = polled(s.poll(c));
        for (int i = 0; i < n; ++i) {
            CHECK(c[i].ok());
            ++times[c[i].wr_id];
            order.push_back(c[i].wr_id);
            if (c[i].wr_id == bulk_id)
                bulk_took = clock_type::now() - start;
            else if (submitted.contains(c[i].wr_id))
                urgent_worst = std::max<std::chrono::nanoseconds>(
                    urgent_worst, clock_type::now() - submitted[c[i].wr_id]);
        }
    }
    const auto& k = s.counters();
    INFO(fmt::format("{}", k));
    REQUIRE(next == n_urgent);
    REQUIRE(s.outstanding() == 0);

    REQUIRE(times.size() == n_urgent + 1);
    for (auto [id, count] : times) {
        INFO("wr_id " << id);
        CHECK(count == 1);
    }
    CHECK(has_pattern(bulk_dst.bytes, 1));
    CHECK(has_pattern(urgent_dst.bytes, 2));

    const auto bulk_at = std::find(order.begin(), order.end(), bulk_id) - order.begin();
    for (std::size_t i = 0; i < order.size(); ++i)
        if (guaranteed.contains(order[i])) {
            INFO("urgent wr_id " << order[i]);
            CHECK(static_cast<std::ptrdiff_t>(i) < bulk_at);
        }
    // Not vacuous: nearly all were submitted while bulk bytes were still queued.
    CHECK(guaranteed.size() >= n_urgent / 2);
    // While urgent work was around, bulk slices were small.
    CHECK(k.small_slices > 0);
    fmt::print("urgent vs bulk: {} of {} urgent writes submitted while bulk bytes were queued; "
               "worst urgent latency {} us, the bulk write took {} ms; {}\n",
               guaranteed.size(), n_urgent,
               std::chrono::duration_cast<std::chrono::microseconds>(urgent_worst).count(),
               std::chrono::duration_cast<std::chrono::milliseconds>(bulk_took).count(), k);
}

TEST_CASE("scheduler: deficit round robin shares one queue pair; every byte arrives") {
    loopback lp;
    // The policy passed explicitly: its constructor is explicit, so the
    // defaulted `Policy policy = {}` does not compile for it.
    sched::priority_scheduler<sched::deficit_round_robin> s(lp.a, small_slices(),
                                                            sched::deficit_round_robin{});
    constexpr unsigned per_level = 4;
    const std::uint32_t each = 256 * KiB;
    registered src(lp.pd, 2 * per_level * each), dst(lp.pd, 2 * per_level * each);
    fill_pattern(src.bytes, 8);
    // Level 1 (weight 64) and level 6 (weight 2), all submitted up front: both
    // levels stay ready until level 1 is done, so the order of picks does not
    // depend on timing. Level 1 gets 32 times level 6's bytes: its 1 MiB goes
    // out while level 6 posts some 32 KiB, less than one of its requests.
    for (unsigned i = 0; i < per_level; ++i) {
        REQUIRE(s.write(sched::priority{1}, src.mr.local(i * each, each), dst.mr.remote(), i * each,
                        10 + i) == status::ok);
        const std::uint32_t off = (per_level + i) * each;
        REQUIRE(s.write(sched::priority{6}, src.mr.local(off, each), dst.mr.remote(), off,
                        60 + i) == status::ok);
    }
    const auto got = finish_all(s);
    REQUIRE(got.size() == 2 * per_level);
    std::map<std::uint64_t, int> times;
    for (const auto& c : got) {
        CHECK(c.ok());
        ++times[c.wr_id];
    }
    CHECK(times.size() == 2 * per_level);
    CHECK(has_pattern(dst.bytes, 8));
    // FIFO within a level; level 1 finishes before any request of level 6.
    std::vector<std::uint64_t> order;
    order.reserve(got.size());
    for (const auto& c : got)
        order.push_back(c.wr_id);
    CHECK(order == std::vector<std::uint64_t>{10, 11, 12, 13, 60, 61, 62, 63});
}

TEST_CASE("scheduler: a send is posted whole; its bytes arrive") {
    loopback lp;
    sched::priority_scheduler<> s(lp.a, small_slices());
    const std::uint32_t len = 48 * KiB; // many small slices' worth, yet one work request
    registered src(lp.pd, len), rbuf(lp.pd, 128 * KiB);
    fill_pattern(src.bytes, 23);
    REQUIRE(lp.b.post_recv(rbuf.mr.local(0, 64 * KiB), 1) == status::ok);
    REQUIRE(lp.b.post_recv(rbuf.mr.local(64 * KiB, 64 * KiB), 2) == status::ok);

    REQUIRE(s.send(sched::normal, src.mr.local(), 31) == status::ok);
    REQUIRE(s.send_imm(sched::urgent, src.mr.local(0, 300), 0x1234, 32) == status::ok);
    const auto got = finish_all(s);
    REQUIRE(got.size() == 2);
    std::map<std::uint64_t, verbs::completion> by_id;
    for (const auto& c : got)
        by_id[c.wr_id] = c;
    REQUIRE(by_id.size() == 2);
    CHECK(by_id[31].ok());
    CHECK(by_id[31].opcode == IBV_WC_SEND);
    CHECK(by_id[32].ok());
    CHECK(s.counters().slices == 2);

    std::vector<verbs::completion> received;
    verbs::completion c[4];
    const auto deadline = clock_type::now() + 5s;
    while (received.size() < 2 && clock_type::now() < deadline) {
        const int n = polled(lp.b.poll_recv(c));
        received.insert(received.end(), c, c + n);
    }
    REQUIRE(received.size() == 2);
    // The sends were posted in one scheduling pass or two; either way the
    // receives are taken in the order they were posted.
    for (const auto& r : received) {
        CHECK(r.ok());
        const std::size_t base = r.wr_id == 1 ? 0 : 64 * KiB;
        if (r.byte_len == len) {
            CHECK_FALSE(r.has_imm);
            CHECK(has_pattern(std::span(rbuf.bytes).subspan(base, len), 23));
        } else {
            CHECK(r.byte_len == 300);
            CHECK(r.has_imm);
            CHECK(r.imm == 0x1234);
            CHECK(has_pattern(std::span(rbuf.bytes).subspan(base, 300), 23));
        }
    }
}

TEST_CASE("scheduler: an error in one slice fails exactly its request") {
    loopback lp;
    sched::priority_scheduler<> s(lp.a, small_slices());
    const std::uint32_t len = 256 * KiB;
    registered src(lp.pd, 4 * len);
    registered dst_a(lp.pd, len, std::byte{0xee}), dst_c(lp.pd, len, std::byte{0xee});
    registered dst_d(lp.pd, len, std::byte{0xee});
    for (unsigned i = 0; i < 4; ++i)
        fill_pattern(std::span(src.bytes).subspan(i * len, len), 40 + i);

    std::uint32_t b_valid = 0; // bytes of B's target that are registered
    SECTION("a remote range beyond the registration fails a middle slice") {
        b_valid = 96 * KiB;
    }
    SECTION("a wrong rkey fails the first slice") {
        b_valid = 0;
    }
    registered dst_b(lp.pd, std::max<std::uint32_t>(b_valid, 4096), std::byte{0xee});
    remote_buffer<all_rights> b_token = dst_b.mr.remote();
    if (b_valid == 0)
        b_token.rkey ^= 0x5a5a00;
    // The token claims more than was registered: the scheduler's range check
    // passes, the responder's fails in the slice that crosses the end.
    b_token.length = 4 * MiB;

    // A, B and C at one level (FIFO: A's slices, then B's, then C's); D less urgent.
    REQUIRE(s.write(sched::normal, src.mr.local(0, len), dst_a.mr.remote(), 0, 1) == status::ok);
    REQUIRE(s.write(sched::normal, src.mr.local(len, len), b_token, 0, 2) == status::ok);
    REQUIRE(s.write(sched::normal, src.mr.local(2 * len, len), dst_c.mr.remote(), 0, 3) ==
            status::ok);
    REQUIRE(s.write(sched::bulk, src.mr.local(3 * len, len), dst_d.mr.remote(), 0, 4) ==
            status::ok);
    const auto got = finish_all(s);

    std::map<std::uint64_t, int> times;
    std::map<std::uint64_t, ibv_wc_status> st;
    for (const auto& c : got) {
        ++times[c.wr_id];
        st[c.wr_id] = c.status;
    }
    REQUIRE(times.size() == 4);
    for (auto [id, n] : times) {
        INFO("wr_id " << id);
        CHECK(n == 1);
    }
    CHECK(st[1] == IBV_WC_SUCCESS);
    CHECK(st[2] == IBV_WC_REM_ACCESS_ERR);
    CHECK(st[3] == IBV_WC_WR_FLUSH_ERR);
    CHECK(st[4] == IBV_WC_WR_FLUSH_ERR);
    CHECK(has_pattern(dst_a.bytes, 40));
    // With a 32 KiB budget and 64 KiB slices one slice is in flight at a
    // time: C was never posted, so none of its bytes moved.
    CHECK(all_equal(dst_c.bytes, std::byte{0xee}));
    if (b_valid != 0) {
        // B's slices before the failing one landed.
        CHECK(has_pattern(std::span(dst_b.bytes).first(64 * KiB), 41));
        // Of the failing slice, the part inside the registration may or may
        // not have been written (the device's business); report which.
        const auto head = std::span(dst_b.bytes).subspan(64 * KiB);
        const auto untouched =
            static_cast<std::size_t>(std::count(head.begin(), head.end(), std::byte{0xee}));
        fmt::print("failing slice: {} of its {} bytes inside the registration still hold the "
                   "fill (the pattern repeats 0xee once in 251 bytes)\n",
                   untouched, head.size());
    }

    const auto& k = s.counters();
    INFO(fmt::format("{}", k));
    CHECK(k.completed == 1);
    CHECK(k.failed == 3);
    CHECK(k.in_flight_bytes == 0);
    CHECK(s.failed());
    CHECK(s.write(sched::urgent, src.mr.local(0, 64), dst_a.mr.remote(), 0, 5) ==
          status::qp_failed);
    CHECK(s.read(sched::normal, src.mr.local(0, 64), dst_a.mr.remote(), 0, 6) == status::qp_failed);
    CHECK(s.outstanding() == 0);
}

TEST_CASE("scheduler: a fenced urgent read after a bulk write sees the written bytes") {
    loopback lp;
    sched::priority_scheduler<> s(lp.a, small_slices());
    const std::uint32_t len = 1 * MiB;
    registered src(lp.pd, len), target(lp.pd, len), back(lp.pd, len);
    fill_pattern(src.bytes, 61);
    fill_pattern(target.bytes, 99); // what an early read would see instead

    REQUIRE(s.write(sched::bulk, src.mr.local(), target.mr.remote(), 0, 1) == status::ok);
    // Urgent, so that without the fence it would overtake the write's slices.
    REQUIRE(s.read(sched::urgent, back.mr.local(), target.mr.remote(), 0, 2, {.fence = true}) ==
            status::ok);
    // Another urgent request after it, unfenced and to another range: not held
    // back by the fence, it overtakes the rest of the bulk write.
    registered small(lp.pd, 64), small_dst(lp.pd, 64);
    fill_pattern(small.bytes, 3);
    REQUIRE(s.write(sched::high, small.mr.local(), small_dst.mr.remote(), 0, 3) == status::ok);

    const auto got = finish_all(s);
    REQUIRE(got.size() == 3);
    std::vector<std::uint64_t> order;
    for (const auto& c : got) {
        CHECK(c.ok());
        order.push_back(c.wr_id);
    }
    CHECK(order == std::vector<std::uint64_t>{3, 1, 2});
    CHECK(has_pattern(target.bytes, 61));
    CHECK(has_pattern(back.bytes, 61));
    CHECK(has_pattern(small_dst.bytes, 3));
}

TEST_CASE("scheduler: a queue pair failed with work queued and none in flight: it fails, no hang") {
    // What a striper's rail_down() or a peer's disconnect does to a rail's
    // queue pair: moved to the error state with nothing posted, it brings
    // no completion; the scheduler must still hand back what it holds.
    loopback lp;
    sched::priority_scheduler<> s(lp.a, small_slices());
    registered src(lp.pd, MiB), dst(lp.pd, MiB);
    REQUIRE(s.write(sched::bulk, src.mr.local(), dst.mr.remote(), 0, 71, {.deferred = true}) ==
            status::ok);
    REQUIRE(s.outstanding() == 1);
    CHECK(s.counters().slices == 0); // held: nothing posted
    s.port().fail();
    const auto got = finish_all(s, 10s);
    REQUIRE(got.size() == 1);
    CHECK(got[0].wr_id == 71);
    CHECK(got[0].status == IBV_WC_WR_FLUSH_ERR);
    CHECK(s.failed());
    CHECK(s.write(sched::urgent, src.mr.local(0, 64), dst.mr.remote(), 0, 72) == status::qp_failed);
}
