#pragma once
// A tag for the few objects that can be built with no RDMA device: an arena
// registrar that registers nothing, an RPC inbox with only its epoll set,
// and the RPC endpoints the protocol unit tests drive over a fake link
// (tests/support/fake_link.hpp). No user names it: an explicit tag keeps
// `{}` from building one by accident.

namespace rdmax::detail {

struct no_device_t {
    explicit no_device_t() = default;
};
inline constexpr no_device_t no_device{};

} // namespace rdmax::detail
