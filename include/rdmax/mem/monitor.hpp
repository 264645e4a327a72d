#pragma once
// Monitor: how the registration cache learns that registered memory was
// unmapped or replaced. A C++20 concept.
//
// A monitor watches each cached range. valid(token) is the hot-path check
// (for the kernel module's monitor, one load of a generation counter); events
// it cannot check that way it reports by drain(), which the cache calls at
// its next operation, never from inside the monitor's own callback.

#include <concepts>
#include <cstddef>
#include <cstdint>

namespace rdmax {

template <class M>
concept monitor =
    requires(M& m, const M& cm, std::uintptr_t start, std::size_t len, typename M::token t,
             void (*sink)(void*, std::uintptr_t, std::uintptr_t), void* ctx) {
        typename M::token;
        { m.watch(start, len) } -> std::same_as<typename M::token>;
        { m.unwatch(t) } noexcept;
        { cm.valid(t) } noexcept -> std::same_as<bool>;
        /// Reports ranges invalidated since the last call, as sink(ctx, start, end).
        { m.drain(sink, ctx) } noexcept;
        /// True when drain() has something to report (a cheap load).
        { cm.pending() } noexcept -> std::same_as<bool>;
    };

/// The application tells the cache with invalidate(); nothing is watched.
/// Use it when memory handed to the cache is never unmapped behind its back
/// (arenas, pools), or together with explicit invalidate() calls.
struct manual_monitor {
    struct token {};
    token watch(std::uintptr_t, std::size_t) noexcept { return {}; }
    void unwatch(token) noexcept {}
    [[nodiscard]] bool valid(token) const noexcept { return true; }
    void drain(void (*)(void*, std::uintptr_t, std::uintptr_t), void*) noexcept {}
    [[nodiscard]] bool pending() const noexcept { return false; }
};

static_assert(monitor<manual_monitor>);

} // namespace rdmax
