// The striper over priority schedulers on simulated send queues (one per
// rail, each draining at its own rate): how transfers are shared, one
// completion each, failover when a rail fails under a transfer, a rail's
// return, fences, cancel, foreign completions, refusals, and no allocation
// per transfer.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include <rdmax/sched/basic_striper.hpp>
#include <rdmax/sched/priority_scheduler.hpp>

#include "../support/catch.hpp"
#include "../support/counting_new.hpp"
#include "../support/simulated_send_queue.hpp"

namespace {

using namespace rdmax;
using namespace rdmax::sched;
using rdmax::test::simulated_send_queue;

using sim_scheduler = basic_priority_scheduler<strict_priority, simulated_send_queue>;
using striper = basic_striper<sim_scheduler>;

constexpr rights rw = rights::local_write | rights::remote_write | rights::remote_read;
constexpr std::uint64_t MiB = 1024 * 1024;

// The buffers are never touched: the simulated queues only look at addresses.
std::byte* const local_base = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 32);
constexpr std::uint64_t remote_base = std::uint64_t{1} << 40;

rail_local<rw> local(std::uint64_t length, std::uint32_t rails = max_rails) {
    return {local_base, length, {0x10, 0x11, 0x12, 0x13}, rails};
}
rail_remote<rw> remote(std::uint64_t length = std::uint64_t{1} << 32,
                       std::uint32_t rails = max_rails) {
    return {remote_base, length, {0x20, 0x21, 0x22, 0x23}, rails, 0};
}

scheduler_options sched_options() {
    scheduler_options o;
    o.small_slice = 16 * 1024;
    o.large_slice = 256 * 1024;
    o.budget_bytes = 1 * MiB;
    o.budget_wqes = 16;
    o.hold = std::chrono::hours(1);
    o.max_requests = 64;
    return o;
}

stripe_options stripe(std::uint64_t chunk = 1 * MiB, std::uint64_t min = 256 * 1024) {
    stripe_options o;
    o.chunk = chunk;
    o.stripe_min = min;
    o.chunks_ahead = 2;
    o.max_requests = 64;
    return o;
}

/// `n` rails, each a scheduler on its own simulated queue draining `rate[k]`
/// bytes a step.
struct rig {
    std::vector<std::unique_ptr<sim_scheduler>> rail;
    std::vector<std::unique_ptr<sim_scheduler>> lane; ///< urgent lanes, if any (lane_rig)
    std::vector<std::uint64_t> rate;
    striper st;
    std::vector<verbs::completion> got;

    rig(std::vector<std::uint64_t> rates, stripe_options o = stripe())
        : rate(std::move(rates))
        , st(o) {
        for (std::size_t k = 0; k < rate.size(); ++k) {
            rail.push_back(std::make_unique<sim_scheduler>(sched_options(), strict_priority{}));
            REQUIRE(st.attach(k, *rail[k], 100));
        }
    }
    /// A new queue pair for rail k (after a reconnect).
    void replace(std::size_t k) {
        rail[k] = std::make_unique<sim_scheduler>(sched_options(), strict_priority{});
        REQUIRE(st.attach(k, *rail[k], 100));
    }
    /// One step: the striper polls, each rail's wire moves its bytes.
    int step() {
        std::array<verbs::completion, 8> c;
        const int n = st.poll(c);
        got.insert(got.end(), c.begin(), c.begin() + n);
        for (std::size_t k = 0; k < rail.size(); ++k)
            rail[k]->port().drain(rate[k]);
        for (std::size_t k = 0; k < lane.size(); ++k)
            lane[k]->port().drain(rate[k]);
        return n;
    }
    /// Steps until nothing is outstanding (a step limit fails the test).
    void run(int steps = 1'000'000) {
        for (int i = 0; i < steps; ++i) {
            step();
            if (st.outstanding() == 0)
                return;
        }
        FAIL("the striper did not finish within the step limit");
    }
    /// Completions handed back for `wr_id`.
    [[nodiscard]] std::size_t completions(std::uint64_t wr_id) const {
        return static_cast<std::size_t>(std::count_if(
            got.begin(), got.end(), [&](const verbs::completion& c) { return c.wr_id == wr_id; }));
    }
};

/// Bytes of [remote_base, remote_base + length) covered by the slices of
/// `log` before index `upto`, each byte counted as often as it was written.
void cover(std::map<std::uint64_t, int>& bytes_at, const simulated_send_queue& q,
           std::size_t upto) {
    for (std::size_t i = 0; i < std::min(upto, q.log.size()); ++i) {
        const auto& s = q.log[i].slice;
        // Coverage per 4 KiB page: every piece and slice is page-aligned here.
        for (std::uint64_t a = s.remote_addr; a < s.remote_addr + s.length; a += 4096)
            ++bytes_at[a];
    }
}

} // namespace

