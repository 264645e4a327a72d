#include <arpa/inet.h>
#include <cerrno>
#include <charconv>

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
            continue;
        }
        const std::size_t colon = n.rfind(':');
        unsigned port = 0;
        const char* digits = n.data() + (colon == std::string::npos ? n.size() : colon + 1);
        const auto [end, ec] = std::from_chars(digits, n.data() + n.size(), port);
        if (colon == std::string::npos || colon == 0 || ec != std::errc{} ||
            end != n.data() + n.size() || port == 0 || port > 255)
            throw_error("rail_set", EINVAL,
                        fmt::format("rail '{}': neither an address nor device:port", n));
        s.add_by_port(n.substr(0, colon), static_cast<std::uint8_t>(port), n);
    }
    return s;
}

std::uint8_t rail_set::domain_for(context c) {
    for (std::size_t d = 0; d < domains_.size(); ++d)
        if (domains_[d]->ctx.name() == c.name())
            return static_cast<std::uint8_t>(d);
    // librdmacm's context of the device where rdma_cm is available: the one
    // connections on the rail are made on (context::open's contract).
    domains_.push_back(std::make_unique<device_domain>(context::open(c.name())));
    return static_cast<std::uint8_t>(domains_.size() - 1);
}

void rail_set::push(rail r) {
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
    rails_.push_back(std::move(r));
}

void rail_set::add_by_address(const std::string& address) {
    std::uint8_t port = 0;
    context c = context::open_by_address(address, &port);
    const port_info p = usable_port(c, port, address);
    const std::optional<gid_entry> g = c.find_gid(port, *gid::parse(address), gid_type::roce_v2);
    if (!g)
        throw_error(
            "rail_set", EADDRNOTAVAIL,
            fmt::format("rail {}: {} port {} has no RoCE v2 GID for it", address, c.name(), port));
    rail r{c.name(), port, *g, address, p.gbps(), 0};
    r.domain = domain_for(std::move(c));
    push(std::move(r));
}

void rail_set::add_by_port(const std::string& device, std::uint8_t port, const std::string& label) {
    context c = context::open(device);
    const port_info p = usable_port(c, port, label);
    const std::optional<gid_entry> g = c.preferred_gid(port);
    if (!g || g->type != gid_type::roce_v2 || !g->value.is_ipv4_mapped())
        throw_error("rail_set", EADDRNOTAVAIL,
                    fmt::format("rail {}: {} port {} has no IPv4 RoCE v2 GID (rdma_cm needs an "
                                "IP address on each rail)",
                                label, device, port));
    rail r{device, port, *g, ipv4_of(g->value), p.gbps(), 0};
    r.domain = domain_for(std::move(c));
    push(std::move(r));
}

void rail_set::add_active_port(const context& c, std::uint8_t port) {
    const std::string label = fmt::format("{}:{}", c.name(), port);
    const port_info p = c.port(port);
    const std::optional<gid_entry> g = p.active() ? c.preferred_gid(port) : std::nullopt;
    if (!p.active())
        skipped_.push_back(fmt::format("{}: {}", label, to_string(p.state)));
    else if (!p.is_roce())
        skipped_.push_back(fmt::format("{}: {}", label, to_string(p.layer)));
    else if (!g || g->type != gid_type::roce_v2 || !g->value.is_ipv4_mapped())
        skipped_.push_back(fmt::format("{}: no IPv4 RoCE v2 GID", label));
    else if (rails_.size() == max_rails)
        skipped_.push_back(fmt::format("{}: {} rails already", label, max_rails));
    else
        add_by_port(c.name(), port, label);
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
    return domains_.at(rails_.at(k).domain)->pd;
}

const protection_domain& rail_set::domain(std::size_t d) const {
    return domains_.at(d)->pd;
}

const context& rail_set::device(std::size_t k) const {
    return domains_.at(rails_.at(k).domain)->ctx;
}

port_info rail_set::port_now(std::size_t k) const {
    return device(k).port(rails_.at(k).port);
}

connection rail_set::connect(std::size_t k, std::string_view addr, std::uint16_t port,
                             std::span<const std::byte> payload, const qp_config& cfg,
                             std::chrono::milliseconds timeout) const {
    return connection::connect(pd(k), addr, port, payload, cfg, timeout, rails_.at(k).address);
}

} // namespace rdmax::verbs
