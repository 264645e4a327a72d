// The fields of each published kind (counter_fields.hpp).

#include <algorithm>
#include <string_view>

#include <rdmax/mem/arena_options.hpp>
#include <rdmax/mem/rcache_options.hpp>
#include <rdmax/rpc/rpc_counters.hpp>
#include <rdmax/sched/scheduler_options.hpp>
#include <rdmax/stats/counter_fields.hpp>

namespace rdmax::stats {

namespace {

constexpr field_desc rpc_table[] = {
    {"calls", field_type::counter},
    {"completed", field_type::counter},
    {"failed", field_type::counter},
    {"timed_out", field_type::counter},
    {"cancelled", field_type::counter},
    {"late_replies", field_type::counter},
    {"no_credit", field_type::counter},
    {"external_bodies", field_type::counter},
    {"external_replies", field_type::counter},
    {"window_reallocs", field_type::counter},
    {"windows_unavailable", field_type::counter},
    {"fence_stalls", field_type::counter},
    {"cancelled_reads", field_type::counter},
    {"rail_joins", field_type::counter},
    {"striped_bodies", field_type::counter},
    {"rail_bytes", field_type::counter},
    {"keepalive_probes", field_type::counter},
    {"keepalive_timeouts", field_type::counter},
    {"reconnects", field_type::counter},
    {"reconnect_attempts", field_type::counter},
    {"retried_calls", field_type::counter},
    {"unknown_outcomes", field_type::counter},
    {"duplicates", field_type::counter},
    {"goaways", field_type::counter},
    {"bytes_in", field_type::counter},
    {"bytes_out", field_type::counter},
    {"unknown_method", field_type::counter},
    {"rejected_kind", field_type::counter},
    {"rejected_slot", field_type::counter},
    {"rejected_length", field_type::counter},
    {"rejected_malformed", field_type::counter},
    {"rejected_credit", field_type::counter},
    {"rejected_opcode", field_type::counter},
    {"stray_completions", field_type::counter},
    {"connected", field_type::counter},
    {"connected_local", field_type::counter},
    {"connected_tcp", field_type::counter},
    {"refused", field_type::counter},
    {"disconnected", field_type::counter},
    {"link_failures", field_type::counter},
    {"in_flight", field_type::gauge},
    {"peers", field_type::gauge},
};

constexpr field_desc rcache_table[] = {
    {"lookups", field_type::counter},        {"hits", field_type::counter},
    {"misses", field_type::counter},         {"merges", field_type::counter},
    {"evictions", field_type::counter},      {"invalidations", field_type::counter},
    {"registrations", field_type::counter},  {"uncached", field_type::counter},
    {"thrash", field_type::counter},         {"registered_count", field_type::gauge},
    {"registered_bytes", field_type::gauge},
};

constexpr field_desc arena_table[] = {
    {"allocations", field_type::counter},      {"frees", field_type::counter},
    {"areas_registered", field_type::counter}, {"areas_released", field_type::counter},
    {"huge_page_areas", field_type::counter},  {"trims", field_type::counter},
    {"pressure_events", field_type::counter},  {"registered_bytes", field_type::gauge},
    {"allocated_bytes", field_type::gauge},
};

constexpr field_desc scheduler_table[] = {
    {"requests", field_type::counter},       {"completed", field_type::counter},
    {"failed", field_type::counter},         {"slices", field_type::counter},
    {"small_slices", field_type::counter},   {"signaled", field_type::counter},
    {"bytes", field_type::counter},          {"doorbells", field_type::counter},
    {"budget_stalls", field_type::counter},  {"foreign_completions", field_type::counter},
    {"budget_samples", field_type::counter}, {"max_in_flight", field_type::gauge},
    {"in_flight_bytes", field_type::gauge},  {"budget_bytes", field_type::gauge},
    {"rate_mb_per_s", field_type::gauge},    {"base_latency_ns", field_type::gauge},
};

/// The scheduler fields that take the most of the connections, not the sum.
bool is_most(std::size_t i) noexcept {
    const std::string_view n = scheduler_table[i].name;
    return n == "max_in_flight" || n == "base_latency_ns";
}

/// Writes what fits: a span shorter than the table (a record cut at
/// max_fields) gets the first fields.
template <std::size_t N>
void put(std::span<std::uint64_t> out, const std::uint64_t (&v)[N]) noexcept {
    std::copy_n(v, std::min(N, out.size()), out.begin());
}

} // namespace

std::span<const field_desc> rpc_fields() noexcept {
    return rpc_table;
}

void rpc_values(const rpc::rpc_counters& c, std::uint64_t in_flight, std::uint64_t peers,
                std::span<std::uint64_t> out) noexcept {
    const std::uint64_t v[] = {
        c.calls,
        c.completed,
        c.failed,
        c.timed_out,
        c.cancelled,
        c.late_replies,
        c.no_credit,
        c.external_bodies,
        c.external_replies,
        c.window_reallocs,
        c.windows_unavailable,
        c.fence_stalls,
        c.cancelled_reads,
        c.rail_joins,
        c.striped_bodies,
        c.rail_bytes,
        c.keepalive_probes,
        c.keepalive_timeouts,
        c.reconnects,
        c.reconnect_attempts,
        c.retried_calls,
        c.unknown_outcomes,
        c.duplicates,
        c.goaways,
        c.bytes_in,
        c.bytes_out,
        c.unknown_method,
        c.rejected_kind,
        c.rejected_slot,
        c.rejected_length,
        c.rejected_malformed,
        c.rejected_credit,
        c.rejected_opcode,
        c.stray_completions,
        c.connected,
        c.connected_local,
        c.connected_tcp,
        c.refused,
        c.disconnected,
        c.link_failures,
        in_flight,
        peers,
    };
    static_assert(std::size(v) == std::size(rpc_table));
    put(out, v);
}

std::span<const field_desc> rcache_fields() noexcept {
    return rcache_table;
}

void rcache_values(const rcache_counters& c, std::span<std::uint64_t> out) noexcept {
    const std::uint64_t v[] = {
        c.lookups,          c.hits,          c.misses,   c.merges, c.evictions,
        c.invalidations,    c.registrations, c.uncached, c.thrash, c.registered_count,
        c.registered_bytes,
    };
    static_assert(std::size(v) == std::size(rcache_table));
    put(out, v);
}

std::span<const field_desc> arena_fields() noexcept {
    return arena_table;
}

void arena_values(const arena_counters& c, std::span<std::uint64_t> out) noexcept {
    const std::uint64_t v[] = {
        c.allocations, c.frees,           c.areas_registered, c.areas_released,  c.huge_page_areas,
        c.trims,       c.pressure_events, c.registered_bytes, c.allocated_bytes,
    };
    static_assert(std::size(v) == std::size(arena_table));
    put(out, v);
}

std::span<const field_desc> scheduler_fields() noexcept {
    return scheduler_table;
}

void add_scheduler_values(const sched::scheduler_counters& c,
                          std::span<std::uint64_t> out) noexcept {
    const std::uint64_t v[] = {
        c.requests,        c.completed,
        c.failed,          c.slices,
        c.small_slices,    c.signaled,
        c.bytes,           c.doorbells,
        c.budget_stalls,   c.foreign_completions,
        c.budget_samples,  c.max_in_flight,
        c.in_flight_bytes, c.budget_bytes,
        c.rate_mb_per_s,   c.base_latency_ns,
    };
    static_assert(std::size(v) == std::size(scheduler_table));
    for (std::size_t i = 0; i < std::min(std::size(v), out.size()); ++i)
        out[i] = is_most(i) ? std::max(out[i], v[i]) : out[i] + v[i];
}

} // namespace rdmax::stats
