// registered_arena with the counting registrar: blocks inside registered areas,
// keys in O(1), size classes, runs and dedicated areas, lazy unmap (watermark,
// trim), the pmr adapter, threads, and a randomized run against a plain model.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory_resource>
#include <random>
#include <thread>
#include <vector>

#include <rdmax/mem/registered_arena.hpp>

#include "../support/catch.hpp"
#include "../support/eventually.hpp"

using namespace rdmax;
using rdmax::test::eventually;
using arena_t = basic_registered_arena<counting_registrar>;

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

arena_options small(std::size_t watermark = std::size_t{1} << 40) {
    arena_options o;
    o.area_bytes = 2 * mib;
    o.high_watermark = watermark;
    o.huge_pages = false;
    // The host's own memory pressure (PSI) would trim at any time and break
    // the exact counts; the pressure test turns it back on.
    o.trim_under_pressure = false;
    return o;
}

} // namespace

TEST_CASE("arena: blocks lie in one registered area, aligned, with that area's keys") {
    arena_t a{counting_registrar{}, small()};
    std::vector<arena_t::block> blocks;
    for (std::size_t size : {1ul, 64ul, 100ul, 4096ul, 32768ul, 40000ul, 300000ul, 1500000ul})
        blocks.push_back(a.allocate(size, 64));
    for (const auto& b : blocks) {
        CHECK(reinterpret_cast<std::uintptr_t>(b.data) % 64 == 0);
        const auto k = a.keys_of(b.data);
        REQUIRE(k.has_value());
        CHECK(k->lkey == b.lkey);
        CHECK(a.keys_of(b.data + b.size - 1)->lkey == b.lkey); // the whole block: one area
        std::memset(b.data, 0xab, b.size);                     // the memory is real
        auto lb = a.local<rights::local_write>(b.data, b.size);
        CHECK(lb.lkey == b.lkey);
        auto rb = a.remote<rights::remote_read>(b.data, b.size);
        CHECK(rb.rkey == b.rkey);
    }
    CHECK(a.counters().allocations == blocks.size());
    CHECK(a.registrar_ref().live == a.counters().areas_registered);
    for (const auto& b : blocks)
        a.deallocate(b.data, b.size);
    CHECK(a.counters().allocated_bytes == 0);
}

TEST_CASE("arena: many small blocks share an area and one key; freed ones are reused") {
    arena_t a{counting_registrar{}, small()};
    std::vector<arena_t::block> blocks;
    blocks.reserve(10000);
    for (int i = 0; i < 10000; ++i)
        blocks.push_back(a.allocate(64));
    CHECK(a.counters().areas_registered == 1); // 640 KB: one 2 MiB area
    std::map<std::byte*, int> seen;
    for (const auto& b : blocks)
        CHECK(seen.emplace(b.data, 0).second); // all distinct
    const auto regs = a.registrar_ref().regs;
    for (const auto& b : blocks)
        a.deallocate(b.data, b.size);
    for (int i = 0; i < 10000; ++i)
        blocks[static_cast<std::size_t>(i)] = a.allocate(64);
    CHECK(a.registrar_ref().regs == regs); // nothing registered again
    for (const auto& b : blocks)
        a.deallocate(b.data, b.size);
    // One empty span per class stays ready (so a block freed and allocated
    // again does not move a span each time); trim() takes it back with the area.
    CHECK(a.idle_bytes() == 0);
    CHECK(a.trim() == 2 * mib);
    CHECK(a.registrar_ref().live == 0);
}

TEST_CASE("arena: freed areas stay registered up to the watermark; trim gives them back") {
    arena_t a{counting_registrar{}, small()};
    auto b1 = a.allocate(1500000); // dedicated areas
    auto b2 = a.allocate(1500000);
    CHECK(a.counters().areas_registered == 2);
    a.deallocate(b1.data, b1.size);
    a.deallocate(b2.data, b2.size);
    CHECK(a.registrar_ref().live == 2); // lazily kept
    auto b3 = a.allocate(1400000);      // reuses one
    CHECK(a.counters().areas_registered == 2);
    CHECK(a.trim() == 2 * mib); // the idle one only: b3's area is in use
    CHECK(a.registrar_ref().live == 1);
    a.deallocate(b3.data, b3.size);
    CHECK(a.trim() == 2 * mib);
    CHECK(a.registrar_ref().live == 0);
    CHECK(a.counters().areas_released == 2);
    CHECK(a.counters().trims == 2);
}