TEST_CASE("striper: a large write is shared by two equal rails and completes once") {
    rig r({64 * 1024, 64 * 1024});
    const std::uint64_t len = 64 * MiB;
    REQUIRE(r.st.write(bulk, local(len), remote(), 0, 7) == status::ok);
    r.run();
    REQUIRE(r.got.size() == 1);
    CHECK(r.got[0].wr_id == 7);
    CHECK(r.got[0].ok());
    CHECK(r.got[0].opcode == IBV_WC_RDMA_WRITE);
    const auto& c = r.st.counters();
    CHECK(c.rail_bytes[0] + c.rail_bytes[1] == len);
    // Equal rails: an even share, to within a chunk.
    CHECK(c.rail_bytes[0] >= len / 2 - 1 * MiB);
    CHECK(c.rail_bytes[1] >= len / 2 - 1 * MiB);
    // Every byte written exactly once, with each rail's own key.
    std::map<std::uint64_t, int> at;
    for (std::size_t k = 0; k < 2; ++k) {
        const auto& q = r.rail[k]->port();
        cover(at, q, q.log.size());
        for (const auto& rec : q.log)
            CHECK(rec.slice.rkey == 0x20 + k);
    }
    CHECK(at.size() == len / 4096);
    CHECK(std::all_of(at.begin(), at.end(), [](const auto& e) { return e.second == 1; }));
    CHECK(c.reposts == 0);
    CHECK(c.failovers == 0);
}

TEST_CASE("striper: rails share a transfer in proportion to what each delivers") {
    for (const std::uint64_t ratio : {1, 3}) {
        rig r({ratio * 32 * 1024, 32 * 1024});
        const std::uint64_t len = 64 * MiB;
        REQUIRE(r.st.write(bulk, local(len), remote(), 0, 1) == status::ok);
        REQUIRE(r.st.read(bulk, local(len), remote(), 0, 2) == status::ok);
        r.run();
        CHECK(r.completions(1) == 1);
        CHECK(r.completions(2) == 1);
        const auto& c = r.st.counters();
        const double share0 =
            static_cast<double>(c.rail_bytes[0]) / static_cast<double>(c.rail_bytes[1]);
        INFO("ratio " << ratio << ": rail 0 carried " << share0 << "x rail 1's bytes");
        CHECK(share0 > 0.9 * static_cast<double>(ratio));
        CHECK(share0 < 1.1 * static_cast<double>(ratio));
    }
}

TEST_CASE("striper: a short transfer goes whole to the least-loaded rail") {
    rig r({64 * 1024, 64 * 1024});
    // Rail 0 gets a whole 200 KiB write first (the least loaded of two idle ones).
    REQUIRE(r.st.write(bulk, local(200 * 1024), remote(), 0, 1) == status::ok);
    CHECK(r.rail[0]->outstanding() == 1);
    CHECK(r.rail[1]->outstanding() == 0);
    // Then an urgent 64-byte write: to rail 1, which holds nothing.
    REQUIRE(r.st.write(urgent, local(64), remote(), 8 * MiB, 2) == status::ok);
    CHECK(r.rail[1]->outstanding() == 1);
    r.run();
    CHECK(r.completions(1) == 1);
    CHECK(r.completions(2) == 1);
    CHECK(r.st.counters().rail_bytes[1] == 64);
}

TEST_CASE("striper: a rail that fails under a transfer: its pieces go again on the other") {
    for (const ibv_wc_status why : {IBV_WC_RETRY_EXC_ERR, IBV_WC_WR_FLUSH_ERR}) {
        rig r({64 * 1024, 64 * 1024});
        // Rail 1's fifth slice fails as a link that went away; what follows is flushed.
        r.rail[1]->port().fail_slice = 4;
        r.rail[1]->port().fail_status = why;
        const std::uint64_t len = 32 * MiB;
        REQUIRE(r.st.write(bulk, local(len), remote(), 0, 9) == status::ok);
        r.run();
        REQUIRE(r.got.size() == 1);
        CHECK(r.got[0].ok());
        const auto& c = r.st.counters();
        CHECK(c.failovers == 1);
        CHECK(c.reposts >= 1);
        CHECK(!r.st.rail_up(1));
        CHECK(c.rail_bytes[0] + c.rail_bytes[1] == len);
        // Every byte was written by a slice that completed: rail 0's all, rail 1's
        // up to the one that failed.
        std::map<std::uint64_t, int> at;
        cover(at, r.rail[0]->port(), r.rail[0]->port().log.size());
        const auto& q1 = r.rail[1]->port();
        const auto failed =
            std::find_if(q1.log.begin(), q1.log.end(),
                         [](const simulated_send_queue::record& x) { return x.slice.id == 4; });
        cover(at, q1, static_cast<std::size_t>(failed - q1.log.begin()));
        CHECK(at.size() == len / 4096);
    }
}

