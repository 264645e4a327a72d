#pragma once
// Weighted sharing by deficit round robin (Shreedhar and Varghese): levels
// take turns; on its turn a level earns weight x quantum bytes of credit and
// posts slices while its credit lasts, so over time each busy level gets
// bytes in proportion to its weight, whatever its slice sizes. A slice may
// overdraw the credit; the debt is paid on later turns. A level that runs out
// of work loses its credit, so an idle level cannot save up a burst.

#include <array>
#include <cstddef>
#include <cstdint>

#include <rdmax/sched/priority.hpp>
#include <rdmax/sched/scheduling_policy.hpp>

namespace rdmax::sched {

class deficit_round_robin {
public:
    /// Default weights halve from level to level: 128, 64, ..., 1.
    static constexpr std::array<std::uint32_t, priority_levels> halving_weights{128, 64, 32, 16,
                                                                                8,   4,  2,  1};

    explicit deficit_round_robin(
        std::array<std::uint32_t, priority_levels> weights = halving_weights,
        std::uint64_t quantum_bytes = 4096) noexcept {
        for (std::size_t l = 0; l < priority_levels; ++l) {
            // A weight of 0 would never earn credit and spin pick(): treat it as 1.
            const std::uint64_t w = weights[l] == 0 ? 1 : weights[l];
            quantum_[l] = static_cast<std::int64_t>(w * (quantum_bytes == 0 ? 1 : quantum_bytes));
        }
    }

    [[nodiscard]] int pick(level_mask ready) noexcept {
        if (ready == 0)
            return -1;
        // Terminates: every full round adds a positive quantum to each ready
        // level, so some ready level's credit turns positive.
        for (;;) {
            const std::size_t l = cursor_;
            if ((ready >> l) & 1U) {
                if (credit_[l] > 0)
                    return static_cast<int>(l);
                if (!topped_up_) {
                    credit_[l] += quantum_[l];
                    topped_up_ = true;
                    if (credit_[l] > 0)
                        return static_cast<int>(l);
                }
            }
            cursor_ = (cursor_ + 1) % priority_levels;
            topped_up_ = false;
        }
    }
    void charge(std::size_t level, std::uint64_t bytes) noexcept {
        credit_[level] -= static_cast<std::int64_t>(bytes);
    }
    void idle(std::size_t level) noexcept { credit_[level] = 0; }

    [[nodiscard]] std::int64_t credit(std::size_t level) const noexcept { return credit_[level]; }

private:
    std::array<std::int64_t, priority_levels> quantum_{};
    std::array<std::int64_t, priority_levels> credit_{};
    std::size_t cursor_ = 0;
    bool topped_up_ = false; ///< the level under the cursor got its quantum this turn
};

static_assert(SchedulingPolicy<deficit_round_robin>);

} // namespace rdmax::sched
