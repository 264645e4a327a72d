#pragma once
// Send completions a wait took on the caller's behalf and keeps, in order,
// for the caller's next poll_send / wait_send.
//
// A queue pair's waits (wait_send_for, wait_send_slots) reap the send CQ for
// their own reasons. Once polled, a completion exists nowhere else, so every
// completion the caller would have been handed (its signaled requests' and
// every failure) must be kept here, not dropped. A ring of fixed capacity:
// push() never allocates, so a data-path wait can keep completions; a set-up
// wait may make_room() first, which may allocate.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include <rdmax/verbs/completion.hpp>

namespace rdmax::verbs {

class kept_completions {
public:
    /// Room for `capacity` completions, allocated now.
    explicit kept_completions(std::size_t capacity = 0)
        : ring_(capacity) {}
    kept_completions(kept_completions&& o) noexcept
        : ring_(std::move(o.ring_))
        , head_(std::exchange(o.head_, 0))
        , count_(std::exchange(o.count_, 0)) {
        o.ring_.clear();
    }
    kept_completions& operator=(kept_completions&& o) noexcept {
        if (this != &o) {
            ring_ = std::move(o.ring_);
            head_ = std::exchange(o.head_, 0);
            count_ = std::exchange(o.count_, 0);
            o.ring_.clear();
        }
        return *this;
    }
    kept_completions(const kept_completions&) = delete;
    kept_completions& operator=(const kept_completions&) = delete;
    ~kept_completions() = default;

    [[nodiscard]] bool empty() const noexcept { return count_ == 0; }
    [[nodiscard]] std::size_t size() const noexcept { return count_; }
    [[nodiscard]] std::size_t capacity() const noexcept { return ring_.size(); }
    /// How many more push() takes without allocating.
    [[nodiscard]] std::size_t room() const noexcept { return ring_.size() - count_; }

    /// Keeps `c` after every completion kept before it; room() must be > 0.
    void push(const completion& c) noexcept {
        ring_[(head_ + count_) % ring_.size()] = c;
        ++count_;
    }

    /// Grows the ring, if need be, so that room() >= n (set-up paths only:
    /// may throw bad_alloc, and then keeps what it held).
    void make_room(std::size_t n) {
        if (room() >= n)
            return;
        std::vector<completion> bigger(std::max(count_ + n, 2 * ring_.size()));
        for (std::size_t i = 0; i < count_; ++i)
            bigger[i] = at(i);
        ring_ = std::move(bigger);
        head_ = 0;
    }

    /// Hands out kept completions, oldest first; returns how many.
    int take(std::span<completion> out) noexcept {
        const std::size_t k = std::min(out.size(), count_);
        for (std::size_t i = 0; i < k; ++i)
            out[i] = at(i);
        drop_front(k);
        return static_cast<int>(k);
    }

    /// Takes the oldest kept completion of `wr_id`; the others keep their order.
    std::optional<completion> take_id(std::uint64_t wr_id) noexcept {
        for (std::size_t i = 0; i < count_; ++i) {
            if (at(i).wr_id != wr_id)
                continue;
            const completion c = at(i);
            // Close the gap by moving the older ones up one place.
            for (std::size_t j = i; j > 0; --j)
                at(j) = at(j - 1);
            drop_front(1);
            return c;
        }
        return std::nullopt;
    }

    /// Whether a kept completion reports a failure (the queue pair is broken).
    [[nodiscard]] bool any_failed() const noexcept {
        for (std::size_t i = 0; i < count_; ++i)
            if (!at(i).ok())
                return true;
        return false;
    }

private:
    [[nodiscard]] completion& at(std::size_t i) noexcept {
        return ring_[(head_ + i) % ring_.size()];
    }
    [[nodiscard]] const completion& at(std::size_t i) const noexcept {
        return ring_[(head_ + i) % ring_.size()];
    }
    void drop_front(std::size_t k) noexcept {
        count_ -= k;
        head_ = count_ == 0 ? 0 : (head_ + k) % ring_.size();
    }

    std::vector<completion> ring_;
    std::size_t head_ = 0;  ///< the oldest kept completion
    std::size_t count_ = 0; ///< kept: ring_[head_ .. head_ + count_) modulo the size
};

} // namespace rdmax::verbs
