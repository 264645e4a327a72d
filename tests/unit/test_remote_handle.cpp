// Remote handles without a device: the peer-side checks (the issuer's
// incarnation first, then rights and bounds), the incarnations issuers draw,
// the rule that picks how a handle is revoked, RDMAX_HANDLE_REVOKE, and the
// counters' printing.
// (Issuing and revoking need a device: tests/rxe/test_remote_handle.cpp.)
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include <fmt/format.h>

#include <rdmax/mem/handle_issuer.hpp>
#include <rdmax/mem/handle_options.hpp>
#include <rdmax/mem/remote_handle.hpp>

#include "../support/catch.hpp"

using namespace rdmax;

static_assert(std::is_trivially_copyable_v<remote_handle> && sizeof(remote_handle) == 32);
static_assert(std::has_unique_object_representations_v<remote_handle>, "no padding on the wire");
static_assert(valid(rights::local_write | rights::mw_bind));
static_assert(valid(rights::mw_bind));
static_assert(to_ibv(rights::mw_bind) == IBV_ACCESS_MW_BIND);
static_assert(!has(all_rights, rights::mw_bind), "binding is asked for, never implied");
static_assert(has(remote_rights, rights::remote_atomic) &&
              !has(remote_rights, rights::local_write));

TEST_CASE("handle: bounds, length and rights are checked, overflow included") {
    const remote_handle h{0x10000, 4096, 0x1234, static_cast<std::uint32_t>(rights::remote_read)};
    CHECK(h.check(rights::remote_read, 0, 4096) == status::ok);
    CHECK(h.check(rights::remote_read, 4095, 1) == status::ok);
    CHECK(h.check(rights::remote_read, 4096, 1) == status::out_of_range);
    CHECK(h.check(rights::remote_read, 1, 4096) == status::out_of_range);
    CHECK(h.check(rights::remote_read, ~std::uint64_t{0}, 2) == status::out_of_range);
    CHECK(h.check(rights::remote_read, 8, ~std::uint64_t{0}) == status::out_of_range);
    CHECK(h.check(rights::remote_read, 0, 0) == status::zero_length);
    CHECK(h.check(rights::remote_write, 0, 16) == status::not_permitted);
    CHECK(h.check(rights::remote_atomic, 0, 8) == status::not_permitted);
    CHECK(h.check(rights::remote_read | rights::remote_write, 0, 16) == status::not_permitted);
}

TEST_CASE("handle: a handle of another incarnation is refused, before rights and bounds") {
    constexpr std::uint64_t before = 0x1111'2222'3333'4444u; // the issuer that restarted
    constexpr std::uint64_t now = 0x5555'6666'7777'8888u;    // the issuer the peer knows now
    const auto read_only = static_cast<std::uint32_t>(rights::remote_read);
    const remote_handle fresh{0x10000, 4096, 0x1234, read_only, now};
    CHECK(fresh.check(now, rights::remote_read, 0, 4096) == status::ok);
    CHECK(fresh.check(now, rights::remote_write, 0, 16) == status::not_permitted);
    CHECK(fresh.check(now, rights::remote_read, 4096, 1) == status::out_of_range);
    CHECK(fresh.check(now, rights::remote_read, 0, 0) == status::zero_length);

    // The old handle names the same key and address as the new one (keys
    // repeat across restarts): only its epoch tells them apart.
    remote_handle old = fresh;
    old.epoch = before;
    CHECK(old.check_epoch(now) == status::stale_handle);
    CHECK(old.check(now, rights::remote_read, 0, 4096) == status::stale_handle);
    // The epoch is checked first: a stale handle's window and rights say nothing.
    CHECK(old.check(now, rights::remote_write, 0, 16) == status::stale_handle);
    CHECK(old.check(now, rights::remote_read, 4096, 1) == status::stale_handle);
    CHECK(old.check(now, rights::remote_read, 0, 0) == status::stale_handle);
    // A handle of a newer incarnation than the queue pair knows is refused too.
    CHECK(fresh.check(before, rights::remote_read, 0, 4096) == status::stale_handle);

    // A queue pair that knows no incarnation (0, a new connection) posts no
    // issued handle: an old one can never pass before the new epoch is known.
    CHECK(old.check(0, rights::remote_read, 0, 4096) == status::unknown_epoch);
    CHECK(fresh.check(0, rights::remote_read, 0, 4096) == status::unknown_epoch);
    // A token built by hand names no incarnation: it passes only there.
    const remote_handle by_hand{0x10000, 4096, 0x1234, read_only};
    CHECK(by_hand.epoch == 0);
    CHECK(by_hand.check(0, rights::remote_read, 0, 4096) == status::ok);
    CHECK(by_hand.check(now, rights::remote_read, 0, 4096) == status::stale_handle);

    // The epoch crosses the wire with the rest: 32 bytes, copied as bytes.
    std::byte wire[sizeof(remote_handle)];
    std::memcpy(wire, &old, sizeof old);
    remote_handle back;
    std::memcpy(&back, wire, sizeof back);
    CHECK(back.epoch == before);
    CHECK(back.rkey == 0x1234);
    CHECK(back.check(now, rights::remote_read, 0, 1) == status::stale_handle);

    CHECK(to_string(status::stale_handle).find("restarted") != std::string_view::npos);
    CHECK(to_string(status::unknown_epoch).find("set_peer_epoch") != std::string_view::npos);
}

