#pragma once
// rdma_link: an RPC connection through the RDMA device. Its queue pair and
// the priority scheduler that posts on it, this side's ring (the peer writes
// into it, under a key that covers that ring alone), this side's staging
// slots (what it writes from), and the peer's ring.
//
// On a client it also owns what a call shows the server of the caller's
// memory: the registration cache's handles of a large body and a reply
// buffer, and, where the device has type-2 memory windows, two windows per
// slot bound over exactly those bytes for the call's life (docs/rpc.md).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include <rdmax/detail/rpc/arena_block.hpp>
#include <rdmax/detail/rpc/inbox.hpp>
#include <rdmax/detail/rpc/link.hpp>
#include <rdmax/detail/rpc/wire.hpp>
#include <rdmax/mem/dmabuf_cache.hpp>
#include <rdmax/mem/handle_issuer.hpp>
#include <rdmax/mem/remote_handle.hpp>
#include <rdmax/mem/verbs_cache.hpp>
#include <rdmax/sched/priority_scheduler.hpp>
#include <rdmax/verbs/connection.hpp>

namespace rdmax::detail {
/// Test seams of rdma_link (tests/rxe/test_rpc.cpp); null in production.
struct rdma_link_hooks {
    /// Replaces ibv_alloc_mw (a device out of windows).
    ibv_mw* (*alloc_mw)(ibv_pd* pd, ibv_mw_type type) = nullptr;
    /// Asked before an unsignaled invalidation is staged: true refuses it,
    /// as a full send queue would.
    bool (*refuse_invalidate)() = nullptr;
};
[[nodiscard]] rdma_link_hooks& rdma_link_test_hooks() noexcept;
} // namespace rdmax::detail

namespace rdmax::rpc::detail {

/// What a client's link needs to expose its calls' buffers: the cache that
/// registers them (made at the first use) and the counters windows count in.
struct call_memory {
    verbs_cache& (*cache)(void* owner) = nullptr;
    void* owner = nullptr;
    rpc_counters* counters = nullptr;
};

class rdma_link final : public link {
public:
    /// This side's ring and staging slots for `slots` x `slot_bytes`, and the
    /// key (a registration of the ring alone, remote write only) the peer gets.
    rdma_link(registered_arena& arena, handle_issuer& issuer, std::uint16_t slots,
              std::uint32_t slot_bytes);
    /// Scheduler, then windows and queue pair (no more DMA), then the ring's
    /// key, then the memory; the calls' registrations last (a registration
    /// with a window bound to it cannot go before the window).
    ~rdma_link() override;

    /// What the peer needs to write into this side's ring.
    [[nodiscard]] ring_offer offer() const noexcept;
    /// The connection is up: the peer's ring (already checked against the
    /// geometry) and the scheduler over the queue pair.
    void attach(verbs::connection conn, const ring_offer& peer,
                const sched::scheduler_options& opts);
    /// A client's link: its calls' bodies and reply buffers are registered
    /// through `memory`, and shown through windows if `windows` (the device
    /// has type 2). False if windows were wanted and none could be had: the
    /// registrations' own keys are shown then.
    bool serve_calls(const call_memory& memory, bool windows);
    [[nodiscard]] bool has_windows() const noexcept { return !windows_.empty(); }

