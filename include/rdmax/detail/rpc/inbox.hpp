#pragma once
// The receive side of an RPC endpoint (server or client): one completion
// queue and one shared receive queue for every connection, the receives
// zero-length (a write-with-immediate needs one only for its immediate), and
// a completion channel so that the endpoint can sleep, alone or in the
// caller's own epoll loop.

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>

#include <infiniband/verbs.h>

#include <rdmax/detail/no_device.hpp>
#include <rdmax/error.hpp>
#include <rdmax/verbs/completion_channel.hpp>
#include <rdmax/verbs/completion_queue.hpp>
#include <rdmax/verbs/protection_domain.hpp>
#include <rdmax/verbs/shared_receive_queue.hpp>

namespace rdmax::rpc {

namespace detail {
/// Builds an endpoint (and its inbox) with no device: no queues, no
/// channel; its links bring their own immediates. For the protocol's unit
/// tests (tests/support/fake_link.hpp).
using rdmax::detail::no_device;
using rdmax::detail::no_device_t;
} // namespace detail

class inbox {
public:
    /// `depth` receives posted at all times (clamped to the device's
    /// max_srq_wr and max_cqe); throws rdmax::error naming the verb.
    inbox(const verbs::protection_domain& pd, std::uint32_t depth);
    /// The epoll set alone: poll() finds nothing, arm() and sleep() watch
    /// only the descriptors given to watch().
    explicit inbox(detail::no_device_t);
    inbox(const inbox&) = delete;
    inbox& operator=(const inbox&) = delete;
    ~inbox();

    /// The queues (throw ENODEV on an inbox built with no device).
    [[nodiscard]] verbs::completion_queue& cq() { return *device_part(cq_); }
    [[nodiscard]] verbs::shared_receive_queue& srq() { return *device_part(srq_); }
    [[nodiscard]] std::uint32_t depth() const noexcept { return depth_; }
    /// The channel fd() sleeps on. The connections' send queues raise their
    /// events here too (qp_config::send_channel), so that a scheduler whose
    /// queued work waits for send completions wakes the endpoint.
    [[nodiscard]] verbs::completion_channel& channel() { return *device_part(channel_); }

    /// Receive completions, without blocking.
    [[nodiscard]] int poll(std::span<ibv_wc> out) noexcept { return cq_ ? cq_->poll(out) : 0; }
    /// Gives back `n` receives that completions took (posted in batches).
    void replenish(std::uint32_t n) noexcept;

    /// An epoll descriptor, readable when a completion or an event of a
    /// watched descriptor (watch()) may be waiting. Arm first.
    [[nodiscard]] int fd() const noexcept { return epoll_fd_; }
    /// Adds a descriptor (rdma_cm channels) to fd()'s set; forget() removes it.
    void watch(int fd);
    void forget(int fd) noexcept;
    /// True when a watched descriptor (an rdma_cm channel) is readable: one
    /// epoll_wait that returns at once, so that housekeeping reads the
    /// channels only when something happened on one. Takes the completion
    /// channel's events on the way.
    [[nodiscard]] bool events_pending() noexcept;
    /// Asks for a wake-up at the next completion: arm, poll once more (a
    /// completion that came before the arming raises no event), and sleep
    /// only if that poll found nothing. False if the device refused.
    bool arm() noexcept;
    /// Sleeps until fd() is readable or `timeout` passed, then takes the
    /// channel's events. Arm first.
    void sleep(std::chrono::microseconds timeout) noexcept;

private:
    template <class T>
    static std::optional<T>& device_part(std::optional<T>& o) {
        if (!o)
            throw_error("rpc::inbox", ENODEV, "an inbox built with no device has no queues");
        return o;
    }
    void take_events() noexcept;

    // Empty with no device (detail::no_device) only.
    std::optional<verbs::completion_channel> channel_;
    std::optional<verbs::completion_queue> cq_;
    std::optional<verbs::shared_receive_queue> srq_;
    std::uint32_t depth_ = 0;
    std::uint32_t owed_ = 0; ///< receives taken and not yet given back
    int epoll_fd_ = -1;
};

} // namespace rdmax::rpc
