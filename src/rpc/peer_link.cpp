#include <algorithm>

#include <rdmax/rpc/peer_link.hpp>

namespace rdmax::rpc {

peer_link::peer_link(registered_arena& arena, handle_issuer& issuer, std::uint16_t slots,
                     std::uint32_t slot_bytes)
    : link_wire(slots, slot_bytes)
    , issuer_(&issuer)
    , ring_(arena, std::size_t{slots} * slot_bytes)
    , staging_(arena, std::size_t{slots} * slot_bytes)
    , key_(issuer.issue(ring_.data(), ring_.size(), rights::remote_write)) {
    // A slot read before the peer wrote it holds zeros, not old bytes.
    std::fill_n(ring_.data(), ring_.size(), std::byte{0});
}

peer_link::~peer_link() {
    sched_.reset();
    // A window holds on to its queue pair; deallocating one revokes it.
    for (window& w : windows_)
        if (w.mw != nullptr)
            ibv_dealloc_mw(w.mw);
    conn_.reset();
    issuer_->revoke(key_);
}

ring_offer peer_link::offer() const noexcept {
    ring_offer o;
    o.slots = slots();
    o.slot_bytes = slot_bytes();
    o.rkey = key_.rkey;
    o.addr = key_.addr;
    return o;
}

void peer_link::attach(verbs::connection conn, const ring_offer& peer,
                       const sched::scheduler_options& opts) {
    // The geometry granted (the server's, at most what was asked for) addresses both rings.
    grant(std::min(slots(), peer.slots), std::min(slot_bytes(), peer.slot_bytes));
    peer_ring_ = {peer.addr, std::uint64_t{slots()} * slot_bytes(), peer.rkey, 0};
    conn_.emplace(std::move(conn));
    qp_num_ = conn_->qp().qp_num();
    qp_ = &conn_->qp();
    sched_.emplace(conn_->qp(), opts);
}

bool peer_link::enable_windows() noexcept {
    // Windows for the calls' large bodies and reply buffers, where the device
    // has type 2: the peer then sees a call's bytes only, and only until the
    // call ends. Without them, the registrations' own keys (docs/rpc.md).
    if (!conn_ || !windows_.empty())
        return !windows_.empty();
    ibv_pd* pd = conn_->qp().get()->pd;
    try {
        std::vector<window> ws(std::size_t{slots()} * 2);
        for (window& w : ws) {
            w.mw = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
            if (w.mw == nullptr)
                break;
        }
        if (!ws.empty() && ws.back().mw != nullptr) {
            windows_ = std::move(ws);
        } else {
            for (window& w : ws)
                if (w.mw != nullptr)
                    ibv_dealloc_mw(w.mw);
        }
    } catch (...) {
        // No memory for the table: no windows.
    }
    return !windows_.empty();
}

bool peer_link::expose(std::span<exposure> e) noexcept {
    if (windows_.empty() || broken)
        return false;
    for (const exposure& x : e) {
        if (x.window >= windows_.size() || x.mr == nullptr)
            return false;
        if (windows_[x.window].bound)
            revoke(x.window, 1);
        if (windows_.empty())
            return false;
    }
    // Posted ahead of the request that names the keys: a send queue runs in
    // order, so the windows are bound before the peer can learn of them.
    verbs::send_batch b = conn_->qp().batch();
    for (exposure& x : e) {
        const window& win = windows_[x.window];
        x.rkey = ibv_inc_rkey(win.mw->rkey);
        if (b.bind_mw(win.mw, x.rkey, static_cast<ibv_mr*>(x.mr), x.addr, x.len, x.r,
                      (std::uint64_t{0x5257} << 48) | window_ops_++,
                      verbs::send_flags{.signaled = false}) != status::ok)
            return false; // nothing posted: the batch gives its slots back
    }
    if (b.post() != status::ok) {
        // Some may have been taken: deallocating settles each either way.
        for (const exposure& x : e)
            if (x.window < windows_.size())
                replace_window(x.window);
        return false;
    }
    for (const exposure& x : e) {
        windows_[x.window].mw->rkey = x.rkey; // the provider names the window by it next time
        windows_[x.window].bound = true;
    }
    return true;
}

void peer_link::revoke(std::uint32_t first, std::uint32_t count) noexcept {
    bool ok = true;
    {
        verbs::send_batch b = conn_->qp().batch();
        for (std::uint32_t w = first; w < first + count && w < windows_.size(); ++w) {
            if (!windows_[w].bound)
                continue;
            if (b.local_invalidate(windows_[w].mw->rkey,
                                   (std::uint64_t{0x5257} << 48) | window_ops_++,
                                   verbs::send_flags{.signaled = false}) != status::ok) {
                ok = false;
                break;
            }
        }
        ok = ok && b.post() == status::ok;
    }
    for (std::uint32_t w = first; w < first + count && w < windows_.size(); ++w) {
        if (!windows_[w].bound)
            continue;
        windows_[w].bound = false;
        // The queue pair could not take the invalidation (full, or failed):
        // deallocating the window revokes its key all the same.
        if (!ok)
            replace_window(w);
    }
}

void peer_link::revoke_now(std::uint32_t first, std::uint32_t count) noexcept {
    // Every window of the range, bound or not: one whose LOCAL_INV an
    // earlier revoke() posted may not have executed yet.
    for (std::uint32_t w = first; w < first + count && w < windows_.size(); ++w)
        replace_window(w);
}

void peer_link::replace_window(std::uint32_t w) noexcept {
    window& win = windows_[w];
    ibv_pd* pd = win.mw->pd;
    ibv_dealloc_mw(win.mw);
    win.bound = false;
    win.mw = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
    if (win.mw == nullptr) {
        // No window to take its place: none of this link's windows is used
        // any more (their keys die with the link).
        for (window& o : windows_)
            if (o.mw != nullptr)
                ibv_dealloc_mw(o.mw);
        windows_.clear();
    }
}

status peer_link::send_slot(message_kind k, std::uint32_t s, std::uint32_t bytes, sched::priority p,
                            bool epoch) noexcept {
    const std::uint64_t at = std::uint64_t{s} * slot_bytes();
    return sched_->write_imm(p, staging_.local(at, bytes), peer_ring_, at,
                             encode_imm(k, s, bytes, epoch), s,
                             sched::request_flags{.signaled = false});
}

transfer peer_link::read_body(sched::priority p, local_buffer<rights::local_write> dst,
                              const buffer_descriptor& src, std::uint64_t wr_id) noexcept {
    const remote_buffer<rights::remote_read> from{src.addr, src.length, src.rkey, 0};
    return sched_->read(p, dst, from, 0, wr_id) == status::ok ? transfer::started
                                                              : transfer::failed;
}

transfer peer_link::write_body(sched::priority p, local_buffer<rights::local_write> src,
                               const buffer_descriptor& dst, std::uint64_t wr_id) noexcept {
    const remote_buffer<rights::remote_write> to{dst.addr, dst.length, dst.rkey, 0};
    // Signaled: the header that follows at the same level tells the peer it
    // landed, but only the completion tells this side that its source may go.
    return sched_->write(p, src, to, 0, wr_id) == status::ok ? transfer::started : transfer::failed;
}

bool peer_link::prepare_sleep() noexcept {
    // Unsignaled replies complete quietly; only work waiting for room in the
    // budget needs the completion that makes room (one event, then re-armed
    // at the next sleep). On rxe, arming is a system call: only here.
    if (sched_ && sched_->queued())
        (void)ibv_req_notify_cq(conn_->qp().send_cq().get(), 0);
    return true;
}

verbs::qp_config link_qp_config(inbox& in, std::uint16_t slots) {
    verbs::qp_config cfg;
    // Each call posts one or two requests; the scheduler keeps at most half
    // the queue in flight.
    cfg.send_depth = std::clamp<std::uint32_t>(4U * slots, 64, 1024);
    cfg.max_send_sge = 2;
    cfg.max_recv_sge = 1;
    cfg.max_inline = 256;
    cfg.recv_cq = &in.cq();
    cfg.srq = &in.srq();
    cfg.send_channel = &in.channel();
    return cfg;
}

} // namespace rdmax::rpc
