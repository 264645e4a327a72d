// Remote handles backed by type-2 memory windows, and by registrations when
// forced: a peer reads and writes through a handle (the bytes that arrived
// are checked); bounds and rights are refused before anything is posted; a
// revoked handle fails at the peer with an error completion within a
// deadline; a re-issued handle has a fresh key, and the stale one never
// matches; after the issuer restarts (destroyed, made again: a new epoch) its
// old handles are refused before posting, even one whose key and address
// repeat the new handle's ([epoch]). The owner's queue pair is lp.b, the
// peer's lp.a (which knows the issuer's epoch, as a peer learns it): the peer's
// requests arrive on lp.b, so windows are bound through lp.b.
//
// SKIP (77) where the device has no type-2 memory windows (the
// registration-backed handles are tested in test_arena.cpp as well).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include <fmt/format.h>
#include <infiniband/verbs.h>

#include <rdmax/mem/handle_issuer.hpp>

#include "../support/eventually.hpp"
#include "../support/loopback.hpp"
#include "../support/skip_reason.hpp"

using namespace rdmax;
using namespace rdmax::test;

namespace {

/// Memory a peer can reach only through windows: local write and binding,
/// no remote right of its own.
constexpr rdmax::rights bindable = rights::local_write | rights::mw_bind;

struct window_memory {
    std::vector<std::byte> bytes;
    memory_region<bindable> mr;
    window_memory(const verbs::protection_domain& pd, std::size_t n)
        : bytes(n)
        , mr(pd, bytes.data(), bytes.size()) {}
};

handle_options by(revoke_by r) {
    handle_options o;
    o.revoke = r;
    o.deadline = std::chrono::seconds(5);
    return o;
}

constexpr rdmax::rights read_write = rights::remote_read | rights::remote_write;

/// The peer's request through a revoked or foreign handle: it must complete,
/// with a remote access error, before the deadline.
void expect_refused_at_peer(verbs::queue_pair<verbs::rc>& peer) {
    const auto done = wait_send(peer, std::chrono::seconds(10));
    CHECK_FALSE(done.ok());
    CHECK(done.status == IBV_WC_REM_ACCESS_ERR);
}

/// Whether the device has put qp into the error state. The responder does
/// that after it sent the NAK that fails the requester's work: a test that
/// goes on from the requester's completion must wait for it.
bool in_error_state(const verbs::queue_pair<verbs::rc>& qp) {
    ibv_qp_attr attr{};
    ibv_qp_init_attr init{};
    return ibv_query_qp(qp.get(), &attr, IBV_QP_STATE, &init) == 0 && attr.qp_state == IBV_QPS_ERR;
}

} // namespace

std::optional<std::string> rdmax::test::skip_reason() {
    if (auto why = device_unavailable())
        return why;
    const auto ctx = open_test_device();
    if (!ctx.limits().memory_windows)
        return fmt::format("{} reports no type-2 memory windows (IBV_DEVICE_MEM_WINDOW_TYPE_2A/2B)",
                           ctx.name());
    return std::nullopt;
}

TEST_CASE("window: the device's memory window capabilities") {
    loopback lp;
    const auto& l = lp.ctx.limits();
    // Reported, for the record: which of type 2A and 2B the device claims.
    fmt::print("{}: memory windows type 2A {}, type 2B {}, max_mw {}\n", l.name,
               l.mw_type_2a ? "yes" : "no", l.mw_type_2b ? "yes" : "no", l.max_mw);
    CHECK(l.memory_windows);
    CHECK(l.max_mw > 0);
    handle_issuer issuer(lp.pd, lp.b, by(revoke_by::automatic));
    CHECK(issuer.memory_windows());
}

