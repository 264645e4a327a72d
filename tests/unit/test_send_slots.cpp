// Send-queue slot accounting: the arithmetic that keeps a send queue from
// overflowing under selective signaling, checked against a simulated queue.
#include <deque>
#include <random>

#include <rdmax/detail/verbs/send_slots.hpp>

#include "../support/catch.hpp"

using rdmax::verbs::send_slots;

TEST_CASE("a signal is forced at least every interval requests") {
    send_slots s(16);
    CHECK(s.interval() == 8);
    unsigned run = 0;
    for (int i = 0; i < 100; ++i) {
        const auto c = s.take(i, false);
        run = c.signaled ? 0 : run + 1;
        CHECK(run < s.interval());
        (void)s.complete(c.id, true);
    }
}

TEST_CASE("the interval is clamped to half the depth") {
    CHECK(send_slots(16, 100).interval() == 8);
    CHECK(send_slots(16, 3).interval() == 3);
    CHECK(send_slots(1).interval() == 1);
    CHECK(send_slots(2).interval() == 1);
}

TEST_CASE("a signaled completion frees its slot and every earlier one") {
    send_slots s(8, 4);
    std::uint64_t last_signaled = 0;
    for (int i = 0; i < 8; ++i) {
        const auto c = s.take(100 + i, false);
        if (c.signaled)
            last_signaled = c.id;
    }
    CHECK(s.available() == 0);
    const auto d = s.complete(last_signaled, true);
    CHECK(!d.report); // the library asked for it, not the caller
    CHECK(s.available() == last_signaled + 1);
}

TEST_CASE("the caller's wr_id comes back; failures are always reported") {
    send_slots s(8);
    const auto a = s.take(111, true);
    const auto b = s.take(222, false);
    const auto da = s.complete(a.id, true);
    CHECK(da.report);
    CHECK(da.wr_id == 111);
    const auto db = s.complete(b.id, false); // unsignaled, but it failed (or was flushed)
    CHECK(db.report);
    CHECK(db.wr_id == 222);
}

TEST_CASE("rollback returns the slots of a post that did not happen") {
    send_slots s(8);
    (void)s.take(1, true);
    const auto mark = s.mark();
    (void)s.take(2, false);
    (void)s.take(3, false);
    CHECK(s.available() == 5);
    s.rollback(mark);
    CHECK(s.available() == 7);
    const auto again = s.take(4, false);
    CHECK(again.id == 1); // the slot ids are reused
    s.rollback_to(again.id);
    CHECK(s.available() == 7);
    CHECK(s.take(5, false).signaled); // after a refused post the next one is signaled
}

TEST_CASE("against a simulated send queue: never more in flight than the depth, never stuck") {
    // The device: completes work in order, a few requests per step, and
    // produces a completion only for signaled ones (flushes aside).
    std::mt19937 rng(1234);
    for (std::uint32_t depth : {1u, 2u, 3u, 16u, 100u}) {
        send_slots s(depth, 0);
        std::deque<send_slots::claim> in_flight;
        std::uint64_t next_wr = 0, reported = 0, asked = 0;
        for (int step = 0; step < 20000; ++step) {
            // Post while there is room; a caller asks for a completion 1 time in 10.
            while (s.available() > 0 && rng() % 3 != 0) {
                const bool want = rng() % 10 == 0;
                asked += want;
                in_flight.push_back(s.take(next_wr++, want));
            }
            // The library counts what the device holds, plus retired
            // unsignaled requests it has not heard of yet.
            REQUIRE(in_flight.size() <= s.in_use());
            REQUIRE(s.in_use() <= depth);
            // The device retires up to 4 requests.
            for (int k = 0; k < 4 && !in_flight.empty(); ++k) {
                const auto c = in_flight.front();
                in_flight.pop_front();
                if (c.signaled)
                    reported += s.complete(c.id, true).report;
            }
            // Liveness: when no slot is free, a signaled request is still in
            // flight, and its completion will give slots back.
            if (s.available() == 0) {
                bool signaled_in_flight = false;
                for (const auto& c : in_flight)
                    signaled_in_flight = signaled_in_flight || c.signaled;
                REQUIRE(signaled_in_flight);
            }
        }
        // Drain: each remaining signaled completion frees what precedes it.
        while (!in_flight.empty()) {
            const auto c = in_flight.front();
            in_flight.pop_front();
            if (c.signaled)
                reported += s.complete(c.id, true).report;
        }
        CHECK(reported == asked); // every completion the caller asked for, and no other
    }
}
