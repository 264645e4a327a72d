// rail_registrar: one range registered on every rail (an inner registrar
// each: counting ones here), rolled back when one refuses, and the
// registration cache over it handing back every rail's key from one lookup;
// and how a rail finds the peer's matching rail (rail_set::same_subnet).

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include <rdmax/mem/rail_arena.hpp>
#include <rdmax/mem/rail_cache.hpp>
#include <rdmax/mem/rail_registrar.hpp>
#include <rdmax/mem/registration_cache.hpp>
#include <rdmax/verbs/port_watch.hpp>

#include "../support/catch.hpp"

using namespace rdmax;

namespace {

using rails_t = rail_registrar<counting_registrar>;
constexpr rights rw = rights::local_write | rights::remote_write | rights::remote_read;

/// Two rails whose keys differ: rail 1's counter starts further on.
rails_t two_rails() {
    std::vector<counting_registrar> per_rail(2);
    per_rail[1].regs = 100;
    return rails_t(std::move(per_rail));
}

// What keeps pointers into a rail_set cannot be made from a temporary one.
static_assert(!std::is_constructible_v<verbs::port_watch, verbs::rail_set&&>);
static_assert(std::is_constructible_v<verbs::port_watch, const verbs::rail_set&>);
template <class S>
concept cache_from = requires(S&& s) { make_rail_cache(std::forward<S>(s)); };
static_assert(!cache_from<verbs::rail_set>);
static_assert(cache_from<const verbs::rail_set&>);
template <class S>
concept arena_from = requires(S&& s) { make_rail_arena(std::forward<S>(s)); };
static_assert(!arena_from<verbs::rail_set>);
static_assert(arena_from<const verbs::rail_set&>);

} // namespace

TEST_CASE("rail_registrar: one reg registers on every rail; dereg on every rail") {
    rails_t r = two_rails();
    std::vector<std::byte> buf(8192);
    const rails_t::handle h = r.reg(buf.data(), buf.size(), rw);
    CHECK(h.rails == 2);
    CHECK(r.rail(0).live == 1);
    CHECK(r.rail(1).live == 1);
    CHECK(rails_t::keys(h).lkey == rails_t::keys(h, 0).lkey);
    CHECK(rails_t::keys(h, 0).lkey != rails_t::keys(h, 1).lkey);
    CHECK(rails_t::keys(h, 3).rkey == 0); // no key for a rail it has none for
    const rail_local<rw> l = rails_t::local<rw>(h, buf.data(), buf.size());
    CHECK(l.rails == 2);
    CHECK(l.lkey[1] == rails_t::keys(h, 1).lkey);
    const rail_remote<rw> t = rails_t::remote<rw>(h, buf.data(), buf.size());
    CHECK(t.rkey[0] == rails_t::keys(h, 0).rkey);
    CHECK(t.addr == reinterpret_cast<std::uintptr_t>(buf.data()));
    r.dereg(h);
    CHECK(r.rail(0).live == 0);
    CHECK(r.rail(1).live == 0);
}

TEST_CASE("rail_registrar: a rail that refuses leaves the range registered on none") {
    rails_t r = two_rails();
    r.rail(1).fail_next = 1;
    r.rail(1).fail_errno = ENOMEM;
    std::vector<std::byte> buf(4096);
    CHECK_THROWS_AS(r.reg(buf.data(), buf.size(), rw), rdmax::error);
    CHECK(r.rail(0).regs == 1);
    CHECK(r.rail(0).live == 0); // rolled back
    CHECK(r.rail(1).live == 0);
    CHECK_THROWS_AS(rails_t(std::vector<counting_registrar>(5)), rdmax::error);
    CHECK_THROWS_AS(rails_t(std::vector<counting_registrar>{}), rdmax::error);
}

TEST_CASE("rail_registrar: the registration cache over it: one lookup, every rail's key") {
    registration_cache<rails_t> c{two_rails()};
    std::vector<std::byte> buf(64 * 1024);
    auto h1 = c.get<rw>(buf.data(), 16 * 1024);
    auto h2 = c.get<rw>(buf.data() + 4096, 4096); // a hit
    CHECK(c.counters().hits == 1);
    CHECK(c.registrar_ref().rail(0).regs == 1);
    CHECK(c.registrar_ref().rail(1).regs == 101);
    const rails_t::handle reg = h2.registration();
    CHECK(reg.rails == 2);
    CHECK(rails_t::keys(reg, 1).rkey == 101);
    CHECK(h2.lkey() == rails_t::keys(reg, 0).lkey);
}

