#pragma once
// What one port of a device reports: state, link layer, MTU, addressing.

#include <cstdint>
#include <string_view>

#include <fmt/format.h>
#include <infiniband/verbs.h>

namespace rdmax::verbs {

enum class link_layer : std::uint8_t { infiniband, ethernet, unspecified };

[[nodiscard]] constexpr std::string_view to_string(link_layer l) noexcept {
    switch (l) {
    case link_layer::infiniband: return "InfiniBand";
    case link_layer::ethernet: return "Ethernet";
    case link_layer::unspecified: return "unspecified";
    }
    return "unknown";
}

/// "ACTIVE", "DOWN", ... (ibv_port_state_str without the PORT_ prefix).
[[nodiscard]] std::string_view to_string(ibv_port_state s) noexcept;

/// MTU in bytes (IBV_MTU_1024 -> 1024).
[[nodiscard]] constexpr unsigned mtu_bytes(ibv_mtu m) noexcept {
    return 128u << static_cast<unsigned>(m);
}

struct port_info {
    std::uint8_t number = 0;
    ibv_port_state state = IBV_PORT_NOP;
    link_layer layer = link_layer::unspecified;
    ibv_mtu active_mtu = IBV_MTU_1024;
    ibv_mtu max_mtu = IBV_MTU_1024;
    std::uint16_t lid = 0; ///< InfiniBand only; 0 on RoCE
    std::uint32_t gid_table_len = 0;
    std::uint32_t max_msg_size = 0;
    std::uint8_t active_speed = 0; ///< ibv_port_attr's code: per-lane rate
    std::uint8_t active_width = 0; ///< ibv_port_attr's code: lanes

    /// The link's rate in Gb/s, lanes x the per-lane rate its speed code
    /// names (SDR 2.5 .. EDR 25.78, HDR 50, NDR 100: a weight, not a
    /// measurement); 0 for a code this table does not know (verbs.h here
    /// has no active_speed_ex, so XDR reads 0). Soft-RoCE reports its
    /// netdev's speed (a dummy netdev has none: 2.5, SDR x1).
    [[nodiscard]] double gbps() const noexcept;

    [[nodiscard]] bool active() const noexcept { return state == IBV_PORT_ACTIVE; }
    [[nodiscard]] bool is_roce() const noexcept { return layer == link_layer::ethernet; }
};

} // namespace rdmax::verbs

template <>
struct fmt::formatter<rdmax::verbs::link_layer> : fmt::formatter<std::string_view> {
    auto format(rdmax::verbs::link_layer l, fmt::format_context& ctx) const {
        return fmt::formatter<std::string_view>::format(rdmax::verbs::to_string(l), ctx);
    }
};
