// The memory a client's call shows its server: registrations through the
// cache, and type-2 windows over exactly the call's bytes where the device
// has them, bound ahead of the request and revoked or fenced when it ends.

#include <algorithm>

#include <rdmax/detail/rpc/rdma_link.hpp>

#include "../notice.hpp"

rdmax::detail::rdma_link_hooks& rdmax::detail::rdma_link_test_hooks() noexcept {
    static rdma_link_hooks hooks;
    return hooks;
}

namespace rdmax::rpc::detail {

namespace {
// Work request ids of the windows' own requests (posted beside the
// scheduler, whose slice ids never reach these): a bind or an unsignaled
// invalidation, and a fence's signaled one (its low bits: the fence's first window).
constexpr std::uint64_t window_op_tag = std::uint64_t{0x5257} << 48;
constexpr std::uint64_t fence_tag = std::uint64_t{0x5246} << 48;

ibv_mw* alloc_window(ibv_pd* pd) noexcept {
    if (auto* hook = rdmax::detail::rdma_link_test_hooks().alloc_mw)
        return hook(pd, IBV_MW_TYPE_2);
    return ibv_alloc_mw(pd, IBV_MW_TYPE_2);
}
} // namespace

access rdma_link::grant_access(std::uint32_t slot, const call_ranges& r, buffer_descriptor& body,
                               buffer_descriptor& reply) noexcept {
    body = {};
    reply = {};
    // A registration in another protection domain is no use on this queue
    // pair: the peer's READ would fail the connection, not the call.
    for (const dmabuf_range* d : {r.dev_body, r.dev_reply})
        if (d != nullptr &&
            (d->cache == nullptr || !conn_ || d->cache->pd().get() != conn_->qp().get()->pd))
            return access::foreign;
    return grant_call(slot, r, body, reply);
}

access rdma_link::grant_call(std::uint32_t slot, const call_ranges& r, buffer_descriptor& body,
                             buffer_descriptor& reply) noexcept {
    body = {};
    reply = {};
    if (slot >= calls_.size())
        return access::no_room; // not a client's link
    call_access& a = calls_[slot];
    const bool windows = has_windows();
    // The previous call's windows: an invalidation the send queue had no
    // room for is still owed (the window stays bound, its registration held):
    // not bound again, nor the registration released, before it is posted.
    if (windows && (a.body || a.reply) && !settled(2 * slot, 2))
        return access::owed;
    a.release(); // the previous call's, kept until now (its windows are revoked)
    // Where the peer finds each in its key's space: a host buffer at its
    // address, a dma-buf range at its iova in the cache's space.
    if (r.dev_body != nullptr)
        body = {dmabuf_cache::iova(r.dev_body->buffer, r.dev_body->offset), 0, r.dev_body->length};
    else if (!r.body.empty())
        body = {reinterpret_cast<std::uint64_t>(r.body.data()), 0,
                static_cast<std::uint32_t>(r.body.size())};
    if (r.dev_reply != nullptr)
        reply = {dmabuf_cache::iova(r.dev_reply->buffer, r.dev_reply->offset), 0,
                 r.dev_reply->length};
    else if (!r.reply.empty())
        reply = {reinterpret_cast<std::uint64_t>(r.reply.data()), 0,
                 static_cast<std::uint32_t>(std::min<std::size_t>(r.reply.size(), UINT32_MAX))};
    if (body.length == 0 && reply.length == 0)
        return access::ok;
    if (!register_call(a, r, windows))
        return access::registration_failed;
    // dma-buf ranges by their registrations' keys (no window can be bound
    // over one: call_access); host memory through windows where there are.
    if (a.dev_body != nullptr)
        body.rkey = a.dev_body->rkey;
    if (a.dev_reply != nullptr)
        reply.rkey = a.dev_reply->rkey;
    if (!windows || (!a.body && !a.reply)) {
        if (a.body)
            body.rkey = a.body.rkey();
        if (a.reply)
            reply.rkey = a.reply.rkey();
        return access::ok;
    }
    return bind_call(slot, a, body, reply) ? access::ok : access::no_room;
}

bool rdma_link::register_call(call_access& a, const call_ranges& r, bool windows) noexcept {
    constexpr rights read_bind = rights::remote_read | rights::mw_bind;
    constexpr rights write_bind = rights::local_write | rights::remote_write | rights::mw_bind;
    try {
        if (!r.body.empty() || !r.reply.empty()) {
            verbs_cache& cache = memory_.cache(memory_.owner);
            if (!r.body.empty())
                a.body = windows ? cache.get<read_bind>(r.body.data(), r.body.size())
                                 : cache.get<rights::remote_read>(r.body.data(), r.body.size());
            if (!r.reply.empty())
                a.reply = windows ? cache.get<write_bind>(r.reply.data(), r.reply.size())
                                  : cache.get<rights::remote_write>(r.reply.data(), r.reply.size());
        }
        // A dma-buf range: exactly its bytes and rights, this call's alone
        // (call_access). A stale buffer token or a range outside the buffer
        // throws, as a refused registration does.
        if (const dmabuf_range* d = r.dev_body)
            a.dev_body =
                d->cache->register_exact(d->buffer, d->offset, d->length, rights::remote_read);
        if (const dmabuf_range* d = r.dev_reply)
            a.dev_reply = d->cache->register_exact(d->buffer, d->offset, d->length,
                                                   rights::local_write | rights::remote_write);
        return true;
    } catch (...) {
        // Memory the device cannot pin (or a registration limit): not a size.
        a.release();
        return false;
    }
}

bool rdma_link::bind_call(std::uint32_t slot, call_access& a, buffer_descriptor& body,
                          buffer_descriptor& reply) noexcept {
    exposure e[2];
    std::size_t n = 0;
    if (a.body)
        e[n++] = {2 * slot, a.body.registration(), body.addr, body.length, rights::remote_read};
    if (a.reply)
        e[n++] = {2 * slot + 1, a.reply.registration(), reply.addr, reply.length,
                  rights::remote_write};
    if (!expose(std::span(e, n))) {
        // The send queue is full (or failed): nothing goes out unfenced.
        a.release();
        windows_lost();
        return false;
    }
    a.windows = true;
    for (std::size_t i = 0; i < n; ++i)
        (e[i].window == 2 * slot ? body : reply).rkey = e[i].rkey;
    return true;
}

bool rdma_link::end_access(std::uint32_t slot, access_end how) noexcept {
    if (slot >= calls_.size())
        return how != access_end::fence; // not a client's link: nothing was shown
    ring_before_direct();
    call_access& a = calls_[slot];
    // Whichever way the call ended (answered, given up, never sent), its
    // dma-buf keys die before its result goes out: nothing is bound to them.
    a.drop_dmabufs();
    switch (how) {
    case access_end::fence:
        // A signaled invalidation; the result goes out once its completion
        // is in (the call's binds ran before its request, which was answered).
        if (!a.windows || broken || !fence(2 * slot, 2))
            return false;
        a.windows = false;
        a.fencing = true;
        ++fencing_calls_;
        return true;
    case access_end::lazy:
        if (!a.windows) {
            // Registrations' own keys (no windows): nothing to revoke; the
            // registration goes back to the cache.
            a.release();
            return true;
        }
        // Queued; the registrations are held until the slot's next call.
        a.windows = false;
        revoke(2 * slot, 2);
        return true;
    case access_end::now:
    case access_end::abandon:
        // The caller reuses its buffers as soon as it sees the result, so the
        // windows die before (an invalidation could wait behind a stalled
        // send queue); then the registrations can go at once.
        if (a.windows || a.fencing)
            revoke_now(2 * slot, 2);
        if (a.fencing)
            --fencing_calls_;
        a.windows = false;
        a.fencing = false;
        a.release();
        return true;
    }
    return true;
}

bool rdma_link::enable_windows() noexcept {
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
            sched_->on_foreign(&rdma_link::on_window_completion, this);
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

bool rdma_link::expose(std::span<exposure> e) noexcept {
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

bool rdma_link::stage_invalidations(verbs::send_batch& b, std::uint32_t first,
                                    std::uint32_t count) noexcept {
    for (std::uint32_t w = first; w < first + count && w < windows_.size(); ++w) {
        if (!windows_[w].bound)
            continue;
        if (auto* refuse = rdmax::detail::rdma_link_test_hooks().refuse_invalidate;
            refuse && refuse())
            return false;
        if (b.local_invalidate(windows_[w].mw->rkey, window_op_tag | window_ops_++,
                               verbs::send_flags{.signaled = false}) != status::ok)
            return false;
    }
    return true;
}

void rdma_link::revoke(std::uint32_t first, std::uint32_t count) noexcept {
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

void rdma_link::settle() noexcept {
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

bool rdma_link::settled(std::uint32_t first, std::uint32_t count) noexcept {
    if (owed_ != 0)
        settle();
    for (std::uint32_t w = first; w < first + count && w < windows_.size(); ++w)
        if (windows_[w].owed)
            return false;
    return true;
}

bool rdma_link::fence(std::uint32_t first, std::uint32_t count) noexcept {
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

int rdma_link::take_fenced(std::span<link_event> out) noexcept {
    int n = 0;
    const auto hand_out = [&](std::uint32_t slot) {
        call_access& a = calls_[slot];
        a.fencing = false;
        --fencing_calls_;
        // Its windows are dead: the registrations may go.
        a.release();
        out[static_cast<std::size_t>(n++)] = link_event::of_fenced(slot);
    };
    std::size_t taken = 0;
    for (; taken < fenced_.size() && static_cast<std::size_t>(n) < out.size(); ++taken) {
        const std::uint32_t slot = fenced_[taken] / 2;
        if (slot < calls_.size() && calls_[slot].fencing)
            hand_out(slot);
    }
    fenced_.erase(fenced_.begin(), fenced_.begin() + static_cast<std::ptrdiff_t>(taken));
    // Every window deallocated (none could be allocated in one's place):
    // each fence left is moot, and nothing would complete for it.
    if (windows_.empty())
        for (std::uint32_t s = 0;
             s < calls_.size() && fencing_calls_ != 0 && static_cast<std::size_t>(n) < out.size();
             ++s)
            if (calls_[s].fencing)
                hand_out(s);
    return n;
}

void rdma_link::on_window_completion(void* self, const verbs::completion& c) noexcept {
    rdma_link& l = *static_cast<rdma_link*>(self);
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

void rdma_link::revoke_now(std::uint32_t first, std::uint32_t count) noexcept {
    if (!windows_.empty() && memory_.counters != nullptr)
        memory_.counters->window_reallocs += count;
    // Every window of the range, bound or not: one whose LOCAL_INV an
    // earlier revoke() posted may not have executed yet.
    for (std::uint32_t w = first; w < first + count && w < windows_.size(); ++w)
        replace_window(w);
    windows_lost();
}

void rdma_link::windows_lost() noexcept {
    if (!windows_wanted_ || !windows_.empty())
        return;
    // A replacement window could not be allocated: the link gave its windows up.
    windows_wanted_ = false;
    if (memory_.counters != nullptr)
        ++memory_.counters->windows_unavailable;
    rdmax::detail::notice("rpc::client: a connection lost its memory windows (ibv_alloc_mw "
                          "failed): its calls' large bodies and reply buffers go under the "
                          "cached registrations' own keys from now on");
}

void rdma_link::replace_window(std::uint32_t w) noexcept {
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

} // namespace rdmax::rpc::detail
