#pragma once
// One connection of an RPC endpoint: its queue pair and the priority
// scheduler that posts on it, this side's ring (the peer writes into it,
// under a key that covers that ring alone), this side's staging slots (what
// it writes from), and the peer's ring. Server and client both hold one per
// peer; what each keeps per slot is its own.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include <rdmax/mem/buffer.hpp>
#include <rdmax/mem/handle_issuer.hpp>
#include <rdmax/mem/registered_arena.hpp>
#include <rdmax/mem/remote_handle.hpp>
#include <rdmax/rpc/inbox.hpp>
#include <rdmax/rpc/link_wire.hpp>
#include <rdmax/rpc/wire.hpp>
#include <rdmax/sched/priority_scheduler.hpp>
#include <rdmax/verbs/connection.hpp>

namespace rdmax::detail {
/// Test seams of peer_link (tests/rxe/test_rpc.cpp); null in production.
struct peer_link_hooks {
    /// Replaces ibv_alloc_mw (a device out of windows).
    ibv_mw* (*alloc_mw)(ibv_pd* pd, ibv_mw_type type) = nullptr;
    /// Asked before an unsignaled invalidation is staged: true refuses it,
    /// as a full send queue would.
    bool (*refuse_invalidate)() = nullptr;
};
[[nodiscard]] peer_link_hooks& peer_link_test_hooks() noexcept;
} // namespace rdmax::detail

namespace rdmax::rpc {

/// A block of a registered arena, given back when this goes.
class arena_block {
public:
    arena_block() = default;
    arena_block(registered_arena& arena, std::size_t bytes)
        : arena_(&arena)
        , block_(arena.allocate(bytes, 64)) {}
    arena_block(arena_block&& o) noexcept
        : arena_(std::exchange(o.arena_, nullptr))
        , block_(o.block_) {}
    arena_block& operator=(arena_block&& o) noexcept {
        if (this != &o) {
            reset();
            arena_ = std::exchange(o.arena_, nullptr);
            block_ = o.block_;
        }
        return *this;
    }
    arena_block(const arena_block&) = delete;
    arena_block& operator=(const arena_block&) = delete;
    ~arena_block() { reset(); }

    void reset() noexcept {
        if (arena_ != nullptr)
            arena_->deallocate(block_.data, block_.size);
        arena_ = nullptr;
    }
    [[nodiscard]] explicit operator bool() const noexcept { return arena_ != nullptr; }
    [[nodiscard]] std::byte* data() const noexcept { return block_.data; }
    [[nodiscard]] std::size_t size() const noexcept { return block_.size; }
    /// [offset, offset + len) for local reads and writes (the caller keeps it in range).
    [[nodiscard]] local_buffer<rights::local_write> local(std::size_t offset,
                                                          std::size_t len) const noexcept {
        return {block_.data + offset, static_cast<std::uint32_t>(len), block_.lkey};
    }

private:
    registered_arena* arena_ = nullptr;
    registered_arena::block block_{};
};

/// A connection through the RDMA device.
class peer_link final : public link_wire {
public:
    /// This side's ring and staging slots for `slots` x `slot_bytes`, and the
    /// key (a registration of the ring alone, remote write only) the peer gets.
    peer_link(registered_arena& arena, handle_issuer& issuer, std::uint16_t slots,
              std::uint32_t slot_bytes);
    /// Scheduler, then queue pair (no more DMA), then the ring's key, then the memory.
    ~peer_link() override;

    /// What the peer needs to write into this side's ring.
    [[nodiscard]] ring_offer offer() const noexcept;
    /// The connection is up: the peer's ring (already checked against the
    /// geometry) and the scheduler over the queue pair.
    void attach(verbs::connection conn, const ring_offer& peer,
                const sched::scheduler_options& opts);

