#pragma once
// allreduce on a node_team (local/node_team.hpp): every rank ends with the
// element-wise reduction (a sum by default) of every rank's vector, all
// ranks bit for bit the same.
//
// How: the vector is cut into one share per rank. Reduce-scatter: each rank
// reads its share of every peer's window where it lies (mapped, no copy) and
// folds it into its own; allgather: each rank copies every peer's reduced
// share out of that peer's window. A vector in the rank's window
// (node_team::window_as) moves once: the allgather's copy. One elsewhere is
// staged into the window first (one more copy), in pieces of the window's
// size when longer. Three steps per piece. (Folding every rank's whole
// vector on every rank, two steps, was slower even at 4 KiB between two
// ranks: a peer's lines cost more than a step.) When a call returns, no peer
// reads the rank's window any more (the caller may write it).
//
// Every rank passes the same number of elements of the same type; a rank
// that does not breaks the team (rdmax::error) rather than mix calls.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <type_traits>
#include <typeinfo>

#include <rdmax/local/node_team.hpp>

namespace rdmax::local {

namespace detail {

/// Share `r` of `n` elements cut `size` ways, whole cache lines where it can.
struct team_share {
    std::size_t begin, end;
};
[[nodiscard]] inline team_share share_of(std::size_t n, std::size_t element, int r, int size) {
    const std::size_t per_line = std::max<std::size_t>(1, 64 / element);
    const std::size_t lines = (n + per_line - 1) / per_line;
    const auto s = static_cast<std::size_t>(size);
    const auto i = static_cast<std::size_t>(r);
    const auto line_at = [&](std::size_t k) { return std::min(n, (lines * k / s) * per_line); };
    return {line_at(i), line_at(i + 1)};
}

template <class T, class Op, std::size_t N>
void fold_block(T* __restrict into, const T* __restrict b, Op& op) {
    for (std::size_t k = 0; k < N; ++k)
        into[k] = op(into[k], b[k]);
}
template <class T, class Op, std::size_t N>
void fold_block(T* __restrict into, const T* __restrict a, const T* __restrict b, Op& op) {
    for (std::size_t k = 0; k < N; ++k)
        into[k] = op(a[k], b[k]);
}

/// `into[i] = op(a[i], b[i])`, `into` being `a` or apart from both. In
/// blocks of a cache line with a fixed count, so that GCC's -O2 (whose cost
/// model vectorizes only loops it needs no scalar rest or alias check for)
/// vectorizes them too.
template <class T, class Op>
void fold(T* into, const T* a, const T* b, std::size_t n, Op& op) {
    constexpr std::size_t block = std::max<std::size_t>(1, 64 / sizeof(T));
    std::size_t i = 0;
    if (into == a) {
        for (; i + block <= n; i += block)
            fold_block<T, Op, block>(into + i, b + i, op);
    } else {
        for (; i + block <= n; i += block)
            fold_block<T, Op, block>(into + i, a + i, b + i, op);
    }
    for (; i < n; ++i)
        into[i] = op(a[i], b[i]);
}

/// The collective's kind, noted for the peers' check: an allreduce, of this
/// element type, with this operation (a float sum is not an int sum, a max
/// not a min). Their mangled names hashed (FNV-1a), the same in every
/// process of a program whatever the runtime's hash_code() does; what they
/// cannot tell apart: two operations of one type (function pointers, two
/// std::function), and two lambdas that are one on every rank but were
/// written apart.
template <class T, class Op>
std::uint32_t allreduce_kind() noexcept {
    return (type_hash(typeid(T).name(), type_hash(typeid(Op).name())) << 1) | 1U; // odd
}

/// This rank's share of every rank folded into its own (in its window), then
/// every peer's reduced share copied into `data`.
template <class T, class Op>
void by_shares(node_team& t, const team_call& call, T* mine, std::span<T> data, bool in_window,
               Op& op) {
    const int me = t.rank();
    const int size = t.size();
    const team_share own = share_of(data.size(), sizeof(T), me, size);
    // Staged: only what the peers read goes into the window; this rank's own
    // share is read from the caller's vector by the first fold.
    if (!in_window && own.begin != 0)
        std::memcpy(mine, data.data(), own.begin * sizeof(T));
    if (!in_window && own.end != data.size())
        std::memcpy(mine + own.end, data.data() + own.end, (data.size() - own.end) * sizeof(T));
    const std::uint64_t ready = t.step();
    const std::size_t n = own.end - own.begin;
    T* const into = mine + own.begin;
    for (int k = 1; k < size; ++k) {
        const int p = (me + k) % size; // peers in a different order on each rank
        t.wait(p, ready, "its input");
        const T* theirs = reinterpret_cast<const T*>(t.peer_data(p, call)) + own.begin;
        fold(into, k == 1 ? data.data() + own.begin : into, theirs, n, op);
    }
    if (!in_window && n != 0 && size > 1) // alone, the vector is its own sum
        std::memcpy(data.data() + own.begin, into, n * sizeof(T));
    const std::uint64_t reduced = t.step();
    for (int k = 1; k < size; ++k) {
        const int p = (me + k) % size;
        t.wait(p, reduced, "its share");
        const auto* theirs = reinterpret_cast<const T*>(t.peer_data(p, call));
        const team_share s = share_of(data.size(), sizeof(T), p, size);
        if (s.end > s.begin)
            std::memcpy(data.data() + s.begin, theirs + s.begin, (s.end - s.begin) * sizeof(T));
    }
}

template <class T, class Op>
void allreduce_piece(node_team& t, std::span<T> data, std::span<T> whole, bool in_window, Op& op) {
    std::byte* const win = t.window().data();
    team_call call = t.call_for(data, whole, in_window, allreduce_kind<T, Op>());
    t.begin_call(call);
    T* const mine = reinterpret_cast<T*>(win + call.offset);
    try {
        by_shares(t, call, mine, data, in_window, op);
    } catch (...) {
        t.mark_broken(); // thrown midway (the operation, a peer): out of step for good
        throw;
    }
    // The caller may write its window once this returns (for this call or
    // the next): every peer must be done reading it.
    t.wait_all(t.step(), "reading this rank's window");
}

} // namespace detail

/// Reduces `data` element-wise with `op` across the team, in place, on every
/// rank. Throws rdmax::error (the team is broken then).
template <class T, class Op = std::plus<T>>
    requires std::is_trivially_copyable_v<T> && std::is_invocable_r_v<T, Op&, T, T>
void allreduce(node_team& t, std::span<T> data, Op op = {}) {
    t.in_pieces(data, [&](std::span<T> part, bool in_window) {
        detail::allreduce_piece(t, part, data, in_window, op);
    });
}

} // namespace rdmax::local
