#pragma once
// LITE-style remote handles, the peer's side: a peer names registered memory
// by (window, offset, length, rights), and every use is checked for bounds
// and permission before anything is posted. The owner issues and revokes
// handles with a handle_issuer (handle_issuer.hpp); a peer's use of a revoked
// handle then completes with an error (remote access error), never a hang.

#include <cstdint>
#include <type_traits>

#include <infiniband/verbs.h>

#include <rdmax/mem/buffer.hpp>
#include <rdmax/mem/rights.hpp>
#include <rdmax/status.hpp>
#include <rdmax/verbs/queue_pair.hpp>

namespace rdmax {

/// What a peer holds: plain bytes that cross the wire (24, no padding).
struct remote_handle {
    std::uint64_t addr = 0;   ///< the window's first byte, in the owner's address space
    std::uint64_t length = 0; ///< bytes in the window
    std::uint32_t rkey = 0;
    std::uint32_t granted = 0; ///< the rights granted (remote read, write, atomic), as bits

    [[nodiscard]] bool permits(rights a) const noexcept {
        return (granted & static_cast<std::uint32_t>(a)) == static_cast<std::uint32_t>(a);
    }
    /// ok, out_of_range, zero_length or not_permitted for [offset, offset + len).
    [[nodiscard]] status check(rights a, std::uint64_t offset, std::uint64_t len) const noexcept {
        if (!permits(a))
            return status::not_permitted;
        if (len == 0)
            return status::zero_length;
        if (offset > length || len > length - offset)
            return status::out_of_range;
        return status::ok;
    }
};
static_assert(std::is_trivially_copyable_v<remote_handle> && sizeof(remote_handle) == 24);

/// RDMA-reads [offset, offset + dst.length) of the handle's window into dst,
/// after checking bounds and rights. noexcept: a status, as the data path does.
template <rights L>
    requires(has(L, rights::local_write))
status read(verbs::queue_pair<verbs::rc>& qp, local_buffer<L> dst, const remote_handle& h,
            std::uint64_t offset, std::uint64_t wr_id) noexcept {
    if (const status s = h.check(rights::remote_read, offset, dst.length); s != status::ok)
        return s;
    return qp.read(dst, remote_buffer<rights::remote_read>{h.addr, h.length, h.rkey, 0}, offset,
                   wr_id);
}

/// RDMA-writes src into the handle's window at offset, after the same checks.
template <rights L>
status write(verbs::queue_pair<verbs::rc>& qp, local_buffer<L> src, const remote_handle& h,
             std::uint64_t offset, std::uint64_t wr_id) noexcept {
    if (const status s = h.check(rights::remote_write, offset, src.length); s != status::ok)
        return s;
    return qp.write(src, remote_buffer<rights::remote_write>{h.addr, h.length, h.rkey, 0}, offset,
                    wr_id);
}

} // namespace rdmax