TEST_CASE("arena: above the high watermark idle areas go back in the background") {
    arena_t a{counting_registrar{}, small(0)}; // keep nothing idle
    std::vector<arena_t::block> blocks;
    blocks.reserve(4);
    for (int i = 0; i < 4; ++i)
        blocks.push_back(a.allocate(1500000));
    CHECK(a.registrar_ref().live == 4);
    for (const auto& b : blocks)
        a.deallocate(b.data, b.size);
    CHECK(eventually([&] { return a.counters().areas_released == 4; }));
    CHECK(a.registrar_ref().live == 0);
    CHECK(a.counters().registered_bytes == 0);
}

TEST_CASE("arena: a pmr vector lives in registered memory and finds its key in O(1)") {
    arena_t a{counting_registrar{}, small()};
    arena_t::resource res(a);
    std::pmr::vector<std::byte> v(&res);
    for (int i = 0; i < 100000; ++i)
        v.push_back(static_cast<std::byte>(i)); // grows through several size classes
    const auto k = a.keys_of(v.data());
    REQUIRE(k.has_value());
    CHECK(a.local<rights::local_write>(v.data(), v.size()).lkey == k->lkey);
    std::pmr::vector<float> f(1000, 1.0F, &res);
    CHECK(a.keys_of(f.data()).has_value());
    arena_t::resource other(a);
    CHECK(res.is_equal(other));
    CHECK_FALSE(res.is_equal(*std::pmr::new_delete_resource()));
}

TEST_CASE("arena: bad requests are refused, foreign pointers ignored") {
    arena_t a{counting_registrar{}, small()};
    CHECK_THROWS_AS(a.allocate(0), std::bad_alloc);
    CHECK_THROWS_AS(a.allocate(64, 48), std::bad_alloc);      // not a power of two
    CHECK_THROWS_AS(a.allocate(64, 1 << 20), std::bad_alloc); // beyond a span
    CHECK_THROWS_AS(a.allocate(std::size_t{1} << 60), std::bad_alloc);
    auto b = a.allocate(128);
    CHECK_THROWS_AS(a.local<rights::local_write>(b.data, 4 * mib), rdmax::error);
    int outside = 0;
    CHECK_FALSE(a.keys_of(&outside).has_value());
    CHECK_THROWS_AS(a.remote<rights::remote_read>(&outside, 4), rdmax::error);
    a.deallocate(&outside, sizeof outside); // not the arena's: ignored
    a.deallocate(nullptr, 0);
    arena_options o = small();
    o.area_bytes = 3 * mib;
    CHECK_THROWS_AS((arena_t{counting_registrar{}, o}), rdmax::error);
    arena_options ro = small();
    ro.area_rights = rights::local_write;
    arena_t local_only{counting_registrar{}, ro};
    auto lb = local_only.allocate(64);
    CHECK_THROWS_AS(local_only.remote<rights::remote_read>(lb.data, 64), rdmax::error);
    a.deallocate(b.data, b.size);
}

TEST_CASE("arena: options read RDMAX_ARENA_* and refuse malformed values") {
    setenv("RDMAX_ARENA_AREA_BYTES", "4M", 1);
    setenv("RDMAX_ARENA_HIGH_WATERMARK", "1G", 1);
    setenv("RDMAX_ARENA_HUGE_PAGES", "0", 1);
    setenv("RDMAX_ARENA_PSI", "no", 1);
    const auto o = arena_options{}.with_env();
    CHECK(o.area_bytes == 4 * mib);
    CHECK(o.high_watermark == 1024 * mib);
    CHECK_FALSE(o.huge_pages);
    CHECK_FALSE(o.trim_under_pressure);
    setenv("RDMAX_ARENA_AREA_BYTES", "3M", 1);
    CHECK_THROWS_WITH(arena_options{}.with_env(),
                      Catch::Matchers::Contains("RDMAX_ARENA_AREA_BYTES"));
    for (const char* v : {"RDMAX_ARENA_AREA_BYTES", "RDMAX_ARENA_HIGH_WATERMARK",
                          "RDMAX_ARENA_HUGE_PAGES", "RDMAX_ARENA_PSI"})
        unsetenv(v);
}

