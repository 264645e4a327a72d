#pragma once
// A server_group with no device (node-local path only), for unit tests:
// server_group befriends this struct, as rpc::server does protocol_test_access.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include <rdmax/rpc/server_group.hpp>

namespace rdmax::rpc {
struct group_test_access {
    static std::unique_ptr<server_group> make(std::string_view addr, std::uint16_t port,
                                              std::size_t threads, rpc_options o) {
        return std::unique_ptr<server_group>(
            new server_group(detail::no_device, addr, port, threads, o));
    }
};
} // namespace rdmax::rpc
