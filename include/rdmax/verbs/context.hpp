#pragma once
// An open RDMA device: the root of every other verbs object. Opening queries
// the device's limits once; ports and GID tables are queried on demand (they
// change when links go up or addresses are added).

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <infiniband/verbs.h>

#include <rdmax/verbs/device_limits.hpp>
#include <rdmax/verbs/gid.hpp>
#include <rdmax/verbs/port.hpp>

namespace rdmax::verbs {

/// Names of the RDMA devices present ("rxe0", "mlx5_0"), in the kernel's order.
[[nodiscard]] std::vector<std::string> device_names();

/// Move-only handle of an open device. Devices are opened through librdmacm
/// where it is available, so that protection domains, queues and memory
/// regions made here also serve rdma_cm connections (librdmacm keeps one
/// context per device open for the life of the process); elsewhere the
/// context is opened, and closed, with ibv_open_device / ibv_close_device.
class context {
public:
    /// Opens a device by name; throws rdmax::error naming the devices present
    /// when there is no such device.
    [[nodiscard]] static context open(std::string_view name);
    /// Opens the first device that has an ACTIVE port; throws when none has.
    [[nodiscard]] static context open_first_active();
    /// The device and port that carry an IP address of this machine (resolved
    /// by rdma_cm), e.g. "192.0.2.1"; throws if no RDMA device has it.
    [[nodiscard]] static context open_by_address(std::string_view ip, std::uint8_t* port = nullptr);
    /// A handle on a context librdmacm opened (a connection's or listener's).
    [[nodiscard]] static context borrow(ibv_context* cm_context);

    context(context&& other) noexcept;
    context& operator=(context&& other) noexcept;
    context(const context&) = delete;
    context& operator=(const context&) = delete;
    ~context();

    [[nodiscard]] ibv_context* get() const noexcept { return ctx_; }
    [[nodiscard]] const std::string& name() const noexcept { return limits_.name; }
    [[nodiscard]] const device_limits& limits() const noexcept { return limits_; }

    /// Port attributes (ports are numbered from 1).
    [[nodiscard]] port_info port(std::uint8_t number = 1) const;
    /// The port's populated GID table entries.
    [[nodiscard]] std::vector<gid_entry> gids(std::uint8_t port = 1) const;
    /// The entry with this value and type, if the port has it.
    [[nodiscard]] std::optional<gid_entry> find_gid(std::uint8_t port, const gid& value,
                                                    gid_type type) const;
    /// The GID a connection on this port should use: on RoCE an IPv4-mapped
    /// RoCE v2 GID (routable, needs no IPv6 set-up), else any RoCE v2 GID, else
    /// the first entry; on InfiniBand index 0. nullopt if the table is empty.
    [[nodiscard]] std::optional<gid_entry> preferred_gid(std::uint8_t port = 1) const;

private:
    context(ibv_context* ctx, bool owned);
    ibv_context* ctx_ = nullptr;
    bool owned_ = false; ///< close on destruction (not librdmacm's)
    device_limits limits_;
};

} // namespace rdmax::verbs
