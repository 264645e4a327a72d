#pragma once
// Where a client's connection to a server stands (rpc::client::state, and
// the callback rpc::client::on_state_change).

#include <cstdint>
#include <string_view>

#include <fmt/format.h>

namespace rdmax::rpc {

enum class peer_state : std::uint8_t {
    ready,        ///< connected: calls go at once
    reconnecting, ///< the connection ended: a new one is being made (backoff); calls wait
    draining,     ///< the server said goaway: calls wait for the next connection
    closed,       ///< disconnected, or reconnecting gave up: calls end peer_gone
};

[[nodiscard]] constexpr std::string_view to_string(peer_state s) noexcept {
    switch (s) {
    case peer_state::ready: return "ready";
    case peer_state::reconnecting: return "reconnecting";
    case peer_state::draining: return "draining";
    case peer_state::closed: return "closed";
    }
    return "unknown";
}

} // namespace rdmax::rpc

template <>
struct fmt::formatter<rdmax::rpc::peer_state> : fmt::formatter<std::string_view> {
    auto format(rdmax::rpc::peer_state s, fmt::format_context& ctx) const {
        return fmt::formatter<std::string_view>::format(rdmax::rpc::to_string(s), ctx);
    }
};
