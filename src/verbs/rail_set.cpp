#include <arpa/inet.h>
#include <bit>
#include <cerrno>
#include <cstring>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/rail_buffer.hpp>
#include <rdmax/verbs/rail_set.hpp>

namespace rdmax::verbs {

namespace {

/// "192.0.2.1" of ::ffff:192.0.2.1.
std::string ipv4_of(const gid& g) {
    char buf[INET_ADDRSTRLEN];
    if (inet_ntop(AF_INET, g.raw.data() + 12, buf, sizeof buf) == nullptr)
        return "?";
    return buf;
}

/// IPv4 `s` in host order, or nullopt.
std::optional<std::uint32_t> ipv4_bits(std::string_view s) noexcept {
    char buf[INET_ADDRSTRLEN] = {};
    if (s.size() >= sizeof buf || s.find('\0') != std::string_view::npos)
        return std::nullopt;
    std::memcpy(buf, s.data(), s.size());
    in_addr a{};
    if (inet_pton(AF_INET, buf, &a) != 1)
        return std::nullopt;
    return ntohl(a.s_addr);
}

/// The prefix length of IPv4 `address` on the interface that carries it; 0
/// when none does (or the interfaces cannot be listed).
unsigned prefix_of(std::string_view address) noexcept {
    const std::optional<std::uint32_t> want = ipv4_bits(address);
    ifaddrs* all = nullptr;
    if (!want || getifaddrs(&all) != 0)
        return 0;
    unsigned prefix = 0;
    for (const ifaddrs* i = all; i != nullptr; i = i->ifa_next) {
        if (i->ifa_addr == nullptr || i->ifa_netmask == nullptr ||
            i->ifa_addr->sa_family != AF_INET)
            continue;
        sockaddr_in a{};
        sockaddr_in m{};
        std::memcpy(&a, i->ifa_addr, sizeof a);
        std::memcpy(&m, i->ifa_netmask, sizeof m);
        if (ntohl(a.sin_addr.s_addr) == *want) {
            prefix = static_cast<unsigned>(std::popcount(ntohl(m.sin_addr.s_addr)));
            break;
        }
    }
    freeifaddrs(all);
    return prefix;
}

/// The port's preferred GID when it is an IPv4-mapped RoCE v2 one (what
/// rdma_cm needs on a rail), else nullopt.
std::optional<gid_entry> ipv4_roce_v2_gid(const context& c, std::uint8_t port) {
    std::optional<gid_entry> g = c.preferred_gid(port);
    if (!g || g->type != gid_type::roce_v2 || !g->value.is_ipv4_mapped())
        return std::nullopt;
    return g;
}

/// The rail's port: ACTIVE and RoCE, or throws naming the rail.
port_info usable_port(const context& c, std::uint8_t port, std::string_view label) {
    const port_info p = c.port(port);
    if (!p.active())
        throw_error("rail_set", ENETDOWN,
                    fmt::format("rail {}: {} port {} is {}, not ACTIVE", label, c.name(), port,
                                to_string(p.state)));
    if (!p.is_roce())
        throw_error("rail_set", ENOTSUP,
                    fmt::format("rail {}: {} port {} is {}: rails are RoCE ports", label, c.name(),
                                port, to_string(p.layer)));
    return p;
}

} // namespace

rail_set rail_set::discover(const rail_options& o) {
    rail_set s;
    switch (o.rails.how) {
    case rail_list::mode::off: break;
    case rail_list::mode::automatic: s.add_all_active(); break;
    case rail_list::mode::named: return of(o.rails.names);
    }
    return s;
}

rail_set rail_set::of(std::span<const std::string> names) {
    if (names.empty() || names.size() > max_rails)
        throw_error("rail_set", EINVAL,
                    fmt::format("{} rails named: 1 to {}", names.size(), max_rails));
    rail_set s;
    for (const std::string& n : names) {
        if (gid::parse(n)) {
            s.add_by_address(n);
        } else if (const std::optional<device_port> dp = parse_device_port(n)) {
            s.add_by_port(context::open(dp->device), dp->port, n);
        } else {
            throw_error("rail_set", EINVAL,
                        fmt::format("rail '{}': neither an address nor device:port", n));
        }
    }
    return s;
}

void rail_set::add(const context& c, std::uint8_t port, const port_info& p, const gid_entry& g,
                   std::string address) {
    rail r{c.name(), port, g, std::move(address), p.gbps(), 0, 0};
    r.prefix = prefix_of(r.address);
    for (const rail& other : rails_) {
        if (other.device == r.device && other.port == r.port)
            throw_error("rail_set", EINVAL,
                        fmt::format("{} port {} named twice ({} and {})", r.device, r.port,
                                    other.address, r.address));
        // Two ports with one address (both under one bond, say): a
        // connection bound to it could leave by either device.
        if (other.address == r.address)
            throw_error("rail_set", EINVAL,
                        fmt::format("{} is on {} port {} and on {} port {}: a rail needs an "
                                    "address of its own",
                                    r.address, other.device, other.port, r.device, r.port));
    }
    // librdmacm's context of the device where rdma_cm is available: the one
    // connections on the rail are made on (domain_per_device's contract).
    r.domain = static_cast<std::uint8_t>(domains_.index_of(c));
    rails_.push_back(std::move(r));
}

void rail_set::add_by_address(const std::string& address) {
    std::uint8_t port = 0;
    const context c = context::open_by_address(address, &port);
    const port_info p = usable_port(c, port, address);
    const std::optional<gid_entry> g = c.find_gid(port, *gid::parse(address), gid_type::roce_v2);
    if (!g)
        throw_error(
            "rail_set", EADDRNOTAVAIL,
            fmt::format("rail {}: {} port {} has no RoCE v2 GID for it", address, c.name(), port));
    add(c, port, p, *g, address);
}

void rail_set::add_by_port(const context& c, std::uint8_t port, const std::string& label) {
    const port_info p = usable_port(c, port, label);
    const std::optional<gid_entry> g = ipv4_roce_v2_gid(c, port);
    if (!g)
        throw_error("rail_set", EADDRNOTAVAIL,
                    fmt::format("rail {}: {} port {} has no IPv4 RoCE v2 GID (rdma_cm needs an "
                                "IP address on each rail)",
                                label, c.name(), port));
    add(c, port, p, *g, ipv4_of(g->value));
}

void rail_set::add_active_port(const context& c, std::uint8_t port) {
    const std::string label = fmt::format("{}:{}", c.name(), port);
    const port_info p = c.port(port);
    const std::optional<gid_entry> g = p.active() ? ipv4_roce_v2_gid(c, port) : std::nullopt;
    if (!p.active())
        skipped_.push_back(fmt::format("{}: {}", label, to_string(p.state)));
    else if (!p.is_roce())
        skipped_.push_back(fmt::format("{}: {}", label, to_string(p.layer)));
    else if (!g)
        skipped_.push_back(fmt::format("{}: no IPv4 RoCE v2 GID", label));
    else if (rails_.size() == max_rails)
        skipped_.push_back(fmt::format("{}: {} rails already", label, max_rails));
    else
        add(c, port, p, *g, ipv4_of(g->value));
}

void rail_set::add_all_active() {
    // A device this process cannot open (a container given only some), or
    // a port that changes under the scan, is left out with the reason; so
    // is a port whose address an earlier rail has.
    for (const std::string& name : device_names()) {
        try {
            const context c = context::open(name);
            for (unsigned port = 1; port <= c.limits().phys_port_cnt; ++port) {
                try {
                    add_active_port(c, static_cast<std::uint8_t>(port));
                } catch (const rdmax::error& e) {
                    skipped_.push_back(fmt::format("{}:{}: {}", name, port, e.what()));
                }
            }
        } catch (const rdmax::error& e) {
            skipped_.push_back(fmt::format("{}: {}", name, e.what()));
        }
    }
    if (rails_.empty())
        throw_error("rail_set", ENODEV,
                    fmt::format("RDMAX_RAILS=auto found no ACTIVE RoCE port with an IPv4 "
                                "address{}{}",
                                skipped_.empty() ? "" : ": ", fmt::join(skipped_, "; ")));
}

const protection_domain& rail_set::pd(std::size_t k) const {
    return domains_.at(rails_.at(k).domain);
}

const protection_domain& rail_set::domain(std::size_t d) const {
    return domains_.at(d);
}

const context& rail_set::device(std::size_t k) const {
    return pd(k).device();
}

port_info rail_set::port_now(std::size_t k) const {
    return device(k).port(rails_.at(k).port);
}

connection rail_set::connect(std::size_t k, std::string_view addr, std::uint16_t port,
                             std::span<const std::byte> payload, const qp_config& cfg,
                             std::chrono::milliseconds timeout) const {
    return connection::connect(pd(k), addr, port, payload, cfg, timeout, rails_.at(k).address);
}

std::optional<std::size_t> rail_set::peer_for(std::size_t k,
                                              std::span<const std::string> peer) const {
    const rail& r = rails_.at(k);
    // Where several are (rails that share a subnet), the k-th of the
    // peer's, if it is one of them: rail k to the peer's rail k.
    if (k < peer.size() && same_subnet(r.address, peer[k], r.prefix))
        return k;
    for (std::size_t i = 0; i < peer.size(); ++i)
        if (same_subnet(r.address, peer[i], r.prefix))
            return i;
    return std::nullopt;
}

bool rail_set::same_subnet(std::string_view a, std::string_view b, unsigned prefix) noexcept {
    if (prefix == 0 || prefix > 32)
        return false;
    const std::optional<std::uint32_t> x = ipv4_bits(a);
    const std::optional<std::uint32_t> y = ipv4_bits(b);
    if (!x || !y)
        return false;
    const std::uint32_t mask = ~std::uint32_t{0} << (32 - prefix);
    return (*x & mask) == (*y & mask);
}

} // namespace rdmax::verbs