TEST_CASE("handle: every issuer draws an incarnation of its own, never 0") {
    const handle_issuer first;
    const handle_issuer second; // a restart: another issuer, another epoch
    CHECK(first.epoch() != 0);
    CHECK(second.epoch() != 0);
    CHECK(first.epoch() != second.epoch());
    std::set<std::uint64_t> drawn;
    for (int i = 0; i < 10000; ++i)
        drawn.insert(new_epoch());
    CHECK(drawn.size() == 10000);
    CHECK_FALSE(drawn.contains(0));
}

TEST_CASE("handle: a window when it can be had, a registration otherwise") {
    // Each reason, in the order a user would fix them.
    CHECK(why_no_window(true, true, true, true, true) == nullptr);
    CHECK(why_no_window(true, true, true, false, false) ==
          nullptr); // read-only needs no local write
    CHECK(std::string(why_no_window(false, true, true, true, false)).find("type-2") !=
          std::string::npos);
    CHECK(std::string(why_no_window(true, false, true, true, false)).find("queue pair") !=
          std::string::npos);
    CHECK(std::string(why_no_window(true, true, false, true, false)).find("mw_bind") !=
          std::string::npos);
    CHECK(std::string(why_no_window(true, true, true, false, true)).find("local write") !=
          std::string::npos);

    const char* no = "no windows here";
    CHECK(choose_mechanism(revoke_by::automatic, nullptr).by == revoke_by::memory_window);
    CHECK(choose_mechanism(revoke_by::automatic, no).by == revoke_by::memory_region);
    CHECK_FALSE(choose_mechanism(revoke_by::automatic, no).refused);
    CHECK(choose_mechanism(revoke_by::memory_window, nullptr).by == revoke_by::memory_window);
    CHECK_FALSE(choose_mechanism(revoke_by::memory_window, nullptr).refused);
    CHECK(choose_mechanism(revoke_by::memory_window, no).refused); // insisted on: an error
    CHECK(choose_mechanism(revoke_by::memory_region, nullptr).by == revoke_by::memory_region);
    CHECK(choose_mechanism(revoke_by::memory_region, no).by == revoke_by::memory_region);
}

TEST_CASE("handle: options read RDMAX_HANDLE_REVOKE and refuse malformed values") {
    CHECK(handle_options{}.revoke == revoke_by::automatic);
    setenv("RDMAX_HANDLE_REVOKE", "mw", 1);
    CHECK(handle_options{}.with_env().revoke == revoke_by::memory_window);
    setenv("RDMAX_HANDLE_REVOKE", "mr", 1);
    CHECK(handle_options{}.with_env().revoke == revoke_by::memory_region);
    setenv("RDMAX_HANDLE_REVOKE", "auto", 1);
    handle_options forced;
    forced.revoke = revoke_by::memory_region;
    CHECK(forced.with_env().revoke == revoke_by::automatic); // the variable wins
    setenv("RDMAX_HANDLE_REVOKE", "window", 1);
    CHECK_THROWS_WITH(handle_options{}.with_env(),
                      Catch::Matchers::Contains("RDMAX_HANDLE_REVOKE") &&
                          Catch::Matchers::Contains("auto, mw or mr"));
    unsetenv("RDMAX_HANDLE_REVOKE");
    CHECK(forced.with_env().revoke == revoke_by::memory_region); // unset: the options stand
}

TEST_CASE("handle: counters and mechanisms print") {
    handle_counters c;
    c.issued_mw = 3;
    c.issued_mr = 2;
    c.fallbacks = 1;
    c.revoked_mw = 2;
    c.revoked_mw_dealloc = 1;
    c.revoked_mr = 1;
    c.live = 1;
    c.windows_allocated = 2;
    c.windows_reused = 1;
    CHECK(fmt::format("{}", c) ==
          "handles issued 3 by mw, 2 by mr (1 fallbacks); revoked 2 by mw (+1 by deallocation), "
          "1 by mr; live 1; windows allocated 2 reused 1");
    CHECK(fmt::format("{} {} {}", revoke_by::automatic, revoke_by::memory_window,
                      revoke_by::memory_region) == "auto mw mr");
    CHECK(to_string(status::bad_window).find("memory window") != std::string_view::npos);
}
