#pragma once
// Options of the live counters (publisher.hpp), and their knobs (RDMAX_STAT_*).

#include <chrono>
#include <tuple>

#include <rdmax/config/knob.hpp>

namespace rdmax::stats {

struct stat_options {
    /// Publish this process's counters for rdmax-stat. On by default: it
    /// costs a copy of an object's counters each interval, at its
    /// housekeeping, and nothing on a data path (docs/stats.md has the figures).
    bool enable = true;
    /// How often objects copy their counters into the segment.
    std::chrono::milliseconds interval{1000};

    /// These options with the variables of stat_knobs that are set applied;
    /// a malformed value throws rdmax::error naming it.
    [[nodiscard]] stat_options with_env() const;
};

/// RDMAX_STAT_*: read once, when the process publishes its first object.
inline constexpr std::tuple stat_knobs{
    config::knob{"RDMAX_STAT", &stat_options::enable, config::flag{},
                 "`0`: publish no live counters (`rdmax-stat` then sees nothing of this process)"},
    config::knob{"RDMAX_STAT_INTERVAL_MS", &stat_options::interval,
                 config::number{.lo = 10, .hi = 3'600'000},
                 "how often objects copy their counters into the process's stat segment"},
};

} // namespace rdmax::stats
