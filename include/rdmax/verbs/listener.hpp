#pragma once
// An rdma_cm listener: accepts RC connections on an address and port.

#include <chrono>
#include <concepts>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include <rdma/rdma_cma.h>

#include <rdmax/verbs/connection.hpp>
#include <rdmax/verbs/connection_request.hpp>
#include <rdmax/verbs/context.hpp>

namespace rdmax::verbs {

/// Picks the protection domain for a request from the device it arrived on:
/// invocable with that device, returning a reference to a domain that
/// outlives the connection (a domain made and returned by value would not:
/// refused at compile time). domain_per_device is one.
template <class F>
concept domain_chooser =
    std::invocable<F&, const context&> &&
    std::is_lvalue_reference_v<std::invoke_result_t<F&, const context&>> &&
    std::convertible_to<std::invoke_result_t<F&, const context&>, const protection_domain&>;

class listener {
public:
    /// Listens on addr:port ("192.0.2.1", 0 picks a free port; see port()).
    explicit listener(std::string_view addr, std::uint16_t port = 0, int backlog = 16);
    /// Listens nowhere (as a moved-from listener): port() 0, fd() -1, no
    /// requests. For an RPC server built without a device in tests.
    listener() noexcept = default;
    listener(listener&& other) noexcept;
    listener& operator=(listener&& other) noexcept;
    listener(const listener&) = delete;
    listener& operator=(const listener&) = delete;
    ~listener();

    /// The port it listens on.
    [[nodiscard]] std::uint16_t port() const noexcept;
    /// The device that carries the address: make the protection domain of
    /// accepted connections on it. A listener on a wildcard address has no
    /// such device (throws): each request shows its own (next_request, or
    /// accept with a domain_chooser).
    [[nodiscard]] context device() const;

    /// Waits up to `timeout` for a connection request and hands it over
    /// unanswered: the caller makes its QP on the request's device, may post
    /// receives, then accepts or rejects it (see connection_request). Throws
    /// at the deadline.
    [[nodiscard]] connection_request next_request(std::chrono::milliseconds timeout = 5s);
    /// Without waiting: the next connection request if one has arrived.
    /// For a loop that serves many peers (poll fd() with its other fds).
    [[nodiscard]] std::optional<connection_request> poll_request();
    /// The event channel's descriptor: readable when a request may be waiting.
    [[nodiscard]] int fd() const noexcept;

    /// Waits up to `timeout` for a connection request, accepts it with a QP
    /// made in `pd` and `payload` in the reply; throws at the deadline. A
    /// request that arrived on a device other than `pd`'s is rejected, and
    /// the error names both devices.
    [[nodiscard]] connection accept(const protection_domain& pd,
                                    std::span<const std::byte> payload = {},
                                    const qp_config& cfg = {},
                                    std::chrono::milliseconds timeout = 5s);

    /// Like accept(pd, ...), with the domain `choose(device)` returns for the
    /// device the request arrived on: what a listener on "0.0.0.0" needs.
    /// If `choose` throws, the request is rejected and the exception passes.
    template <domain_chooser Chooser>
    [[nodiscard]] connection accept(Chooser&& choose, std::span<const std::byte> payload = {},
                                    const qp_config& cfg = {},
                                    std::chrono::milliseconds timeout = 5s) {
        return accept_choosing(
            [&choose](const context& device) -> const protection_domain& {
                return std::invoke(choose, device);
            },
            payload, cfg, timeout);
    }

private:
    using chooser_ref = std::function<const protection_domain&(const context&)>;
    connection accept_choosing(const chooser_ref& choose, std::span<const std::byte> payload,
                               const qp_config& cfg, std::chrono::milliseconds timeout);
    void release() noexcept;
    /// Gives the request `id` a channel of its own and wraps it, unanswered.
    connection_request hand_over(rdma_cm_id* id, std::vector<std::byte> payload,
                                 std::uint8_t initiator_depth, std::uint8_t responder_resources);
    rdma_event_channel* channel_ = nullptr;
    rdma_cm_id* id_ = nullptr;
};

/// A payload's bytes, for connect() and accept(): payload_of(token).
template <class T>
    requires std::is_trivially_copyable_v<T>
[[nodiscard]] std::span<const std::byte> payload_of(const T& value) noexcept {
    return std::as_bytes(std::span(&value, 1));
}

} // namespace rdmax::verbs
