#pragma once
// LITE-style remote handles, the peer's side: a peer names registered memory
// by (window, offset, length, rights, epoch), and every use is checked for the
// issuer's incarnation, permission and bounds before anything is posted. The
// owner issues and revokes handles with a handle_issuer (handle_issuer.hpp); a
// peer's use of a revoked handle then completes with an error (remote access
// error), never a hang.
//
// Epochs. Every handle_issuer draws a random 64-bit incarnation (never 0) when
// it is made, and every handle it issues carries it (epoch). The peer's queue
// pair records the incarnation of the issuer it talks to
// (queue_pair<rc>::set_peer_epoch, learned from what the peer sent on that
// connection, e.g. a handle in the connect payload). read() and write() post
// a handle only if its epoch is exactly the one the queue pair knows:
//   - another nonzero epoch: status::stale_handle (the issuer restarted, and
//     its keys may repeat over other memory);
//   - the queue pair knows none (0) and the handle names one: status::unknown_epoch.
// So a handle of an earlier incarnation is never posted, even before the new
// incarnation is known. A handle built by hand with epoch 0 (no issuer) passes
// only on a queue pair that knows no incarnation. The epoch is checked first,
// then rights, length and bounds: a stale handle's window says nothing.

#include <cstdint>
#include <type_traits>

#include <infiniband/verbs.h>

#include <rdmax/mem/buffer.hpp>
#include <rdmax/mem/rights.hpp>
#include <rdmax/status.hpp>
#include <rdmax/verbs/queue_pair.hpp>

namespace rdmax {

/// What a peer holds: plain bytes that cross the wire (32, no padding).
struct remote_handle {
    std::uint64_t addr = 0;   ///< the window's first byte, in the owner's address space
    std::uint64_t length = 0; ///< bytes in the window
    std::uint32_t rkey = 0;
    std::uint32_t granted = 0; ///< the rights granted (remote read, write, atomic), as bits
    std::uint64_t epoch = 0;   ///< the issuer's incarnation (handle_issuer::epoch()); 0: none

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
    /// ok if the handle names the incarnation `known` (what the queue pair
    /// knows of its peer's issuer), else stale_handle, or unknown_epoch when
    /// known is 0 and the handle names one.
    [[nodiscard]] status check_epoch(std::uint64_t known) const noexcept {
        if (epoch == known)
            return status::ok;
        return known == 0 ? status::unknown_epoch : status::stale_handle;
    }
    /// check_epoch(known), then check(a, offset, len): what read() and write() ask.
    [[nodiscard]] status check(std::uint64_t known, rights a, std::uint64_t offset,
                               std::uint64_t len) const noexcept {
        if (const status s = check_epoch(known); s != status::ok)
            return s;
        return check(a, offset, len);
    }
};
static_assert(std::is_trivially_copyable_v<remote_handle> && sizeof(remote_handle) == 32 &&
              std::has_unique_object_representations_v<remote_handle>);

/// RDMA-reads [offset, offset + dst.length) of the handle's window into dst,
/// after checking the epoch against qp.peer_epoch(), the rights and the bounds.
/// noexcept: a status, as the data path does; a refusal posts nothing.
template <rights L>
    requires(has(L, rights::local_write))
status read(verbs::queue_pair<verbs::rc>& qp, local_buffer<L> dst, const remote_handle& h,
            std::uint64_t offset, std::uint64_t wr_id) noexcept {
    if (const status s = h.check(qp.peer_epoch(), rights::remote_read, offset, dst.length);
        s != status::ok)
        return s;
    return qp.read(dst, remote_buffer<rights::remote_read>{h.addr, h.length, h.rkey, 0}, offset,
                   wr_id);
}

/// RDMA-writes src into the handle's window at offset, after the same checks.
template <rights L>
status write(verbs::queue_pair<verbs::rc>& qp, local_buffer<L> src, const remote_handle& h,
             std::uint64_t offset, std::uint64_t wr_id) noexcept {
    if (const status s = h.check(qp.peer_epoch(), rights::remote_write, offset, src.length);
        s != status::ok)
        return s;
    return qp.write(src, remote_buffer<rights::remote_write>{h.addr, h.length, h.rkey, 0}, offset,
                    wr_id);
}

} // namespace rdmax
