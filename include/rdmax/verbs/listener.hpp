#pragma once
// An rdma_cm listener: accepts RC connections on an address and port.

#include <chrono>
#include <cstdint>
#include <span>
#include <string_view>

#include <rdma/rdma_cma.h>

#include <rdmax/verbs/connection.hpp>
#include <rdmax/verbs/context.hpp>

namespace rdmax::verbs {

class listener {
public:
    /// Listens on addr:port ("192.0.2.1", 0 picks a free port; see port()).
    explicit listener(std::string_view addr, std::uint16_t port = 0, int backlog = 16);
    listener(listener&& other) noexcept;
    listener& operator=(listener&& other) noexcept;
    listener(const listener&) = delete;
    listener& operator=(const listener&) = delete;
    ~listener();

    /// The port it listens on.
    [[nodiscard]] std::uint16_t port() const noexcept;
    /// The device that carries the address: make the protection domain of
    /// accepted connections on it.
    [[nodiscard]] context device() const;

    /// Waits up to `timeout` for a connection request, accepts it with a QP
    /// made in `pd` and `payload` in the reply; throws at the deadline.
    [[nodiscard]] connection accept(const protection_domain& pd,
                                    std::span<const std::byte> payload = {},
                                    const qp_config& cfg = {},
                                    std::chrono::milliseconds timeout = 5s);

private:
    void release() noexcept;
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
