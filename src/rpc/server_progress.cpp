// rpc::server, progress: what arrived (through the inbox, or a node-local
// link's own ring), body transfers that ended, and every housekeeping
// interval new connections and the links to tear down.

#include <rdmax/detail/rpc/server_rails.hpp>
#include <rdmax/error.hpp>
#include <rdmax/rpc/server.hpp>

namespace rdmax::rpc {

void server::on(std::uint16_t method, handler h) {
    if (method == 0)
        throw_error("rpc::server::on", EINVAL, "method id 0 is reserved");
    if (handlers_.size() <= method)
        handlers_.resize(std::size_t{method} + 1);
    handlers_[method] = std::move(h);
}

bool server::arm() noexcept {
    // A caller's own loop sleeps on fd() instead of wait(): the same steps.
    // A readable rdma_cm channel or mailbox is housekeeping's, and stays
    // readable until it runs: at the next poll, not after a sleep.
    // A node-local peer's wake-up may come after this side woke (it saw
    // the flag before poll() cleared it): its eventfd is drained here too,
    // as wait() drains it after every sleep.
    if (ep_.in.events_pending()) {
        asleep_ = true; // poll() clears the flags and drains the eventfds
        ep_.housekeep_soon();
        return false;
    }
    if (!ep_.in.arm())
        return false;
    asleep_ = true;
    bool quiet = true;
    for (peer& p : ep_.peers)
        if (p.wire && !p.wire->broken && !p.wire->sleep(true))
            quiet = false;
    return quiet;
}

int server::poll() noexcept {
    if (asleep_) { // awake: node-local peers need not wake this side
        asleep_ = false;
        for (peer& p : ep_.peers)
            if (p.wire)
                (void)p.wire->sleep(false);
    }
    const std::uint64_t before = ep_.counters.calls;
    ep_.take_inbox([this](const ibv_wc& wc) { on_receive(wc); });
    for (std::uint32_t i = 0; i < ep_.peers.size(); ++i) {
        peer& l = ep_.peers[i];
        if (l.wire && !l.wire->broken)
            on_link_events(l, i, l.reads != 0 || l.writes != 0);
    }
    if (ep_.housekeeping_due())
        housekeeping();
    if (!orphans_.empty())
        run_orphans();
    return static_cast<int>(ep_.counters.calls - before);
}

int server::wait(std::chrono::microseconds timeout) noexcept {
    return ep_.wait(timeout, [this] { return poll(); });
}

void server::on_link_events(peer& l, std::uint32_t index, bool thorough) noexcept {
    detail::link_event events[32];
    const int n = l.wire->poll(events, thorough);
    if (n < 0) {
        reject(l, violation::malformed); // a node-local peer's ring is corrupt
        return;
    }
    for (int k = 0; k < n; ++k) {
        const detail::link_event& e = events[k];
        if (e.what == detail::link_event::kind::transfer)
            transfer_ended(l, index, e);
        else if (e.what == detail::link_event::kind::imm && !l.wire->broken)
            on_imm(l, index, e.imm());
    }
    // Also when it polled nothing: the scheduler may have failed posting
    // queued work (its error completion comes later).
    check_failed(l);
}

void server::transfer_ended(peer& l, std::uint32_t index, const detail::link_event& c) noexcept {
    const std::uint64_t tag = c.wr_id >> 56;
    const auto at = static_cast<std::uint16_t>((c.wr_id >> 16) & 0xffffU);
    const auto slot = static_cast<std::uint32_t>(c.wr_id & 0xffffU);
    // A failure the link says is the call's alone (tcp: a body the caller
    // no longer grants) leaves the link whole; any other leaves it broken.
    const bool call_only = !c.ok() && c.call_only;
    if (!c.ok() && !call_only)
        l.wire->broken = true;
    // The transfer is over (done or flushed): its block is free again, once
    // the handler had a request body.
    const bool owned = at < l.blocks.size() && l.blocks[at];
    if (tag == tag_external && owned) {
        release_block(l, at);
        --l.writes;
        return;
    }
    if (tag != tag_read)
        return;
    if (l.reads > 0)
        --l.reads;
    if (!owned)
        return;
    // Still the body of the call in its slot (not one superseded)?
    slot_state* ss = slot < l.slots.size() ? &l.slots[slot] : nullptr;
    const bool current = ss != nullptr && ss->busy && ss->body_at == at;
    if (current && !l.wire->broken && !call_only) {
        run_handler(l, index, slot, {l.blocks[at].data(), l.blocks[at].size()});
        return;
    }
    if (current)
        ss->body_at = no_block;
    release_block(l, at);
    if (current && call_only && !l.wire->broken) {
        ++ep_.counters.calls;
        answer(l, index, slot, call_status::read_failed, {}, false);
    }
}

void server::check_failed(peer& l) noexcept {
    if (l.wire->broken)
        return;
    if (const std::optional<link_end> why = l.wire->ended(detail::look::failure)) {
        ep_.counters.count_link_end(*why);
        l.wire->broken = true;
    }
}

void server::reject(peer& l, violation v) noexcept {
    if (v == violation::none)
        return;
    ep_.counters.count(v);
    // Closed at the next housekeeping, after the completions already queued
    // for it are taken; from now on they are dropped.
    l.wire->broken = true;
    ep_.housekeep_soon();
}

void server::housekeeping() noexcept {
    const auto now = ep_.start_housekeeping();
    housekept_ = now;
    ep_.publish_stats(now, 0);
    // The rdma_cm channels (new requests, peers that left) are read only when
    // one has something: otherwise this costs one epoll_wait.
    const bool events = ep_.in.events_pending();
    accept_new(events);
    if (rails_)
        detail::server_rails::progress(*this);
    reap_links(events);
    cache_.expire(now);
    if (group_ != nullptr)
        publish_load();
}

void server::keep_alive(peer& l, sched::coarse_clock::time_point now) noexcept {
    if (l.wire->broken || l.establish_by)
        return; // its handshake is not over: nothing may be sent yet
    if (draining_ && !l.goaway_sent &&
        ep_.send_control(l, message_kind::reply, control::goaway) == status::ok) {
        l.goaway_sent = true;
        ++ep_.counters.goaways;
    }
    if (ep_.tend(l, message_kind::reply, now) == detail::liveness::silent)
        l.wire->broken = true;
}

void server::reap_links(bool events) noexcept {
    bool any_broken = false;
    const auto now = ep_.now();
    for (std::uint32_t i = 0; i < ep_.peers.size(); ++i) {
        peer& l = ep_.peers[i];
        if (!l.wire)
            continue;
        // Reaps what poll() left (unsignaled requests' slots, failures).
        if (!l.wire->broken)
            on_link_events(l, i, true);
        if (!l.wire->broken && events) {
            if (const std::optional<link_end> why = l.wire->ended(detail::look::events)) {
                ep_.counters.count_link_end(*why);
                l.wire->broken = true;
            }
        }
        if (l.establish_by && !l.wire->broken) {
            if (l.wire->established(false)) {
                l.establish_by.reset();
                l.last_heard = now; // silence counts from here, not from the accept
            } else if (now >= *l.establish_by)
                l.wire->broken = true; // its handshake never ended
        }
        keep_alive(l, now);
        any_broken = any_broken || l.wire->broken;
    }
    if (!any_broken)
        return;
    // Take every completion already queued (a broken link's are dropped), so
    // that none is left for a queue pair number a new connection may reuse.
    ep_.take_inbox([this](const ibv_wc& wc) { on_receive(wc); }, true);
    for (std::uint32_t i = 0; i < ep_.peers.size(); ++i)
        if (ep_.peers[i].wire && ep_.peers[i].wire->broken)
            teardown(i);
}

void server::teardown(std::uint32_t index) noexcept {
    peer& l = ep_.peers[index];
    // Calls whose handler never ran (their body was being read) did not
    // happen: a copy the client re-sends may run. Deferred ones keep their
    // entries: their answer is kept when it comes (keep_orphan).
    for (slot_state& ss : l.slots)
        if (ss.busy && ss.kept && !ss.ran)
            forget_call(*ss.kept);
    cache_.detach(l.incarnation, l.said_bye, ep_.now());
    ep_.drop(index); // no more DMA into or out of the slots' blocks
    l.slots.clear();
    l.blocks.clear();
    l.free_blocks.clear();
    --live_;
    ++ep_.counters.disconnected;
}

void server::disconnect(peer_id p) noexcept {
    if (peer* l = ep_.find(p)) {
        l->wire->broken = true;
        ep_.housekeep_soon();
    }
}

void server::begin_drain() noexcept {
    draining_ = true;
    ep_.housekeep_soon(); // the goaways go at the next poll
}

bool server::drained() const noexcept {
    for (const peer& l : ep_.peers) {
        if (!l.wire || l.wire->broken)
            continue;
        if (!l.goaway_acked || l.reads != 0 || l.writes != 0)
            return false;
        for (const slot_state& ss : l.slots)
            if (ss.busy)
                return false;
    }
    return true;
}

void server::end_drain() noexcept {
    for (peer& l : ep_.peers)
        if (l.wire && !l.wire->broken) {
            l.wire->close();
            l.wire->broken = true;
        }
    reap_links(false);
    // Still draining: a drained server refuses new connections (destroy it,
    // or make another on its address).
}

bool server::drain(std::chrono::milliseconds deadline) noexcept {
    begin_drain();
    // Real time, whatever clock the endpoint's deadlines use.
    const auto end = std::chrono::steady_clock::now() + deadline;
    bool clean = false;
    while (!(clean = drained()) && std::chrono::steady_clock::now() < end) {
        (void)wait(std::min<std::chrono::microseconds>(
            std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::microseconds>(
                                              end - std::chrono::steady_clock::now())));
        ep_.housekeep_soon(); // goaways, and acknowledgements' connections ended
    }
    end_drain();
    return clean;
}

bool server::is_local(peer_id p) const noexcept {
    const peer* l = ep_.find(p);
    return l != nullptr && l->wire->node_local();
}

std::optional<sched::scheduler_counters> server::scheduler_counters(peer_id p) noexcept {
    const peer* l = ep_.find(p);
    return l != nullptr ? l->wire->scheduler_counters() : std::nullopt;
}

} // namespace rdmax::rpc
