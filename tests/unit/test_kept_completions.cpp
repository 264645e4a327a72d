// The keep of a queue pair's send completions (wait_send_for, wait_send_slots):
// oldest first, each exactly once, within the room it was made with.
#include <cstdint>
#include <vector>

#include <rdmax/detail/verbs/kept_completions.hpp>

#include "../support/catch.hpp"

using rdmax::verbs::completion;
using rdmax::verbs::kept_completions;

namespace {
completion done(std::uint64_t wr_id, ibv_wc_status st = IBV_WC_SUCCESS) {
    completion c;
    c.wr_id = wr_id;
    c.status = st;
    return c;
}

std::vector<std::uint64_t> take_all(kept_completions& k, std::size_t chunk) {
    std::vector<std::uint64_t> ids;
    std::vector<completion> out(chunk);
    while (int n = k.take(out))
        for (int i = 0; i < n; ++i)
            ids.push_back(out[static_cast<std::size_t>(i)].wr_id);
    return ids;
}
} // namespace

TEST_CASE("kept completions come out oldest first, each once, across the ring's wrap") {
    kept_completions k(5);
    CHECK(k.capacity() == 5);
    CHECK(k.room() == 5);
    std::uint64_t next = 0, expect = 0;
    // Keep 3 and take 2, again and again: the ring wraps many times.
    for (int round = 0; round < 50; ++round) {
        while (k.room() > 0 && next < expect + 5)
            k.push(done(next++));
        completion out[2];
        const int n = k.take(out);
        REQUIRE(n == 2);
        CHECK(out[0].wr_id == expect++);
        CHECK(out[1].wr_id == expect++);
        CHECK(k.capacity() == 5); // push never grew it
    }
    const auto rest = take_all(k, 1);
    for (std::uint64_t id : rest)
        CHECK(id == expect++);
    CHECK(expect == next);
    CHECK(k.empty());
    completion out[4];
    CHECK(k.take(out) == 0);
}

TEST_CASE("take_id takes the oldest match; the others keep their order") {
    kept_completions k(6);
    // Start part-way round the ring.
    for (std::uint64_t i = 0; i < 4; ++i)
        k.push(done(100 + i));
    completion sink[4];
    REQUIRE(k.take(sink) == 4);
    for (std::uint64_t id : {1, 2, 3, 2, 4, 5})
        k.push(done(id));
    REQUIRE(k.room() == 0);
    const auto two = k.take_id(2);
    REQUIRE(two.has_value());
    CHECK(two->wr_id == 2);
    CHECK(!k.take_id(9).has_value());
    CHECK(k.size() == 5);
    CHECK(take_all(k, 2) == std::vector<std::uint64_t>{1, 3, 2, 4, 5});
}

TEST_CASE("make_room grows the keep and keeps the order; push alone never grows it") {
    kept_completions k(3);
    completion sink[2];
    k.push(done(0));
    k.push(done(1));
    REQUIRE(k.take(sink) == 2); // head now mid-ring
    for (std::uint64_t i = 2; i < 5; ++i)
        k.push(done(i));
    CHECK(k.room() == 0);
    k.make_room(4);
    CHECK(k.room() >= 4);
    for (std::uint64_t i = 5; i < 9; ++i)
        k.push(done(i));
    CHECK(take_all(k, 3) == std::vector<std::uint64_t>{2, 3, 4, 5, 6, 7, 8});
    const std::size_t cap = k.capacity();
    k.make_room(2); // enough room already: nothing changes
    CHECK(k.capacity() == cap);

    kept_completions none; // a moved-from queue pair's: no room, nothing kept
    CHECK(none.room() == 0);
    none.make_room(1);
    none.push(done(7));
    CHECK(take_all(none, 1) == std::vector<std::uint64_t>{7});
}

TEST_CASE("a kept failure is seen; moving the keep moves what it holds") {
    kept_completions k(4);
    k.push(done(1));
    CHECK(!k.any_failed());
    k.push(done(2, IBV_WC_REM_ACCESS_ERR));
    CHECK(k.any_failed());
    kept_completions moved(std::move(k));
    CHECK(moved.size() == 2);
    CHECK(moved.any_failed());
    CHECK(k.empty()); // NOLINT(bugprone-use-after-move): moved-from is empty, by design
    CHECK(k.room() == 0);
    completion out[2];
    REQUIRE(moved.take(out) == 2);
    CHECK(out[0].wr_id == 1);
    CHECK(!out[1].ok());
    CHECK(!moved.any_failed());
}
