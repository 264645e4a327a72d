#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include <rdmax/detail/rpc/wire.hpp>
#include <rdmax/error.hpp>
#include <rdmax/rpc/rpc_options.hpp>

namespace rdmax::rpc {

// The table's bounds are the wire format's.
static_assert(std::get<0>(rpc_knobs).parser.hi == max_slots);
static_assert(std::get<1>(rpc_knobs).parser.lo == min_slot_bytes);
static_assert(std::get<1>(rpc_knobs).parser.hi == max_slot_bytes);

transport_set transport_list::parse_transports(const char* who, std::string_view name,
                                               std::string_view text) {
    transport_set set;
    std::string_view rest = text;
    while (true) {
        const std::size_t comma = rest.find(',');
        const std::string_view word = rest.substr(0, comma);
        if (word == "rdma")
            set = set | transport::rdma;
        else if (word == "shm")
            set = set | transport::shm;
        else if (word == "tcp")
            set = set | transport::tcp;
        else
            config::refuse(who, name, text, "a comma list of rdma, shm, tcp");
        if (comma == std::string_view::npos)
            break;
        rest.remove_prefix(comma + 1);
    }
    return set;
}

std::string transport_list::format_transports(transport_set v) {
    std::string out;
    for (const transport t : {transport::rdma, transport::shm, transport::tcp})
        if (v.has(t))
            out += fmt::format("{}{}", out.empty() ? "" : ",", to_string(t));
    return out;
}

rpc_options rpc_options::with_env() const {
    constexpr const char* who = "rpc_options::with_env";
    rpc_options o = config::apply_env(*this, rpc_knobs, who);
    o.scheduler = o.scheduler.with_env();
    o.arena = o.arena.with_env();
    o.cache = o.cache.with_env();
    o.check(who);
    return o;
}

void rpc_options::check(const char* who) const {
    if (slots == 0 || slots > max_slots)
        throw_error(who, EINVAL, fmt::format("slots {}: 1 to {}", slots, max_slots));
    if (slot_bytes < min_slot_bytes || slot_bytes > max_slot_bytes || slot_bytes % 8 != 0)
        throw_error(who, EINVAL,
                    fmt::format("slot_bytes {}: a multiple of 8 from {} to {}", slot_bytes,
                                min_slot_bytes, max_slot_bytes));
    if (max_message == 0)
        throw_error(who, EINVAL, "max_message 0");
    if (max_peers == 0)
        throw_error(who, EINVAL, "max_peers 0");
    if (transports.bits == 0 || (transports.bits & ~all_transports.bits) != 0)
        throw_error(
            who, EINVAL,
            fmt::format("transports {:#x}: one or more of rdma, shm, tcp", transports.bits));
    if (call_timeout.count() <= 0 || connect_timeout.count() <= 0 || housekeeping.count() <= 0)
        throw_error(who, EINVAL, "timeouts and the housekeeping interval must be positive");
    if (keepalive.count() <= 0 || keepalive_timeout < keepalive)
        throw_error(who, EINVAL,
                    fmt::format("keepalive {} ms, keepalive_timeout {} ms: positive, and the "
                                "timeout at least the interval",
                                keepalive.count(), keepalive_timeout.count()));
    if (reconnect_backoff.count() <= 0 || reconnect_backoff_max < reconnect_backoff ||
        reconnect_give_up.count() < 0)
        throw_error(who, EINVAL,
                    "reconnect_backoff positive, reconnect_backoff_max at least it, "
                    "reconnect_give_up not negative");
    if (reply_cache_calls == 0 || reply_cache_ttl.count() <= 0 || reply_cache_linger.count() < 0)
        throw_error(who, EINVAL, "reply_cache_calls and reply_cache_ttl must be positive");
}

arena_options rpc_options::ring_arena() const {
    arena_options a = arena;
    a.area_rights = rights::local_write;
    a.area_bytes = std::max<std::size_t>(a.area_bytes, std::size_t{2} << 20);
    return a;
}

} // namespace rdmax::rpc