TEST_CASE("striper: rail_down() mid-transfer, then the rail comes back and carries bytes") {
    rig r({64 * 1024, 64 * 1024});
    const std::uint64_t len = 32 * MiB;
    REQUIRE(r.st.write(bulk, local(len), remote(), 0, 1) == status::ok);
    for (int i = 0; i < 100; ++i)
        r.step();
    REQUIRE(r.st.counters().rail_bytes[1] > 0);
    r.st.rail_down(1);
    CHECK(!r.st.rail_up(1));
    CHECK(r.st.rails_up() == 1);
    // Its old queue pair still has pieces out: it cannot be replaced yet.
    sim_scheduler fresh(sched_options(), strict_priority{});
    CHECK_FALSE(r.st.attach(1, fresh, 100));
    r.run();
    REQUIRE(r.got.size() == 1);
    CHECK(r.got[0].ok());
    CHECK(r.st.counters().reposts >= 1);
    CHECK(r.st.counters().rail_bytes[0] + r.st.counters().rail_bytes[1] == len);
    // Back: a new queue pair; it takes its share of the next transfer.
    REQUIRE(r.st.rail_idle(1));
    const std::uint64_t before = r.st.counters().rail_bytes[1];
    r.replace(1);
    CHECK(r.st.rail_up(1));
    CHECK(r.st.counters().rejoins == 1);
    REQUIRE(r.st.write(bulk, local(len), remote(), 0, 2) == status::ok);
    r.run();
    CHECK(r.completions(2) == 1);
    CHECK(r.st.counters().rail_bytes[1] - before >= len / 2 - 1 * MiB);
}

TEST_CASE("striper: with no rail left a transfer fails once, after its pieces settled") {
    rig r({64 * 1024, 64 * 1024});
    r.rail[0]->port().fail_slice = 2;
    r.rail[0]->port().fail_status = IBV_WC_RETRY_EXC_ERR;
    r.rail[1]->port().fail_slice = 3;
    r.rail[1]->port().fail_status = IBV_WC_RETRY_EXC_ERR;
    REQUIRE(r.st.write(bulk, local(16 * MiB), remote(), 0, 1) == status::ok);
    REQUIRE(r.st.write(normal, local(100), remote(), 32 * MiB, 2) == status::ok);
    r.run();
    CHECK(r.completions(1) == 1);
    CHECK(r.completions(2) == 1);
    for (const auto& c : r.got)
        CHECK(c.status == IBV_WC_RETRY_EXC_ERR);
    CHECK(r.st.rails_up() == 0);
    CHECK(r.st.write(bulk, local(100), remote(), 0, 3) == status::qp_failed);
    // Nothing of theirs is left in a scheduler.
    CHECK(r.rail[0]->outstanding() == 0);
    CHECK(r.rail[1]->outstanding() == 0);
}

TEST_CASE("striper: a failure that is the transfer's own fails it, not the other transfers") {
    rig r({64 * 1024, 64 * 1024});
    // Rail 0's second slice: the peer refuses the key. Rail 0's queue pair is
    // then in error: its other pieces flush and go again on rail 1.
    r.rail[0]->port().fail_slice = 1;
    r.rail[0]->port().fail_status = IBV_WC_REM_ACCESS_ERR;
    REQUIRE(r.st.write(bulk, local(8 * MiB), remote(), 0, 1) == status::ok);
    REQUIRE(r.st.write(bulk, local(8 * MiB), remote(), 16 * MiB, 2) == status::ok);
    r.run();
    REQUIRE(r.completions(1) == 1);
    REQUIRE(r.completions(2) == 1);
    const auto status_of = [&](std::uint64_t id) {
        return std::find_if(r.got.begin(), r.got.end(),
                            [&](const verbs::completion& c) { return c.wr_id == id; })
            ->status;
    };
    CHECK(status_of(1) == IBV_WC_REM_ACCESS_ERR);
    CHECK(status_of(2) == IBV_WC_SUCCESS);
    CHECK(!r.st.rail_up(0));
}

