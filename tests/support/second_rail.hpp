#pragma once
// A second soft-RoCE device for multi-rail tests (issue 31): a dummy netdev
// of its own with an IPv4 address, and an rxe device on it, made by the
// object and removed when it goes. It needs root, iproute2's ip and rdma
// tools, and the rdma_rxe and dummy modules: a test program's skip_reason()
// (skip_reason.hpp) returns second_rail::unavailable() when it has no other
// reason.
//
// Make it before this process opens any RDMA device: librdmacm opens every
// device present when first used and keeps them open until exit, and an open
// device cannot be deleted, so a leftover of an earlier run (a test killed
// before its removal) opened so could not be removed (the constructor says
// so). A device made after that is found by librdmacm all the same.
//
//     rdmax::test::second_rail rail("dummy1", "rxe1", "203.0.113.1");
//     verbs::listener l(rail.address(), 0); // l.device() is rxe1
//     rail.down();
//     rail.up();
//     REQUIRE(rail.wait_active(clock::now() + 10s));

#include <chrono>
#include <optional>
#include <string>

#include <rdmax/verbs/gid.hpp>

namespace rdmax::test {

class second_rail {
public:
    using clock = std::chrono::steady_clock;

    /// Makes the dummy netdev `netdev` with `address`/`prefix`, brings it up,
    /// adds the soft-RoCE device `device` on it, and waits up to `ready_within`
    /// until its port is ACTIVE with the address's IPv4-mapped GID. A leftover
    /// of an earlier run (a dummy netdev by that name, an rxe device by that
    /// name on it) is removed first; anything else by those names is refused,
    /// and so is a device this process has open: one object of a name in a
    /// process (a function-local static, say), since its device stays open.
    /// Throws std::runtime_error naming the command that failed with its
    /// output, or the wait that ran out; what it made is removed then.
    second_rail(std::string netdev, std::string device, std::string address, unsigned prefix = 24,
                std::chrono::milliseconds ready_within = std::chrono::seconds(20));
    /// Removes the device, then the netdev. Deleting an rxe device waits until
    /// every process that opened it has closed it, and librdmacm keeps each
    /// device it used open until the process exits: when this process has
    /// the device open, a background shell removes both once it has exited.
    ~second_rail();
    second_rail(const second_rail&) = delete;
    second_rail& operator=(const second_rail&) = delete;
    second_rail(second_rail&&) = delete;
    second_rail& operator=(second_rail&&) = delete;

    /// Why no second rail can be made here (not root, no ip or rdma tool, no
    /// rdma_rxe or dummy module), or nullopt. Loads the modules if it can.
    [[nodiscard]] static std::optional<std::string> unavailable();

    [[nodiscard]] const std::string& netdev() const noexcept { return netdev_; }
    [[nodiscard]] const std::string& device() const noexcept { return device_; }
    [[nodiscard]] const std::string& address() const noexcept { return address_; }
    /// The address's IPv4-mapped RoCE v2 GID (::ffff:a.b.c.d).
    [[nodiscard]] const verbs::gid& gid() const noexcept { return gid_; }

    /// `ip link set NETDEV down` / `up`; throws if ip fails. Neither waits for
    /// the port: see wait_active() and wait_not_active().
    void down() const;
    void up() const;

    /// The port's state as sysfs says it ("ACTIVE", "DOWN", ...); "" if unreadable.
    [[nodiscard]] std::string port_state() const;
    /// The port's GID table holds gid().
    [[nodiscard]] bool has_gid() const;
    /// ACTIVE, and has_gid(): what a connection on this rail needs.
    [[nodiscard]] bool active() const { return port_state() == "ACTIVE" && has_gid(); }
    /// Polls active() until it holds (true) or `deadline` passes (false).
    [[nodiscard]] bool wait_active(clock::time_point deadline) const;
    /// Polls until the port is not ACTIVE (true) or `deadline` passes (false).
    [[nodiscard]] bool wait_not_active(clock::time_point deadline) const;

private:
    /// A dummy netdev and an rxe device on it by these names: removed.
    /// Anything else by these names: throws.
    void remove_leftovers() const;
    /// Removes the device and the netdev now (nothing may have the device open).
    void remove_now() const noexcept;
    /// This process has the device's uverbs character device open.
    [[nodiscard]] bool device_open_here() const;

    std::string netdev_;
    std::string device_;
    std::string address_;
    verbs::gid gid_;
};

} // namespace rdmax::test
