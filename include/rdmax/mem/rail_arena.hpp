#pragma once
// rail_arena: a registered arena (registered_arena.hpp) whose areas are
// registered once per device of a rail_set, so a block has every rail's key
// (issue 31). Blocks come from allocate() as usual; their keys per rail:
//
//     rail_arena arena = make_rail_arena(rails);
//     auto b = arena.allocate(n);
//     auto src = rail_block_local<rights::local_read>(arena, b.data, n); // a key per rail
//     auto token = rail_block_remote<rights::remote_write>(arena, b.data, n);

#include <cerrno>
#include <cstddef>

#include <rdmax/error.hpp>
#include <rdmax/mem/arena_options.hpp>
#include <rdmax/mem/rail_buffer.hpp>
#include <rdmax/mem/rail_cache.hpp>
#include <rdmax/mem/registered_arena.hpp>
#include <rdmax/verbs/rail_set.hpp>

namespace rdmax {

using rail_arena = basic_registered_arena<rail_verbs_registrar>;

/// An arena over every rail of `rails` (which must outlive it); options from
/// RDMAX_ARENA_* unless given. Each area is pinned once per device.
[[nodiscard]] inline rail_arena make_rail_arena(const verbs::rail_set& rails,
                                                arena_options opt = arena_options{}.with_env()) {
    return rail_arena(make_rail_registrar(rails), opt);
}
rail_arena make_rail_arena(const verbs::rail_set&&, arena_options = {}) = delete;

/// [p, p + n) of an arena over rails, with every rail's lkey; throws
/// rdmax::error (EINVAL) unless it lies inside one area of the arena.
template <rights A, registrar R>
[[nodiscard]] rail_local<A> rail_block_local(const basic_registered_arena<R>& arena, void* p,
                                             std::size_t n) {
    (void)arena.template local<A>(p, n); // inside one area, with the arena's rights
    return R::template local<A>(*arena.registration_of(p), static_cast<std::byte*>(p), n);
}

/// The token a peer needs to address [p, p + n) on each rail.
template <rights A, registrar R>
[[nodiscard]] rail_remote<A> rail_block_remote(const basic_registered_arena<R>& arena,
                                               const void* p, std::size_t n) {
    (void)arena.template remote<A>(p, n);
    return R::template remote<A>(*arena.registration_of(p), static_cast<const std::byte*>(p), n);
}

} // namespace rdmax
