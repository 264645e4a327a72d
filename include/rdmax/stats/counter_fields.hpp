#pragma once
// The fields each kind of object publishes (publisher.hpp): their names and
// types, and how a counters struct becomes the values in that order. One
// table per counters struct, kept beside rdmax-stat's names for them.

#include <cstdint>
#include <span>

#include <rdmax/stats/segment_layout.hpp>

namespace rdmax {
struct rcache_counters;
struct arena_counters;
namespace rpc {
struct rpc_counters;
} // namespace rpc
namespace sched {
struct scheduler_counters;
} // namespace sched
} // namespace rdmax

namespace rdmax::stats {

/// rpc_counters, then two levels: calls in flight and connections now.
[[nodiscard]] std::span<const field_desc> rpc_fields() noexcept;
void rpc_values(const rpc::rpc_counters& c, std::uint64_t in_flight, std::uint64_t peers,
                std::span<std::uint64_t> out) noexcept;

[[nodiscard]] std::span<const field_desc> rcache_fields() noexcept;
void rcache_values(const rcache_counters& c, std::span<std::uint64_t> out) noexcept;

[[nodiscard]] std::span<const field_desc> arena_fields() noexcept;
void arena_values(const arena_counters& c, std::span<std::uint64_t> out) noexcept;

/// The schedulers of an endpoint's connections, summed (the most, for
/// max_in_flight and base_latency_ns).
[[nodiscard]] std::span<const field_desc> scheduler_fields() noexcept;
void add_scheduler_values(const sched::scheduler_counters& c,
                          std::span<std::uint64_t> out) noexcept;

} // namespace rdmax::stats
