#pragma once
// window_set: the type-2 memory windows a client's RPC link binds through one
// queue pair (its own, or one of its other rails'), two per slot: window 2s
// shows slot s's call body, 2s + 1 its reply buffer. A type-2 window is
// reached only through the queue pair it was bound through, so each rail of
// a link has a set of its own; the calls' bookkeeping (which call is bound,
// which is fencing) stays in rdma_link.
//
// What a window goes through: bound ahead of the request that names its key
// (a send queue runs in order), then invalidated: lazily (an unsignaled
// LOCAL_INV, or owed while the send queue has no room), by a fence (a
// signaled one whose completion says the peer's key is dead), or at once by
// deallocating it (and allocating another in its place).

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <infiniband/verbs.h>

#include <rdmax/mem/rights.hpp>
#include <rdmax/verbs/queue_pair.hpp>

namespace rdmax::rpc::detail {

class window_set {
public:
    /// Work request ids of the windows' own requests (posted beside the
    /// scheduler, whose slice ids never reach these): a bind or an
    /// unsignaled invalidation, and a fence's signaled one, whose low bits
    /// name the fence's rail (bits 32..47) and first window (0..31).
    static constexpr std::uint64_t op_tag = std::uint64_t{0x5257} << 48;
    static constexpr std::uint64_t fence_tag = std::uint64_t{0x5246} << 48;
    /// A bind signaled so that its completion says it ran (expose()'s
    /// `signal`): bits 32..47 its rail, 0..31 its number.
    static constexpr std::uint64_t bind_tag = std::uint64_t{0x5242} << 48;
    [[nodiscard]] static constexpr bool is_bind(std::uint64_t wr_id) noexcept {
        return (wr_id & ~((std::uint64_t{1} << 48) - 1)) == bind_tag;
    }
    [[nodiscard]] static constexpr bool is_fence(std::uint64_t wr_id) noexcept {
        return (wr_id & ~((std::uint64_t{1} << 48) - 1)) == fence_tag;
    }
    [[nodiscard]] static constexpr std::uint32_t fence_rail(std::uint64_t wr_id) noexcept {
        return static_cast<std::uint32_t>((wr_id >> 32) & 0xffffU);
    }
    [[nodiscard]] static constexpr std::uint32_t fence_first(std::uint64_t wr_id) noexcept {
        return static_cast<std::uint32_t>(wr_id & 0xffffffffU);
    }

    /// What one bind shows: window `window` over [addr, addr + len) of `mr`
    /// with rights `r`; expose() fills in the key.
    struct exposure {
        std::uint32_t window = 0;
        void* mr = nullptr;
        std::uint64_t addr = 0;
        std::uint64_t len = 0;
        rights r = rights::remote_read;
        std::uint32_t rkey = 0;
    };

    window_set() = default;
    window_set(const window_set&) = delete;
    window_set& operator=(const window_set&) = delete;
    window_set(window_set&& o) noexcept;
    window_set& operator=(window_set&& o) noexcept;
    /// Deallocates every window (which revokes its key).
    ~window_set() { release(); }

    /// `count` windows in `pd`, all or none; their binds and invalidations go
    /// through `qp` (a queue pair in `pd`), their fences named `rail`.
    [[nodiscard]] bool allocate(ibv_pd* pd, std::size_t count, std::uint32_t rail) noexcept;
    /// The queue pair the windows go through from now on (a rail dialed again).
    void use(verbs::queue_pair<verbs::rc>& qp) noexcept { qp_ = &qp; }
    /// Deallocates every window; the set is empty after.
    void release() noexcept;

    [[nodiscard]] bool empty() const noexcept { return windows_.empty(); }
    [[nodiscard]] std::size_t size() const noexcept { return windows_.size(); }
    [[nodiscard]] std::uint32_t owed() const noexcept { return owed_; }
    [[nodiscard]] std::uint32_t fences() const noexcept { return fences_; }
    /// The binds and invalidations (unsignaled) hold half the send queue.
    [[nodiscard]] bool low() const noexcept {
        return !windows_.empty() && qp_ != nullptr &&
               qp_->send_slots_free() * 2 < qp_->send_depth();
    }

    /// Binds each exposure's window (one doorbell) and fills in its key.
    /// False if nothing could be posted (nothing exposed). `signal`: the
    /// last bind is signaled with this wr_id (0: none is).
    [[nodiscard]] bool expose(std::span<exposure> e, std::uint64_t signal = 0) noexcept;
    /// Invalidates the bound windows of [first, first + count), unsignaled;
    /// those the send queue has no room for are owed (settle()).
    void revoke(std::uint32_t first, std::uint32_t count) noexcept;
    /// Posts the owed invalidations the send queue has room for.
    void settle() noexcept;
    /// No window of the range owes its invalidation (after a settle()).
    [[nodiscard]] bool settled(std::uint32_t first, std::uint32_t count) noexcept;
    /// A signaled invalidation of the range's bound windows: false if none
    /// is bound or it could not be posted (then deallocate them).
    [[nodiscard]] bool fence(std::uint32_t first, std::uint32_t count) noexcept;
    /// The fence whose first window is `first` completed: true if it was
    /// still awaited (its windows were not deallocated since).
    bool fence_done(std::uint32_t first) noexcept;
    /// Deallocates window w (its key dies) and allocates another in its
    /// place; without one, every window goes (empty() after).
    void replace(std::uint32_t w) noexcept;
    /// replace() of every window of the range, bound or not (one whose
    /// invalidation was posted may not have run).
    void replace_range(std::uint32_t first, std::uint32_t count) noexcept;

private:
    struct window {
        ibv_mw* mw = nullptr;
        bool bound = false;
        bool fencing = false; ///< first of a fence whose completion is awaited
        /// Revoked, but the send queue had no room for its invalidation:
        /// still bound (its bind may still be queued, so it is not
        /// deallocated), posted by settle() before the window is used again.
        bool owed = false;
    };
    /// Stages unsignaled invalidations of the bound windows of the range
    /// into b; false when one is refused (post or drop the batch whole).
    bool stage_invalidations(verbs::send_batch& b, std::uint32_t first,
                             std::uint32_t count) noexcept;

    std::vector<window> windows_;
    verbs::queue_pair<verbs::rc>* qp_ = nullptr;
    std::uint32_t rail_ = 0;
    std::uint32_t fences_ = 0; ///< fences awaiting their completion
    std::uint32_t owed_ = 0;   ///< windows whose invalidation is owed
    std::uint64_t ops_ = 0;    ///< the unsignaled requests' ids
};

} // namespace rdmax::rpc::detail
