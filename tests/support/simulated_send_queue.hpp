#pragma once
// A send queue for the scheduler's unit tests: it takes slices like a queue
// pair, moves `drain(bytes)` bytes off its head per call (the wire, at a rate
// the test sets), completes slices in order, reports the signaled and failed
// ones as a queue pair does, and can fail a chosen slice (then flushes the
// rest, as an RC queue pair in the error state does) or refuse a post. Once
// failed it refuses to stage (qp_failed), as a failed queue pair does.

#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <vector>

#include <rdmax/sched/send_port.hpp>

namespace rdmax::test {

/// A FIFO of fixed capacity that never allocates after construction.
template <class T>
class fixed_fifo {
public:
    explicit fixed_fifo(std::size_t capacity)
        : items_(capacity == 0 ? 1 : capacity) {}
    [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
    [[nodiscard]] std::size_t size() const noexcept { return size_; }
    T& front() noexcept { return items_[head_]; }
    void push_back(const T& v) {
        if (size_ == items_.size())
            throw std::length_error("fixed_fifo full");
        items_[(head_ + size_++) % items_.size()] = v;
    }
    void pop_front() noexcept {
        head_ = (head_ + 1) % items_.size();
        --size_;
    }
    template <class F>
    void for_each(F&& f) const {
        for (std::size_t i = 0; i < size_; ++i)
            f(items_[(head_ + i) % items_.size()]);
    }

private:
    std::vector<T> items_;
    std::size_t head_ = 0;
    std::size_t size_ = 0;
};

class simulated_send_queue {
public:
    struct record {
        sched::slice_request slice;
        std::uint64_t bytes_ahead = 0; ///< bytes queued before it when it was posted
        std::uint32_t wqes_ahead = 0;
        std::uint32_t reads_ahead = 0;
    };

    explicit simulated_send_queue(std::uint32_t depth = 256, std::uint32_t max_rd_atomic = 16,
                                  std::uint32_t max_message = 1U << 31)
        : depth_(depth)
        , max_rd_(max_rd_atomic)
        , max_msg_(max_message)
        , queue_(depth)
        , done_(2 * std::size_t{depth}) {
        chain_.reserve(depth);
    }

    // ---- SendPort ---------------------------------------------------------------------------
    status stage(const sched::slice_request& s) noexcept {
        if (error_)
            return status::qp_failed; // as a queue pair refuses once it failed
        if (queue_.size() + chain_.size() >= depth_)
            return status::queue_full;
        chain_.push_back(s);
        return status::ok;
    }
    status post() noexcept {
        ++doorbells;
        std::size_t take = chain_.size();
        if (refuse_after) {
            take = std::min<std::size_t>(*refuse_after, take);
            refuse_after.reset();
        }
        accepted_ = static_cast<std::uint32_t>(take);
        for (std::size_t i = 0; i < take; ++i) {
            record r{chain_[i], queued_bytes(), static_cast<std::uint32_t>(queue_.size()),
                     queued_reads()};
            log.push_back(r);
            queue_.push_back({chain_[i], chain_[i].length});
            max_queued_bytes = std::max(max_queued_bytes, queued_bytes());
            max_queued_wqes =
                std::max<std::uint32_t>(max_queued_wqes, static_cast<std::uint32_t>(queue_.size()));
            max_queued_reads = std::max(max_queued_reads, queued_reads());
        }
        const bool refused = take != chain_.size();
        chain_.clear();
        return refused ? status::post_failed : status::ok;
    }
    [[nodiscard]] std::uint32_t accepted() const noexcept { return accepted_; }
    void fail() noexcept { flush(); }
    int poll(std::span<verbs::completion> out) noexcept {
        int k = 0;
        while (!done_.empty() && static_cast<std::size_t>(k) < out.size()) {
            out[static_cast<std::size_t>(k++)] = done_.front();
            done_.pop_front();
        }
        return k;
    }
    [[nodiscard]] std::uint32_t slots_free() const noexcept {
        return depth_ - static_cast<std::uint32_t>(queue_.size() + chain_.size());
    }
    [[nodiscard]] std::uint32_t max_rd_atomic() const noexcept { return max_rd_; }
    [[nodiscard]] std::uint32_t max_message() const noexcept { return max_msg_; }
    [[nodiscard]] bool ready() const noexcept { return !error_; }
    [[nodiscard]] bool failed() const noexcept { return error_; }

    // ---- the wire -----------------------------------------------------------------------------
    /// Moves up to `bytes` off the head of the queue, completing what finishes.
    void drain(std::uint64_t bytes) {
        while (!queue_.empty()) {
            entry& e = queue_.front();
            const std::uint64_t step = std::min(bytes, e.left);
            e.left -= step;
            bytes -= step;
            if (e.left != 0)
                break;
            const sched::slice_request s = e.slice;
            queue_.pop_front();
            if (fail_slice && *fail_slice == s.id) {
                done_.push_back(completion_of(s, fail_status));
                flush();
                return;
            }
            if (s.signaled)
                done_.push_back(completion_of(s, IBV_WC_SUCCESS));
        }
    }
    [[nodiscard]] bool idle() const noexcept { return queue_.empty(); }
    /// A completion of a request the scheduler did not post; one in error
    /// fails the queue, as on an RC queue pair (what follows it is flushed).
    void inject(std::uint64_t wr_id, ibv_wc_status st) {
        verbs::completion c;
        c.wr_id = wr_id;
        c.status = st;
        done_.push_back(c);
        if (st != IBV_WC_SUCCESS)
            flush();
    }
    [[nodiscard]] std::uint64_t queued_bytes() const noexcept {
        std::uint64_t n = 0;
        queue_.for_each([&](const entry& e) { n += e.left; });
        return n;
    }
    [[nodiscard]] std::uint32_t queued_reads() const noexcept {
        std::uint32_t n = 0;
        queue_.for_each([&](const entry& e) { n += e.slice.opcode == IBV_WR_RDMA_READ ? 1U : 0U; });
        return n;
    }

    std::vector<record> log;
    std::optional<std::uint64_t> fail_slice; ///< this slice id completes with fail_status
    ibv_wc_status fail_status = IBV_WC_REM_ACCESS_ERR;
    std::optional<std::uint32_t> refuse_after; ///< the next post takes only this many
    std::uint64_t max_queued_bytes = 0;
    std::uint32_t max_queued_wqes = 0;
    std::uint32_t max_queued_reads = 0;
    std::uint64_t doorbells = 0;

private:
    struct entry {
        sched::slice_request slice;
        std::uint64_t left = 0;
    };
    static verbs::completion completion_of(const sched::slice_request& s, ibv_wc_status st) {
        verbs::completion c;
        c.wr_id = s.id;
        c.status = st;
        return c;
    }
    void flush() {
        error_ = true;
        while (!queue_.empty()) {
            done_.push_back(completion_of(queue_.front().slice, IBV_WC_WR_FLUSH_ERR));
            queue_.pop_front();
        }
    }

    std::uint32_t depth_;
    std::uint32_t max_rd_;
    std::uint32_t max_msg_;
    std::uint32_t accepted_ = 0;
    bool error_ = false;
    std::vector<sched::slice_request> chain_;
    fixed_fifo<entry> queue_;
    fixed_fifo<verbs::completion> done_; ///< at most one per slice in the queue
};

static_assert(sched::SendPort<simulated_send_queue>);

} // namespace rdmax::test