    [[nodiscard]] std::span<const std::byte> inbound(std::uint32_t s,
                                                     std::uint32_t bytes) const noexcept override {
        return {ring_.data() + std::size_t{s} * slot_bytes(), bytes};
    }
    [[nodiscard]] std::byte* staging(std::uint32_t s) const noexcept override {
        return staging_.data() + std::size_t{s} * slot_bytes();
    }
    /// Writes with the immediate, unsignaled (failures still complete).
    [[nodiscard]] status send_slot(message_kind k, std::uint32_t s, std::uint32_t bytes,
                                   sched::priority p, bool epoch) noexcept override;
    [[nodiscard]] transfer read_body(sched::priority p, local_buffer<rights::local_write> dst,
                                     const buffer_descriptor& src,
                                     std::uint64_t wr_id) noexcept override;
    [[nodiscard]] transfer write_body(sched::priority p, local_buffer<rights::local_write> src,
                                      const buffer_descriptor& dst,
                                      std::uint64_t wr_id) noexcept override;
    [[nodiscard]] bool cancel(std::uint64_t wr_id) noexcept override {
        return sched_->cancel(wr_id);
    }
    /// Also posts the invalidations the send queue had no room for.
    [[nodiscard]] int poll_transfers(std::span<verbs::completion> out) noexcept override {
        if (owed_ != 0)
            settle();
        return sched_->poll(out);
    }
    /// The scheduler has work to post, or enough in flight that its budget
    /// wants completions reaped: poll it now. Otherwise its completions (of
    /// unsignaled requests, failures aside) can wait for housekeeping, and
    /// the poll loop stays short: what a call waits for is the receive side.
    [[nodiscard]] bool needs_progress() const noexcept override {
        return sched_->queued() || sched_->in_flight() * 2 >= sched_->options().budget_wqes ||
               windows_low() || fences_ != 0 || owed_ != 0;
    }
    [[nodiscard]] bool has_outstanding() const noexcept override {
        return sched_->outstanding() != 0 || windows_low() || fences_ != 0 || owed_ != 0;
    }
    [[nodiscard]] bool failed() const noexcept override { return sched_->failed(); }
    /// Work queued behind the byte budget moves on only when a send
    /// completion frees room: arm the send queue, so that its next completion
    /// wakes the endpoint (the caller polls once more after this).
    [[nodiscard]] bool prepare_sleep() noexcept override;
    [[nodiscard]] link_end why_ended() const noexcept override {
        link_end e{.failure = sched_->failure()};
        if (const auto by = conn_->ended_by()) {
            e.event = static_cast<int>(by->event);
            e.event_status = by->status;
        }
        return e;
    }
    [[nodiscard]] std::optional<sched::scheduler_counters>
    scheduler_counters() const noexcept override {
        return sched_ ? std::optional(sched_->counters()) : std::nullopt;
    }
    [[nodiscard]] bool peer_gone() noexcept override { return conn_->peer_disconnected(); }
    [[nodiscard]] int event_fd() const noexcept override { return conn_->id()->channel->fd; }
    [[nodiscard]] bool established() noexcept override { return conn_->established(); }
    void established_by_traffic() noexcept override { conn_->established_by_traffic(); }
    void close() noexcept override { conn_->disconnect(std::chrono::milliseconds(0)); }
    /// Type-2 windows, two per slot, allocated at attach() where the device
    /// has them: a bind (unsignaled, straight on the queue pair, ahead of
    /// the request that names its key) and a local invalidation per use.
    [[nodiscard]] bool expose(std::span<exposure> e) noexcept override;
    void revoke(std::uint32_t first, std::uint32_t count) noexcept override;
    void revoke_now(std::uint32_t first, std::uint32_t count) noexcept override;
    /// Signaled LOCAL_INVs (the last one of the range asks for the
    /// completion); its completion comes through the scheduler's poll.
    [[nodiscard]] bool fence(std::uint32_t first, std::uint32_t count) noexcept override;
    [[nodiscard]] std::size_t take_fenced(std::span<std::uint32_t> out) noexcept override;
    [[nodiscard]] bool has_windows() const noexcept override { return !windows_.empty(); }
    [[nodiscard]] bool settled(std::uint32_t first, std::uint32_t count) noexcept override;
    /// Allocates the windows (after attach; the device must have type 2).
    /// False if it could not: then none.
    bool enable_windows() noexcept;

    [[nodiscard]] verbs::connection& conn() noexcept { return *conn_; }
    [[nodiscard]] sched::priority_scheduler<>& scheduler() noexcept { return *sched_; }
    [[nodiscard]] std::uint32_t qp_num() const noexcept { return qp_num_; }

private:
    handle_issuer* issuer_;
    arena_block ring_;
    arena_block staging_;
    remote_handle key_;
    remote_buffer<rights::remote_write> peer_ring_{};
    std::uint32_t qp_num_ = 0;
    std::optional<verbs::connection> conn_;
    std::optional<sched::priority_scheduler<>> sched_;
    struct window {
        ibv_mw* mw = nullptr;
        bool bound = false;
        bool fencing = false; ///< first of a fence() whose completion is awaited
        /// Revoked, but the send queue had no room for its invalidation:
        /// still bound (its bind may still be queued, so it is not
        /// deallocated), posted by settle() before the window is used again.
        bool owed = false;
    };
    std::vector<window> windows_;                      ///< 2 per slot, or none
    std::vector<std::uint32_t> fenced_;                ///< fences completed, not yet taken
    std::uint32_t fences_ = 0;                         ///< fences awaiting their completion
    std::uint32_t owed_ = 0;                           ///< windows whose invalidation is owed
    const verbs::queue_pair<verbs::rc>* qp_ = nullptr; ///< conn_'s, once attached
    std::uint64_t window_ops_ = 0;
    /// The windows' binds and invalidations (unsignaled, posted beside the
    /// scheduler) hold half the send queue: reap it now, or calls would wait
    /// for housekeeping to give their slots back.
    [[nodiscard]] bool windows_low() const noexcept {
        return !windows_.empty() && qp_->send_slots_free() * 2 < qp_->send_depth();
    }
    /// Deallocates window w (which revokes its key) and allocates another in
    /// its place; without one, the link gives up its windows.
    void replace_window(std::uint32_t w) noexcept;
    /// Posts the owed invalidations the send queue has room for (unsignaled).
    void settle() noexcept;
    /// Stages unsignaled invalidations of the bound windows of [first, first
    /// + count) into b; false when one is refused (the batch then holds
    /// those before it: post or drop it whole).
    bool stage_invalidations(verbs::send_batch& b, std::uint32_t first,
                             std::uint32_t count) noexcept;
    /// The scheduler's foreign completions: a fence's.
    static void on_window_completion(void* self, const verbs::completion& c) noexcept;
};

/// The queue pair configuration of an RPC connection on `in`'s queues, its
/// send queue's events on `in`'s channel.
/// `windows`: room for the type-2 windows' own requests too (a client on a
/// device that has them: 2 binds and 2 invalidations per slot may be queued
/// beside the scheduler's work); clamped to the device's limits.
[[nodiscard]] verbs::qp_config link_qp_config(inbox& in, std::uint16_t slots,
                                              const verbs::device_limits& limits, bool windows);

} // namespace rdmax::rpc
