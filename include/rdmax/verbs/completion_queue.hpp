#pragma once
// Completion queue: batched polling, and waiting with a deadline either by
// spinning or, when created on a completion channel, by sleeping on it.

#include <chrono>
#include <cstdint>
#include <span>

#include <infiniband/verbs.h>

#include <rdmax/verbs/completion_channel.hpp>
#include <rdmax/verbs/context.hpp>

namespace rdmax::verbs {

/// Move-only owner of an ibv_cq.
class completion_queue {
public:
    /// At least `min_entries` entries; a request beyond the device's max_cqe is
    /// refused with an error that names both numbers. With a channel, wait()
    /// sleeps on it instead of spinning (the channel must outlive the queue).
    completion_queue(const context& ctx, std::uint32_t min_entries,
                     completion_channel* channel = nullptr);
    completion_queue(completion_queue&& other) noexcept;
    completion_queue& operator=(completion_queue&& other) noexcept;
    completion_queue(const completion_queue&) = delete;
    completion_queue& operator=(const completion_queue&) = delete;
    ~completion_queue();

    [[nodiscard]] ibv_cq* get() const noexcept { return cq_; }
    /// Entries the device actually allocated (at least what was asked for).
    [[nodiscard]] std::uint32_t capacity() const noexcept {
        return static_cast<std::uint32_t>(cq_->cqe);
    }

    /// Polls up to out.size() completions without blocking; returns how many
    /// were written, or a negative value if the device reported an error.
    [[nodiscard]] int poll(std::span<ibv_wc> out) noexcept {
        return ibv_poll_cq(cq_, static_cast<int>(out.size()), out.data());
    }

    /// Like poll(), but waits up to `timeout` for at least one completion:
    /// returns 0 when the deadline passed with none, negative on error.
    [[nodiscard]] int wait(std::span<ibv_wc> out, std::chrono::microseconds timeout) noexcept;

private:
    void release() noexcept;
    ibv_cq* cq_;
    completion_channel* channel_;
    unsigned unacked_events_ = 0;
};

} // namespace rdmax::verbs
