#pragma once
// How urgent a request is: one of eight levels, 0 the most urgent. Requests
// of one level are posted in the order they were submitted; how levels share
// the queue pair is the scheduling policy's choice.

#include <cstddef>
#include <cstdint>

namespace rdmax::sched {

inline constexpr std::size_t priority_levels = 8;

struct priority {
    std::uint8_t level = priority_levels - 1;

    friend constexpr bool operator==(priority, priority) = default;
    /// More urgent than `other`.
    [[nodiscard]] constexpr bool above(priority other) const noexcept {
        return level < other.level;
    }
};

/// Names for four of the levels; any level from 0 to 7 may be used.
inline constexpr priority urgent{0};
inline constexpr priority high{2};
inline constexpr priority normal{4};
inline constexpr priority bulk{7};

} // namespace rdmax::sched
