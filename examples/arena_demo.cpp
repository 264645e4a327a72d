// arena_demo: registered memory without registering, and a handle a peer uses
// until the owner revokes it.
//
//   arena_demo [-d DEVICE]
//
// 1. A registered_arena hands out 10000 buffers and a std::pmr::vector that
//    grows in it: one registration covers them all, and the key of any pointer
//    is found in O(1).
// 2. A handle grants a peer read access to 4 KiB of it. The peer (a second
//    queue pair in this process, connected to the first) reads through it;
//    an out-of-bounds read and a write are refused before anything is posted;
//    after the owner revokes the handle, the peer's read fails with an error.
//    Where the device has type-2 memory windows, the areas are registered for
//    binding and with no remote right, so that only handles open them, and a
//    handle is a window bound through the owner's queue pair (revoked by a
//    local invalidation); elsewhere, or with RDMAX_HANDLE_REVOKE=mr, a
//    registration of its own (revoked by deregistration).
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <getopt.h>
#include <memory_resource>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <rdmax/mem/handle_issuer.hpp>
#include <rdmax/mem/registered_arena.hpp>
#include <rdmax/rdmax.hpp>

namespace {

using namespace rdmax;
using namespace std::chrono_literals;
using steady = std::chrono::steady_clock;

int run(const char* device) {
    auto ctx =
        device != nullptr ? verbs::context::open(device) : verbs::context::open_first_active();
    verbs::protection_domain pd(ctx);
    arena_options ao = arena_options{}.with_env();
    if (ctx.limits().memory_windows)
        ao.area_rights =
            rights::local_write | rights::mw_bind; // the areas' keys open nothing remotely
    registered_arena arena(verbs_registrar(pd), ao);

    fmt::print("== an arena on {}\n", ctx.name());
    std::vector<registered_arena::block> blocks;
    const auto t0 = steady::now();
    blocks.push_back(arena.allocate(256)); // maps and registers the first area
    const auto t1 = steady::now();
    for (int i = 1; i < 10000; ++i)
        blocks.push_back(arena.allocate(256));
    const auto t2 = steady::now();
    registered_arena::resource res(arena);
    std::pmr::vector<float> v(&res);
    for (int i = 0; i < 100000; ++i)
        v.push_back(static_cast<float>(i));
    const auto us = [](auto d) { return std::chrono::duration<double, std::micro>(d).count(); };
    fmt::print("the first buffer maps and registers a {} MiB area: {:.1f} us\n"
               "the next 9999 buffers of 256 B: {:.3f} us each, nothing registered\n"
               "a pmr vector of {} floats grew in it; its key, from its data pointer: lkey {:#x}\n",
               arena.options().area_bytes >> 20, us(t1 - t0), us(t2 - t1) / 9999.0, v.size(),
               arena.keys_of(v.data())->lkey);
    for (const auto& b : blocks)
        arena.deallocate(b.data, b.size);
    fmt::print("counters: {}\n\n", arena.counters());

    fmt::print("== a handle used by a peer, then revoked\n");
    verbs::queue_pair<verbs::rc> owner(pd), peer(pd);
    verbs::connect_pair(owner, peer);
    auto window = arena.allocate(4096);
    std::memset(window.data, 'x', window.size);
    // Windows bind through the queue pair the peer's requests arrive on.
    handle_issuer issuer(pd, owner);
    const remote_handle h = issuer.issue(arena, window.data, window.size, rights::remote_read);
    // The peer's queue pair learns the issuer's incarnation from what the
    // owner sends on the connection (here the handle itself, which carries it).
    peer.set_peer_epoch(h.epoch);
    const bool by_window = issuer.mechanism_of(h) == revoke_by::memory_window;
    fmt::print("the handle (rkey {:#x}) is backed by {}\n", h.rkey,
               by_window ? fmt::format("a type-{} memory window bound through the owner's QP",
                                       ctx.limits().mw_type_2b ? "2B" : "2A")
                         : std::string("a registration of its own"));
    auto mine = arena.allocate(4096);
    const auto dst = arena.local<rights::local_write>(mine.data, 4096);
    verbs::completion c[1];
    status s = read(peer, dst, h, 0, 1);
    const bool first_ok = s == status::ok && peer.wait_send(c, 5s) == 1 && c[0].ok() &&
                          std::memcmp(mine.data, window.data, 4096) == 0;
    fmt::print("peer reads 4096 bytes through the handle: {}\n", first_ok ? "ok" : "FAILED");
    fmt::print("peer reads past the window:   {}\n", to_string(read(peer, dst, h, 1, 2)));
    fmt::print("peer writes into it:          {}\n",
               to_string(write(peer, arena.local<rights::local_read>(mine.data, 16), h, 0, 3)));
    issuer.revoke(h);
    s = read(peer, dst, h, 0, 4);
    const bool refused = s == status::ok && peer.wait_send(c, 10s) == 1 && !c[0].ok();
    fmt::print("after revoke, the peer's read completes with: {}\n",
               refused ? c[0].status_name() : "NO ERROR (unexpected)");
    fmt::print("counters: {}\n", issuer.counters());
    arena.deallocate(window.data, window.size);
    arena.deallocate(mine.data, mine.size);
    return first_ok && refused ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
    const char* device = nullptr;
    for (int opt; (opt = getopt(argc, argv, "d:h")) != -1;) {
        if (opt == 'd') {
            device = optarg;
        } else {
            std::fprintf(stderr, "usage: arena_demo [-d DEVICE]\n");
            return opt == 'h' ? 0 : 2;
        }
    }
    try {
        return run(device);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "arena_demo: %s\n", e.what());
        return 1;
    }
}
