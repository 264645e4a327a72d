#pragma once
// The SchedulingPolicy concept: which priority level posts the next slice.
//
// The scheduler asks pick() each time it may post, with a bit mask of the
// levels whose oldest request can be posted now (bit L for level L), and tells
// the policy what it posted (charge) and when a level ran out of work (idle).
// A policy is called from the data path: noexcept, no allocation.

#include <concepts>
#include <cstddef>
#include <cstdint>

namespace rdmax::sched {

/// Bit L set: level L has a request ready to post.
using level_mask = std::uint32_t;

template <class P>
concept SchedulingPolicy =
    requires(P& p, level_mask ready, std::size_t level, std::uint64_t bytes) {
        /// The level to serve, one whose bit is set in `ready`; -1 if none (only when ready == 0).
        { p.pick(ready) } noexcept -> std::same_as<int>;
        /// `bytes` of the level's request were posted.
        { p.charge(level, bytes) } noexcept;
        /// The level has no request left.
        { p.idle(level) } noexcept;
    };

} // namespace rdmax::sched