TEST_CASE("window: a peer reads and writes through a handle, the bytes arrive") {
    loopback lp;
    window_memory mine(lp.pd, 16384);
    fill_pattern(mine.bytes, 9);
    registered local(lp.pd, 8192);
    handle_issuer issuer(lp.pd, lp.b, by(revoke_by::memory_window));
    lp.a.set_peer_epoch(issuer.epoch()); // as the peer learns it on connecting
    const remote_handle h = issuer.issue(mine.mr, mine.bytes.data() + 4096, 8192, read_write);
    CHECK(issuer.mechanism_of(h) == revoke_by::memory_window);
    CHECK(h.addr == reinterpret_cast<std::uintptr_t>(mine.bytes.data() + 4096));
    CHECK(h.length == 8192);
    CHECK(h.rkey != mine.mr.rkey());

    REQUIRE(read(lp.a, local.mr.local(0, 1024), h, 1000, 1) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(has_pattern(std::span(local.bytes).first(1024), 9 + 4096 + 1000));

    fill_pattern(local.bytes, 50);
    REQUIRE(write(lp.a, local.mr.local(0, 512), h, 4000, 2) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(has_pattern(std::span(mine.bytes).subspan(4096 + 4000, 512), 50));
    CHECK(has_pattern(std::span(mine.bytes).subspan(4096 + 3000, 1000), 9 + 4096 + 3000));
    CHECK(has_pattern(std::span(mine.bytes).subspan(4096 + 4512, 1000), 9 + 4096 + 4512));

    const handle_counters c = issuer.counters();
    CHECK(c.issued_mw == 1);
    CHECK(c.issued_mr == 0);
    CHECK(c.windows_allocated == 1);
    CHECK(c.live == 1);
}

TEST_CASE("window: bounds and rights are refused before anything is posted") {
    loopback lp;
    window_memory mine(lp.pd, 8192);
    registered local(lp.pd, 8192);
    handle_issuer issuer(lp.pd, lp.b, by(revoke_by::memory_window));
    lp.a.set_peer_epoch(issuer.epoch()); // as the peer learns it on connecting
    const remote_handle h = issuer.issue(mine.mr, mine.bytes.data(), 4096, rights::remote_read);
    CHECK(write(lp.a, local.mr.local(0, 16), h, 0, 1) == status::not_permitted);
    CHECK(read(lp.a, local.mr.local(0, 1024), h, 3500, 2) == status::out_of_range);
    CHECK(read(lp.a, local.mr.local(0, 1024), h, ~std::uint64_t{0}, 3) == status::out_of_range);
    CHECK(read(lp.a, local.mr.local(0, 0), h, 0, 4) == status::zero_length);
    verbs::completion c[1];
    CHECK(lp.a.wait_send(c, std::chrono::milliseconds(200)) == 0); // nothing was posted

    // The owner's side is checked too: a window past its registration, or
    // with no remote right, is refused before the bind is posted, so the
    // queue pair stays usable.
    CHECK_THROWS_AS(issuer.issue(mine.mr, mine.bytes.data() + 4096, 8192, rights::remote_read),
                    rdmax::error);
    CHECK_THROWS_AS(issuer.issue(mine.mr, mine.bytes.data(), 4096, rights::local_write),
                    rdmax::error);
    CHECK_THROWS_AS(issuer.issue(mine.mr, mine.bytes.data(), 0, rights::remote_read), rdmax::error);
    // Insisting on windows over memory that cannot be bound is an error, not a fallback.
    registered plain(lp.pd, 4096);
    CHECK_THROWS_AS(issuer.issue(plain.mr, plain.bytes.data(), 4096, rights::remote_read),
                    rdmax::error);
    CHECK_THROWS_AS(issuer.issue(mine.bytes.data(), 4096, rights::remote_read), rdmax::error);
    CHECK(lp.b.wait_send(c, std::chrono::milliseconds(200)) == 0);

    fill_pattern(mine.bytes, 4);
    REQUIRE(read(lp.a, local.mr.local(0, 4096), h, 0, 5) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(has_pattern(std::span(local.bytes).first(4096), 4));
}

TEST_CASE("window: after revocation the peer's use fails with an error, not a hang") {
    loopback lp;
    window_memory mine(lp.pd, 4096);
    registered local(lp.pd, 4096);
    handle_issuer issuer(lp.pd, lp.b, by(revoke_by::memory_window));
    lp.a.set_peer_epoch(issuer.epoch()); // as the peer learns it on connecting
    const remote_handle h = issuer.issue(mine.mr, mine.bytes.data(), 4096, read_write);
    fill_pattern(local.bytes, 6);
    REQUIRE(write(lp.a, local.mr.local(), h, 0, 1) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(has_pattern(mine.bytes, 6));

    CHECK(issuer.revoke(h));
    CHECK_FALSE(issuer.revoke(h)); // once
    CHECK(issuer.live() == 0);
    CHECK_FALSE(issuer.mechanism_of(h).has_value());
    const handle_counters c = issuer.counters();
    CHECK(c.revoked_mw == 1); // by a local invalidation, not a deallocation
    CHECK(c.revoked_mw_dealloc == 0);

    std::memset(mine.bytes.data(), 0, mine.bytes.size());
    REQUIRE(read(lp.a, local.mr.local(), h, 0, 2) == status::ok); // the peer does not know yet
    expect_refused_at_peer(lp.a);
    // The QP is in the error state now: a later post is refused up front.
    CHECK(write(lp.a, local.mr.local(), h, 0, 3) == status::qp_failed);
    CHECK(std::all_of(mine.bytes.begin(), mine.bytes.end(),
                      [](std::byte b) { return b == std::byte{0}; }));
}

TEST_CASE("window: once the connection has failed, revocation deallocates the window") {
    loopback lp;
    window_memory mine(lp.pd, 8192);
    registered local(lp.pd, 4096);
    handle_issuer issuer(lp.pd, lp.b, by(revoke_by::memory_window));
    lp.a.set_peer_epoch(issuer.epoch()); // as the peer learns it on connecting
    const remote_handle first = issuer.issue(mine.mr, mine.bytes.data(), 4096, rights::remote_read);
    const remote_handle second =
        issuer.issue(mine.mr, mine.bytes.data() + 4096, 4096, rights::remote_read);
    REQUIRE(issuer.revoke(first));
    // The peer's use of the revoked handle is an access error: both queue
    // pairs of the connection go to the error state.
    REQUIRE(read(lp.a, local.mr.local(), first, 0, 1) == status::ok);
    expect_refused_at_peer(lp.a);
    REQUIRE(eventually([&] { return in_error_state(lp.b); }, std::chrono::seconds(10)));
    // The owner's queue pair can no longer invalidate (its work is flushed):
    // the window is deallocated instead, promptly, not at the deadline.
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(issuer.revoke(second));
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(4));
    const handle_counters c = issuer.counters();
    CHECK(c.revoked_mw == 1);
    CHECK(c.revoked_mw_dealloc == 1);
    CHECK(c.live == 0);
    // A window is no longer issued on a broken queue pair: the bind fails and says so.
    CHECK_THROWS_AS(issuer.issue(mine.mr, mine.bytes.data(), 4096, rights::remote_read),
                    rdmax::error);
}

TEST_CASE("window: a re-issued handle has a fresh key; the stale one never matches") {
    loopback lp;
    window_memory mine(lp.pd, 8192);
    fill_pattern(mine.bytes, 12);
    registered local(lp.pd, 4096);
    handle_issuer issuer(lp.pd, lp.b, by(revoke_by::memory_window));
    lp.a.set_peer_epoch(issuer.epoch()); // as the peer learns it on connecting
    const remote_handle first = issuer.issue(mine.mr, mine.bytes.data(), 4096, rights::remote_read);
    REQUIRE(issuer.revoke(first));
    const remote_handle second =
        issuer.issue(mine.mr, mine.bytes.data() + 4096, 4096, rights::remote_read);
    const handle_counters c = issuer.counters();
    CHECK(c.windows_allocated == 1); // the same window, bound again
    CHECK(c.windows_reused == 1);
    CHECK(second.rkey != first.rkey);
    CHECK((second.rkey >> 8) == (first.rkey >> 8)); // same window index, new key byte

    REQUIRE(read(lp.a, local.mr.local(), second, 0, 1) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(has_pattern(local.bytes, 12 + 4096));

    // The stale handle: its key no longer matches the window's.
    std::memset(local.bytes.data(), 0, local.bytes.size());
    REQUIRE(read(lp.a, local.mr.local(), first, 0, 2) == status::ok);
    expect_refused_at_peer(lp.a);
    CHECK(std::all_of(local.bytes.begin(), local.bytes.end(),
                      [](std::byte b) { return b == std::byte{0}; }));
}

TEST_CASE("window: it answers only on the queue pair it was bound through") {
    loopback lp;
    // A second connection in the same protection domain.
    verbs::queue_pair<verbs::rc> c(lp.pd), d(lp.pd);
    verbs::connect_pair(c, d);
    window_memory mine(lp.pd, 4096);
    fill_pattern(mine.bytes, 21);
    registered local(lp.pd, 4096);
    handle_issuer issuer(lp.pd, lp.b, by(revoke_by::memory_window));
    lp.a.set_peer_epoch(issuer.epoch()); // as the peer learns it on connecting
    d.set_peer_epoch(issuer.epoch());    // the same incarnation, another connection
    const remote_handle h = issuer.issue(mine.mr, mine.bytes.data(), 4096, rights::remote_read);

    REQUIRE(read(lp.a, local.mr.local(), h, 0, 1) == status::ok); // arrives on lp.b
    REQUIRE(wait_send(lp.a).ok());
    CHECK(has_pattern(local.bytes, 21));

    REQUIRE(read(d, local.mr.local(), h, 0, 2) == status::ok); // arrives on c
    expect_refused_at_peer(d);
}

TEST_CASE("window: the issuer's waits keep the application's completions") {
    loopback lp;
    window_memory mine(lp.pd, 4096);
    registered src(lp.pd, 4096), dst(lp.pd, 4096);
    fill_pattern(src.bytes, 33);
    handle_issuer issuer(lp.pd, lp.b, by(revoke_by::memory_window));
    // The owner's own request, on the queue pair the issuer binds through.
    REQUIRE(lp.b.write(src.mr.local(), dst.mr.remote(), 0, 77) == status::ok);
    const remote_handle h = issuer.issue(mine.mr, mine.bytes.data(), 4096, rights::remote_read);
    REQUIRE(lp.b.write(src.mr.local(), dst.mr.remote(), 0, 78) == status::ok);
    REQUIRE(issuer.revoke(h));
    const auto first = wait_send(lp.b);
    CHECK(first.wr_id == 77);
    CHECK(first.ok());
    const auto second = wait_send(lp.b);
    CHECK(second.wr_id == 78);
    CHECK(second.ok());
    CHECK(has_pattern(dst.bytes, 33));
    verbs::completion more[4];
    CHECK(lp.b.poll_send(more) == 0); // the issuer's own completions are not handed out
}

TEST_CASE("window: handles over arena memory registered for binding") {
    loopback lp;
    arena_options o;
    o.area_bytes = std::size_t{2} << 20;
    o.area_rights = bindable; // the areas' own keys open nothing remotely
    registered_arena arena(verbs_registrar(lp.pd), o);
    auto block = arena.allocate(65536);
    fill_pattern(std::span(block.data, block.size), 44);
    registered local(lp.pd, 65536);
    {
        handle_issuer issuer(lp.pd, lp.b, by(revoke_by::automatic));
        lp.a.set_peer_epoch(issuer.epoch()); // as the peer learns it on connecting
        const remote_handle h = issuer.issue(arena, block.data, block.size, read_write);
        CHECK(issuer.mechanism_of(h) == revoke_by::memory_window);
        REQUIRE(read(lp.a, local.mr.local(), h, 0, 1) == status::ok);
        REQUIRE(wait_send(lp.a).ok());
        CHECK(has_pattern(local.bytes, 44));
        fill_pattern(local.bytes, 45);
        REQUIRE(write(lp.a, local.mr.local(0, 1000), h, 2000, 2) == status::ok);
        REQUIRE(wait_send(lp.a).ok());
        CHECK(has_pattern(std::span(block.data + 2000, 1000), 45));
        CHECK(issuer.revoke(h));
        CHECK_THROWS_AS(issuer.issue(arena, &local, 16, rights::remote_read), rdmax::error);
    } // the issuer goes before the arena: no window outlives it
    arena.deallocate(block.data, block.size);
    CHECK(arena.trim() > 0);
    CHECK(arena.counters().areas_released == 1);
}

TEST_CASE("window: the issuer deallocates its windows, so their registration can go") {
    loopback lp;
    std::vector<std::byte> bytes(4096);
    ibv_mr* mr = ibv_reg_mr(lp.pd.get(), bytes.data(), bytes.size(),
                            to_ibv(rights::local_write | rights::mw_bind));
    REQUIRE(mr != nullptr);
    int busy = 0;
    {
        handle_issuer issuer(lp.pd, lp.b, by(revoke_by::memory_window));
        const remote_handle h = issuer.issue(bind_target{mr, rights::local_write | rights::mw_bind},
                                             bytes.data(), 4096, rights::remote_read);
        CHECK(h.rkey != 0);
        // While a window is bound to it, the device keeps the registration.
        busy = ibv_dereg_mr(mr);
        fmt::print("ibv_dereg_mr with a window bound: {}\n",
                   busy == 0 ? "succeeded" : std::strerror(busy));
    }
    if (busy != 0)
        CHECK(ibv_dereg_mr(mr) == 0);
}

TEST_CASE("registration: forced, a handle is backed by its own MR and revoked by deregistration") {
    loopback lp;
    window_memory mine(lp.pd, 8192);
    fill_pattern(mine.bytes, 14);
    registered local(lp.pd, 4096);
    handle_issuer issuer(lp.pd, lp.b, by(revoke_by::memory_region));
    lp.a.set_peer_epoch(issuer.epoch()); // as the peer learns it on connecting
    CHECK_FALSE(issuer.memory_windows());
    const remote_handle h = issuer.issue(mine.mr, mine.bytes.data() + 1024, 4096, read_write);
    CHECK(issuer.mechanism_of(h) == revoke_by::memory_region);
    REQUIRE(read(lp.a, local.mr.local(), h, 0, 1) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(has_pattern(local.bytes, 14 + 1024));
    fill_pattern(local.bytes, 15);
    REQUIRE(write(lp.a, local.mr.local(0, 100), h, 10, 2) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(has_pattern(std::span(mine.bytes).subspan(1024 + 10, 100), 15));
    CHECK(write(lp.a, local.mr.local(0, 100), h, 4000, 3) == status::out_of_range);

    CHECK(issuer.revoke(h));
    const handle_counters c = issuer.counters();
    CHECK(c.issued_mr == 1);
    CHECK(c.issued_mw == 0);
    CHECK(c.fallbacks == 0); // asked for, not fallen back to
    CHECK(c.revoked_mr == 1);
    CHECK(c.windows_allocated == 0);
    REQUIRE(read(lp.a, local.mr.local(), h, 0, 4) == status::ok);
    expect_refused_at_peer(lp.a);
}

TEST_CASE("automatic: windows where the memory allows binding, else a registration") {
    loopback lp;
    window_memory bindable_mem(lp.pd, 4096);
    registered plain(lp.pd, 4096);
    fill_pattern(plain.bytes, 16);
    registered local(lp.pd, 4096);
    handle_issuer issuer(lp.pd, lp.b, by(revoke_by::automatic));
    lp.a.set_peer_epoch(issuer.epoch()); // as the peer learns it on connecting
    const remote_handle hw =
        issuer.issue(bindable_mem.mr, bindable_mem.bytes.data(), 4096, rights::remote_read);
    const remote_handle hr = issuer.issue(plain.mr, plain.bytes.data(), 4096, rights::remote_read);
    const remote_handle hp = issuer.issue(plain.bytes.data(), 4096, rights::remote_read);
    CHECK(issuer.mechanism_of(hw) == revoke_by::memory_window);
    CHECK(issuer.mechanism_of(hr) == revoke_by::memory_region);
    CHECK(issuer.mechanism_of(hp) == revoke_by::memory_region);
    const handle_counters c = issuer.counters();
    CHECK(c.issued_mw == 1);
    CHECK(c.issued_mr == 2);
    CHECK(c.fallbacks == 2);
    REQUIRE(read(lp.a, local.mr.local(), hr, 0, 1) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(has_pattern(local.bytes, 16));
    // Without a queue pair there are no windows.
    handle_issuer no_qp(lp.pd, by(revoke_by::automatic));
    CHECK_FALSE(no_qp.memory_windows());
    CHECK_THROWS_AS(handle_issuer(lp.pd, by(revoke_by::memory_window)), rdmax::error);
}

TEST_CASE("epoch: after the issuer restarts, its old handles are refused before posting",
          "[epoch]") {
    loopback lp;
    window_memory mine(lp.pd, 8192);
    fill_pattern(mine.bytes, 61);
    registered local(lp.pd, 4096);
    remote_handle old{};
    {
        handle_issuer before(lp.pd, lp.b, by(revoke_by::memory_window));
        lp.a.set_peer_epoch(before.epoch());
        old = before.issue(mine.mr, mine.bytes.data(), 4096, read_write);
        CHECK(old.epoch == before.epoch());
        REQUIRE(read(lp.a, local.mr.local(), old, 0, 1) == status::ok);
        REQUIRE(wait_send(lp.a).ok());
        CHECK(has_pattern(local.bytes, 61));
    } // the restart: the issuer goes (its windows with it) and a new one comes
    handle_issuer after(lp.pd, lp.b, by(revoke_by::memory_window));
    REQUIRE(after.epoch() != old.epoch);
    lp.a.set_peer_epoch(after.epoch()); // what the restarted owner told the peer
    const remote_handle now = after.issue(mine.mr, mine.bytes.data() + 4096, 4096, read_write);
    // The worst case: an old handle whose key and address repeat the new
    // one's (keys come back; a restarted process lays its memory out alike).
    remote_handle collided = now;
    collided.epoch = old.epoch;

    fill_pattern(local.bytes, 99);
    CHECK(read(lp.a, local.mr.local(), old, 0, 2) == status::stale_handle);
    CHECK(write(lp.a, local.mr.local(), old, 0, 3) == status::stale_handle);
    CHECK(read(lp.a, local.mr.local(), collided, 0, 4) == status::stale_handle);
    CHECK(write(lp.a, local.mr.local(), collided, 0, 5) == status::stale_handle);
    CHECK(write(lp.a, local.mr.local(0, 16), collided, 8000, 6) == status::stale_handle); // first
    verbs::completion c[1];
    CHECK(lp.a.wait_send(c, std::chrono::milliseconds(200)) == 0); // nothing was posted
    CHECK_FALSE(lp.a.failed());
    CHECK(has_pattern(std::span(mine.bytes).subspan(4096), 61 + 4096)); // new memory untouched
    CHECK(has_pattern(local.bytes, 99));

    // The collision is real: the same key and address posted without the
    // check (as read() did before epochs) reach the new memory.
    REQUIRE(lp.a.read(local.mr.local(),
                      remote_buffer<rights::remote_read>{collided.addr, collided.length,
                                                         collided.rkey, 0},
                      0, 7) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(has_pattern(local.bytes, 61 + 4096));

    // The queue pair is usable and the new handle works.
    fill_pattern(local.bytes, 77);
    REQUIRE(write(lp.a, local.mr.local(0, 512), now, 100, 8) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(has_pattern(std::span(mine.bytes).subspan(4096 + 100, 512), 77));
    CHECK(has_pattern(std::span(mine.bytes).first(4096), 61)); // the old window's bytes stay

    // The owner's side: an old handle whose key repeats cannot revoke the new one.
    CHECK_FALSE(after.mechanism_of(collided).has_value());
    CHECK_FALSE(after.revoke(collided));
    CHECK(after.live() == 1);
    CHECK(after.revoke(now));
}

TEST_CASE("epoch: a new connection knows no incarnation until the peer says", "[epoch]") {
    loopback lp;
    window_memory mine(lp.pd, 4096);
    fill_pattern(mine.bytes, 62);
    registered local(lp.pd, 4096);
    remote_handle old{};
    {
        handle_issuer before(lp.pd, lp.b, by(revoke_by::memory_window));
        old = before.issue(mine.mr, mine.bytes.data(), 4096, rights::remote_read);
    }
    // The restarted owner and the peer connect anew: the peer's new queue
    // pair (d) starts knowing no incarnation.
    verbs::queue_pair<verbs::rc> c(lp.pd), d(lp.pd);
    verbs::connect_pair(c, d);
    handle_issuer after(lp.pd, c, by(revoke_by::memory_window));
    const remote_handle now = after.issue(mine.mr, mine.bytes.data(), 4096, rights::remote_read);
    CHECK(d.peer_epoch() == 0);
    CHECK(read(d, local.mr.local(), old, 0, 1) == status::unknown_epoch);
    CHECK(read(d, local.mr.local(), now, 0, 2) == status::unknown_epoch);
    CHECK(read(d, local.mr.local(0, 0), old, 0, 3) == status::unknown_epoch); // before length
    verbs::completion done[1];
    CHECK(d.wait_send(done, std::chrono::milliseconds(200)) == 0); // nothing was posted

    d.set_peer_epoch(now.epoch); // learned from a handle sent on this connection
    CHECK(read(d, local.mr.local(), old, 0, 4) == status::stale_handle);
    REQUIRE(read(d, local.mr.local(), now, 0, 5) == status::ok);
    REQUIRE(wait_send(d).ok());
    CHECK(has_pattern(local.bytes, 62));
    CHECK(after.revoke(now));
}