    [[nodiscard]] status send_slot(message_kind k, std::uint32_t s, std::uint32_t bytes,
                                   sched::priority p, bool epoch) noexcept override;
    [[nodiscard]] transfer move_body(body_way way, sched::priority p,
                                     local_buffer<rights::local_write> local,
                                     const buffer_descriptor& remote,
                                     std::uint64_t wr_id) noexcept override;
    [[nodiscard]] bool cancel(std::uint64_t wr_id) noexcept override {
        return sched_->cancel(wr_id);
    }
    /// The scheduler's completions (failures of unsignaled work, and the
    /// signaled READs and WRITEs), and fences that ended. Unless `thorough`,
    /// only when the scheduler has work to post or enough in flight that
    /// its budget wants completions reaped: the rest can wait for
    /// housekeeping, and the poll loop stays short (what a call waits for is
    /// the receive side, which comes through the endpoint's queue).
    [[nodiscard]] int poll(std::span<link_event> out, bool thorough) noexcept override;
    [[nodiscard]] std::optional<link_end> ended(look what) noexcept override;
    /// Work queued behind the byte budget moves on only when a send
    /// completion frees room: arm the send queue, so that its next completion
    /// wakes the endpoint (the caller polls once more after this).
    [[nodiscard]] bool sleep(bool going) noexcept override;
    void close() noexcept override { conn_->disconnect(std::chrono::milliseconds(0)); }
    [[nodiscard]] bool established(bool by_traffic) noexcept override;
    [[nodiscard]] access grant_access(std::uint32_t slot, const call_ranges& r,
                                      buffer_descriptor& body,
                                      buffer_descriptor& reply) noexcept override;
    bool end_access(std::uint32_t slot, access_end how) noexcept override;

private:
    /// hold_doorbell: the requests send_slot sends while held are deferred
    /// in the scheduler (request_flags::deferred); the hold's end flushes them.
    bool hold(bool on) noexcept;
    struct window {
        ibv_mw* mw = nullptr;
        bool bound = false;
        bool fencing = false; ///< first of a fence() whose completion is awaited
        /// Revoked, but the send queue had no room for its invalidation:
        /// still bound (its bind may still be queued, so it is not
        /// deallocated), posted by settle() before the window is used again.
        bool owed = false;
    };
    /// What slot s's call shows the peer: windows 2s (the body) and 2s + 1
    /// (the reply buffer), over the cache's registrations. The registrations
    /// are kept until the slot's next call once the windows are revoked
    /// (one with a window bound cannot be deregistered, and the revocation
    /// is only posted) or until their fence completed.
    ///
    /// A dma-buf range is shown by a registration's own key: the kernel
    /// registers dma-bufs without IB_ACCESS_MW_BIND (every device: the uAPI
    /// refuses the flag), so no window can be bound over one. So that the key
    /// still shows exactly the call's bytes with exactly the rights it needs,
    /// and dies with the call, each range is registered on its own for the
    /// call (dmabuf_cache::register_exact: never merged, never shared) and
    /// deregistered when the call ends, before its result is handed out.
    struct call_access {
        verbs_cache::handle body;
        verbs_cache::handle reply;
        ibv_mr* dev_body = nullptr; ///< exact registrations, this call's alone
        ibv_mr* dev_reply = nullptr;
        bool windows = false; ///< windows 2s and 2s + 1 are bound for this call
        bool fencing = false; ///< a fence of them is awaited
        call_access() = default;
        call_access(call_access&& o) noexcept
            : body(std::move(o.body))
            , reply(std::move(o.reply))
            , dev_body(std::exchange(o.dev_body, nullptr))
            , dev_reply(std::exchange(o.dev_reply, nullptr))
            , windows(o.windows)
            , fencing(o.fencing) {}
        call_access(const call_access&) = delete;
        call_access& operator=(const call_access&) = delete;
        call_access& operator=(call_access&&) = delete;
        ~call_access() { drop_dmabufs(); }
        /// The dma-buf ranges' keys die now (nothing is bound to them).
        void drop_dmabufs() noexcept {
            for (ibv_mr** mr : {&dev_body, &dev_reply})
                if (*mr != nullptr)
                    (void)ibv_dereg_mr(std::exchange(*mr, nullptr));
        }
        void release() noexcept {
            body.reset();
            reply.reset();
            drop_dmabufs();
        }
    };
    /// grant_access: registers, binds, describes.
    [[nodiscard]] access grant_call(std::uint32_t slot, const call_ranges& r,
                                    buffer_descriptor& body, buffer_descriptor& reply) noexcept;

    [[nodiscard]] bool needs_progress() const noexcept {
        return sched_->queued() || sched_->in_flight() * 2 >= sched_->options().budget_wqes ||
               windows_low() || fencing_calls_ != 0 || owed_ != 0;
    }
    [[nodiscard]] bool has_outstanding() const noexcept {
        return sched_->outstanding() != 0 || windows_low() || fencing_calls_ != 0 || owed_ != 0;
    }
    /// The windows' binds and invalidations (unsignaled, posted beside the
    /// scheduler) hold half the send queue: reap it now, or calls would wait
    /// for housekeeping to give their slots back.
    [[nodiscard]] bool windows_low() const noexcept {
        return !windows_.empty() && qp_->send_slots_free() * 2 < qp_->send_depth();
    }
    [[nodiscard]] link_end why_ended() const noexcept;
    /// Posts the deferred requests before a request posted beside the
    /// scheduler (an invalidation, a window deallocated): what fences a
    /// call's buffers never overtakes the header that names them.
    void ring_before_direct() noexcept {
        if (held_ && sched_->queued())
            sched_->flush();
    }