TEST_CASE("arena: two threads allocate and free concurrently") {
    arena_t a{counting_registrar{}, small()};
    std::atomic<int> corrupted{0}; // Catch's assertions are for one thread only
    auto work = [&](unsigned seed) {
        std::mt19937 rng(seed);
        std::vector<arena_t::block> mine;
        for (int i = 0; i < 20000; ++i) {
            if (mine.empty() || rng() % 3 != 0) {
                auto b = a.allocate(64u << (rng() % 8));
                std::memset(b.data, static_cast<int>(seed), b.size);
                mine.push_back(b);
            } else {
                const auto k = rng() % mine.size();
                const auto& b = mine[k];
                if (!std::all_of(b.data, b.data + b.size,
                                 [&](std::byte x) { return x == static_cast<std::byte>(seed); }))
                    corrupted.fetch_add(1);
                a.deallocate(mine[k].data, mine[k].size);
                mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(k));
            }
        }
        for (const auto& b : mine)
            a.deallocate(b.data, b.size);
    };
    std::thread t1(work, 1u), t2(work, 2u);
    t1.join();
    t2.join();
    CHECK(corrupted.load() == 0);
    CHECK(a.counters().allocated_bytes == 0);
}

TEST_CASE("arena: 100000 random allocations and frees against a model; no overlap, no leak") {
    arena_t a{counting_registrar{}, small(4 * mib)};
    std::mt19937_64 rng(11);
    struct live {
        std::size_t size;
        std::uint8_t fill;
    };
    std::map<std::uintptr_t, live> model; // start -> block
    for (int op = 0; op < 100000; ++op) {
        if (model.empty() || rng() % 2 == 0) {
            const std::size_t size = rng() % 8 == 0 ? 1 + rng() % (3 * mib) : 1 + rng() % 9000;
            const std::size_t align = std::size_t{1} << (rng() % 13);
            auto b = a.allocate(size, align);
            const auto at = reinterpret_cast<std::uintptr_t>(b.data);
            REQUIRE(at % align == 0);
            // No overlap with any live block.
            auto next = model.lower_bound(at);
            if (next != model.end())
                REQUIRE(at + size <= next->first);
            if (next != model.begin())
                REQUIRE(std::prev(next)->first + std::prev(next)->second.size <= at);
            REQUIRE(a.keys_of(b.data + size - 1)->lkey == b.lkey);
            const auto fill = static_cast<std::uint8_t>(rng());
            std::memset(b.data, fill, std::min<std::size_t>(size, 256));
            model.emplace(at, live{size, fill});
        } else {
            auto it = model.begin();
            std::advance(it, static_cast<std::ptrdiff_t>(rng() % model.size()));
            auto* p = reinterpret_cast<std::byte*>(it->first);
            const std::size_t n = std::min<std::size_t>(it->second.size, 256);
            REQUIRE(std::all_of(p, p + n, [&](std::byte x) { // nobody wrote over it
                return x == static_cast<std::byte>(it->second.fill);
            }));
            a.deallocate(p, it->second.size);
            model.erase(it);
        }
        if (op % 10000 == 0)
            a.trim();
    }
    for (const auto& [at, b] : model)
        a.deallocate(reinterpret_cast<void*>(at), b.size);
    CHECK(a.counters().allocated_bytes == 0);
    a.trim();
    CHECK(a.registrar_ref().live == 0);
}

TEST_CASE("arena: memory pressure trims idle areas") {
    arena_options o = small();
    o.trim_under_pressure = true;
    arena_t a{counting_registrar{}, o};
    auto b = a.allocate(1500000);
    a.deallocate(b.data, b.size);
    // A real event from a loaded host may come first, and trim just the same.
    const auto real_events = a.counters().pressure_events;
    CHECK((a.registrar_ref().live == 1 || a.counters().pressure_events > real_events));
    detail::simulate_memory_pressure(); // what the PSI watcher does on an event
    CHECK(a.registrar_ref().live == 0);
    CHECK(a.counters().pressure_events >= real_events + 1);
    std::string why;
    if (!memory_pressure_subscription::available(&why))
        WARN("no PSI trigger here: " << why);
}

TEST_CASE("arena: a dedicated area of any size is found whole (not only whole area units)") {
    arena_options o = small();
    o.area_bytes = 4 * mib;
    arena_t a{counting_registrar{}, o};
    for (const std::size_t size : {3 * mib, 6 * mib, 10 * mib + 12345}) {
        auto b = a.allocate(size); // 4, 6 and 12 MiB dedicated areas
        CHECK(a.keys_of(b.data + size - 1)->lkey == b.lkey);
        CHECK(a.local<rights::local_write>(b.data, size).lkey == b.lkey);
        std::memset(b.data + size - 4096, 1, 4096);
        a.deallocate(b.data, b.size);
    }
    a.trim();
    CHECK(a.registrar_ref().live == 0);
}
