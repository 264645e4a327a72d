// The memory a client's call shows its server: registrations through the
// cache, and type-2 windows over exactly the call's bytes where the device
// has them, bound ahead of the request and revoked or fenced when it ends.
// On a link with rails, the same on each rail that is up: its own
// registrations (its device's) and its own windows (its queue pair's).

#include <algorithm>
#include <bit>
#include <chrono>

#include <rdmax/detail/rpc/rdma_link.hpp>

#include "../notice.hpp"

rdmax::detail::rdma_link_hooks& rdmax::detail::rdma_link_test_hooks() noexcept {
    static rdma_link_hooks hooks;
    return hooks;
}

namespace rdmax::rpc::detail {

namespace {
constexpr rights read_bind = rights::remote_read | rights::mw_bind;
constexpr rights write_bind = rights::local_write | rights::remote_write | rights::mw_bind;

constexpr std::uint8_t bit(std::uint32_t k) noexcept {
    return static_cast<std::uint8_t>(1U << k);
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
    if (a.shown())
        for (std::uint32_t k = 0; k < max_link_rails; ++k)
            if (!wins_[k].empty() && !wins_[k].settled(2 * slot, 2))
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
    if (!windows || !a.shown()) {
        if (a.body[0])
            body.rkey = a.body[0].rkey();
        if (a.reply[0])
            reply.rkey = a.reply[0].rkey();
    } else if (!bind_call(0, slot, a, body, reply)) {
        // The send queue is full (or failed): nothing goes out unfenced.
        a.release();
        windows_lost();
        return access::no_room;
    }
    grant_rails(slot, a, r, body, reply);
    return access::ok;
}

void rdma_link::grant_rails(std::uint32_t slot, call_access& a, const call_ranges& r,
                            const buffer_descriptor& body,
                            const buffer_descriptor& reply) noexcept {
    // Only a call worth cutting (a body or reply buffer of stripe_min bytes
    // or more), in host memory (a dma-buf range goes over rail 0 alone), and
    // where the request has room for the keys. Each rail keyed shows every
    // buffer the call has (rail_keys_valid); the server cuts what is large.
    // Windows only: without them a rail's key is the registration's own,
    // which no fence ends, and a piece the server sent again after its rail
    // failed could still land there after the call ended.
    if (!has_windows() || a.dev_body != nullptr || a.dev_reply != nullptr ||
        (body.length < stripe_min_ && reply.length < stripe_min_) || keyed_rails() < 2 ||
        slot_bytes() < sizeof(message_header) + 2 * sizeof(buffer_descriptor) + sizeof(rail_keys))
        return;
    const bool has_body = !r.body.empty();
    const bool has_reply = !r.reply.empty();
    std::uint32_t k = 1;
    for (; k < keyed_rails(); ++k) {
        // Rail k's registrations (its device's keys) of the same bytes.
        try {
            verbs_cache& cache = *rails_[k].cache;
            if (has_body)
                a.body[k] = cache.get<read_bind>(r.body.data(), r.body.size());
            if (has_reply)
                a.reply[k] = cache.get<write_bind>(r.reply.data(), r.reply.size());
        } catch (...) {
            break; // this rail's device would not register it: the keys end here
        }
        buffer_descriptor b = body;
        buffer_descriptor p = reply;
        // A rail without its own windows (or without room to bind them
        // now, or whose binds did not run in time) ends the keys.
        if (wins_[k].empty() || !bind_call(k, slot, a, b, p) || !binds_ran(k))
            break;
        a.keys.body[k - 1] = has_body ? b.rkey : 0;
        a.keys.reply[k - 1] = has_reply ? p.rkey : 0;
    }
    if (k < max_link_rails && (a.windows & bit(k)) == 0) { // registered, perhaps, not bound
        a.body[k].reset();
        a.reply[k].reset();
    }
    if (k >= 2)
        a.keys.rails = k;
    else
        a.keys = {};
}

bool rdma_link::keys_of(std::uint32_t slot, rail_keys& out) const noexcept {
    if (slot >= calls_.size() || calls_[slot].keys.rails < 2)
        return false;
    out = calls_[slot].keys;
    return true;
}

bool rdma_link::register_call(call_access& a, const call_ranges& r, bool windows) noexcept {
    try {
        if (!r.body.empty() || !r.reply.empty()) {
            verbs_cache& cache = memory_.cache(memory_.owner);
            if (!r.body.empty())
                a.body[0] = windows ? cache.get<read_bind>(r.body.data(), r.body.size())
                                    : cache.get<rights::remote_read>(r.body.data(), r.body.size());
            if (!r.reply.empty())
                a.reply[0] = windows
                                 ? cache.get<write_bind>(r.reply.data(), r.reply.size())
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

bool rdma_link::bind_call(std::uint32_t k, std::uint32_t slot, call_access& a,
                          buffer_descriptor& body, buffer_descriptor& reply) noexcept {
    window_set::exposure e[2];
    std::size_t n = 0;
    if (a.body[k] && body.length != 0)
        e[n++] = {2 * slot, a.body[k].registration(), body.addr, body.length, rights::remote_read};
    if (a.reply[k] && reply.length != 0)
        e[n++] = {2 * slot + 1, a.reply[k].registration(), reply.addr, reply.length,
                  rights::remote_write};
    // Rail 0's binds are ordered before the request on its own send queue;
    // another rail's last bind is signaled (binds_ran()).
    const std::uint64_t signal =
        k == 0 ? 0 : window_set::bind_tag | (std::uint64_t{k} << 32) | (binds_asked_[k] + 1U);
    if (n == 0 || broken || !wins_[k].expose(std::span(e, n), signal))
        return false;
    if (k != 0)
        ++binds_asked_[k];
    a.windows |= bit(k);
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
    case access_end::fence: return fence_call(slot, a);
    case access_end::lazy:
        if (a.windows == 0) {
            // Registrations' own keys (no windows): nothing to revoke; the
            // registration goes back to the cache.
            a.release();
            return true;
        }
        // Queued; the registrations are held until the slot's next call.
        for (std::uint32_t k = 0; k < max_link_rails; ++k)
            if ((a.windows & bit(k)) != 0)
                wins_[k].revoke(2 * slot, 2);
        a.windows = 0;
        return true;
    case access_end::now:
    case access_end::abandon:
        // The caller reuses its buffers as soon as it sees the result, so the
        // windows die before (an invalidation could wait behind a stalled
        // send queue); then the registrations can go at once.
        if (a.windows != 0 || a.fencing != 0)
            revoke_now(slot, static_cast<std::uint8_t>(a.windows | a.fencing));
        if (a.fenced)
            --fencing_calls_;
        a.windows = 0;
        a.fencing = 0;
        a.fenced = false;
        a.release();
        return true;
    }
    return true;
}

bool rdma_link::fence_call(std::uint32_t slot, call_access& a) noexcept {
    // A signaled invalidation on each rail the call is bound on; the
    // result goes out once every one's completion is in (the call's
    // binds ran before its request, which was answered). A rail whose
    // fence cannot be posted has its windows deallocated at once.
    if (a.windows == 0 || broken)
        return false;
    std::uint8_t fencing = 0;
    for (std::uint32_t k = 0; k < max_link_rails; ++k) {
        if ((a.windows & bit(k)) == 0)
            continue;
        if (wins_[k].fence(2 * slot, 2))
            fencing |= bit(k);
        else if (k != 0)
            revoke_now(slot, bit(k));
    }
    if ((fencing & bit(0)) == 0) {
        // Rail 0's was not posted: the caller ends the call now, which
        // deallocates rail 0's windows (still bound) and whatever fences
        // went on the other rails.
        a.windows = static_cast<std::uint8_t>(fencing | bit(0));
        return false;
    }
    a.windows = 0;
    a.fencing = fencing;
    a.fenced = true;
    ++fencing_calls_;
    return true;
}

bool rdma_link::enable_windows() noexcept {
    // Windows for the calls' large bodies and reply buffers, where the device
    // has type 2: the peer then sees a call's bytes only, and only until the
    // call ends. Without them, the registrations' own keys (docs/rpc.md).
    if (!conn_ || !wins_[0].empty())
        return !wins_[0].empty();
    try {
        ready_.reserve(slots()); // one per slot at most: none allocates
    } catch (...) {
        return false;
    }
    if (!wins_[0].allocate(conn_->qp().get()->pd, std::size_t{slots()} * 2, 0))
        return false;
    wins_[0].use(conn_->qp());
    windowed_ |= bit(0);
    sched_->on_foreign(&rdma_link::on_window_completion, this);
    return true;
}

void rdma_link::fence_over(std::uint32_t k, std::uint32_t slot) noexcept {
    if (slot >= calls_.size())
        return;
    call_access& a = calls_[slot];
    if (!a.fenced || (a.fencing & bit(k)) == 0)
        return;
    a.fencing = static_cast<std::uint8_t>(a.fencing & ~bit(k));
    if (a.fencing == 0)
        ready_.push_back(slot); // reserved for every slot: no allocation
}

int rdma_link::take_fenced(std::span<link_event> out) noexcept {
    // Every window of a rail deallocated (none could be allocated in one's
    // place, or the rail was lost): its fences are moot, and nothing would
    // complete for them.
    for (std::uint32_t k = 0; k < max_link_rails; ++k) {
        if ((windowed_ & bit(k)) == 0 || !wins_[k].empty())
            continue;
        windowed_ = static_cast<std::uint8_t>(windowed_ & ~bit(k));
        for (std::uint32_t s = 0; s < calls_.size(); ++s)
            fence_over(k, s);
    }
    int n = 0;
    std::size_t taken = 0;
    for (; taken < ready_.size() && static_cast<std::size_t>(n) < out.size(); ++taken) {
        call_access& a = calls_[ready_[taken]];
        if (!a.fenced || a.fencing != 0)
            continue;
        a.fenced = false;
        --fencing_calls_;
        // Its windows are dead: the registrations may go.
        a.release();
        out[static_cast<std::size_t>(n++)] = link_event::of_fenced(ready_[taken]);
    }
    ready_.erase(ready_.begin(), ready_.begin() + static_cast<std::ptrdiff_t>(taken));
    return n;
}

bool rdma_link::binds_ran(std::uint32_t k) noexcept {
    // Spinning on the rail's completions, bounded (a bind takes
    // microseconds; a rail that keeps it longer is not keyed this time).
    constexpr int polls_per_look = 64;
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
    for (int i = 1; binds_seen_[k] != binds_asked_[k]; ++i) {
        if (!rails_[k].sched || rails_[k].sched->failed())
            return false;
        (void)rails_[k].sched->poll(std::span<verbs::completion>{});
        if (i % polls_per_look == 0 && std::chrono::steady_clock::now() >= until) {
            // A rail that does not run a bind in time is taken out: its
            // windows (one with a bind perhaps still queued) go with its
            // queue pair, and it is dialed again.
            rail_lost(k);
            return false;
        }
    }
    return true;
}

void rdma_link::on_window_completion(void* self, const verbs::completion& c) noexcept {
    rdma_link& l = *static_cast<rdma_link*>(self);
    if (window_set::is_bind(c.wr_id)) {
        const auto k = static_cast<std::uint32_t>((c.wr_id >> 32) & 0xffffU);
        if (k < max_link_rails && c.ok())
            l.binds_seen_[k] = static_cast<std::uint32_t>(c.wr_id & 0xffffffffU);
        return;
    }
    if (!window_set::is_fence(c.wr_id))
        return;
    const std::uint32_t k = window_set::fence_rail(c.wr_id);
    const std::uint32_t first = window_set::fence_first(c.wr_id);
    if (k >= max_link_rails)
        return;
    // Its windows deallocated since (that fenced them): fence_done says no,
    // and the call was handed on then. (No windows left on the rail: they
    // were all deallocated; take_fenced ends the rail's fences.)
    if (!l.wins_[k].fence_done(first))
        return;
    // One that failed is not named: the queue pair failed with it. Rail 0:
    // the endpoint deallocates the windows of every call still fencing.
    // Another rail: it is lost (tend_rails), which ends its fences.
    if (c.ok())
        l.fence_over(k, first / 2);
}

void rdma_link::revoke_now(std::uint32_t slot, std::uint8_t rails) noexcept {
    for (std::uint32_t k = 0; k < max_link_rails; ++k) {
        if ((rails & bit(k)) == 0 || wins_[k].empty())
            continue;
        if (memory_.counters != nullptr)
            memory_.counters->window_reallocs += 2;
        // Every window of the range, bound or not: one whose LOCAL_INV an
        // earlier revoke() posted may not have executed yet.
        wins_[k].replace_range(2 * slot, 2);
    }
    windows_lost();
}

void rdma_link::windows_lost() noexcept {
    if (!windows_wanted_ || !wins_[0].empty())
        return;
    // A replacement window could not be allocated: the link gave its windows up.
    windows_wanted_ = false;
    if (memory_.counters != nullptr)
        ++memory_.counters->windows_unavailable;
    rdmax::detail::notice("rpc::client: a connection lost its memory windows (ibv_alloc_mw "
                          "failed): its calls' large bodies and reply buffers go under the "
                          "cached registrations' own keys from now on");
}

} // namespace rdmax::rpc::detail
