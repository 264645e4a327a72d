// The windows of one queue pair of a client's link: bind, invalidate, fence,
// replace (include/rdmax/detail/rpc/window_set.hpp).

#include <utility>

#include <rdmax/detail/rpc/rdma_link.hpp>
#include <rdmax/detail/rpc/window_set.hpp>
#include <rdmax/verbs/send_batch.hpp>

namespace rdmax::rpc::detail {

namespace {
ibv_mw* alloc_window(ibv_pd* pd) noexcept {
    if (auto* hook = rdmax::detail::rdma_link_test_hooks().alloc_mw)
        return hook(pd, IBV_MW_TYPE_2);
    return ibv_alloc_mw(pd, IBV_MW_TYPE_2);
}
} // namespace

window_set::window_set(window_set&& o) noexcept
    : windows_(std::move(o.windows_))
    , qp_(std::exchange(o.qp_, nullptr))
    , rail_(o.rail_)
    , fences_(std::exchange(o.fences_, 0))
    , owed_(std::exchange(o.owed_, 0))
    , ops_(o.ops_) {
    o.windows_.clear();
}

window_set& window_set::operator=(window_set&& o) noexcept {
    if (this != &o) {
        release();
        windows_ = std::move(o.windows_);
        o.windows_.clear();
        qp_ = std::exchange(o.qp_, nullptr);
        rail_ = o.rail_;
        fences_ = std::exchange(o.fences_, 0);
        owed_ = std::exchange(o.owed_, 0);
        ops_ = o.ops_;
    }
    return *this;
}

bool window_set::allocate(ibv_pd* pd, std::size_t count, std::uint32_t rail) noexcept {
    release();
    rail_ = rail;
    try {
        std::vector<window> ws(count);
        for (window& w : ws) {
            w.mw = alloc_window(pd);
            if (w.mw == nullptr)
                break;
        }
        if (!ws.empty() && ws.back().mw != nullptr) {
            windows_ = std::move(ws);
            return true;
        }
        for (window& w : ws)
            if (w.mw != nullptr)
                ibv_dealloc_mw(w.mw);
    } catch (...) {
        // No memory for the table: no windows.
    }
    return false;
}

void window_set::release() noexcept {
    for (window& w : windows_)
        if (w.mw != nullptr)
            ibv_dealloc_mw(w.mw);
    windows_.clear();
    fences_ = 0;
    owed_ = 0;
}

bool window_set::expose(std::span<exposure> e, std::uint64_t signal) noexcept {
    if (windows_.empty() || qp_ == nullptr)
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
    verbs::send_batch b = qp_->batch();
    for (exposure& x : e) {
        const window& win = windows_[x.window];
        x.rkey = ibv_inc_rkey(win.mw->rkey);
        const bool signaled = signal != 0 && &x == &e.back();
        if (b.bind_mw(win.mw, x.rkey, static_cast<ibv_mr*>(x.mr), x.addr, x.len, x.r,
                      signaled ? signal : op_tag | ops_++,
                      verbs::send_flags{.signaled = signaled}) != status::ok)
            return false; // nothing posted: the batch gives its slots back
    }
    if (b.post() != status::ok) {
        // Some may have been taken: deallocating settles each either way.
        for (const exposure& x : e)
            if (x.window < windows_.size())
                replace(x.window);
        return false;
    }
    for (const exposure& x : e) {
        windows_[x.window].mw->rkey = x.rkey; // the provider names the window by it next time
        windows_[x.window].bound = true;
    }
    return true;
}

bool window_set::stage_invalidations(verbs::send_batch& b, std::uint32_t first,
                                     std::uint32_t count) noexcept {
    for (std::uint32_t w = first; w < first + count && w < windows_.size(); ++w) {
        if (!windows_[w].bound)
            continue;
        if (auto* refuse = rdmax::detail::rdma_link_test_hooks().refuse_invalidate;
            refuse && refuse())
            return false;
        if (b.local_invalidate(windows_[w].mw->rkey, op_tag | ops_++,
                               verbs::send_flags{.signaled = false}) != status::ok)
            return false;
    }
    return true;
}

void window_set::revoke(std::uint32_t first, std::uint32_t count) noexcept {
    bool ok = false;
    if (qp_ != nullptr) {
        verbs::send_batch b = qp_->batch();
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

void window_set::settle() noexcept {
    for (std::uint32_t w = 0; w < windows_.size() && owed_ != 0 && qp_ != nullptr; ++w) {
        window& win = windows_[w];
        if (!win.owed)
            continue;
        {
            verbs::send_batch b = qp_->batch();
            if (!stage_invalidations(b, w, 1) || b.post() != status::ok)
                return; // no room yet
        }
        win.owed = false;
        win.bound = false;
        --owed_;
    }
}

bool window_set::settled(std::uint32_t first, std::uint32_t count) noexcept {
    if (owed_ != 0)
        settle();
    for (std::uint32_t w = first; w < first + count && w < windows_.size(); ++w)
        if (windows_[w].owed)
            return false;
    return true;
}

bool window_set::fence(std::uint32_t first, std::uint32_t count) noexcept {
    if (windows_.empty() || qp_ == nullptr || first >= windows_.size() || windows_[first].fencing)
        return false;
    std::uint32_t last = UINT32_MAX;
    for (std::uint32_t w = first; w < first + count && w < windows_.size(); ++w)
        if (windows_[w].bound)
            last = w;
    if (last == UINT32_MAX)
        return false;
    if (auto* refuse = rdmax::detail::rdma_link_test_hooks().refuse_invalidate; refuse && refuse())
        return false; // as a full send queue would
    {
        // In order on the send queue: the last one's completion says every
        // one of them ran (an earlier one that failed completes in error).
        verbs::send_batch b = qp_->batch();
        for (std::uint32_t w = first; w <= last; ++w) {
            if (!windows_[w].bound)
                continue;
            const bool signaled = w == last;
            const std::uint64_t id =
                signaled ? fence_tag | (std::uint64_t{rail_} << 32) | first : op_tag | ops_++;
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

bool window_set::fence_done(std::uint32_t first) noexcept {
    if (first >= windows_.size() || !windows_[first].fencing)
        return false; // its windows were deallocated since: that fenced them
    windows_[first].fencing = false;
    --fences_;
    return true;
}

void window_set::replace(std::uint32_t w) noexcept {
    window& win = windows_[w];
    ibv_pd* pd = win.mw->pd;
    ibv_dealloc_mw(win.mw);
    win.mw = nullptr;
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
    if (win.mw == nullptr)
        release(); // no window to take its place: none of the set is used any more
}

void window_set::replace_range(std::uint32_t first, std::uint32_t count) noexcept {
    for (std::uint32_t w = first; w < first + count && w < windows_.size(); ++w)
        replace(w);
}

} // namespace rdmax::rpc::detail
