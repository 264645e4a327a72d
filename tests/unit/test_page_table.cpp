// page_table: ranges tiled over four levels, checked page by page against a
// plain map; empty nodes are freed.
#include <cstdint>
#include <map>
#include <random>

#include <rdmax/detail/mem/page_table.hpp>

#include "../support/catch.hpp"

namespace {

struct value {
    int id;
};

constexpr unsigned shift = 12;
constexpr std::uintptr_t pg = std::uintptr_t{1} << shift;

} // namespace

TEST_CASE("page_table maps every page of a range to its value, at any alignment and size") {
    rdmax::page_table<value> t(shift);
    value a{1}, b{2}, c{3};
    const auto base = std::uintptr_t{0x7f12'3450'0000};
    t.insert(base + pg, base + 3 * pg, &a);                                 // two pages
    t.insert(base + 3 * pg, base + 3 * pg + (std::uintptr_t{1} << 30), &b); // a GiB, unaligned
    t.insert(std::uintptr_t{1} << 39, (std::uintptr_t{1} << 39) + (std::uintptr_t{1} << 21), &c);
    CHECK(t.find(base) == nullptr);
    CHECK(t.find(base + pg + 17) == &a);
    CHECK(t.find(base + 3 * pg - 1) == &a);
    CHECK(t.find(base + 3 * pg) == &b);
    CHECK(t.find(base + (std::uintptr_t{1} << 29)) == &b);
    CHECK(t.find(base + 3 * pg + (std::uintptr_t{1} << 30)) == nullptr);
    CHECK(t.find((std::uintptr_t{1} << 39) + 5 * pg) == &c);
    CHECK(t.covers(base, base + pg));
    CHECK_FALSE(t.covers(std::uintptr_t{1} << 48, (std::uintptr_t{1} << 48) + pg));
    const auto full = t.bytes();
    t.erase(base + 3 * pg, base + 3 * pg + (std::uintptr_t{1} << 30));
    t.erase(std::uintptr_t{1} << 39, (std::uintptr_t{1} << 39) + (std::uintptr_t{1} << 21));
    CHECK(t.find(base + 3 * pg) == nullptr);
    CHECK(t.find(base + 2 * pg) == &a);
    t.erase(base + pg, base + 3 * pg);
    CHECK(t.find(base + 2 * pg) == nullptr);
    // Emptied nodes are kept for reuse (readers may still be inside them).
    t.insert(base + 3 * pg, base + 3 * pg + (std::uintptr_t{1} << 30), &b);
    CHECK(t.find(base + 3 * pg) == &b);
    CHECK(t.bytes() == full);
}

TEST_CASE("page_table agrees with a plain map over 20000 random inserts and erases") {
    rdmax::page_table<value> t(shift);
    std::map<std::uintptr_t, std::pair<std::uintptr_t, value*>> model; // start -> (end, v)
    std::vector<value> values(64);
    std::mt19937_64 rng(7);
    const auto base = std::uintptr_t{0x5500'0000'0000};
    const auto overlaps = [&](std::uintptr_t s, std::uintptr_t e) {
        auto it = model.upper_bound(s);
        if (it != model.begin() && std::prev(it)->second.first > s)
            return true;
        return it != model.end() && it->first < e;
    };
    for (int op = 0; op < 20000; ++op) {
        const std::uintptr_t s = base + (rng() % 4096) * pg;
        const std::uintptr_t len = (rng() % 4 == 0 ? rng() % 2048 : rng() % 8) * pg + pg;
        if (rng() % 2 == 0 && !overlaps(s, s + len)) {
            value* v = &values[rng() % values.size()];
            t.insert(s, s + len, v);
            model[s] = {s + len, v};
        } else if (!model.empty()) {
            auto it = model.lower_bound(s);
            if (it == model.end())
                it = model.begin();
            t.erase(it->first, it->second.first);
            model.erase(it);
        }
        const std::uintptr_t probe = base + (rng() % 6144) * pg + rng() % pg;
        value* want = nullptr;
        if (auto it = model.upper_bound(probe); it != model.begin()) {
            --it;
            if (it->second.first > probe)
                want = it->second.second;
        }
        REQUIRE(t.find(probe) == want);
    }
    const auto peak = t.bytes();
    for (auto& [s, ev] : model)
        t.erase(s, ev.first);
    for (auto& [s, ev] : model)
        t.insert(s, ev.first, ev.second);
    CHECK(t.bytes() == peak); // the same ranges again: only recycled nodes
    for (auto& [s, ev] : model)
        REQUIRE(t.find(s) == ev.second);
}
