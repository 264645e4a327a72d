#pragma once
// Live counters: how an object publishes its counters into this process's
// stat segment (segment_layout.hpp), for rdmax-stat to read from outside.
//
// Two ways, by who may read the counters:
//
//   - stats::slot: the object copies its counters in itself, from its own
//     progress (an RPC endpoint's housekeeping: due() once an interval, then
//     publish()). For single-threaded objects whose counters are plain
//     words: nobody else may read them, so nobody else does.
//   - stats::pulled: the process's stat thread calls the object's reader once
//     an interval. For objects whose counters() any thread may call (the
//     registration cache, the arena: atomics and their own locks), so their
//     data paths gain nothing, not one instruction.
//
// The segment is made when the first object is published, mode 0600, and
// removed at exit; a killed process's is recognised as stale and removed by
// rdmax-stat. RDMAX_STAT=0 publishes nothing. A forked child publishes
// nothing (its inherited objects would write into the parent's segment).

#include <atomic>
#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <utility>

#include <rdmax/sched/coarse_clock.hpp>
#include <rdmax/stats/segment_layout.hpp>

namespace rdmax::stats {

namespace detail {
/// Bumped in a forked child: a slot opened before stops publishing.
extern std::atomic<std::uint32_t> fork_generation;
} // namespace detail

/// One object's record, written by its owner's thread only.
class slot {
public:
    /// No record: due() is never true.
    slot() noexcept = default;
    /// A record of `kind` ("rpc_server", ...) named `name` (empty: "#N", N
    /// counting the kind's objects), with these fields. No record (and no
    /// error) when publishing is off, the table is full or it cannot be made.
    slot(std::string_view kind, std::string_view name, std::span<const field_desc> fields) noexcept;
    slot(slot&& o) noexcept;
    slot& operator=(slot&& o) noexcept;
    slot(const slot&) = delete;
    slot& operator=(const slot&) = delete;
    ~slot();

    [[nodiscard]] explicit operator bool() const noexcept { return rec_ != nullptr; }

    /// True once an interval (`now`: the caller's coarse clock reading).
    [[nodiscard]] bool due(sched::coarse_clock::time_point now) noexcept {
        if (rec_ == nullptr || now < next_)
            return false;
        next_ = now + interval_;
        return generation_ == detail::fork_generation.load(std::memory_order_relaxed);
    }
    /// Copies `values` in (at most the record's fields) under the seqlock.
    void publish(std::span<const std::uint64_t> values) noexcept;

private:
    void close() noexcept;

    record* rec_ = nullptr;
    sched::coarse_clock::time_point next_{};
    sched::coarse_clock::duration interval_{};
    std::uint32_t generation_ = 0;
};

/// One object read by the stat thread: `read` fills the values (as many as
/// fields) once an interval, from that thread, until this is destroyed
/// (after the destructor returns it is never called again). Declare it as
/// the object's last member, so that it goes first.
class pulled {
public:
    using reader = std::function<void(std::span<std::uint64_t>)>;

    pulled() noexcept = default;
    pulled(std::string_view kind, std::string_view name, std::span<const field_desc> fields,
           reader read) noexcept;
    pulled(pulled&& o) noexcept
        : id_(std::exchange(o.id_, 0)) {}
    pulled& operator=(pulled&& o) noexcept;
    pulled(const pulled&) = delete;
    pulled& operator=(const pulled&) = delete;
    ~pulled();

    [[nodiscard]] explicit operator bool() const noexcept { return id_ != 0; }

private:
    std::uint64_t id_ = 0;
};

/// Where this process's segment is ("" when it publishes nothing yet).
[[nodiscard]] std::string_view segment_path() noexcept;

/// Copies the pulled objects' counters in now (tests; rdmax-stat's readers
/// otherwise see them within an interval).
void publish_pulled_now() noexcept;

} // namespace rdmax::stats
