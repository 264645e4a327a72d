#include <algorithm>
#include <arpa/inet.h>
#include <string>

#include <rdmax/verbs/gid.hpp>

namespace rdmax::verbs {

namespace {
constexpr std::array<std::uint8_t, 12> ipv4_mapped_prefix{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
}

gid gid::ipv4_mapped(std::uint32_t addr_host_order) noexcept {
    gid g;
    std::copy(ipv4_mapped_prefix.begin(), ipv4_mapped_prefix.end(), g.raw.begin());
    for (std::size_t i = 0; i < 4; ++i)
        g.raw[12 + i] = static_cast<std::uint8_t>(addr_host_order >> (24 - 8 * i));
    return g;
}

std::optional<gid> gid::parse(std::string_view text) {
    const std::string s(text); // inet_pton wants a terminated string
    in_addr v4{};
    if (inet_pton(AF_INET, s.c_str(), &v4) == 1)
        return ipv4_mapped(ntohl(v4.s_addr));
    gid g;
    if (inet_pton(AF_INET6, s.c_str(), g.raw.data()) == 1)
        return g;
    return std::nullopt;
}

bool gid::is_zero() const noexcept {
    return std::all_of(raw.begin(), raw.end(), [](std::uint8_t b) { return b == 0; });
}

bool gid::is_ipv4_mapped() const noexcept {
    return std::equal(ipv4_mapped_prefix.begin(), ipv4_mapped_prefix.end(), raw.begin());
}

std::string gid::to_string() const {
    char buf[INET6_ADDRSTRLEN];
    if (inet_ntop(AF_INET6, raw.data(), buf, sizeof buf) == nullptr)
        return "?";
    return buf;
}

} // namespace rdmax::verbs
