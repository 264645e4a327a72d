#pragma once
// LITE-style remote handles: a peer names registered memory by
// (window, offset, length, rights), and every use is checked for bounds and
// permission before anything is posted. The owner can revoke a handle; a
// peer's later use then fails with a completion error, never a hang.
//
// The owner's handle_issuer backs each handle with a registration of its own
// over the window (so revocation is deregistration: the device refuses the
// key from then on), with only the rights granted. Memory windows (type 2,
// bound through a queue pair) would avoid that registration; they are not
// used yet.

#include <cerrno>
#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>

#include <fmt/format.h>
#include <infiniband/verbs.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/access.hpp>
#include <rdmax/mem/buffer.hpp>
#include <rdmax/status.hpp>
#include <rdmax/verbs/protection_domain.hpp>
#include <rdmax/verbs/queue_pair.hpp>

namespace rdmax {

/// What a peer holds: plain bytes that cross the wire (24, no padding).
struct remote_handle {
    std::uint64_t addr = 0;   ///< the window's first byte, in the owner's address space
    std::uint64_t length = 0; ///< bytes in the window
    std::uint32_t rkey = 0;
    std::uint32_t rights = 0; ///< the access bits granted (remote read, write, atomic)

    [[nodiscard]] bool permits(access a) const noexcept {
        return (rights & static_cast<std::uint32_t>(a)) == static_cast<std::uint32_t>(a);
    }
    /// ok, out_of_range, zero_length or not_permitted for [offset, offset + len).
    [[nodiscard]] status check(access a, std::uint64_t offset, std::uint64_t len) const noexcept {
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
template <access L>
    requires(has(L, access::local_write))
status read(verbs::queue_pair<verbs::rc>& qp, local_buffer<L> dst, const remote_handle& h,
            std::uint64_t offset, std::uint64_t wr_id) noexcept {
    if (const status s = h.check(access::remote_read, offset, dst.length); s != status::ok)
        return s;
    return qp.read(dst, remote_buffer<access::remote_read>{h.addr, h.length, h.rkey, 0}, offset,
                   wr_id);
}

/// RDMA-writes src into the handle's window at offset, after the same checks.
template <access L>
status write(verbs::queue_pair<verbs::rc>& qp, local_buffer<L> src, const remote_handle& h,
             std::uint64_t offset, std::uint64_t wr_id) noexcept {
    if (const status s = h.check(access::remote_write, offset, src.length); s != status::ok)
        return s;
    return qp.write(src, remote_buffer<access::remote_write>{h.addr, h.length, h.rkey, 0}, offset,
                    wr_id);
}

/// The owner's side: issues handles over its memory and revokes them.
class handle_issuer {
public:
    explicit handle_issuer(const verbs::protection_domain& pd) noexcept
        : pd_(&pd) {}
    handle_issuer(const handle_issuer&) = delete;
    handle_issuer& operator=(const handle_issuer&) = delete;
    ~handle_issuer() {
        for (auto& [key, mr] : issued_)
            ibv_dereg_mr(mr);
    }

    /// A handle granting `rights` (remote read, write and/or atomic) over
    /// [addr, addr + len). Throws rdmax::error if the device refuses.
    [[nodiscard]] remote_handle issue(const void* addr, std::size_t len, access rights) {
        if (len == 0 || rights == access::local_read || rights == access::local_write)
            throw_error("handle_issuer::issue", EINVAL,
                        len == 0 ? "zero length" : "grant at least one remote right");
        // Remote write and atomic need local write to be registered (verbs).
        const access reg = valid(rights) ? rights : rights | access::local_write;
        ibv_mr* mr = ibv_reg_mr(pd_->get(), const_cast<void*>(addr), len, to_ibv(reg));
        if (mr == nullptr)
            throw_error("ibv_reg_mr", errno, fmt::format("a handle's window of {} bytes", len));
        std::lock_guard g(mutex_);
        issued_.emplace(mr->rkey, mr);
        const auto granted = static_cast<std::uint32_t>(rights) &
                             static_cast<std::uint32_t>(access::remote_read | access::remote_write |
                                                        access::remote_atomic);
        return {reinterpret_cast<std::uintptr_t>(addr), len, mr->rkey, granted};
    }

    /// Revokes h: from now on the device refuses its key. Returns false if h
    /// was not issued here or was revoked already.
    bool revoke(const remote_handle& h) noexcept {
        ibv_mr* mr = nullptr;
        {
            std::lock_guard g(mutex_);
            auto it = issued_.find(h.rkey);
            if (it == issued_.end())
                return false;
            mr = it->second;
            issued_.erase(it);
        }
        ibv_dereg_mr(mr);
        return true;
    }

    [[nodiscard]] std::size_t live() const noexcept {
        std::lock_guard g(mutex_);
        return issued_.size();
    }

private:
    const verbs::protection_domain* pd_;
    mutable std::mutex mutex_;
    std::map<std::uint32_t, ibv_mr*> issued_;
};

} // namespace rdmax
