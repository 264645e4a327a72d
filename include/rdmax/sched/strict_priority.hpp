#pragma once
// Strict priority, the default policy: the most urgent ready level always
// goes first. A busy urgent level starves the others; that is the point, and
// deficit_round_robin is the policy for when it must not.

#include <bit>
#include <cstddef>
#include <cstdint>

#include <rdmax/sched/scheduling_policy.hpp>

namespace rdmax::sched {

struct strict_priority {
    [[nodiscard]] int pick(level_mask ready) const noexcept {
        return ready == 0 ? -1 : std::countr_zero(ready);
    }
    void charge(std::size_t, std::uint64_t) const noexcept {}
    void idle(std::size_t) const noexcept {}
};

static_assert(SchedulingPolicy<strict_priority>);

} // namespace rdmax::sched
