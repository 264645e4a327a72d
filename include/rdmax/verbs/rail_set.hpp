#pragma once
// rail_set: the ports this process stripes over (issue 31), found from the
// addresses a user names or from every ACTIVE RoCE port (RDMAX_RAILS), with
// one protection domain per device. It hands out what the rest of a
// multi-rail program needs per rail: the domain to register in and to make
// the rail's queue pair in, a registrar that registers a range once per
// device (so one cache lookup gives every rail's key), and connections bound
// to the rail's own address, so that the kernel's routing cannot put rail k's
// traffic on another device.
//
//     verbs::rail_set rails = verbs::rail_set::discover(); // RDMAX_RAILS
//     auto cache = make_rail_cache(rails);   // mem/rail_cache.hpp
//     auto c0 = rails.connect(0, peer_addr[0], port, token);
//
// A rail is what the kernel knew when the set was made: a port that goes
// down later stays in the set (a port_watch says so; the striper takes the
// rail out), and comes back when it is ACTIVE again. A named rail must be
// ACTIVE when the set is made (a down one is an error: start with the rails
// that are up, or auto). Binding a connection's source picks the device it
// leaves by; the replies' way back is the peer's routing (two rails in one
// subnet want arp_ignore / arp_announce, or a subnet each).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <rdmax/verbs/connection.hpp>
#include <rdmax/verbs/context.hpp>
#include <rdmax/verbs/domain_per_device.hpp>
#include <rdmax/verbs/gid.hpp>
#include <rdmax/verbs/protection_domain.hpp>
#include <rdmax/verbs/rail_options.hpp>

namespace rdmax::verbs {

/// One rail: a port of a device, the GID and address its connections use.
struct rail {
    std::string device;    ///< "rxe0", "mlx5_0"
    std::uint8_t port = 1; ///< from 1
    gid_entry gid;         ///< the RoCE v2 GID of `address` (IPv4-mapped for IPv4)
    std::string address;   ///< this machine's address on the rail
    /// The port's rate (port_info::gbps); 0 when its speed code is unknown:
    /// then give the striper's attach() a weight of your own.
    double gbps = 0;
    std::uint8_t domain = 0; ///< index of its device's protection domain in the set
    /// The length of `address`'s prefix on the interface that carries it
    /// (24 for a /24): the rail's subnet, which peer_for() matches the
    /// peer's addresses against. 0 when no interface shows the address.
    unsigned prefix = 0;
};

class rail_set {
public:
    /// The rails `o` names (rail_options{}.with_env() by default): none for
    /// off (the caller uses one device as without rails), every ACTIVE RoCE
    /// port with an IPv4-mapped RoCE v2 GID for auto (in the kernel's device
    /// order, at most max_rails), or the named ones in their order. Throws
    /// rdmax::error naming the rail and why: an address no device carries, a
    /// port that is not ACTIVE or has no such GID, a device:port that does
    /// not exist, a rail named twice, or auto finding none.
    [[nodiscard]] static rail_set discover(const rail_options& o = rail_options{}.with_env());
    /// discover() of a list of addresses and device:port names.
    [[nodiscard]] static rail_set of(std::span<const std::string> names);

    rail_set(rail_set&&) noexcept = default;
    rail_set& operator=(rail_set&&) noexcept = default;
    rail_set(const rail_set&) = delete;
    rail_set& operator=(const rail_set&) = delete;
    ~rail_set() = default;

    [[nodiscard]] std::size_t size() const noexcept { return rails_.size(); }
    [[nodiscard]] bool empty() const noexcept { return rails_.empty(); }
    [[nodiscard]] const rail& operator[](std::size_t k) const { return rails_.at(k); }
    [[nodiscard]] std::span<const rail> rails() const noexcept { return rails_; }
    /// Distinct devices (protection domains) under the rails.
    [[nodiscard]] std::size_t domains() const noexcept { return domains_.size(); }
    /// Rail k's protection domain (shared by rails on ports of one device).
    [[nodiscard]] const protection_domain& pd(std::size_t k) const;
    /// The protection domain of device index d (rail::domain).
    [[nodiscard]] const protection_domain& domain(std::size_t d) const;
    /// Rail k's device.
    [[nodiscard]] const context& device(std::size_t k) const;
    /// Rail k's port as it is now (state, speed).
    [[nodiscard]] port_info port_now(std::size_t k) const;
    /// Why auto left a device or port out ("mlx5_2:1: InfiniBand"), one line each.
    [[nodiscard]] const std::vector<std::string>& skipped() const noexcept { return skipped_; }

    /// The index in `peer` of the first of the peer's addresses on rail k's
    /// subnet (rail::prefix), or nullopt: the peer's matching rail, whatever
    /// the order or number of the peer's rails. Where several are on it
    /// (rails that share a subnet), k itself if peer[k] is one of them.
    [[nodiscard]] std::optional<std::size_t> peer_for(std::size_t k,
                                                      std::span<const std::string> peer) const;
    /// True when IPv4 addresses `a` and `b` agree in their first `prefix`
    /// bits; false when either is not an IPv4 address or prefix is not 1..32.
    [[nodiscard]] static bool same_subnet(std::string_view a, std::string_view b,
                                          unsigned prefix) noexcept;

    /// Connects rail k to a listener at addr:port from rail k's own address
    /// (connection::connect with the rail's address as source).
    [[nodiscard]] connection
    connect(std::size_t k, std::string_view addr, std::uint16_t port,
            std::span<const std::byte> payload = {}, const qp_config& cfg = {},
            std::chrono::milliseconds timeout = std::chrono::seconds(5)) const;

private:
    rail_set() = default;
    void add_by_address(const std::string& address);
    void add_by_port(const context& c, std::uint8_t port, const std::string& label);
    void add_all_active();
    void add_active_port(const context& c, std::uint8_t port);
    /// Rail `port` of `c` at `address`, its GID g, its device's domain made
    /// the first time the device is seen; refused if it repeats a rail.
    void add(const context& c, std::uint8_t port, const port_info& p, const gid_entry& g,
             std::string address);

    std::vector<rail> rails_;
    domain_per_device domains_; // a domain never moves: the set may
    std::vector<std::string> skipped_;
};

} // namespace rdmax::verbs
