#include <cerrno>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/rpc/rpc_options.hpp>
#include <rdmax/rpc/wire.hpp>

#include "../env_knobs.hpp"

namespace rdmax::rpc {

rpc_options rpc_options::with_env() const {
    using namespace rdmax::detail;
    constexpr const char* who = "rpc_options::with_env";
    rpc_options o = *this;
    const auto number = [&](const char* name, std::string_view v, std::size_t least,
                            std::size_t most) {
        const std::size_t n = parse_size(who, name, v);
        if (n < least || n > most)
            malformed(who, name, v, fmt::format("a number from {} to {}", least, most));
        return n;
    };
    if (auto v = env("RDMAX_RPC_SLOTS"); !v.empty())
        o.slots = static_cast<std::uint16_t>(number("RDMAX_RPC_SLOTS", v, 1, max_slots));
    if (auto v = env("RDMAX_RPC_SLOT_BYTES"); !v.empty())
        o.slot_bytes = static_cast<std::uint32_t>(
            number("RDMAX_RPC_SLOT_BYTES", v, min_slot_bytes, max_slot_bytes));
    if (auto v = env("RDMAX_RPC_MAX_MESSAGE"); !v.empty())
        o.max_message = static_cast<std::uint32_t>(number("RDMAX_RPC_MAX_MESSAGE", v, 1, 1U << 30));
    if (auto v = env("RDMAX_RPC_MAX_PEERS"); !v.empty())
        o.max_peers = static_cast<std::uint32_t>(number("RDMAX_RPC_MAX_PEERS", v, 1, 1U << 20));
    if (auto v = env("RDMAX_RPC_TIMEOUT_MS"); !v.empty())
        o.call_timeout =
            std::chrono::milliseconds(number("RDMAX_RPC_TIMEOUT_MS", v, 1, 86'400'000));
    if (auto v = env("RDMAX_RPC_CONNECT_TIMEOUT_MS"); !v.empty())
        o.connect_timeout =
            std::chrono::milliseconds(number("RDMAX_RPC_CONNECT_TIMEOUT_MS", v, 1, 600'000));
    if (auto v = env("RDMAX_RPC_HOUSEKEEPING_US"); !v.empty())
        o.housekeeping =
            std::chrono::microseconds(number("RDMAX_RPC_HOUSEKEEPING_US", v, 1, 1'000'000));
    if (auto v = env("RDMAX_RPC_LOCAL"); !v.empty())
        o.local = parse_flag(who, "RDMAX_RPC_LOCAL", v);
    if (auto v = env("RDMAX_RPC_PTRACER"); !v.empty()) {
        if (v == "off")
            o.ptracer = ptracer_grant::off;
        else if (v == "peer")
            o.ptracer = ptracer_grant::peer;
        else if (v == "any")
            o.ptracer = ptracer_grant::any;
        else
            malformed(who, "RDMAX_RPC_PTRACER", v, "off, peer or any");
    }
    o.scheduler = o.scheduler.with_env();
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
    if (call_timeout.count() <= 0 || connect_timeout.count() <= 0 || housekeeping.count() <= 0)
        throw_error(who, EINVAL, "timeouts and the housekeeping interval must be positive");
}

} // namespace rdmax::rpc
