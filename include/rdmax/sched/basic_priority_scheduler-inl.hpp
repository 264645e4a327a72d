#pragma once
// The bodies of basic_priority_scheduler's members (basic_priority_scheduler.hpp
// holds the class, what it promises and its API; this file, how it keeps
// that). Included at the end of basic_priority_scheduler.hpp; including it
// alone includes that first.

#include <rdmax/sched/basic_priority_scheduler.hpp>

namespace rdmax::sched {

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline basic_priority_scheduler<Policy, Port, Clock, FineClock>::~basic_priority_scheduler() {
    // The queues link into pool_; unhook before the pool goes.
    free_.clear();
    done_.clear();
    for (auto& q : queues_)
        q.clear();
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline int basic_priority_scheduler<Policy, Port, Clock, FineClock>::poll(
    std::span<verbs::completion> out) noexcept {
    reap();
    if (done_.empty() || deferred_pump_) {
        pump();
        deferred_pump_ = false;
    } else {
        deferred_pump_ = true;
    }
    return deliver(out);
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline bool
basic_priority_scheduler<Policy, Port, Clock, FineClock>::cancel(std::uint64_t wr_id) noexcept {
    for (std::size_t level = 0; level < priority_levels; ++level) {
        queue& q = queues_[level];
        for (auto prev = q.before_begin(), it = q.begin(); it != q.end(); prev = it++) {
            request& r = *it;
            if (r.wr_id != wr_id || r.posted != 0 || r.in_flight != 0)
                continue;
            q.erase_after(prev);
            r.queued = false;
            if (q.empty())
                policy_.idle(level);
            --live_[level];
            --live_total_;
            free_.push_front(r);
            ++free_count_;
            return true;
        }
    }
    return false;
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline int basic_priority_scheduler<Policy, Port, Clock, FineClock>::wait(
    std::span<verbs::completion> out, std::chrono::microseconds timeout) noexcept {
    // The deadline is on the coarse clock, read every 256 polls: this
    // spins, and a precise clock may cost a system call per read.
    const auto deadline = clock::now() + timeout + std::chrono::milliseconds(1);
    for (std::uint32_t tries = 1;; ++tries) {
        if (const int n = poll(out); n != 0)
            return n;
        if (live_total_ == 0 || ((tries & 255U) == 0 && clock::now() >= deadline))
            return 0;
    }
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline scheduler_options
basic_priority_scheduler<Policy, Port, Clock, FineClock>::clamp(scheduler_options o,
                                                                const Port& port) noexcept {
    const std::uint32_t most_msg = std::max<std::uint32_t>(port.max_message(), 1);
    o.small_slice = std::clamp<std::uint32_t>(o.small_slice, 1, most_msg);
    o.large_slice = std::clamp<std::uint32_t>(o.large_slice, o.small_slice, most_msg);
    // 0 stays 0: the budget is measured (adaptive).
    // Half the send queue at most: the queue pair's own selective
    // signaling needs the other half to recycle slots.
    const std::uint32_t half = std::max<std::uint32_t>(port.slots_free() / 2, 1);
    o.budget_wqes = std::clamp<std::uint32_t>(o.budget_wqes, 1, half);
    o.max_requests = std::max<std::uint32_t>(o.max_requests, 1);
    return o;
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline status basic_priority_scheduler<Policy, Port, Clock, FineClock>::submit(
    priority p, ibv_wr_opcode op, local_view local, std::optional<remote_view> remote,
    std::uint64_t remote_offset, std::optional<std::uint32_t> imm, std::uint64_t wr_id,
    request_flags f) noexcept {
    const std::uint32_t length = local.length;
    if (p.level >= priority_levels)
        return status::out_of_range;
    if (broken_)
        return status::qp_failed;
    if (port_.failed()) [[unlikely]] {
        // Someone else's request on the queue pair failed (a window's
        // bind): nothing more goes, and what is queued is flushed.
        port_failed();
        return status::qp_failed;
    }
    if (!port_.ready())
        return status::not_connected;
    const bool is_send = op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM;
    if (length == 0 && !imm)
        return status::zero_length;
    if (is_send && length > port_.max_message())
        return status::too_long;
    if (remote && !remote->contains(remote_offset, length))
        return status::out_of_range;
    if (free_.empty())
        return status::queue_full;
    request& r = free_.front();
    free_.pop_front();
    --free_count_;
    r.wr = {};
    r.wr.local = local.addr;
    r.wr.length = length;
    r.wr.lkey = local.lkey;
    r.wr.remote_addr = remote ? remote->addr + remote_offset : 0;
    r.wr.rkey = remote ? remote->rkey : 0;
    r.wr.opcode = op;
    r.wr.has_imm = imm.has_value();
    r.wr.imm = imm.value_or(0);
    r.wr.solicited = f.solicited;
    r.length = length;
    r.posted = 0;
    r.seq = next_seq_++;
    r.wr_id = wr_id;
    r.in_flight = 0;
    r.result = IBV_WC_SUCCESS;
    r.level = p.level;
    r.report = f.signaled;
    r.first_fenced = f.fence;
    r.queued = true;
    queues_[p.level].push_back(r);
    ++live_[p.level];
    ++live_total_;
    ++counters_.requests;
    if (!f.deferred)
        pump(); // a deferred request waits for the next doorbell rung (flush, poll)
    return status::ok;
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline bool basic_priority_scheduler<Policy, Port, Clock, FineClock>::contended(
    std::size_t level, clock::time_point now) const noexcept {
    for (std::size_t l = 0; l < level; ++l)
        if (live_[l] != 0 || last_active_[l] > now - opts_.hold)
            return true;
    return false;
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline bool basic_priority_scheduler<Policy, Port, Clock, FineClock>::startable(
    const request& r) const noexcept {
    if (r.wr.opcode == IBV_WR_RDMA_READ && reads_in_flight_ >= port_.max_rd_atomic())
        return false;
    if (r.first_fenced && r.posted == 0)
        for (std::size_t l = 0; l < priority_levels; ++l)
            if (l != r.level && !queues_[l].empty() && queues_[l].front().seq < r.seq)
                return false;
    return true;
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline void
basic_priority_scheduler<Policy, Port, Clock, FineClock>::pump(bool every_level) noexcept {
    if (!broken_ && port_.failed()) [[unlikely]]
        port_failed();
    if (broken_ || live_total_ == 0)
        return;
    const auto now = clock::now();
    std::uint64_t chain_first = next_slice_;
    std::size_t most_urgent_staged = priority_levels;
    for (;;) {
        if (in_flight_wqes_ >= opts_.budget_wqes || port_.slots_free() == 0) {
            note_budget_stall();
            break;
        }
        const bool over_budget = in_flight_bytes_ >= budget_;
        const level_mask ready = ready_levels(over_budget, now);
        if (over_budget && ready == 0) {
            note_budget_stall();
            break;
        }
        const int picked = policy_.pick(ready);
        if (picked < 0)
            break;
        const auto level = static_cast<std::size_t>(picked);
        // Once a more urgent level's slices are staged, a less urgent
        // level's wait for the next call: the caller then gets back to
        // polling, and learns that its urgent request finished, without
        // first paying for posting the bulk (on soft-RoCE, posting is the
        // packets' transmission, in this thread).
        if (level > most_urgent_staged && !every_level)
            break;
        const status st = post_slice(queues_[level].front(), level, contended(level, now));
        if (st == status::ok) {
            most_urgent_staged = std::min(most_urgent_staged, level);
            continue;
        }
        if (st == status::batch_full && next_slice_ != chain_first) {
            if (!ring(chain_first))
                return;
            chain_first = next_slice_;
            continue;
        }
        if (st == status::qp_failed) {
            // The queue pair failed under this pass: the slices staged
            // are refused with it (ring fails them, flushed), the rest
            // of the queues flushed, nothing waits.
            if (next_slice_ == chain_first || ring(chain_first))
                port_failed();
            return;
        }
        break; // queue_full: the queue pair's own completions free slots
    }
    if (next_slice_ != chain_first)
        ring(chain_first);
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline void basic_priority_scheduler<Policy, Port, Clock, FineClock>::note_budget_stall() noexcept {
    // A stall only when something waits: a pass that found the queues
    // empty was not held back.
    if (any_queued())
        ++counters_.budget_stalls;
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline level_mask basic_priority_scheduler<Policy, Port, Clock, FineClock>::ready_levels(
    bool over_budget, clock::time_point now) const noexcept {
    // Over the byte budget only a small request of the most urgent
    // level with work may still go: it adds next to nothing to the
    // wait of what follows, and it then waits for the bytes in flight
    // only, not also for the budget to come back.
    level_mask ready = 0;
    for (std::size_t l = 0; l < priority_levels; ++l) {
        if (queues_[l].empty())
            continue;
        const request& r = queues_[l].front();
        if (over_budget && (r.length - r.posted > opts_.small_slice || contended(l, now)))
            continue;
        if (startable(r))
            ready |= level_mask{1} << l;
    }
    return ready;
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline status
basic_priority_scheduler<Policy, Port, Clock, FineClock>::post_slice(request& r, std::size_t level,
                                                                     bool small) noexcept {
    // RDMA writes and reads go in slices; a send is one message, whole.
    const bool sliced = r.wr.opcode == IBV_WR_RDMA_WRITE ||
                        r.wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM ||
                        r.wr.opcode == IBV_WR_RDMA_READ;
    const std::uint64_t left = r.length - r.posted;
    const auto len = static_cast<std::uint32_t>(sliced ? std::min(left, slice_cut(small)) : left);
    const bool last = r.posted + len == r.length;
    const bool read = r.wr.opcode == IBV_WR_RDMA_READ;
    const slice_request s = next_slice_of(r, len, last, read);
    if (const status st = port_.stage(s); st != status::ok)
        return st;
    // A sample reads the fine clock four times: a system call each where
    // the clocksource has no vDSO (the HPET of a qemu TCG guest, where the
    // samples of an RPC link's messages cost 0.8 of a system call per 64 B
    // echo). What the budget holds back is bulk (a request of more than a
    // small slice), so bulk sizes it: the probe after a quiet spell and
    // every slice of a probe's bytes or more are timed, one at a time, as
    // before. Smaller ones, which the budget never holds, are not.
    if (adaptive() && s.signaled && !sampling_ && len >= probe_bytes)
        start_sample(len);
    note_staged(r, level, len, read, s.signaled, small && sliced);
    return status::ok;
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline std::uint64_t
basic_priority_scheduler<Policy, Port, Clock, FineClock>::slice_cut(bool small) const noexcept {
    // A large slice fills what is left of the budget, and no more: posted
    // whole past it, the first urgent request after a quiet spell would
    // wait for all of it (1 MiB: 84 us at 100 Gb/s) instead of the budget.
    const std::uint64_t room = budget_ > in_flight_bytes_ ? budget_ - in_flight_bytes_ : 0;
    const std::uint64_t cut =
        small ? small_slice_
              : std::min<std::uint64_t>(opts_.large_slice,
                                        std::max<std::uint64_t>(room, small_slice_));
    // With a measured budget, the first slice after a quiet spell is a
    // short probe: nothing is ahead of it, so its latency is the base
    // latency, with little of its own bytes' time in it.
    if (adaptive() && in_flight_bytes_ == 0)
        return std::min(cut, probe_bytes);
    // With a measured budget, a quarter of it at most: a slice's bytes
    // count in flight until its last one is acknowledged, so a budget held
    // by two large slices has the link idle while each one's completion
    // comes back and the next is posted (a host that serves several links
    // finds that much room at each visit), and the rate it measures then
    // shrinks the budget further. An eighth while the host is away on other
    // rails: room comes back at its visits, and in a quarter's steps the
    // NIC model's links dipped to 0.87-0.91 for 100 us at a time.
    return adaptive() ? std::min<std::uint64_t>(
                            cut, std::max(budget_ / (host_away_ns_ > 0 ? 8 : 4), small_slice_))
                      : cut;
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline slice_request basic_priority_scheduler<Policy, Port, Clock, FineClock>::next_slice_of(
    const request& r, std::uint32_t len, bool last, bool read) const noexcept {
    // The request's template, moved on by what is posted; the immediate,
    // the solicited bit and WITH_IMM go with the last slice only, the
    // fence with the first.
    slice_request s = r.wr;
    s.id = next_slice_;
    s.local = r.wr.local + r.posted;
    s.length = len;
    s.remote_addr = r.wr.remote_addr + r.posted;
    s.has_imm = last && r.wr.has_imm;
    s.solicited = last && r.wr.solicited;
    if (s.opcode == IBV_WR_RDMA_WRITE_WITH_IMM && !last)
        s.opcode = IBV_WR_RDMA_WRITE;
    s.fence = r.first_fenced && r.posted == 0;
    // Signal the last slice, and any slice after which the budget could
    // run dry before a signaled completion came back.
    const std::uint64_t bytes_after = in_flight_bytes_ + len;
    // With a measured budget, every slice: its completion frees its bytes
    // as soon as it can, and the budget, sized to the product, has no
    // room for bytes that completed but are not known to.
    s.signaled = last || adaptive() || bytes_after >= budget_ ||
                 in_flight_wqes_ + 1 >= opts_.budget_wqes ||
                 unsignaled_bytes_ + len >= budget_ / 2 ||
                 (read && reads_in_flight_ + 1 >= port_.max_rd_atomic());
    return s;
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline void
basic_priority_scheduler<Policy, Port, Clock, FineClock>::start_sample(std::uint32_t len) noexcept {
    // One sample at a time: this slice's time to completion, and the
    // bytes that complete with it (everything in flight before it).
    // Called before note_staged: next_slice_ is still this slice's id and
    // in_flight_bytes_ does not count it yet.
    sampling_ = true;
    sample_id_ = next_slice_;
    sample_ahead_ = in_flight_bytes_;
    sample_len_ = len;
    sample_rung_ = false;
    sample_start_ = fine_clock::now();
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline void basic_priority_scheduler<Policy, Port, Clock, FineClock>::note_staged(
    request& r, std::size_t level, std::uint32_t len, bool read, bool signaled,
    bool small_slice) noexcept {
    // The port took the slice: it is in flight from here (the doorbell
    // may come later in this pass, and ring() takes it back if refused).
    ring_[next_slice_ % ring_.size()] = {&r, len, read};
    ++next_slice_;
    r.posted += len;
    ++r.in_flight;
    in_flight_bytes_ += len;
    ++in_flight_wqes_;
    reads_in_flight_ += read ? 1U : 0U;
    unsignaled_bytes_ = signaled ? 0 : unsignaled_bytes_ + len;
    counters_.in_flight_bytes = in_flight_bytes_;
    counters_.max_in_flight = std::max(counters_.max_in_flight, in_flight_bytes_);
    ++counters_.slices;
    counters_.small_slices += small_slice ? 1U : 0U;
    counters_.signaled += signaled ? 1U : 0U;
    counters_.bytes += len;
    policy_.charge(level, len);
    if (r.posted == r.length) {
        // Posted whole: it leaves its level's queue, and finishes when
        // its last slice in flight completes (finish_if_done).
        queues_[level].pop_front();
        r.queued = false;
        if (queues_[level].empty())
            policy_.idle(level);
    }
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline bool
basic_priority_scheduler<Policy, Port, Clock, FineClock>::ring(std::uint64_t first) noexcept {
    ++counters_.doorbells;
    // The doorbell that carries a sample is timed too: what posting
    // costs the host per slice (on a NIC a memory write, on soft-RoCE the
    // slices' transmission).
    const bool timed = sampling_ && !sample_rung_ && sample_id_ >= first;
    const auto before = timed ? fine_clock::now() : typename fine_clock::time_point{};
    const status st = port_.post();
    if (timed) {
        sample_rung_ = true;
        const auto ns =
            std::chrono::duration_cast<std::chrono::nanoseconds>(fine_clock::now() - before)
                .count();
        const double per_slice = static_cast<double>(ns) / static_cast<double>(next_slice_ - first);
        post_ns_ = post_ns_ == 0 ? per_slice : (7 * post_ns_ + per_slice) / 8;
        counters_.post_ns = static_cast<std::uint64_t>(post_ns_);
    }
    if (st == status::ok)
        return true;
    // The slices the device did not take would never complete: take
    // them back, newest first, as failed. Those it took complete flushed,
    // because the queue pair is moved to the error state: nothing waits
    // for a completion that cannot come.
    // A queue pair that had failed already refuses the whole chain: its
    // slices are as flushed; any other refusal is the post's own error.
    const std::uint64_t refused_from = first + port_.accepted();
    const ibv_wc_status why = st == status::qp_failed ? IBV_WC_WR_FLUSH_ERR : IBV_WC_LOC_QP_OP_ERR;
    while (next_slice_ > refused_from) {
        --next_slice_;
        release_slice(next_slice_, why);
    }
    port_.fail();
    fail_all(IBV_WC_WR_FLUSH_ERR);
    return false;
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline bool basic_priority_scheduler<Policy, Port, Clock, FineClock>::any_queued() const noexcept {
    for (const auto& q : queues_)
        if (!q.empty())
            return true;
    return false;
}

// The measured budget (budget_bytes 0): the bandwidth-delay product and
// one small slice. A sample is a signaled slice of probe_bytes or more,
// one at a time: the time from its posting to its completion being
// reaped. The bytes completed between the previous sample's completion
// and this one's, over the time between them, are the rate the link
// delivered; the largest of the last
// eight estimates the link's rate (as BBR's bottleneck bandwidth,
// Cardwell et al., 2016). A slice posted with nothing in flight (a 1 KiB
// probe) gives the base latency; the smallest is kept (as BBR's
// round-trip propagation time). While the budget is below the product,
// the rate measured is about the budget over the base latency, and the
// slack of one slice lets the budget grow until the link is full.
// With host_away(), at least what the link sends while the host is away.
template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline void basic_priority_scheduler<Policy, Port, Clock, FineClock>::measure(
    typename fine_clock::duration elapsed) noexcept {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count();
    const auto since =
        std::chrono::duration_cast<std::chrono::nanoseconds>(sample_start_ + elapsed - last_end_)
            .count();
    last_end_ = sample_start_ + elapsed;
    const std::uint64_t delivered = delivered_ - delivered_at_last_end_;
    delivered_at_last_end_ = delivered_;
    if (ns <= 0)
        return;
    // Bytes over the time between two completions (the previous sample's
    // and this one's): never above the link's rate, unlike bytes over the
    // time since posting, which counts bytes sent before it began.
    const double rate = sampled_before_ && since > 0
                            ? static_cast<double>(delivered) / static_cast<double>(since)
                            : static_cast<double>(sample_ahead_ + sample_len_) /
                                  static_cast<double>(ns); // bytes per ns
    sampled_before_ = true;
    rates_[rate_next_++ % rates_.size()] = rate;
    const double best_rate = *std::max_element(rates_.begin(), rates_.end());
    if (sample_ahead_ == 0 && (base_ns_ == 0 || static_cast<double>(ns) < base_ns_))
        base_ns_ = static_cast<double>(ns);
    counters_.rate_mb_per_s = static_cast<std::uint64_t>(best_rate * 1000.0);
    counters_.base_latency_ns = static_cast<std::uint64_t>(base_ns_);
    ++counters_.budget_samples;
    if (base_ns_ == 0)
        return;
    size_budget(best_rate);
}

// The budget and the small slice from the link's rate (bytes per ns) and
// the base latency measured.
template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline void
basic_priority_scheduler<Policy, Port, Clock, FineClock>::size_budget(double best_rate) noexcept {
    // The product, and one small slice: what is ahead of an urgent
    // request then drains while its own doorbell and fetches are under
    // way, and the slack lets the budget grow while it is below the
    // product (the rate measured is then the budget over the latency).
    const auto product = static_cast<std::uint64_t>(best_rate * base_ns_);
    // Plus what the link sends while the host is away (host_away()): a
    // host that comes back finds that much done, and must find the link
    // still busy. Without it, one thread driving several links measures its
    // own slowness as their rate, and the budget shrinks with it. At most
    // the base latency's worth: a round timed long once, or a host that
    // posts slowly because the budget is large, must not grow it without
    // bound. On top of the small slice, not the larger of the two: the rate
    // measured is then the budget over the latency plus the time away, and
    // the away term alone gives back the budget it was measured with,
    // wherever that is (bulk alone over two 400 Gb/s rails driven by one
    // thread stayed at 0.77 of the links in the NIC model). So an urgent
    // request waits for one small slice more on a host that drives several
    // rails; a striper's urgent lane waits for neither. One rail: no away.
    const auto away = static_cast<std::uint64_t>(best_rate * std::min(host_away_ns_, base_ns_));
    budget_ =
        std::clamp<std::uint64_t>(product + small_slice_ + away, adaptive_floor, adaptive_ceiling);
    // Small slices an eighth of the budget, at most the option's and at
    // least 4 KiB: an urgent request waits for about one slice more than
    // the product, and every slice costs the host and the device
    // something (soft-RoCE from Linux 6.12, which sends from a work
    // queue, gave its stream 0.63 of plain with 1 KiB slices).
    // But at least what the link sends while the host posts four slices:
    // where a doorbell is dear (soft-RoCE: a system call that sends what
    // it carries), small slices would leave the link idle.
    const auto posting = static_cast<std::uint64_t>(best_rate * post_ns_ * 4);
    small_slice_ = std::clamp<std::uint64_t>(
        std::max(budget_ / 8, posting), std::min<std::uint64_t>(slice_floor, opts_.small_slice),
        opts_.small_slice);
    counters_.budget_bytes = budget_;
    counters_.small_slice = small_slice_;
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline void basic_priority_scheduler<Policy, Port, Clock, FineClock>::reap() noexcept {
    verbs::completion wcs[32];
    for (;;) {
        const int n = port_.poll(wcs);
        if (n <= 0)
            break;
        for (int i = 0; i < n; ++i) {
            const verbs::completion& c = wcs[i];
            // Not a slice in flight (a request someone else posted on the
            // queue pair, such as a handle issuer's bind): not ours to retire.
            if (c.wr_id < tail_slice_ || c.wr_id >= next_slice_) {
                ++counters_.foreign_completions;
                if (foreign_sink_ != nullptr)
                    foreign_sink_(foreign_ctx_, c);
                // One in error failed the queue pair all the same: the
                // slices in flight complete flushed, nothing more goes.
                if (!c.ok()) {
                    if (failure_ == IBV_WC_SUCCESS || failure_ == IBV_WC_WR_FLUSH_ERR)
                        failure_ = c.status;
                    broken_ = true;
                }
                continue;
            }
            // In order: one completion retires every slice up to it.
            while (tail_slice_ < c.wr_id)
                retire_oldest(IBV_WC_SUCCESS);
            retire_oldest(c.status);
        }
        if (n < static_cast<int>(std::size(wcs)))
            break;
    }
    if (broken_)
        fail_all(IBV_WC_WR_FLUSH_ERR);
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline void
basic_priority_scheduler<Policy, Port, Clock, FineClock>::release_slice(std::uint64_t id,
                                                                        ibv_wc_status st) noexcept {
    in_flight_slice& s = ring_[id % ring_.size()];
    request& r = *s.req;
    in_flight_bytes_ -= s.bytes;
    delivered_ += s.bytes;
    if (sampling_ && id == sample_id_) {
        sampling_ = false;
        if (st == IBV_WC_SUCCESS)
            measure(fine_clock::now() - sample_start_);
    }
    --in_flight_wqes_;
    reads_in_flight_ -= s.read ? 1U : 0U;
    counters_.in_flight_bytes = in_flight_bytes_;
    if (in_flight_wqes_ == 0)
        unsignaled_bytes_ = 0;
    --r.in_flight;
    if (st != IBV_WC_SUCCESS) {
        // An RC queue pair goes to the error state at its first failure;
        // everything after it is flushed.
        if (r.result == IBV_WC_SUCCESS)
            r.result = st;
        if (failure_ == IBV_WC_SUCCESS || failure_ == IBV_WC_WR_FLUSH_ERR)
            failure_ = st;
        broken_ = true;
    }
    finish_if_done(r);
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline void
basic_priority_scheduler<Policy, Port, Clock, FineClock>::finish_if_done(request& r) noexcept {
    if (r.in_flight != 0)
        return;
    if (r.result == IBV_WC_SUCCESS && (r.queued || r.posted != r.length))
        return;
    if (r.queued) {
        // A request fails while queued only as the oldest of its level
        // (the only one with slices posted) or from fail_all(), which
        // takes them from the front too.
        queue& q = queues_[r.level];
        if (&q.front() == &r)
            q.pop_front();
        else
            q.remove_if([&](const request& x) { return &x == &r; });
        r.queued = false;
        if (queues_[r.level].empty())
            policy_.idle(r.level);
    }
    --live_[r.level];
    --live_total_;
    last_active_[r.level] = clock::now();
    if (r.result == IBV_WC_SUCCESS)
        ++counters_.completed;
    else
        ++counters_.failed;
    if (r.report || r.result != IBV_WC_SUCCESS) {
        done_.push_back(r);
    } else {
        free_.push_front(r);
        ++free_count_;
    }
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline void basic_priority_scheduler<Policy, Port, Clock, FineClock>::port_failed() noexcept {
    if (failure_ == IBV_WC_SUCCESS)
        failure_ = IBV_WC_WR_FLUSH_ERR;
    fail_all(IBV_WC_WR_FLUSH_ERR);
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline void
basic_priority_scheduler<Policy, Port, Clock, FineClock>::fail_all(ibv_wc_status st) noexcept {
    broken_ = true;
    for (std::size_t l = 0; l < priority_levels; ++l) {
        queue& q = queues_[l];
        while (!q.empty()) {
            request& r = q.front();
            if (r.result == IBV_WC_SUCCESS)
                r.result = st;
            if (r.in_flight != 0) {
                // Its posted slices still complete (flushed): it finishes then.
                q.pop_front();
                r.queued = false;
                continue;
            }
            finish_if_done(r);
        }
        policy_.idle(l);
    }
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline int basic_priority_scheduler<Policy, Port, Clock, FineClock>::deliver(
    std::span<verbs::completion> out) noexcept {
    int k = 0;
    while (!done_.empty() && static_cast<std::size_t>(k) < out.size()) {
        request& r = done_.front();
        done_.pop_front();
        verbs::completion c;
        c.wr_id = r.wr_id;
        c.status = r.result;
        c.opcode = opcode_of(r.wr.opcode);
        c.byte_len = static_cast<std::uint32_t>(r.length);
        out[static_cast<std::size_t>(k++)] = c;
        free_.push_front(r);
        ++free_count_;
    }
    return k;
}

template <SchedulingPolicy Policy, SendPort Port, class Clock, class FineClock>
inline ibv_wc_opcode
basic_priority_scheduler<Policy, Port, Clock, FineClock>::opcode_of(ibv_wr_opcode op) noexcept {
    switch (op) {
    case IBV_WR_RDMA_READ: return IBV_WC_RDMA_READ;
    case IBV_WR_SEND:
    case IBV_WR_SEND_WITH_IMM: return IBV_WC_SEND;
    default: return IBV_WC_RDMA_WRITE;
    }
}

} // namespace rdmax::sched
