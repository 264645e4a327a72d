// Registered arenas and remote handles on a real device: arena memory moves
// over RDMA under the area's key with nothing registered per buffer; a
// handle's bounds and rights are enforced before posting; a revoked handle
// fails at the peer with an error; trim() never takes memory in use.
#include <chrono>
#include <cstring>
#include <memory_resource>
#include <vector>

#include <rdmax/mem/handle_issuer.hpp>
#include <rdmax/mem/registered_arena.hpp>

#include "../support/loopback.hpp"

using namespace rdmax;
using namespace rdmax::test;

namespace {

arena_options test_arena() {
    arena_options o;
    o.area_bytes = std::size_t{2} << 20;
    o.huge_pages = true;
    o.trim_under_pressure = false; // the host's pressure would trim at any time
    return o;
}

} // namespace

TEST_CASE("arena: buffers move over RDMA under the area's key, none registered per buffer") {
    loopback lp;
    registered_arena arena(verbs_registrar(lp.pd), test_arena());
    auto src = arena.allocate(100000);
    auto dst = arena.allocate(100000);
    fill_pattern(std::span(src.data, src.size), 5);
    std::memset(dst.data, 0, dst.size);
    REQUIRE(lp.a.write(arena.local<rights::local_read>(src.data, src.size),
                       arena.remote<rights::remote_write>(dst.data, dst.size), 0, 1) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(has_pattern(std::span(dst.data, dst.size), 5));
    // A pmr vector in the arena: its key is found from its data pointer.
    registered_arena::resource res(arena);
    std::pmr::vector<std::byte> v(50000, std::byte{0}, &res);
    REQUIRE(lp.a.read(arena.local<rights::local_write>(v.data(), v.size()),
                      arena.remote<rights::remote_read>(src.data, v.size()), 0, 2) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(has_pattern(v, 5));
    CHECK(arena.counters().areas_registered == 1); // one registration served all of it
    arena.deallocate(src.data, src.size);
    arena.deallocate(dst.data, dst.size);
}

TEST_CASE("handle: bounds and rights are checked before anything is posted") {
    loopback lp;
    registered mine(lp.pd, 8192);
    fill_pattern(mine.bytes, 9);
    handle_issuer issuer(lp.pd);
    lp.a.set_peer_epoch(issuer.epoch()); // as the peer learns it on connecting
    const remote_handle h = issuer.issue(mine.bytes.data() + 4096, 4096, rights::remote_read);
    registered local(lp.pd, 8192);
    CHECK(read(lp.a, local.mr.local(0, 1024), h, 1000, 1) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(has_pattern(std::span(local.bytes).first(1024), 9 + 4096 + 1000));
    CHECK(write(lp.a, local.mr.local(0, 16), h, 0, 2) == status::not_permitted);
    CHECK(read(lp.a, local.mr.local(0, 1024), h, 3500, 3) == status::out_of_range);
    CHECK(read(lp.a, local.mr.local(0, 0), h, 0, 4) == status::zero_length);
    verbs::completion c[1];
    CHECK(lp.a.wait_send(c, std::chrono::milliseconds(200)) == 0); // nothing was posted
    CHECK_THROWS_AS(issuer.issue(mine.bytes.data(), 0, rights::remote_read), rdmax::error);
}

TEST_CASE("handle: after revocation the peer's use fails with an error, not a hang") {
    loopback lp;
    registered mine(lp.pd, 4096), local(lp.pd, 4096);
    handle_issuer issuer(lp.pd);
    lp.a.set_peer_epoch(issuer.epoch()); // as the peer learns it on connecting
    const remote_handle h =
        issuer.issue(mine.bytes.data(), 4096, rights::remote_read | rights::remote_write);
    REQUIRE(write(lp.a, local.mr.local(), h, 0, 1) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(issuer.revoke(h));
    CHECK_FALSE(issuer.revoke(h));                                // once
    REQUIRE(read(lp.a, local.mr.local(), h, 0, 2) == status::ok); // the peer does not know yet
    const auto done = wait_send(lp.a, std::chrono::seconds(10));
    CHECK_FALSE(done.ok());
    CHECK(done.status == IBV_WC_REM_ACCESS_ERR);
    CHECK(issuer.live() == 0);
}

TEST_CASE("arena: trim never takes a buffer in use") {
    loopback lp;
    arena_options o = test_arena();
    o.high_watermark = 0;
    registered_arena arena(verbs_registrar(lp.pd), o);
    auto keep = arena.allocate(4096);
    auto drop = arena.allocate(1500000); // a dedicated area
    arena.deallocate(drop.data, drop.size);
    arena.trim();
    registered src(lp.pd, 4096);
    fill_pattern(src.bytes, 3);
    REQUIRE(lp.a.write(src.mr.local(), arena.remote<rights::remote_write>(keep.data, 4096), 0, 1) ==
            status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(has_pattern(std::span(keep.data, 4096), 3));
    CHECK(arena.counters().areas_released >= 1);
    arena.deallocate(keep.data, keep.size);
}
