#include <algorithm>

#include <rdmax/rpc/peer_link.hpp>

rdmax::detail::peer_link_hooks& rdmax::detail::peer_link_test_hooks() noexcept {
    static peer_link_hooks hooks;
    return hooks;
}

namespace rdmax::rpc {

namespace {
// Work request ids of the windows' own requests (posted beside the
// scheduler, whose slice ids never reach these): a bind or an unsignaled
// invalidation, and a fence's signaled one (its low bits: the fence's first window).
constexpr std::uint64_t window_op_tag = std::uint64_t{0x5257} << 48;
constexpr std::uint64_t fence_tag = std::uint64_t{0x5246} << 48;

ibv_mw* alloc_window(ibv_pd* pd) noexcept {
    if (auto* hook = rdmax::detail::peer_link_test_hooks().alloc_mw)
        return hook(pd, IBV_MW_TYPE_2);
    return ibv_alloc_mw(pd, IBV_MW_TYPE_2);
}
} // namespace

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
            w.mw = alloc_window(pd);
            if (w.mw == nullptr)
                break;
        }
        if (!ws.empty() && ws.back().mw != nullptr) {
            fenced_.reserve(slots()); // one fence per slot at most: none allocates
            windows_ = std::move(ws);
            sched_->on_foreign(&peer_link::on_window_completion, this);
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
        if (windows_[x.window].bound)
            return false; // its invalidation is owed: not bound again before it is posted
    }
    // Posted ahead of the request that names the keys: a send queue runs in
    // order, so the windows are bound before the peer can learn of them.
    verbs::send_batch b = conn_->qp().batch();
    for (exposure& x : e) {
        const window& win = windows_[x.window];
        x.rkey = ibv_inc_rkey(win.mw->rkey);
        if (b.bind_mw(win.mw, x.rkey, static_cast<ibv_mr*>(x.mr), x.addr, x.len, x.r,
                      window_op_tag | window_ops_++,
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

bool peer_link::stage_invalidations(verbs::send_batch& b, std::uint32_t first,
                                    std::uint32_t count) noexcept {
    for (std::uint32_t w = first; w < first + count && w < windows_.size(); ++w) {
        if (!windows_[w].bound)
            continue;
        if (auto* refuse = rdmax::detail::peer_link_test_hooks().refuse_invalidate;
            refuse && refuse())
            return false;
        if (b.local_invalidate(windows_[w].mw->rkey, window_op_tag | window_ops_++,
                               verbs::send_flags{.signaled = false}) != status::ok)
            return false;
    }
    return true;
}

void peer_link::revoke(std::uint32_t first, std::uint32_t count) noexcept {
    bool ok = false;
    {
        verbs::send_batch b = conn_->qp().batch();
        ok = stage_invalidations(b, first, count) && b.post() == status::ok;
    }
    for (std::uint32_t w = first; w < first + count && w < windows_.size(); ++w) {
        window& win = windows_[w];
        if (!win.bound)
            continue;
        if (ok) {
            win.bound = false;
            if (win.owed) { // what was owed went now: never again later, on a new binding
                win.owed = false;
                --owed_;
            }
        } else if (!win.owed) {
            // The queue pair could not take the invalidation. Deallocating
            // the window would revoke its key at once, but its bind may
            // still be queued in the send queue, and a bind of a window that
            // is gone fails the queue pair: the invalidation waits for room
            // (settle()), and the window is not bound again before.
            win.owed = true;
            ++owed_;
        }
    }
}

void peer_link::settle() noexcept {
    if (broken)
        return;
    for (std::uint32_t w = 0; w < windows_.size() && owed_ != 0; ++w) {
        window& win = windows_[w];
        if (!win.owed)
            continue;
        {
            verbs::send_batch b = conn_->qp().batch();
            if (!stage_invalidations(b, w, 1) || b.post() != status::ok)
                return; // no room yet
        }
        win.owed = false;
        win.bound = false;
        --owed_;
    }
}

bool peer_link::settled(std::uint32_t first, std::uint32_t count) noexcept {
    if (owed_ != 0)
        settle();
    for (std::uint32_t w = first; w < first + count && w < windows_.size(); ++w)
        if (windows_[w].owed)
            return false;
    return true;
}

bool peer_link::fence(std::uint32_t first, std::uint32_t count) noexcept {
    if (windows_.empty() || broken || first >= windows_.size() || windows_[first].fencing)
        return false;
    std::uint32_t last = UINT32_MAX;
    for (std::uint32_t w = first; w < first + count && w < windows_.size(); ++w)
        if (windows_[w].bound)
            last = w;
    if (last == UINT32_MAX)
        return false;
    {
        // In order on the send queue: the last one's completion says every
        // one of them ran (an earlier one that failed completes in error).
        verbs::send_batch b = conn_->qp().batch();
        for (std::uint32_t w = first; w <= last; ++w) {
            if (!windows_[w].bound)
                continue;
            const bool signaled = w == last;
            const std::uint64_t id = signaled ? fence_tag | first : window_op_tag | window_ops_++;
            if (b.local_invalidate(windows_[w].mw->rkey, id,
                                   verbs::send_flags{.signaled = signaled}) != status::ok)
                return false; // nothing posted: the batch gives its slots back
        }
        // Not taken (a failed queue pair): the caller deallocates them, which
        // is safe here, the call's binds having run before its request.
        if (b.post() != status::ok)
            return false;
    }
    for (std::uint32_t w = first; w <= last; ++w)
        windows_[w].bound = false;
    windows_[first].fencing = true;
    ++fences_;
    return true;
}

std::size_t peer_link::take_fenced(std::span<std::uint32_t> out) noexcept {
    const std::size_t n = std::min(out.size(), fenced_.size());
    std::copy_n(fenced_.begin(), n, out.begin());
    fenced_.erase(fenced_.begin(), fenced_.begin() + static_cast<std::ptrdiff_t>(n));
    return n;
}

void peer_link::on_window_completion(void* self, const verbs::completion& c) noexcept {
    peer_link& l = *static_cast<peer_link*>(self);
    if ((c.wr_id & ~((std::uint64_t{1} << 48) - 1)) != fence_tag)
        return;
    const auto first = static_cast<std::uint32_t>(c.wr_id & 0xffffffffU);
    if (!l.windows_.empty()) {
        if (first >= l.windows_.size() || !l.windows_[first].fencing)
            return; // its windows were deallocated since: that fenced them
        l.windows_[first].fencing = false;
        --l.fences_;
    }
    // (No windows left: they were all deallocated, the invalidation ran all
    // the same; the endpoint checks that the slot still waits for it.)
    // One that failed is not named: the queue pair failed with it, and the
    // endpoint deallocates the windows of every call still fencing.
    if (c.ok())
        l.fenced_.push_back(first); // reserved for every slot: no allocation
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
    if (win.fencing) {
        win.fencing = false; // its completion, if it comes, names nothing
        --fences_;
    }
    if (win.owed) {
        win.owed = false; // deallocated: nothing left to invalidate
        --owed_;
    }
    win.mw = alloc_window(pd);
    if (win.mw == nullptr) {
        // No window to take its place: none of this link's windows is used
        // any more (their keys die with the link).
        for (window& o : windows_)
            if (o.mw != nullptr)
                ibv_dealloc_mw(o.mw);
        windows_.clear();
        fences_ = 0;
        owed_ = 0;
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
    // A fence's completion hands a result out: it must wake the endpoint too.
    if (sched_ && (sched_->queued() || fences_ != 0))
        (void)ibv_req_notify_cq(conn_->qp().send_cq().get(), 0);
    return true;
}

verbs::qp_config link_qp_config(inbox& in, std::uint16_t slots, const verbs::device_limits& limits,
                                bool windows) {
    verbs::qp_config cfg;
    // Each call posts one or two requests through the scheduler, which keeps
    // at most half the queue in flight.
    std::uint32_t depth = std::clamp<std::uint32_t>(4U * slots, 64, 1024);
    // Beside it, a call with windows posts 2 binds ahead of its request and,
    // once answered, 2 invalidations: all of them in the queue at once for
    // every slot at worst (unsignaled, they are known done only at a later
    // signaled completion). Without that room, a burst of calls would find
    // the send queue full while it still has free slots (no_credit).
    if (windows)
        depth += 4U * slots;
    cfg.send_depth = std::max<std::uint32_t>(
        1, std::min({depth, limits.max_qp_wr, limits.max_cqe != 0 ? limits.max_cqe : depth}));
    cfg.max_send_sge = 2;
    cfg.max_recv_sge = 1;
    cfg.max_inline = 256;
    cfg.recv_cq = &in.cq();
    cfg.srq = &in.srq();
    cfg.send_channel = &in.channel();
    return cfg;
}

} // namespace rdmax::rpc