TEST_CASE("striper: exactly one completion per transfer under random rail failures") {
    for (std::uint32_t seed = 1; seed <= 300; ++seed) {
        std::mt19937 rng(seed);
        const auto rails = 2 + rng() % 3;
        std::vector<std::uint64_t> rates;
        for (std::size_t k = 0; k < rails; ++k)
            rates.push_back((1 + rng() % 8) * 16 * 1024);
        rig r(rates, stripe((1 + rng() % 4) * 512 * 1024, 256 * 1024));
        // Every rail but one may fail, at a random slice, for a rail's reason.
        for (std::size_t k = 1; k < rails; ++k)
            if (rng() % 2 == 0) {
                r.rail[k]->port().fail_slice = rng() % 40;
                r.rail[k]->port().fail_status =
                    rng() % 2 == 0 ? IBV_WC_RETRY_EXC_ERR : IBV_WC_WR_FLUSH_ERR;
            }
        const int n = 1 + static_cast<int>(rng() % 6);
        std::uint64_t bytes = 0;
        for (int i = 0; i < n; ++i) {
            const std::uint64_t len = 1 + rng() % (24 * MiB);
            bytes += len;
            const auto p = priority{static_cast<std::uint8_t>(rng() % priority_levels)};
            const status s = i % 2 == 0 ? r.st.write(p, local(len), remote(), 64 * MiB * i, i)
                                        : r.st.read(p, local(len), remote(), 64 * MiB * i, i);
            REQUIRE(s == status::ok);
        }
        // One rail may also be taken out from outside, mid-way.
        if (rng() % 3 == 0) {
            for (int i = 0; i < 50; ++i)
                r.step();
            r.st.rail_down(rails - 1);
        }
        r.run();
        INFO("seed " << seed);
        REQUIRE(r.got.size() == static_cast<std::size_t>(n));
        for (int i = 0; i < n; ++i)
            CHECK(r.completions(static_cast<std::uint64_t>(i)) == 1);
        for (const auto& c : r.got)
            CHECK(c.ok()); // rail 0 never failed
        std::uint64_t carried = 0;
        for (const std::uint64_t b : r.st.counters().rail_bytes)
            carried += b;
        CHECK(carried == bytes);
    }
}

TEST_CASE("striper: a fenced transfer starts only once every earlier one completed") {
    rig r({64 * 1024, 64 * 1024});
    REQUIRE(r.st.write(bulk, local(4 * MiB), remote(), 0, 1) == status::ok);
    request_flags fenced;
    fenced.fence = true;
    REQUIRE(r.st.read(urgent, local(4 * MiB), remote(), 0, 2, fenced) == status::ok);
    // Until the write completed, the read has nothing in a rail.
    for (int step = 0; r.completions(1) == 0; ++step) {
        REQUIRE(step < 1'000'000);
        std::uint64_t reads = 0;
        for (const auto& q : r.rail)
            for (const auto& rec : q->port().log)
                reads += rec.slice.opcode == IBV_WR_RDMA_READ ? 1 : 0;
        REQUIRE(reads == 0);
        r.step();
    }
    r.run();
    CHECK(r.completions(2) == 1);
}

TEST_CASE("striper: cancel withdraws a transfer none of which went to a rail") {
    stripe_options o = stripe();
    o.chunks_ahead = 1;
    rig r({64 * 1024}, o);
    REQUIRE(r.st.write(bulk, local(8 * MiB), remote(), 0, 1) == status::ok);
    REQUIRE(r.st.write(bulk, local(8 * MiB), remote(), 0, 2) == status::ok);
    CHECK_FALSE(r.st.cancel(1)); // under way
    CHECK(r.st.cancel(2));       // waiting for room
    CHECK_FALSE(r.st.cancel(2));
    r.run();
    CHECK(r.completions(1) == 1);
    CHECK(r.completions(2) == 0);
}

TEST_CASE("striper: completions of the caller's own requests on a rail pass through") {
    rig r({64 * 1024, 64 * 1024});
    const local_buffer<rw> msg{local_base, 64, 0x10};
    REQUIRE(r.rail[0]->send(urgent, msg, 0x1234) == status::ok);
    REQUIRE(r.st.write(bulk, local(4 * MiB), remote(), 0, 5) == status::ok);
    r.run();
    for (int i = 0; i < 100 && r.completions(0x1234) == 0; ++i)
        r.step();
    CHECK(r.completions(0x1234) == 1);
    CHECK(r.completions(5) == 1);
    CHECK(r.st.counters().foreign == 1);
}

