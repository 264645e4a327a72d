#pragma once
// GIDs: the 128-bit port addresses of RDMA. On RoCE v2 a GID is the IPv6 (or
// IPv4-mapped IPv6) address of the netdev under the port.

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <infiniband/verbs.h>

namespace rdmax::verbs {

enum class gid_type : std::uint8_t { ib, roce_v1, roce_v2 };

[[nodiscard]] constexpr std::string_view to_string(gid_type t) noexcept {
    switch (t) {
    case gid_type::ib: return "IB";
    case gid_type::roce_v1: return "RoCE v1";
    case gid_type::roce_v2: return "RoCE v2";
    }
    return "unknown";
}

/// A GID value, comparable and printable as an IPv6 address.
struct gid {
    std::array<std::uint8_t, 16> raw{};

    [[nodiscard]] static gid from(const ibv_gid& g) noexcept {
        gid out;
        std::memcpy(out.raw.data(), g.raw, sizeof g.raw);
        return out;
    }
    [[nodiscard]] ibv_gid to_ibv() const noexcept {
        ibv_gid g;
        std::memcpy(g.raw, raw.data(), sizeof g.raw);
        return g;
    }
    /// ::ffff:a.b.c.d, the RoCE v2 GID of an IPv4 address.
    [[nodiscard]] static gid ipv4_mapped(std::uint32_t addr_host_order) noexcept;
    /// Parses dotted IPv4 ("192.0.2.1", mapped) or IPv6 text; nullopt if neither.
    [[nodiscard]] static std::optional<gid> parse(std::string_view text);

    [[nodiscard]] bool is_zero() const noexcept;
    [[nodiscard]] bool is_ipv4_mapped() const noexcept;
    /// "::ffff:192.0.2.1", "fe80::...".
    [[nodiscard]] std::string to_string() const;

    friend bool operator==(const gid&, const gid&) = default;
};

/// One row of a port's GID table.
struct gid_entry {
    gid value;
    std::uint32_t index = 0;
    std::uint8_t port = 0;
    gid_type type = gid_type::ib;
    std::uint32_t netdev_ifindex = 0; ///< 0 on InfiniBand
};

} // namespace rdmax::verbs

template <>
struct fmt::formatter<rdmax::verbs::gid> : fmt::formatter<std::string_view> {
    auto format(const rdmax::verbs::gid& g, fmt::format_context& ctx) const {
        return fmt::formatter<std::string_view>::format(g.to_string(), ctx);
    }
};

template <>
struct fmt::formatter<rdmax::verbs::gid_type> : fmt::formatter<std::string_view> {
    auto format(rdmax::verbs::gid_type t, fmt::format_context& ctx) const {
        return fmt::formatter<std::string_view>::format(rdmax::verbs::to_string(t), ctx);
    }
};