TEST_CASE("rail_registrar: rails on ports of one device share its registration and key") {
    // Three rails over two devices: rails 0 and 2 are ports of device 0.
    std::vector<counting_registrar> per_domain(2);
    per_domain[1].regs = 100;
    rails_t r(std::move(per_domain), {0, 1, 0});
    CHECK(r.rails() == 3);
    CHECK(r.domains() == 2);
    std::vector<std::byte> buf(4096);
    const rails_t::handle h = r.reg(buf.data(), buf.size(), rw);
    CHECK(h.rails == 3);
    CHECK(h.domains == 2);
    CHECK(r.rail(0).live == 1); // one registration on device 0, not two
    CHECK(r.rail(1).live == 1);
    CHECK(rails_t::keys(h, 2).rkey == rails_t::keys(h, 0).rkey);
    CHECK(rails_t::keys(h, 1).rkey != rails_t::keys(h, 0).rkey);
    const rail_remote<rw> t = rails_t::remote<rw>(h, buf.data(), buf.size());
    CHECK(t.rails == 3);
    CHECK(t.rkey[2] == t.rkey[0]);
    r.dereg(h);
    CHECK(r.rail(0).live == 0);
    CHECK(r.rail(1).live == 0);
    // Maps that leave a domain unused, or point past the domains, are refused.
    CHECK_THROWS_AS(rails_t(std::vector<counting_registrar>(2), {0, 0}), rdmax::error);
    CHECK_THROWS_AS(rails_t(std::vector<counting_registrar>(2), {0, 2}), rdmax::error);
    CHECK_THROWS_AS(rails_t(std::vector<counting_registrar>(1), {0, 0, 0, 0, 0}), rdmax::error);
}

TEST_CASE(
    "rail_registrar: an arena over it registers each area once per rail; blocks get every key") {
    arena_options o;
    o.area_bytes = std::size_t{2} << 20;
    o.huge_pages = false;
    o.trim_under_pressure = false;
    basic_registered_arena<rails_t> arena(two_rails(), o);
    const auto a = arena.allocate(4096);
    const auto b = arena.allocate(8192);
    CHECK(arena.registrar_ref().rail(0).regs == 1); // one area, registered once on each rail
    CHECK(arena.registrar_ref().rail(1).regs == 101);
    const rail_local<rw> l = rail_block_local<rw>(arena, b.data, 8192);
    CHECK(l.rails == 2);
    CHECK(l.lkey[0] == a.lkey); // rail 0's keys are what the arena hands out
    CHECK(l.lkey[1] != l.lkey[0]);
    const rail_remote<rw> t = rail_block_remote<rw>(arena, a.data, 4096);
    CHECK(t.rkey[0] == a.rkey);
    CHECK(t.rkey[1] == rails_t::keys(*arena.registration_of(a.data), 1).rkey);
    std::vector<std::byte> outside(64);
    CHECK_THROWS_AS(rail_block_local<rw>(arena, outside.data(), 64), rdmax::error);
    arena.deallocate(a.data, 4096);
    arena.deallocate(b.data, 8192);
}

TEST_CASE("rail_set::same_subnet: the first prefix bits of two IPv4 addresses") {
    using verbs::rail_set;
    CHECK(rail_set::same_subnet("192.0.2.1", "192.0.2.254", 24));
    CHECK_FALSE(rail_set::same_subnet("192.0.2.1", "192.0.3.1", 24));
    CHECK(rail_set::same_subnet("192.0.2.1", "192.0.3.1", 23));
    CHECK(rail_set::same_subnet("203.0.113.1", "203.0.113.2", 32) == false);
    CHECK(rail_set::same_subnet("203.0.113.1", "203.0.113.1", 32));
    CHECK(rail_set::same_subnet("10.1.2.3", "10.200.0.0", 8));
    CHECK(rail_set::same_subnet("10.1.2.3", "138.1.2.3", 1) == false);
    CHECK(rail_set::same_subnet("10.1.2.3", "74.1.2.3", 1));
    // No subnet known (prefix 0), or not one: never a match.
    CHECK_FALSE(rail_set::same_subnet("192.0.2.1", "192.0.2.1", 0));
    CHECK_FALSE(rail_set::same_subnet("192.0.2.1", "192.0.2.1", 33));
    CHECK_FALSE(rail_set::same_subnet("192.0.2.1", "fe80::1", 24));
    CHECK_FALSE(rail_set::same_subnet("192.0.2.1", "rdmax-host0", 24));
    CHECK_FALSE(rail_set::same_subnet("", "", 24));
    CHECK_FALSE(rail_set::same_subnet("192.0.2.1", std::string(64, '1'), 24));
    CHECK_FALSE(rail_set::same_subnet("192.0.2.1", std::string("192.0.2.2\0junk", 14), 24));
}
