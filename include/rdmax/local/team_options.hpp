#pragma once
// Options of node_team (local/node_team.hpp) and their knobs.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <tuple>

#include <rdmax/config/knob.hpp>

namespace rdmax::local {

struct team_options {
    /// Each rank's window: the bytes of a vector a collective moves at once
    /// (a longer one goes in pieces of this size).
    std::size_t window_bytes = std::size_t{4} << 20;
    /// How long a rank waits for a peer (to join, or at a step of a
    /// collective) before it gives up and the team is broken.
    std::chrono::milliseconds timeout{30'000};
    /// Polls of a peer's progress before a waiting rank yields the CPU
    /// (for 1 ms, then it sleeps on a futex the peer's next step wakes).
    /// 0: 4096 when the team's ranks fit the node's CPUs, else 16 (a
    /// spinning rank would hold a CPU a peer needs).
    std::uint32_t spin = 0;
    /// These options with the variables of team_knobs that are set applied;
    /// a malformed value throws rdmax::error naming the variable.
    [[nodiscard]] team_options with_env() const;
};

/// RDMAX_TEAM_*: read by with_env() only.
inline constexpr std::tuple team_knobs{
    config::knob{
        "RDMAX_TEAM_WINDOW", &team_options::window_bytes,
        config::number{.lo = 4096, .hi = std::uint64_t{1} << 40, .bytes = true, .multiple_of = 64},
        "each rank's shared window of a node_team"},
    config::knob{"RDMAX_TEAM_TIMEOUT_MS", &team_options::timeout,
                 config::number{.lo = 1, .hi = 86'400'000}, // a day: no clock overflows
                 "a node_team rank's wait for a peer, at most"},
    config::knob{"RDMAX_TEAM_SPIN", &team_options::spin, config::number{.zero_word = "auto"},
                 "polls of a peer before a waiting node_team rank yields, then sleeps"},
};

} // namespace rdmax::local
