#pragma once
// The bodies of nic_port's and nic's members (nic_model.hpp holds the model's
// parameters, what it models and its API). Included at the end of
// nic_model.hpp; including it alone includes that first.

#include <rdmax/sched/sim/nic_model.hpp>

namespace rdmax::sched::sim {

inline status nic_port::stage(const slice_request& s) noexcept {
    auto& q = nic_->sqs_[qp_];
    if (q.failed)
        return status::qp_failed;
    if (q.wqes.size() + q.chain.size() >= nic_->p_.sq_depth)
        return status::queue_full;
    virtual_clock::ps += nic_->p_.host_wqe;
    q.chain.push_back(s);
    return status::ok;
}

inline status nic_port::post() noexcept {
    auto& q = nic_->sqs_[qp_];
    virtual_clock::ps += nic_->p_.host_doorbell;
    nic_->catch_up();
    ++nic_->doorbells;
    const nic_params& p = nic_->p_;
    const picoseconds ready =
        virtual_clock::ps + p.doorbell_latency + p.wqe_fetch_latency + p.dma_read_latency;
    for (const auto& s : q.chain) {
        q.wqes.push_back({s, ready, 0, false});
        ++nic_->wqes;
    }
    accepted_ = static_cast<std::uint32_t>(q.chain.size());
    q.chain.clear();
    return status::ok;
}

inline void nic_port::fail() noexcept {
    nic_->catch_up();
    auto& q = nic_->sqs_[qp_];
    q.failed = true;
    // Requests whose acknowledgement has not come back by now are flushed
    // too: the queue pair in the error state completes them so, whatever
    // the responder saw.
    for (auto& c : q.cqes)
        if (c.visible > virtual_clock::ps) {
            c.c.status = IBV_WC_WR_FLUSH_ERR;
            c.visible = virtual_clock::ps;
        }
    for (const auto& w : q.wqes) {
        verbs::completion c;
        c.wr_id = w.s.id;
        c.status = IBV_WC_WR_FLUSH_ERR;
        q.cqes.push_back({c, virtual_clock::ps});
    }
    q.wqes.clear();
    nic_->recompute_earliest();
}

inline int nic_port::poll(std::span<verbs::completion> out) noexcept {
    nic_->catch_up();
    auto& q = nic_->sqs_[qp_];
    const nic_params& p = nic_->p_;
    virtual_clock::ps += p.host_poll;
    int k = 0;
    while (!q.cqes.empty() && q.cqes.front().visible <= virtual_clock::ps &&
           static_cast<std::size_t>(k) < out.size()) {
        out[static_cast<std::size_t>(k++)] = q.cqes.front().c;
        q.cqes.pop_front();
        virtual_clock::ps += p.host_cqe;
    }
    if (k != 0)
        nic_->recompute_earliest();
    return k;
}

inline std::uint32_t nic_port::slots_free() const noexcept {
    const auto& q = nic_->sqs_[qp_];
    return nic_->p_.sq_depth - static_cast<std::uint32_t>(q.wqes.size() + q.chain.size());
}

inline std::uint32_t nic_port::max_message() const noexcept {
    return nic_->p_.max_message;
}

inline bool nic_port::ready() const noexcept {
    return !nic_->sqs_[qp_].failed;
}

inline std::uint32_t nic::pick(picoseconds start) noexcept {
    const auto n = static_cast<std::uint32_t>(sqs_.size());
    const auto eligible = [&](std::uint32_t i) {
        return !sqs_[i].wqes.empty() && sqs_[i].wqes.front().ready <= start;
    };
    // Per work request: the one under way finishes first.
    if (p_.arbiter == arbitration::per_wqe && eligible(last_) && sqs_[last_].wqes.front().started)
        return last_;
    for (std::uint32_t k = 1; k <= n; ++k) {
        const std::uint32_t i = (last_ + k) % n;
        if (eligible(i))
            return i;
    }
    return last_; // unreachable: start is some queue's ready time or later
}

inline void nic::send_packet(std::uint32_t qp, picoseconds start) noexcept {
    send_queue& q = sqs_[qp];
    wqe& w = q.wqes.front();
    picoseconds t = start;
    if (qp != last_ && sqs_.size() > 1) {
        t += p_.qp_switch;
        ++qp_switches;
    }
    last_ = qp;
    std::uint64_t wire = p_.header_bytes;
    if (!w.started) {
        t += p_.nic_wqe;
        wire += p_.reth_bytes;
        w.started = true;
    }
    const std::uint64_t payload = std::min<std::uint64_t>(p_.mtu, w.s.length - w.sent);
    wire += payload;
    const picoseconds end = t + p_.wire(wire);
    wire_free_ = end;
    // The receiver.
    ++rx.packets;
    rx.bytes += payload;
    rx.wire_bytes += wire;
    rx.last_arrival = end;
    if (end > rx.window_start && end <= rx.window_end)
        rx.window_bytes[w.s.remote_addr >= rx.split_addr ? 1 : 0] += payload;
    if (rx.bins != nullptr && rx.bin_ps > 0 && w.s.remote_addr < rx.split_addr) {
        const auto bin = static_cast<std::size_t>(end / rx.bin_ps);
        if (bin < rx.bins->size())
            (*rx.bins)[bin] += payload;
    }
    w.sent += payload;
    if (w.sent < w.s.length)
        return;
    ++rx.messages;
    if (w.s.signaled) {
        verbs::completion c;
        c.wr_id = w.s.id;
        c.status = IBV_WC_SUCCESS;
        const picoseconds visible = end + p_.rtt + p_.cqe_latency;
        q.cqes.push_back({c, visible});
        earliest_cqe_ = std::min(earliest_cqe_, visible);
    }
    q.wqes.pop_front();
}

} // namespace rdmax::sched::sim
