#pragma once
// Send-queue slot accounting for selective signaling.
//
// Every posted work request takes a slot. An RC send queue completes in
// order, so the completion of a signaled request frees its slot and every
// earlier one. The accountant forces a signal at least every `interval`
// requests, with interval <= depth / 2, so that a full queue always holds a
// signaled request whose completion gives slots back; and it refuses a post
// that would overflow the queue. The wr_id the device sees is the slot id; the
// caller's wr_id is kept in the slot and handed back on completion.

#include <cstdint>
#include <vector>

namespace rdmax::verbs {

class send_slots {
public:
    struct claim {
        std::uint64_t id; ///< the wr_id to give the device
        bool signaled;    ///< request a completion for this work request
    };
    struct done {
        std::uint64_t wr_id; ///< the caller's
        bool report;         ///< the caller asked for this completion, or it failed
    };
    /// State to return to when a post fails after slots were taken.
    struct checkpoint {
        std::uint64_t head;
        std::uint32_t since_signal;
    };

    /// depth: the send queue's capacity; interval: the longest run of
    /// unsignaled requests (0: depth / 2; larger values are clamped to it).
    explicit send_slots(std::uint32_t depth, std::uint32_t interval = 0)
        : ring_(depth == 0 ? 1 : depth)
        , depth_(depth == 0 ? 1 : depth)
        , interval_(clamp_interval(depth_, interval)) {}

    [[nodiscard]] std::uint32_t depth() const noexcept { return depth_; }
    [[nodiscard]] std::uint32_t interval() const noexcept { return interval_; }
    [[nodiscard]] std::uint32_t in_use() const noexcept {
        return static_cast<std::uint32_t>(head_ - tail_);
    }
    [[nodiscard]] std::uint32_t available() const noexcept { return depth_ - in_use(); }

    [[nodiscard]] checkpoint mark() const noexcept { return {head_, since_signal_}; }
    void rollback(checkpoint c) noexcept {
        head_ = c.head;
        since_signal_ = c.since_signal;
    }

    /// Returns every slot from `id` on (a post the device refused from there);
    /// the next request is signaled, so that no unsignaled run outgrows the
    /// interval whatever the refused part held.
    void rollback_to(std::uint64_t id) noexcept {
        if (id >= tail_ && id < head_)
            head_ = id;
        since_signal_ = interval_;
    }

    /// Takes the next slot; the caller has checked available() > 0.
    [[nodiscard]] claim take(std::uint64_t wr_id, bool want_completion) noexcept {
        const std::uint64_t id = head_++;
        ring_[id % depth_] = {wr_id, want_completion};
        const bool signaled = want_completion || ++since_signal_ >= interval_;
        if (signaled)
            since_signal_ = 0;
        return {id, signaled};
    }

    /// Marks the work request `id` complete: frees it and every earlier slot.
    [[nodiscard]] done complete(std::uint64_t id, bool success) noexcept {
        const entry& e = ring_[id % depth_];
        if (id >= tail_)
            tail_ = id + 1;
        // A failed request is always reported, even if the caller did not ask:
        // the failure (or a flush after it) is news the caller needs.
        return {e.wr_id, e.want_completion || !success};
    }

private:
    struct entry {
        std::uint64_t wr_id = 0;
        bool want_completion = false;
    };
    static std::uint32_t clamp_interval(std::uint32_t depth, std::uint32_t interval) noexcept {
        const std::uint32_t most = depth / 2 == 0 ? 1 : depth / 2;
        return interval == 0 || interval > most ? most : interval;
    }

    std::vector<entry> ring_;
    std::uint32_t depth_;
    std::uint32_t interval_;
    std::uint64_t head_ = 0; ///< next slot id to hand out
    std::uint64_t tail_ = 0; ///< oldest slot not yet known complete
    std::uint32_t since_signal_ = 0;
};

} // namespace rdmax::verbs
