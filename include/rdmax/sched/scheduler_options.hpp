#pragma once
// Options and counters of priority_scheduler, with their knobs
// (scheduler_knobs, RDMAX_SCHED_*).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <tuple>

#include <fmt/format.h>

#include <rdmax/config/knob.hpp>

namespace rdmax::sched {

struct scheduler_options {
    /// Slice size while a more urgent level has work (or had some within
    /// `hold`): small, so that urgent work waits for little. Justitia starts
    /// at 5 KB; the default here was measured on soft-RoCE (see the README),
    /// where every slice costs an acknowledgement and a completion in the
    /// posting thread, so one slice fills the budget. On a NIC, keep it at
    /// most half the budget, so that a slice is posted while one is in flight.
    /// With a measured budget this is the cap: slices are then an eighth of
    /// the budget, at least 4 KiB and what the link sends while the host
    /// posts four.
    std::uint32_t small_slice = 16 * 1024;
    /// Slice size while nothing more urgent is around: large, so that a bulk
    /// transfer costs few work requests and completions (Justitia: 1 MB).
    std::uint32_t large_slice = 1024 * 1024;
    /// Bytes in flight (posted, not known complete) above which nothing more
    /// is posted. A new request waits at least for these bytes, and the link
    /// stays busy only if they cover the bandwidth-delay product; so size it
    /// from that product as measured on the link, not from a data sheet
    /// (rdmax_hol_bench prints it). The default was measured on soft-RoCE,
    /// where the cost of each doorbell, not the product (under 1 KB), sets
    /// the floor: the doorbell transmits in the posting thread, so its fixed
    /// cost must be spread over enough bytes. On a 100 Gb/s link with a 3 us
    /// round trip the product is 37.5 KB.
    ///
    /// 0 (the default): measured at run time, the product of the delivered
    /// rate and the latency of a slice posted with nothing ahead (see
    /// basic_priority_scheduler::measure), starting at 16 KiB; the counters
    /// show the measurement. Any other value is fixed.
    std::uint64_t budget_bytes = 0;
    /// Work requests in flight above which nothing more is posted (clamped to
    /// half the send queue).
    std::uint32_t budget_wqes = 16;
    /// How long a level counts as active after its last request completed:
    /// urgent traffic comes and goes, and a bulk transfer must not switch to
    /// large slices in every gap between two urgent requests.
    std::chrono::microseconds hold{10'000};
    /// Requests queued or in flight at once; submissions beyond are refused
    /// (status::queue_full). Preallocated: no allocation per request.
    std::uint32_t max_requests = 1024;

    /// These options with the variables of scheduler_knobs that are set
    /// applied; a malformed or out-of-range value throws rdmax::error naming
    /// the variable, the value and what it accepts, and nothing is applied.
    [[nodiscard]] scheduler_options with_env() const;
};

/// RDMAX_SCHED_*: read by with_env() only (priority_scheduler's default options).
inline constexpr std::tuple scheduler_knobs{
    config::knob{"RDMAX_SCHED_SMALL_SLICE", &scheduler_options::small_slice,
                 config::number{.lo = 1, .bytes = true},
                 "slice size while a more urgent level has work"},
    config::knob{"RDMAX_SCHED_LARGE_SLICE", &scheduler_options::large_slice,
                 config::number{.lo = 1, .bytes = true}, "slice size otherwise"},
    config::knob{"RDMAX_SCHED_BUDGET_BYTES", &scheduler_options::budget_bytes,
                 config::number{.lo = 1, .hi = UINT32_MAX, .bytes = true, .zero_word = "auto"},
                 "bytes in flight above which nothing more is posted; `auto`: measured "
                 "(bandwidth-delay product + a small slice)"},
    config::knob{"RDMAX_SCHED_BUDGET_WQES", &scheduler_options::budget_wqes,
                 config::number{.lo = 1},
                 "work requests in flight likewise (at most half the send queue)"},
    // Bounded so that the coarse clock's nanoseconds hold it (and a minute is long).
    config::knob{"RDMAX_SCHED_HOLD_US", &scheduler_options::hold, config::number{.hi = 60'000'000},
                 "how long a level counts as active after its last request"},
    config::knob{"RDMAX_SCHED_MAX_REQUESTS", &scheduler_options::max_requests,
                 config::number{.lo = 1, .hi = 65536},
                 "requests queued or in flight (preallocated, per connection)"},
};

struct scheduler_counters {
    std::uint64_t requests = 0;        ///< submitted
    std::uint64_t completed = 0;       ///< finished successfully
    std::uint64_t failed = 0;          ///< finished with an error (flushes included)
    std::uint64_t slices = 0;          ///< work requests posted
    std::uint64_t small_slices = 0;    ///< of those, cut at the small size
    std::uint64_t signaled = 0;        ///< of those, signaled
    std::uint64_t bytes = 0;           ///< posted
    std::uint64_t doorbells = 0;       ///< ibv_post_send calls
    std::uint64_t budget_stalls = 0;   ///< times work waited for the budget
    std::uint64_t max_in_flight = 0;   ///< most bytes ever in flight
    std::uint64_t in_flight_bytes = 0; ///< now
    /// Send completions that were not the scheduler's (someone else posted on
    /// its queue pair); ignored.
    std::uint64_t foreign_completions = 0;
    std::uint64_t budget_bytes = 0;    ///< the byte budget now (fixed, or as measured)
    std::uint64_t small_slice = 0;     ///< the small slice now (an eighth of a measured budget)
    std::uint64_t rate_mb_per_s = 0;   ///< measured delivery rate (adaptive budget only)
    std::uint64_t base_latency_ns = 0; ///< measured latency with nothing ahead (likewise)
    std::uint64_t budget_samples = 0;  ///< measurements taken
    std::uint64_t post_ns = 0;         ///< measured host time per slice posted (doorbell included)
};

} // namespace rdmax::sched

template <>
struct fmt::formatter<rdmax::sched::scheduler_counters> {
    constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
    auto format(const rdmax::sched::scheduler_counters& c, fmt::format_context& ctx) const {
        return fmt::format_to(
            ctx.out(),
            "requests {} completed {} failed {} slices {} (small {}, signaled "
            "{}) bytes {} doorbells {} budget stalls {} max in flight {} "
            "bytes, in flight {} bytes, foreign completions {}, budget {} "
            "bytes, small slice {} (measured: {} MB/s x {} ns base latency, {} ns "
            "per slice posted, {} samples)",
            c.requests, c.completed, c.failed, c.slices, c.small_slices, c.signaled, c.bytes,
            c.doorbells, c.budget_stalls, c.max_in_flight, c.in_flight_bytes, c.foreign_completions,
            c.budget_bytes, c.small_slice, c.rate_mb_per_s, c.base_latency_ns, c.post_ns,
            c.budget_samples);
    }
};
