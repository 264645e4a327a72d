#pragma once
// How an RPC connection's bytes go, and the set of ways an endpoint may use
// (rpc_options::transports, RDMAX_RPC_TRANSPORTS).

#include <cstdint>
#include <string_view>

namespace rdmax::rpc {

/// How a connection's bytes go (rpc::client::transport).
enum class transport : std::uint8_t {
    rdma = 1, ///< through the RDMA device: rdma_cm, write-with-immediate, READ and WRITE
    shm = 2,  ///< between processes on one node: a shared segment, and CMA for large bodies
    tcp = 4,  ///< one TCP socket: for a peer with no RDMA path and not on this node
};
[[nodiscard]] constexpr std::string_view to_string(transport t) noexcept {
    switch (t) {
    case transport::rdma: return "rdma";
    case transport::shm: return "shm";
    case transport::tcp: return "tcp";
    }
    return "?";
}

/// The transports an endpoint may use (rpc_options::transports).
struct transport_set {
    std::uint8_t bits = 0;
    [[nodiscard]] constexpr bool has(transport t) const noexcept {
        return (bits & static_cast<std::uint8_t>(t)) != 0;
    }
    friend constexpr transport_set operator|(transport_set s, transport t) noexcept {
        return {static_cast<std::uint8_t>(s.bits | static_cast<std::uint8_t>(t))};
    }
    friend constexpr bool operator==(transport_set, transport_set) noexcept = default;
};
inline constexpr transport_set all_transports =
    transport_set{} | transport::rdma | transport::shm | transport::tcp;

} // namespace rdmax::rpc