TEST_CASE("striper: refusals post nothing") {
    rig r({64 * 1024, 64 * 1024});
    CHECK(r.st.write(bulk, local(0), remote(), 0, 1) == status::zero_length);
    CHECK(r.st.write(bulk, local(4096), remote(8192), 4097, 1) == status::out_of_range);
    CHECK(r.st.write(bulk, local(4096), remote(8192), ~0ULL, 1) == status::out_of_range);
    CHECK(r.st.write(priority{priority_levels}, local(64), remote(), 0, 1) == status::out_of_range);
    CHECK(r.st.outstanding() == 0);
    CHECK(r.rail[0]->port().log.empty());
    stripe_options o = stripe();
    o.max_requests = 2;
    rig small({64 * 1024}, o);
    CHECK(small.st.write(bulk, local(64), remote(), 0, 1) == status::ok);
    CHECK(small.st.write(bulk, local(64), remote(), 0, 2) == status::ok);
    CHECK(small.st.write(bulk, local(64), remote(), 0, 3) == status::queue_full);
    small.run();
    CHECK(small.got.size() == 2);
    CHECK(rail_local<rw>::of({local_buffer<rw>{local_base, 64, 1},
                              local_buffer<rw>{local_base + 1, 64, 2}}) == std::nullopt);
    const auto joined =
        rail_remote<rw>::of({remote_buffer<rw>{remote_base, 64, 1, 0}, {remote_base, 64, 2, 0}});
    REQUIRE(joined);
    CHECK(joined->rkey[1] == 2);
    CHECK(joined->rails == 2);
    // Keys for no rail: refused.
    CHECK(r.st.write(bulk, local(64, 0), remote(), 0, 1) == status::not_permitted);
}

TEST_CASE("striper: no allocation per transfer once running") {
    rig r({64 * 1024, 64 * 1024});
    for (int i = 0; i < 4; ++i)
        REQUIRE(r.st.write(bulk, local(4 * MiB), remote(), 0, static_cast<std::uint64_t>(i)) ==
                status::ok);
    r.run();
    r.got.reserve(r.got.size() + 2000);
    for (auto& q : r.rail) { // the simulator's own log grows
        q->port().log.clear();
        q->port().log.reserve(1000000);
    }
    const std::uint64_t before = test::allocations.load();
    for (int i = 0; i < 1000; ++i) {
        REQUIRE(r.st.write(bulk, local(3 * MiB), remote(), 0, 100) == status::ok);
        REQUIRE(r.st.read(urgent, local(64), remote(), 0, 101) == status::ok);
        r.run();
    }
    CHECK(test::allocations.load() == before);
}

TEST_CASE("striper: IBV_WC_LOC_QP_OP_ERR is a rail's failure once per transfer, then its own") {
    // soft-RoCE on Linux 6.1 ends a request posted on a down port so.
    rig r({64 * 1024, 64 * 1024, 64 * 1024});
    r.rail[1]->port().fail_slice = 2;
    r.rail[1]->port().fail_status = IBV_WC_LOC_QP_OP_ERR;
    REQUIRE(r.st.write(bulk, local(16 * MiB), remote(), 0, 1) == status::ok);
    r.run();
    REQUIRE(r.completions(1) == 1);
    CHECK(r.got[0].ok());
    CHECK(r.st.counters().failovers == 1);
    // A transfer whose pieces meet it on two rails: its own fault.
    rig twice({64 * 1024, 64 * 1024, 64 * 1024});
    for (std::size_t k : {1U, 2U}) {
        twice.rail[k]->port().fail_slice = 2;
        twice.rail[k]->port().fail_status = IBV_WC_LOC_QP_OP_ERR;
    }
    REQUIRE(twice.st.write(bulk, local(16 * MiB), remote(), 0, 1) == status::ok);
    twice.run();
    REQUIRE(twice.got.size() == 1);
    CHECK(twice.got[0].status == IBV_WC_LOC_QP_OP_ERR);
    CHECK(twice.st.rails_up() == 1);
}

TEST_CASE("striper: a transfer uses only the rails its buffers have keys for") {
    rig r({64 * 1024, 64 * 1024, 64 * 1024});
    // Keys for rails 0 and 1 only (the remote side has two).
    REQUIRE(r.st.write(bulk, local(16 * MiB), remote(std::uint64_t{1} << 32, 2), 0, 1) ==
            status::ok);
    REQUIRE(r.st.write(urgent, local(64, 2), remote(), 32 * MiB, 2) == status::ok);
    r.run();
    CHECK(r.completions(1) == 1);
    CHECK(r.completions(2) == 1);
    CHECK(r.rail[2]->port().log.empty());
    CHECK(r.st.counters().rail_bytes[2] == 0);
    // Its rails down: it fails, while a transfer with a key for rail 2 goes on.
    rig down({64 * 1024, 64 * 1024, 64 * 1024});
    REQUIRE(down.st.write(bulk, local(16 * MiB), remote(std::uint64_t{1} << 32, 2), 0, 1) ==
            status::ok);
    REQUIRE(down.st.write(bulk, local(16 * MiB), remote(), 32 * MiB, 2) == status::ok);
    down.st.rail_down(0);
    down.st.rail_down(1);
    down.run();
    REQUIRE(down.got.size() == 2);
    for (const auto& c : down.got)
        CHECK((c.wr_id == 1 ? !c.ok() : c.ok()));
}

