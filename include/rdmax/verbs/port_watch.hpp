#pragma once
// port_watch: the port events of a rail_set's devices (IBV_EVENT_PORT_ERR,
// IBV_EVENT_PORT_ACTIVE, IBV_EVENT_DEVICE_FATAL), read without blocking, as
// rail changes. A multi-rail program takes a rail out when its port goes
// down (the striper's rail_down: its work is sent again on the other rails
// at once, not after the queue pair's retries) and reconnects it once
// ready() holds again.
//
//     verbs::port_watch watch(rails);
//     watch.poll([&](const verbs::port_watch::change& c) {
//         if (!c.up) striper.rail_down(c.rail);
//     });
//
// On soft-RoCE (Linux 6.1, 6.12, 7.3) `ip link set down` on a rail's netdev
// raises PORT_ERR within 0.1-0.55 s under TCG, and `up` PORT_ACTIVE, with
// the port's IPv4-mapped GID back within 0.75 s (tests/rxe/test_multirail).
//
// A device has one event queue per process (librdmacm's context where
// rdma_cm is present): each event reaches one reader. So one port_watch per
// device per process, and nothing else reading the device's events; the
// watch makes the descriptor non-blocking while it lives. One thread polls
// it. An address removed while the link stays up (GID_CHANGE) is not
// reported: ready() says it.

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include <infiniband/verbs.h>

#include <rdmax/mem/rail_buffer.hpp>
#include <rdmax/verbs/rail_set.hpp>

namespace rdmax::verbs {

class port_watch {
public:
    struct change {
        std::size_t rail = 0;
        bool up = false; ///< PORT_ACTIVE (true); PORT_ERR or DEVICE_FATAL (false)
    };
    struct counters {
        std::uint64_t downs = 0;  ///< PORT_ERR / DEVICE_FATAL events for a rail
        std::uint64_t ups = 0;    ///< PORT_ACTIVE events of a rail's port
        std::uint64_t others = 0; ///< any other event read (acknowledged, not acted on)
    };

    /// Watches every rail of `rails`. Its devices must outlive the watch
    /// (the set may be moved). Events already queued on the devices are
    /// dropped: each rail starts from its port's state now. Throws
    /// rdmax::error (fcntl) if a device's descriptor cannot be made
    /// non-blocking.
    explicit port_watch(const rail_set& rails);
    port_watch(const rail_set&&) = delete; // a temporary set's devices would go with it
    /// Gives the descriptors their flags back.
    ~port_watch();
    port_watch(const port_watch&) = delete;
    port_watch& operator=(const port_watch&) = delete;
    port_watch(port_watch&&) = delete;
    port_watch& operator=(port_watch&&) = delete;

    /// Reads and acknowledges every event pending on the devices and calls
    /// on_change for each that concerns a rail, in order. Never blocks.
    /// Returns the rail changes passed on.
    std::size_t poll(const std::function<void(const change&)>& on_change);
    /// poll() until a change arrives or `deadline` passes, sleeping on the
    /// descriptors between; returns the changes passed on (0: deadline).
    std::size_t wait(std::chrono::steady_clock::time_point deadline,
                     const std::function<void(const change&)>& on_change);

    /// The last event says the rail's port is up (it starts from the port's
    /// state when the watch was made).
    [[nodiscard]] bool up(std::size_t rail) const { return up_.at(rail); }
    /// The port is ACTIVE now and has the rail's GID back: a connection on
    /// the rail can be made (soft-RoCE restores the GID after the event).
    /// poll() first: a PORT_ERR still queued would take down what is
    /// attached after it.
    [[nodiscard]] bool ready(std::size_t rail) const;
    /// Descriptors to wait on (one per device), for an epoll of the caller's.
    [[nodiscard]] const std::vector<int>& fds() const noexcept { return fds_; }
    [[nodiscard]] const counters& stats() const noexcept { return counters_; }

private:
    struct watched_rail {
        std::uint8_t domain = 0;
        std::uint8_t port = 0;
        gid_entry gid;
    };
    struct watched_device {
        const context* ctx = nullptr; ///< the set's; it does not move with the set
        int flags = 0;                ///< the descriptor's before the watch
    };

    void restore_flags() noexcept;
    void pass(std::size_t device, ibv_event_type type, std::uint8_t port,
              const std::function<void(const change&)>& on_change, std::size_t& changes);

    std::vector<watched_rail> rails_;
    std::vector<watched_device> devices_;
    std::vector<int> fds_; ///< per device
    std::array<bool, max_rails> up_{};
    counters counters_;
};

} // namespace rdmax::verbs
