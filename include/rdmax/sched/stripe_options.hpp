#pragma once
// Options and counters of basic_striper (a transfer cut across rails), with
// their knobs (stripe_knobs, RDMAX_STRIPE_*).

#include <array>
#include <cstdint>
#include <tuple>

#include <fmt/format.h>

#include <rdmax/config/knob.hpp>
#include <rdmax/mem/rail_buffer.hpp>
#include <rdmax/sched/priority.hpp>

namespace rdmax::sched {

struct stripe_options {
    /// A transfer shorter than this goes whole to the least-loaded rail. In
    /// the NIC model (docs/bench-multirail-sim.md) a transfer alone on two
    /// rails ends in 0.57 (100 Gb/s) to 0.73 (400 Gb/s) of its time whole
    /// from 256 KiB; below, each piece's fixed costs (a work request, a
    /// completion, the host's round) eat the gain (64 KiB at 400 Gb/s: 0.92).
    std::uint64_t stripe_min = 256 * 1024;
    /// The bytes one rail takes at a time from a striped transfer. A rail
    /// asks for the next piece when one of its own completes, so the rails
    /// share a transfer in proportion to what each delivers, measured by
    /// the transfer itself; the last pieces are cut in proportion to the
    /// rails' rates so that they end together.
    std::uint64_t chunk = 2 * 1024 * 1024;
    /// Pieces a rail holds in its scheduler at once: two keep its link busy
    /// while the host hands it the next (one: 4 x 400 Gb/s at 0.69-0.95 of
    /// two in the model; four: no more than two), and leave little to move
    /// when the rail fails.
    std::uint32_t chunks_ahead = 2;
    /// Transfers queued or in flight at once (preallocated: no allocation
    /// per transfer); more are refused with status::queue_full.
    std::uint32_t max_requests = 1024;
    /// Whole transfers of a priority level under this go to a rail's urgent
    /// lane, where the rail was attached with one (basic_striper::attach):
    /// 1, urgent ones alone; 0, none.
    std::uint32_t lane_levels = 1;

    /// These options with the variables of stripe_knobs that are set applied
    /// (a bad value throws rdmax::error naming it, and nothing is applied).
    [[nodiscard]] stripe_options with_env() const;
};

/// RDMAX_STRIPE_*: read by with_env() only.
inline constexpr std::tuple stripe_knobs{
    config::knob{"RDMAX_STRIPE_MIN", &stripe_options::stripe_min,
                 config::number{.lo = 1, .hi = UINT32_MAX, .bytes = true},
                 "transfers below this go whole to the least-loaded rail"},
    config::knob{"RDMAX_STRIPE_CHUNK", &stripe_options::chunk,
                 config::number{.lo = 4096, .hi = 1U << 30, .bytes = true},
                 "bytes a rail takes at a time from a striped transfer"},
    config::knob{"RDMAX_STRIPE_AHEAD", &stripe_options::chunks_ahead,
                 config::number{.lo = 1, .hi = 64}, "pieces a rail holds in its scheduler"},
    config::knob{"RDMAX_STRIPE_LANE_LEVELS", &stripe_options::lane_levels,
                 config::number{.lo = 0, .hi = priority_levels},
                 "whole transfers of a level under this use a rail's urgent lane"},
};

struct striper_counters {
    std::uint64_t requests = 0;    ///< transfers submitted
    std::uint64_t completed = 0;   ///< finished successfully
    std::uint64_t failed = 0;      ///< finished with an error
    std::uint64_t chunks = 0;      ///< pieces handed to a rail's scheduler (re-sends included)
    std::uint64_t reposts = 0;     ///< of those, pieces sent again after their rail failed
    std::uint64_t steals = 0;      ///< pieces moved, unstarted, to a rail that ran dry
    std::uint64_t failovers = 0;   ///< rails taken out
    std::uint64_t rejoins = 0;     ///< rails attached again after they were out
    std::uint64_t foreign = 0;     ///< completions of others' requests on a rail, passed on
    std::uint64_t lane_pieces = 0; ///< pieces that went by a rail's urgent lane
    std::array<std::uint64_t, max_rails> rail_bytes{}; ///< bytes each rail delivered
};

} // namespace rdmax::sched

template <>
struct fmt::formatter<rdmax::sched::striper_counters> : fmt::formatter<std::string_view> {
    template <class Ctx>
    auto format(const rdmax::sched::striper_counters& c, Ctx& ctx) const {
        return fmt::format_to(
            ctx.out(),
            "requests {} completed {} failed {} chunks {} reposts {} steals {} "
            "failovers {} rejoins {} foreign {} lane_pieces {} rail_bytes {} {} {} {}",
            c.requests, c.completed, c.failed, c.chunks, c.reposts, c.steals, c.failovers,
            c.rejoins, c.foreign, c.lane_pieces, c.rail_bytes[0], c.rail_bytes[1], c.rail_bytes[2],
            c.rail_bytes[3]);
    }
};