TEST_CASE("striper: cancel after a scheduler refused a piece frees it; the slot is clean") {
    // A scheduler that holds one request: the second whole transfer's piece
    // is refused (queue_full) and waits in its transfer.
    scheduler_options one_request = sched_options();
    one_request.max_requests = 1;
    sim_scheduler rail0(one_request, strict_priority{});
    sim_scheduler* s0 = &rail0;
    striper st(stripe());
    REQUIRE(st.attach(0, *s0, 100));
    REQUIRE(st.write(bulk, local(64 * 1024), remote(), 0, 1) == status::ok);
    REQUIRE(st.write(bulk, local(100 * 1024), remote(), 0, 2) == status::ok);
    CHECK(st.cancel(2));
    REQUIRE(st.write(bulk, local(4096), remote(), 0, 3) == status::ok);
    std::vector<verbs::completion> got;
    std::array<verbs::completion, 8> c;
    for (int i = 0; i < 100000 && st.outstanding() != 0; ++i) {
        const int n = st.poll(c);
        got.insert(got.end(), c.begin(), c.begin() + n);
        s0->port().drain(64 * 1024);
    }
    REQUIRE(got.size() == 2);
    CHECK(got[0].ok());
    CHECK(got[1].ok());
    // Nothing longer than its own transfer was posted.
    for (const auto& rec : s0->port().log)
        CHECK(rec.slice.length <= 64 * 1024);
}

TEST_CASE("striper: a caller's wr_id with the piece tag passes through untouched") {
    rig r({64 * 1024, 64 * 1024});
    const local_buffer<rw> msg{local_base, 64, 0x10};
    const std::uint64_t forged = striper::piece_tag | 3; // a small index, a free piece
    REQUIRE(r.rail[0]->send(urgent, msg, forged) == status::ok);
    REQUIRE(r.st.write(bulk, local(4 * MiB), remote(), 0, 5) == status::ok);
    r.run();
    for (int i = 0; i < 100 && r.completions(forged) == 0; ++i)
        r.step();
    CHECK(r.completions(forged) == 1);
    CHECK(r.completions(5) == 1);
}

TEST_CASE("striper: small transfers do not starve a striped one of a rail") {
    rig r({96 * 1024, 32 * 1024});
    REQUIRE(r.st.write(bulk, local(64 * MiB), remote(), 0, 1) == status::ok);
    std::uint64_t id = 100;
    for (int step = 0; r.completions(1) == 0; ++step) {
        REQUIRE(step < 1'000'000);
        for (int k = 0; k < 2; ++k)
            REQUIRE(r.st.write(urgent, local(64), remote(), 128 * MiB, id++) == status::ok);
        r.step();
    }
    // The fast rail carried its share (3:1) of the 64 MiB.
    CHECK(r.st.counters().rail_bytes[0] > 40 * MiB);
}

TEST_CASE("striper: a rail that runs dry takes the unstarted last piece of a slower one") {
    rig r({256 * 1024, 16 * 1024}, stripe(1 * MiB, 256 * 1024));
    REQUIRE(r.st.write(bulk, local(24 * MiB), remote(), 0, 1) == status::ok);
    r.run();
    REQUIRE(r.completions(1) == 1);
    CHECK(r.got[0].ok());
    CHECK(r.st.counters().steals > 0);
    // Every byte written exactly once still.
    std::map<std::uint64_t, int> at;
    for (auto& q : r.rail)
        cover(at, q->port(), q->port().log.size());
    CHECK(at.size() == 24 * MiB / 4096);
    CHECK(std::all_of(at.begin(), at.end(), [](const auto& e) { return e.second == 1; }));
}

TEST_CASE("striper: a transfer's own failure withdraws its unstarted pieces from other rails") {
    rig r({64 * 1024, 64 * 1024});
    // Rail 0's first slice: the peer refuses the key.
    r.rail[0]->port().fail_slice = 0;
    r.rail[0]->port().fail_status = IBV_WC_REM_ACCESS_ERR;
    REQUIRE(r.st.write(bulk, local(16 * MiB), remote(), 0, 1) == status::ok);
    r.run();
    REQUIRE(r.got.size() == 1);
    CHECK(r.got[0].status == IBV_WC_REM_ACCESS_ERR);
    CHECK(!r.st.rail_up(0));
    // Rail 1's second piece never started: withdrawn, and rail 1 is still up
    // (its first piece was under way and completed, as the simulated peer
    // took it).
    CHECK(r.st.rail_up(1));
    REQUIRE(r.st.write(bulk, local(4 * MiB), remote(), 32 * MiB, 2) == status::ok);
    r.run();
    CHECK(r.completions(2) == 1);
    CHECK(r.got.back().ok());
}

