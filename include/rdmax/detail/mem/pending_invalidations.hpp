#pragma once
// pending_invalidations<N>: the ranges a monitor saw unmapped and the cache has
// not yet dropped, in a fixed array that never grows.
//
// A munmap loop must not grow the queue without bound (UCX fixed exactly
// that, PR #11248). Ranges that overlap or touch are merged; when all N slots
// are taken, the two ranges with the smallest gap between them are merged
// into one that spans both. Invalidating more than was unmapped is safe (the
// cache registers again at the next get); invalidating less never happens.
// No allocation, so a monitor may fill it from a thread that a munmap waits on.

#include <array>
#include <cstddef>
#include <cstdint>

namespace rdmax {

struct address_range {
    std::uintptr_t start = 0;
    std::uintptr_t end = 0;
};

template <std::size_t N>
class pending_invalidations {
    static_assert(N >= 2);

public:
    static constexpr std::size_t capacity = N;

    /// Records [start, end); empty ranges are ignored.
    void add(std::uintptr_t start, std::uintptr_t end) noexcept {
        if (start >= end)
            return;
        // Sorted by start and disjoint: find where it goes, absorb neighbours.
        std::size_t i = 0;
        while (i < n_ && r_[i].end < start)
            ++i;
        std::size_t j = i;
        while (j < n_ && r_[j].start <= end) {
            start = r_[j].start < start ? r_[j].start : start;
            end = r_[j].end > end ? r_[j].end : end;
            ++j;
        }
        if (j > i) { // replace r_[i, j) by the union
            r_[i] = {start, end};
            shift_left(i + 1, j - i - 1);
            return;
        }
        if (n_ == N)
            merge_closest();
        // The merge may have moved things: find the place again.
        i = 0;
        while (i < n_ && r_[i].end < start)
            ++i;
        if (i < n_ && r_[i].start <= end) { // now touches a merged range
            r_[i].start = r_[i].start < start ? r_[i].start : start;
            r_[i].end = r_[i].end > end ? r_[i].end : end;
            return;
        }
        for (std::size_t k = n_; k > i; --k)
            r_[k] = r_[k - 1];
        r_[i] = {start, end};
        ++n_;
    }

    [[nodiscard]] std::size_t size() const noexcept { return n_; }
    [[nodiscard]] bool empty() const noexcept { return n_ == 0; }
    [[nodiscard]] const address_range& operator[](std::size_t i) const noexcept { return r_[i]; }
    /// Total merges forced by a full queue (ranges widened beyond what was reported).
    [[nodiscard]] std::uint64_t overflow_merges() const noexcept { return overflows_; }

    void clear() noexcept { n_ = 0; }

private:
    void shift_left(std::size_t from, std::size_t by) noexcept {
        if (by == 0)
            return;
        for (std::size_t k = from; k + by < n_; ++k)
            r_[k] = r_[k + by];
        n_ -= by;
    }

    void merge_closest() noexcept {
        std::size_t best = 0;
        for (std::size_t k = 1; k + 1 < n_; ++k)
            if (r_[k + 1].start - r_[k].end < r_[best + 1].start - r_[best].end)
                best = k;
        r_[best].end = r_[best + 1].end;
        shift_left(best + 1, 1);
        ++overflows_;
    }

    std::array<address_range, N> r_{};
    std::size_t n_ = 0;
    std::uint64_t overflows_ = 0;
};

} // namespace rdmax
