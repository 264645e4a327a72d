#pragma once
// Names one connection of an RPC endpoint (client or server): an index and a
// generation, so that a peer's id is never mistaken for a later peer's.

#include <cstdint>

namespace rdmax::rpc {

struct peer_id {
    std::uint32_t index = UINT32_MAX;
    std::uint32_t generation = 0;
    friend constexpr bool operator==(peer_id, peer_id) = default;
};

} // namespace rdmax::rpc