/// `n` rails as in rig, each with an urgent lane: a second scheduler on a
/// queue of its own. Both of a rail's queues drain at its rate each step
/// (a NIC interleaves its queue pairs).
struct lane_rig : rig {
    explicit lane_rig(std::vector<std::uint64_t> rates, stripe_options o = stripe())
        : rig(std::move(rates), o) {
        for (std::size_t k = 0; k < rate.size(); ++k) {
            lane.push_back(std::make_unique<sim_scheduler>(sched_options(), strict_priority{}));
            REQUIRE(st.rail_idle(k));
            REQUIRE(st.attach(k, *rail[k], 100, lane[k].get()));
        }
    }
};

TEST_CASE("striper: urgent transfers take a rail's urgent lane; bulk and striped ones do not") {
    lane_rig r({64 * 1024, 64 * 1024});
    // A striped write fills both rails' bulk queues, a whole bulk one joins.
    REQUIRE(r.st.write(bulk, local(16 * MiB), remote(), 0, 1) == status::ok);
    REQUIRE(r.st.write(bulk, local(64 * 1024), remote(), 32 * MiB, 2) == status::ok);
    // An urgent write: into a lane, ahead of none of the bulk bytes.
    REQUIRE(r.st.write(urgent, local(64), remote(), 48 * MiB, 3) == status::ok);
    CHECK(r.lane[0]->outstanding() + r.lane[1]->outstanding() == 1);
    CHECK(r.st.counters().lane_pieces == 1);
    // It completes at the second step (the first drains it, the second
    // polls): its lane has nothing else.
    r.step();
    r.step();
    CHECK(r.completions(3) == 1);
    CHECK(r.completions(1) == 0);
    r.run();
    CHECK(r.completions(1) == 1);
    CHECK(r.completions(2) == 1);
    CHECK(r.st.counters().lane_pieces == 1);
    // The lanes carried the 64 bytes and nothing else.
    std::uint64_t lane_bytes = 0;
    for (const auto& l : r.lane)
        for (const auto& x : l->port().log)
            lane_bytes += x.slice.length;
    CHECK(lane_bytes == 64);
    CHECK(r.st.counters().rail_bytes[0] + r.st.counters().rail_bytes[1] ==
          16 * MiB + 64 * 1024 + 64);
}

TEST_CASE("striper: lane_levels sets which levels use a lane; 0, none") {
    for (const std::uint32_t levels : {0U, 3U}) {
        stripe_options o = stripe();
        o.lane_levels = levels;
        lane_rig r({64 * 1024, 64 * 1024}, o);
        REQUIRE(r.st.write(urgent, local(64), remote(), 0, 1) == status::ok);
        REQUIRE(r.st.write(high, local(64), remote(), 4096, 2) == status::ok);
        REQUIRE(r.st.write(normal, local(64), remote(), 8192, 3) == status::ok);
        r.run();
        CHECK(r.st.counters().completed == 3);
        // urgent (0) and high (2) are under 3; normal (4) is not.
        CHECK(r.st.counters().lane_pieces == (levels == 0 ? 0U : 2U));
    }
}

