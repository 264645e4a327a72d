#pragma once
// One connection of an RPC endpoint: its queue pair and the priority
// scheduler that posts on it, this side's ring (the peer writes into it,
// under a key that covers that ring alone), this side's staging slots (what
// it writes from), and the peer's ring. Server and client both hold one per
// peer; what each keeps per slot is its own.

#include <cstddef>
#include <cstdint>
#include <optional>

#include <rdmax/mem/buffer.hpp>
#include <rdmax/mem/handle_issuer.hpp>
#include <rdmax/mem/registered_arena.hpp>
#include <rdmax/mem/remote_handle.hpp>
#include <rdmax/rpc/wire.hpp>
#include <rdmax/sched/priority_scheduler.hpp>
#include <rdmax/verbs/connection.hpp>

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

class peer_link {
public:
    /// This side's ring and staging slots for `slots` x `slot_bytes`, and the
    /// key (a registration of the ring alone, remote write only) the peer gets.
    peer_link(registered_arena& arena, handle_issuer& issuer, std::uint16_t slots,
              std::uint32_t slot_bytes);
    peer_link(const peer_link&) = delete;
    peer_link& operator=(const peer_link&) = delete;
    /// Scheduler, then queue pair (no more DMA), then the ring's key, then the memory.
    ~peer_link();

    /// What the peer needs to write into this side's ring.
    [[nodiscard]] ring_offer offer() const noexcept;
    /// The connection is up: the peer's ring (already checked against the
    /// geometry) and the scheduler over the queue pair.
    void attach(verbs::connection conn, const ring_offer& peer,
                const sched::scheduler_options& opts);

    [[nodiscard]] std::uint16_t slots() const noexcept { return slots_; }
    [[nodiscard]] std::uint32_t slot_bytes() const noexcept { return slot_bytes_; }
    /// This side's slot s, as the peer last wrote it.
    [[nodiscard]] std::span<const std::byte> inbound(std::uint32_t s,
                                                     std::uint32_t bytes) const noexcept {
        return {ring_.data() + std::size_t{s} * slot_bytes_, bytes};
    }
    /// This side's staging slot s: build a message there, then send it.
    [[nodiscard]] std::byte* staging(std::uint32_t s) const noexcept {
        return staging_.data() + std::size_t{s} * slot_bytes_;
    }
    /// Writes the first `bytes` of staging slot s into the peer's slot s,
    /// with the immediate naming them, at priority p; unsignaled (failures
    /// still complete).
    [[nodiscard]] status send_slot(message_kind k, std::uint32_t s, std::uint32_t bytes,
                                   sched::priority p) noexcept;

    [[nodiscard]] verbs::connection& conn() noexcept { return *conn_; }
    [[nodiscard]] sched::priority_scheduler<>& scheduler() noexcept { return *sched_; }
    [[nodiscard]] bool attached() const noexcept { return sched_.has_value(); }
    /// The scheduler has work to post, or enough in flight that its budget
    /// wants completions reaped: poll it now. Otherwise its completions (of
    /// unsignaled requests, failures aside) can wait for housekeeping, and
    /// the poll loop stays short: what a call waits for is the receive side.
    [[nodiscard]] bool needs_progress() const noexcept {
        return sched_->queued() || sched_->in_flight() * 2 >= sched_->options().budget_wqes;
    }
    [[nodiscard]] std::uint32_t qp_num() const noexcept { return qp_num_; }
    /// The connection failed, the peer left, or it broke the protocol: no
    /// more posts; the endpoint tears it down.
    bool broken = false;

private:
    handle_issuer* issuer_;
    arena_block ring_;
    arena_block staging_;
    remote_handle key_;
    std::uint16_t slots_;
    std::uint32_t slot_bytes_;
    remote_buffer<rights::remote_write> peer_ring_{};
    std::uint32_t qp_num_ = 0;
    std::optional<verbs::connection> conn_;
    std::optional<sched::priority_scheduler<>> sched_;
};

/// The queue pair configuration of an RPC connection on `in`'s queues.
[[nodiscard]] verbs::qp_config link_qp_config(verbs::completion_queue& recv_cq,
                                              verbs::shared_receive_queue& srq,
                                              std::uint16_t slots);

} // namespace rdmax::rpc
