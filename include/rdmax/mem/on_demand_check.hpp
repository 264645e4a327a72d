#pragma once
// Whether a device's on-demand paging (ODP) can be trusted with rdmax's data
// path: the device must report ODP, allow every RC operation the queue pair
// posts on an ODP registration, and move the right bytes in a self-test.
//
// The self-test exists because reporting is not enough: soft-RoCE in Linux
// 7.3.4 reports ODP for every RC operation, yet its copy to and from an ODP
// registration ignores the offset within a page, so a transfer that does not
// start on a page boundary, or crosses one, moves the wrong bytes without an
// error (docs/odp.md). rdmax refuses ODP on such a device: it never hands out
// a registration that corrupts data silently.

#include <cstdint>
#include <string>

#include <rdmax/verbs/protection_domain.hpp>

namespace rdmax {

/// The RC operations rdmax's queue pair posts: on-demand registrations are
/// refused on a device that lacks any of them.
inline constexpr std::uint32_t odp_rc_needed = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV |
                                               IBV_ODP_SUPPORT_WRITE | IBV_ODP_SUPPORT_READ |
                                               IBV_ODP_SUPPORT_ATOMIC;

struct on_demand_verdict {
    /// Empty when ODP may be used; otherwise why not, naming the device.
    std::string problem;
    /// The self-test ran and the bytes were right.
    bool self_tested = false;

    [[nodiscard]] bool usable() const noexcept { return problem.empty(); }
};

/// Checks `pd`'s device: IBV_ODP_SUPPORT, the RC capabilities in
/// odp_rc_needed, then a self-test on two loopback RC queue pairs (an RDMA
/// write into and a read out of an ODP registration, both at an offset within
/// a page and across a page boundary, bytes compared). Runs once per device
/// per process (a few milliseconds); later calls return the kept verdict.
/// Never throws: a check that cannot run is a verdict that says why.
[[nodiscard]] on_demand_verdict check_on_demand(const verbs::protection_domain& pd);

/// The names of the IBV_ODP_SUPPORT_* bits set in `caps`, e.g. "send, read".
[[nodiscard]] std::string odp_caps_names(std::uint32_t caps);

} // namespace rdmax