TEST_CASE("striper: a rail whose lane fails is out; its pieces go again; it returns with both") {
    lane_rig r({64 * 1024, 64 * 1024});
    REQUIRE(r.st.write(bulk, local(32 * MiB), remote(), 0, 1) == status::ok);
    for (int i = 0; i < 20; ++i)
        r.step();
    REQUIRE(r.st.counters().rail_bytes[1] > 0);
    // Two urgent writes: one in each rail's lane (the second finds rail 0's
    // busy). Then rail 1's lane breaks (its queue pair to the error state,
    // the urgent write in it flushed): the rail is out as a whole, and
    // both writes and the striped one complete, once each.
    REQUIRE(r.st.write(urgent, local(64), remote(), 40 * MiB, 5) == status::ok);
    REQUIRE(r.st.write(urgent, local(64), remote(), 41 * MiB, 6) == status::ok);
    REQUIRE(r.lane[1]->outstanding() == 1);
    r.lane[1]->port().inject(0x77, IBV_WC_RETRY_EXC_ERR);
    r.run();
    CHECK(r.lane[1]->failed());
    CHECK(r.completions(5) == 1);
    CHECK(r.completions(6) == 1);
    CHECK(r.st.counters().reposts >= 1);
    CHECK(r.completions(1) == 1);
    CHECK(r.got.back().ok());
    CHECK(!r.st.rail_up(1));
    CHECK(r.st.counters().failovers == 1);
    CHECK(r.st.counters().rail_bytes[0] + r.st.counters().rail_bytes[1] == 32 * MiB + 128);
    // An urgent write meanwhile: rail 0's lane.
    REQUIRE(r.st.write(urgent, local(64), remote(), 0, 2) == status::ok);
    CHECK(r.lane[0]->outstanding() == 1);
    r.run();
    CHECK(r.completions(2) == 1);
    // Back with a new pair of queue pairs.
    REQUIRE(r.st.rail_idle(1));
    r.rail[1] = std::make_unique<sim_scheduler>(sched_options(), strict_priority{});
    r.lane[1] = std::make_unique<sim_scheduler>(sched_options(), strict_priority{});
    REQUIRE(r.st.attach(1, *r.rail[1], 100, r.lane[1].get()));
    CHECK(r.st.rail_up(1));
    CHECK(r.st.counters().rejoins == 1);
    // Rail 0's lane is busy: the next urgent write takes rail 1's.
    REQUIRE(r.st.write(urgent, local(64), remote(), 0, 3) == status::ok);
    REQUIRE(r.st.write(urgent, local(64), remote(), 4096, 4) == status::ok);
    CHECK(r.lane[0]->outstanding() == 1);
    CHECK(r.lane[1]->outstanding() == 1);
    r.run();
    CHECK(r.completions(3) == 1);
    CHECK(r.completions(4) == 1);
}

TEST_CASE("striper: rail_down() fails a rail's lane too; a lane may not be its own rail") {
    lane_rig r({64 * 1024, 64 * 1024});
    REQUIRE(r.st.write(urgent, local(64), remote(), 0, 1) == status::ok);
    const std::size_t k = r.lane[0]->outstanding() == 1 ? 0 : 1;
    r.st.rail_down(k);
    CHECK(r.lane[k]->port().failed());
    CHECK(r.rail[k]->port().failed());
    r.run();
    // Its lane's piece came back flushed and went again on the other rail's.
    CHECK(r.completions(1) == 1);
    CHECK(r.got.back().ok());
    CHECK(r.st.counters().reposts == 1);
    CHECK(r.st.counters().lane_pieces == 2);
    sim_scheduler s(sched_options(), strict_priority{});
    CHECK_FALSE(r.st.attach(k, s, 100, &s));
}

TEST_CASE("striper: a rail whose bulk queue pair fails fails its lane too; the lane's piece goes "
          "again") {
    lane_rig r({64 * 1024, 64 * 1024});
    REQUIRE(r.st.write(bulk, local(32 * MiB), remote(), 0, 1) == status::ok);
    for (int i = 0; i < 20; ++i)
        r.step();
    // An urgent write in each lane, then rail 1's bulk queue pair breaks
    // before its lane moved a byte (that lane's rate is 0 from now on).
    REQUIRE(r.st.write(urgent, local(64), remote(), 40 * MiB, 2) == status::ok);
    REQUIRE(r.st.write(urgent, local(64), remote(), 41 * MiB, 3) == status::ok);
    REQUIRE(r.lane[1]->outstanding() == 1);
    r.rate[1] = 0;
    r.rail[1]->port().inject(0x77, IBV_WC_RETRY_EXC_ERR);
    r.run(100'000);
    CHECK(r.lane[1]->port().failed()); // failed with the rail, not left to its retries
    CHECK(!r.st.rail_up(1));
    CHECK(r.completions(1) == 1);
    CHECK(r.completions(2) == 1);
    CHECK(r.completions(3) == 1);
    CHECK(std::all_of(r.got.begin(), r.got.end(),
                      [](const verbs::completion& c) { return c.wr_id == 0x77 || c.ok(); }));
    CHECK(r.st.counters().lane_pieces == 3); // two, and the one sent again
}

TEST_CASE("striper: a scheduler or lane of another rail is refused at attach") {
    lane_rig r({64 * 1024, 64 * 1024});
    // Rail 2 on rail 0's lane, or with rail 1's scheduler as its lane: refused.
    CHECK_FALSE(r.st.attach(2, *r.lane[0], 100));
    sim_scheduler fresh(sched_options(), strict_priority{});
    CHECK_FALSE(r.st.attach(2, fresh, 100, r.rail[1].get()));
    CHECK_FALSE(r.st.attach(2, *r.rail[0], 100));
    // Its own pair: accepted.
    sim_scheduler lane(sched_options(), strict_priority{});
    CHECK(r.st.attach(2, fresh, 100, &lane));
    CHECK(r.st.rails_up() == 3);
}
