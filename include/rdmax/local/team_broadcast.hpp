#pragma once
// broadcast on a node_team (local/node_team.hpp): every rank ends with the
// root's vector. The root's data is read where it lies in its window (staged
// into it first when it is elsewhere, in pieces of the window's size); each
// other rank copies it out once. Two steps per piece: the root's data is
// ready; every rank is done reading it (when a call returns, no rank reads
// the root's window any more). The hierarchical allreduce's last leg: the
// node's leader hands the nodes' sum to its node (examples/allreduce.cpp).
//
// Every rank passes the same number of elements of the same type and the
// same root; a rank that does not breaks the team (rdmax::error).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <typeinfo>

#include <rdmax/local/node_team.hpp>

namespace rdmax::local {

namespace detail {

template <class T>
void broadcast_piece(node_team& t, std::span<T> data, std::span<T> whole, int root,
                     bool in_window) {
    std::byte* const win = t.window().data();
    const bool at_root = t.rank() == root;
    // A broadcast (even: never an allreduce's) of this type, from whom.
    team_call call =
        t.call_for(data, whole, in_window,
                   (type_hash(typeid(T).name()) ^ static_cast<std::uint32_t>(root)) << 1);
    t.begin_call(call);
    if (at_root && !in_window && !data.empty())
        std::memcpy(win, data.data(), data.size_bytes());
    const std::uint64_t ready = t.step();
    if (at_root) {
        // Every rank must name this one: a rank that names another root
        // breaks the team here rather than keep its own data unnoticed.
        for (int p = 0; p < t.size(); ++p)
            if (p != root) {
                t.wait(p, ready, "its call");
                (void)t.peer_data(p, call);
            }
    } else {
        t.wait(root, ready, "its data");
        const std::byte* from = t.peer_data(root, call);
        if (!data.empty())
            std::memcpy(data.data(), from, data.size_bytes());
    }
    t.wait_all(t.step(), "reading the root's window");
}

} // namespace detail

/// Copies `root`'s `data` into every other rank's `data`. Throws
/// rdmax::error (the team is broken then).
template <class T>
    requires std::is_trivially_copyable_v<T>
void broadcast(node_team& t, std::span<T> data, int root = 0) {
    if (root < 0 || root >= t.size())
        t.refuse_data(data.size_bytes(), "its root is not a rank of the team");
    t.in_pieces(data, [&](std::span<T> part, bool in_window) {
        detail::broadcast_piece(t, part, data, root, in_window);
    });
}

} // namespace rdmax::local
