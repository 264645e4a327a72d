#pragma once
// Which ports a rail_set uses (issue 31: several NICs as one), and its knob
// RDMAX_RAILS: "off" (the default: one device, as without rails), "auto"
// (every ACTIVE RoCE port with an IPv4 address) or a comma list of this
// machine's addresses and device:port names, rail 0 first
// ("192.0.2.1,203.0.113.1", "mlx5_0:1,mlx5_1:1").

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <rdmax/config/knob.hpp>

namespace rdmax::verbs {

struct rail_list {
    enum class mode : std::uint8_t { off, automatic, named };
    mode how = mode::off;
    /// mode::named: each rail's address or device:port, rail 0 first.
    std::vector<std::string> names;

    friend bool operator==(const rail_list&, const rail_list&) = default;
};

/// A device's port named as "mlx5_0:1".
struct device_port {
    std::string_view device;
    std::uint8_t port = 0;
};
/// "name:N" with a name and a port from 1 to 255, or nullopt.
[[nodiscard]] std::optional<device_port> parse_device_port(std::string_view word) noexcept;

/// RDMAX_RAILS' parser: off, auto, or a comma list of up to max_rails
/// addresses (IPv4 or IPv6) and device:port names, none twice.
struct rail_list_parser {
    template <class T>
        requires std::same_as<T, rail_list>
    [[nodiscard]] rail_list parse(const char* who, std::string_view name,
                                  std::string_view text) const {
        return parse_rails(who, name, text);
    }
    template <class T>
    [[nodiscard]] std::string format(const rail_list& v) const {
        return format_rails(v);
    }
    template <class T>
    [[nodiscard]] std::string range() const {
        return "off, auto, or a comma list of addresses and device:port (at most 4)";
    }
    /// Throws rdmax::error naming the variable, the value and why.
    static rail_list parse_rails(const char* who, std::string_view name, std::string_view text);
    static std::string format_rails(const rail_list& v);
};

struct rail_options {
    rail_list rails;

    /// These options with RDMAX_RAILS applied when it is set (a bad value
    /// throws rdmax::error naming it).
    [[nodiscard]] rail_options with_env() const;
};

/// RDMAX_RAILS: read by with_env() only.
inline constexpr std::tuple rail_knobs{
    config::knob{"RDMAX_RAILS", &rail_options::rails, rail_list_parser{},
                 "the ports a rail_set holds: off, auto or a list"},
};

} // namespace rdmax::verbs
