#pragma once
// Whether an address belongs to this node (in this network namespace): the
// test a client makes before it looks for a server listening on a wildcard
// address through the node-local path (a server on 0.0.0.0 answers for every
// address of the node, and for no other node's).

#include <string_view>

namespace rdmax::local {

/// True when `addr` (numeric, IPv4 or IPv6, or a host name) names an
/// address of this node: a socket can be bound to it. False for any other
/// address, and for what does not resolve.
[[nodiscard]] bool is_node_address(std::string_view addr) noexcept;

} // namespace rdmax::local