    // Windows (rdma_link.cpp).
    bool enable_windows() noexcept;
    /// Registers the call's memory through the caches (false: one would not).
    bool register_call(call_access& a, const call_ranges& r, bool windows) noexcept;
    /// Binds windows over the call's registrations (one doorbell) and gives
    /// their keys; false if the binds could not be posted (nothing exposed).
    bool bind_call(std::uint32_t slot, call_access& a, buffer_descriptor& body,
                   buffer_descriptor& reply) noexcept;
    struct exposure {
        std::uint32_t window = 0;
        void* mr = nullptr;
        std::uint64_t addr = 0;
        std::uint64_t len = 0;
        rights r = rights::remote_read;
        std::uint32_t rkey = 0;
    };
    bool expose(std::span<exposure> e) noexcept;
    void revoke(std::uint32_t first, std::uint32_t count) noexcept;
    /// Deallocates windows [first, first + count) now, counted; a link that
    /// then has none left says so once.
    void revoke_now(std::uint32_t first, std::uint32_t count) noexcept;
    bool fence(std::uint32_t first, std::uint32_t count) noexcept;
    bool settled(std::uint32_t first, std::uint32_t count) noexcept;
    /// Deallocates window w (which revokes its key) and allocates another in
    /// its place; without one, the link gives up its windows.
    void replace_window(std::uint32_t w) noexcept;
    /// Counts (once) a link that gave its windows up for want of a replacement.
    void windows_lost() noexcept;
    /// Posts the owed invalidations the send queue has room for (unsignaled).
    void settle() noexcept;
    /// Stages unsignaled invalidations of the bound windows of [first, first
    /// + count) into b; false when one is refused (the batch then holds
    /// those before it: post or drop it whole).
    bool stage_invalidations(verbs::send_batch& b, std::uint32_t first,
                             std::uint32_t count) noexcept;
    /// Hands out the calls whose fence ended (or is moot: no windows left).
    int take_fenced(std::span<link_event> out) noexcept;
    /// The scheduler's foreign completions: a fence's.
    static void on_window_completion(void* self, const verbs::completion& c) noexcept;

    handle_issuer* issuer_;
    arena_block ring_;
    arena_block staging_;
    remote_handle key_;
    remote_buffer<rights::remote_write> peer_ring_{};
    std::vector<call_access> calls_; ///< per slot; a client's link only
    call_memory memory_;
    bool windows_wanted_ = false; ///< windows were had (counted once if lost)
    std::optional<verbs::connection> conn_;
    std::optional<sched::priority_scheduler<>> sched_;
    std::vector<window> windows_;                      ///< 2 per slot, or none
    std::vector<std::uint32_t> fenced_;                ///< fences completed, not yet taken
    std::uint32_t fences_ = 0;                         ///< fences awaiting their completion
    std::uint32_t fencing_calls_ = 0;                  ///< calls_ fencing
    std::uint32_t owed_ = 0;                           ///< windows whose invalidation is owed
    const verbs::queue_pair<verbs::rc>* qp_ = nullptr; ///< conn_'s, once attached
    std::uint64_t window_ops_ = 0;
    bool held_ = false; ///< hold_doorbell: send_slot defers its requests
};

/// The queue pair configuration of an RPC connection on `in`'s queues, its
/// send queue's events on `in`'s channel.
/// `windows`: room for the type-2 windows' own requests too (a client on a
/// device that has them: 2 binds and 2 invalidations per slot may be queued
/// beside the scheduler's work); clamped to the device's limits.
[[nodiscard]] verbs::qp_config link_qp_config(inbox& in, std::uint16_t slots,
                                              const verbs::device_limits& limits, bool windows);

} // namespace rdmax::rpc::detail
