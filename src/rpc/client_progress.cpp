// rpc::client, progress: replies as they arrive (through the inbox, or a
// node-local link's own ring), fences that end, links that fail, and every
// housekeeping interval the calls past their deadline and links to tear down.

#include <algorithm>
#include <cstddef>

#include <rdmax/detail/rpc/client_rails.hpp>
#include <rdmax/rpc/client.hpp>

namespace rdmax::rpc {

void client::progress() noexcept {
    if (holding_)
        ring_held(); // what waits for its doorbell goes before the poll
    ep_.take_inbox([this](const ibv_wc& wc) { on_receive(wc); });
    const bool due = ep_.housekeeping_due();
    for (std::uint32_t i = 0; i < ep_.peers.size(); ++i) {
        peer& l = ep_.peers[i];
        if (l.wire && !l.wire->broken)
            on_link_events(l, i, due);
    }
    if (due)
        housekeeping();
}

void client::on_link_events(peer& l, std::uint32_t index, bool due) noexcept {
    detail::link_event events[32];
    // Unless due, a link polls only what cannot wait: a call waits for its
    // reply, not for the completions of its unsignaled requests.
    const int n = l.wire->poll(events, due);
    if (n < 0) {
        ++ep_.counters.rejected_malformed;
        fail_link(l, index);
        return;
    }
    for (int k = 0; k < n && !l.wire->broken; ++k) {
        const detail::link_event& e = events[k];
        switch (e.what) {
        case detail::link_event::kind::imm: on_imm(l, index, e.imm()); break;
        case detail::link_event::kind::transfer:
            if (!e.ok())
                fail_link(l, index);
            break;
        case detail::link_event::kind::fenced:
            if (e.slot() < l.slots.size() && l.slots[e.slot()].phase == slot_phase::fencing)
                fenced(l, index, e.slot(), false);
            break;
        }
    }
    if (l.fencing != 0 && !l.wire->broken) {
        // A fence's invalidation (or another request) failed: its call is
        // never named fenced, and the link ends.
        if (const std::optional<link_end> why = l.wire->ended(detail::look::failure)) {
            ep_.counters.count_link_end(*why);
            fail_link(l, index);
        }
    }
}

void client::on_receive(const ibv_wc& wc) noexcept {
    std::uint32_t index = 0;
    peer* l = ep_.receiver(wc, index);
    if (l == nullptr)
        return;
    if (wc.status != IBV_WC_SUCCESS) {
        link_end e = l->wire->ended(detail::look::cause).value_or(link_end{});
        if (wc.status != IBV_WC_WR_FLUSH_ERR)
            e.failure = wc.status;
        ep_.counters.count_link_end(e);
    }
    std::uint32_t imm = 0;
    const detail::receipt r = detail::receipt_of(wc, imm);
    if (r == detail::receipt::imm)
        return on_imm(*l, index, imm);
    if (r == detail::receipt::bad)
        ep_.counters.count(violation::bad_opcode);
    fail_link(*l, index);
}

void client::on_imm(peer& l, std::uint32_t index, std::uint32_t imm) noexcept {
    imm_fields f;
    l.heard = true;
    if (const violation v = detail::checked_imm(imm, message_kind::reply, *l.wire, f);
        v != violation::none) {
        ep_.counters.count(v);
        return fail_link(l, index);
    }
    if (is_control(f))
        return on_control(l, index, static_cast<control>(f.slot));
    slot_state& ss = l.slots[f.slot];
    if (ss.phase != slot_phase::in_flight || f.epoch != ss.epoch) {
        stray_reply(l, index, f.slot, violation::credit); // a reply for no call, if not late
        return;
    }
    // The header's call_seq before the strict parse: a late immediate taken
    // against the bytes of this slot's next reply (or of a call two epochs
    // back, the same bit) disagrees in length or call_seq; it is late, not
    // malformed (check_imm let through a header's bytes at least).
    if (detail::load<message_header>(l.wire->inbound(f.slot, sizeof(message_header)).data())
            .call_seq != ss.seq) {
        stray_reply(l, index, f.slot, violation::malformed);
        return;
    }
    parsed_reply reply;
    const bool to_dmabuf = !ss.reply_dmabuf.empty();
    const auto offered =
        to_dmabuf
            ? ss.reply_dmabuf.length
            : static_cast<std::uint32_t>(std::min<std::size_t>(ss.reply_into.size(), UINT32_MAX));
    if (const violation v =
            parse_reply(l.wire->inbound(f.slot, f.bytes), offered, reply, to_dmabuf);
        v != violation::none) {
        ep_.counters.count(v);
        fail_link(l, index);
        return;
    }
    ep_.counters.bytes_in += f.bytes;
    std::span<const std::byte> body = reply.inline_body;
    if ((reply.header.flags & flag_external_reply) != 0) {
        // Into the caller's buffer: host memory it reads, or a dma-buf whose
        // bytes it is told the count of (no span: the CPU may not reach it).
        if (to_dmabuf) {
            // What the server says it wrote (within the range: parse_reply).
            body = {};
            if (reply.header.status == static_cast<std::uint32_t>(call_status::ok))
                ss.dmabuf_reply_bytes = reply.header.body_bytes;
        } else {
            body = {ss.reply_into.data(), reply.header.body_bytes};
        }
        ++ep_.counters.external_replies;
    }
    finish(l, index, f.slot, static_cast<call_status>(reply.header.status), body);
}

void client::on_control(peer& l, std::uint32_t index, control c) noexcept {
    switch (c) {
    case control::ping:
        // Answered at housekeeping, once a round (a flood is the server's fault).
        if (!detail::endpoint<peer>::pinged(l)) {
            ep_.counters.count(violation::malformed);
            fail_link(l, index);
        }
        break;
    case control::pong: break; // heard: that is all a probe asks
    case control::goaway: {
        // Nothing new goes here; the calls in flight are answered, then the
        // server closes, and the session connects again (after a backoff).
        ++ep_.counters.goaways;
        (void)ep_.send_control(l, message_kind::request, control::goaway_ack);
        if (sessions_[l.session].link == index)
            set_state(l.session, peer_state::draining);
        break;
    }
    case control::goaway_ack:
    case control::bye: // the client's to say
        ep_.counters.count(violation::malformed);
        fail_link(l, index);
        break;
    }
}

void client::stray_reply(peer& l, std::uint32_t index, std::uint32_t slot, violation v) noexcept {
    slot_state& ss = l.slots[slot];
    if (ss.late == 0) {
        ep_.counters.count(v);
        fail_link(l, index);
        return;
    }
    // The reply of a call that timed out: the slot is not its any more
    // (free, or another call's), so it is dropped unread.
    --ss.late;
    ++ep_.counters.late_replies;
}

void client::finish(peer& l, std::uint32_t index, std::uint32_t slot, call_status st,
                    std::span<const std::byte> reply) noexcept {
    slot_state& ss = l.slots[slot];
    // The caller owns its buffers again once it sees the result: the peer's
    // keys die before, not at an invalidation that runs later (7.x soft-RoCE
    // posts from a work queue; a stalled send queue holds it). A signaled
    // invalidation, and the result once its completion is in (the reply's
    // bytes are in the ring or the caller's buffer already); where it cannot
    // be posted, the windows are deallocated now (the reply came, so the
    // request and the binds before it ran).
    if (!l.wire->broken && l.wire->end_access(slot, detail::access_end::fence)) {
        ss.phase = slot_phase::fencing;
        ss.fenced_status = st;
        ss.fenced_reply = reply;
        ++l.fencing;
        return;
    }
    (void)l.wire->end_access(slot, detail::access_end::now);
    push_done(l, index, slot, st, reply);
}

void client::push_done(peer& l, std::uint32_t index, std::uint32_t slot, call_status st,
                       std::span<const std::byte> reply) noexcept {
    slot_state& ss = l.slots[slot];
    ss.phase = slot_phase::done;
    --l.in_flight;
    ++l.held;
    if (st == call_status::ok)
        ++ep_.counters.completed;
    else
        ++ep_.counters.failed;
    if (st == call_status::unknown_outcome)
        ++ep_.counters.unknown_outcomes;
    push_result({ss.cookie, session_id(l.session), st, reply, ss.dmabuf_reply_bytes},
                {index, slot, ss.seq, true, ss.call_id});
}

void client::fenced(peer& l, std::uint32_t index, std::uint32_t slot, bool dealloc) noexcept {
    slot_state& ss = l.slots[slot];
    --l.fencing;
    if (dealloc)
        (void)l.wire->end_access(slot, detail::access_end::now);
    push_done(l, index, slot, ss.fenced_status, ss.fenced_reply);
}

void client::fail_link(peer& l, std::uint32_t index) noexcept {
    const std::uint32_t s = l.session;
    const bool current = sessions_[s].link == index;
    if (l.wire->broken && l.in_flight == 0 && !current)
        return;
    if (!l.wire->broken)
        ++ep_.counters.disconnected;
    l.wire->broken = true;
    // The calls answered go out; those in flight wait for the session's next
    // connection, where it has one (in call id order: the order they went).
    const bool again = current && sessions_[s].state != peer_state::closed && opts_.reconnect &&
                       (redial_ || !sessions_[s].addr.empty());
    std::deque<waiting_call> moved;
    for (std::uint32_t k = 0; k < l.slots.size(); ++k) {
        const slot_phase phase = l.slots[k].phase;
        if (phase == slot_phase::in_flight && again && requeue(l, k, moved)) {
            (void)l.wire->end_access(k, detail::access_end::now);
            l.slots[k].phase = slot_phase::free;
            --l.in_flight;
        } else if (phase == slot_phase::in_flight) {
            finish(l, index, k, call_status::peer_gone, {});
        } else if (phase == slot_phase::fencing) {
            // Answered, but its invalidation will not complete now (or
            // failed): deallocated, then the answer goes out.
            fenced(l, index, k, true);
        }
    }
    if (current) {
        session& ss = sessions_[s];
        std::sort(moved.begin(), moved.end(), [](const waiting_call& a, const waiting_call& b) {
            return a.call_id < b.call_id;
        });
        // Ahead of the calls started while it was down, in the order they went.
        std::reverse(moved.begin(), moved.end());
        for (waiting_call& c : moved) {
            try {
                ss.waiting.push_front(std::move(c));
            } catch (...) {
                push_slotless(s, c, call_status::peer_gone);
            }
        }
        lose_link(s);
    }
    ep_.housekeep_soon();
}

void client::housekeeping() noexcept {
    const auto now = ep_.start_housekeeping();
    ep_.publish_stats(now, in_flight_);
    // Connection events are read only when a channel has one (one epoll_wait).
    const bool events = ep_.in.events_pending();
    for (std::uint32_t i = 0; i < ep_.peers.size(); ++i) {
        peer& l = ep_.peers[i];
        if (!l.wire)
            continue;
        if (!l.wire->broken) {
            if (const std::optional<link_end> why =
                    l.wire->ended(events ? detail::look::events : detail::look::failure)) {
                ep_.counters.count_link_end(*why);
                fail_link(l, i);
            }
        } else if (l.in_flight != 0) {
            fail_link(l, i); // broken by a send that failed: its other calls end too
        }
        if (!l.wire->broken)
            keep_alive(l, i, now);
        if (l.wire->broken || l.in_flight == 0)
            continue;
        if (fence_stalled(l, now)) {
            // An answered call's invalidation did not complete by the call's
            // deadline: the send queue is stalled (a peer that answers but
            // posts no receives holds it in retries for ever). The link ends;
            // the answers go out once their windows are deallocated.
            ++ep_.counters.fence_stalls;
            ep_.counters.count_link_end(l.wire->ended(detail::look::cause).value_or(link_end{}));
            fail_link(l, i);
            continue;
        }
        expire_calls(l, i, now);
    }
    tend_sessions(now);
    if (rails_)
        detail::client_rails::tend(*this, now);
    teardown_idle();
}

void client::keep_alive(peer& l, std::uint32_t index,
                        sched::coarse_clock::time_point now) noexcept {
    session& ss = sessions_[l.session];
    if (l.heard && ss.link == index)
        ss.backoff = opts_.reconnect_backoff; // the connection works: the next failure starts over
    if (ss.state == peer_state::draining && ss.link == index && l.in_flight == 0) {
        // Acknowledged, nothing left here: closed from this side too (the
        // server's close may never come), and connected again after a backoff.
        l.wire->close();
        fail_link(l, index);
        return;
    }
    if (ep_.tend(l, message_kind::request, now) == detail::liveness::silent)
        fail_link(l, index); // its calls wait for the next connection
}

void client::expire_calls(peer& l, std::uint32_t index,
                          sched::coarse_clock::time_point now) noexcept {
    for (std::uint32_t s = 0; s < l.slots.size(); ++s) {
        const slot_state& ss = l.slots[s];
        if (ss.phase == slot_phase::in_flight && ss.deadline <= now)
            abandon(l, index, s, call_status::timed_out);
    }
}

void client::abandon(peer& l, std::uint32_t index, std::uint32_t slot, call_status st) noexcept {
    slot_state& ss = l.slots[slot];
    // The slot is the caller's again at once: its next call goes with the
    // other epoch, which tells the server to drop this one, and a late reply
    // of this one is dropped unread.
    ss.phase = slot_phase::free;
    // The server is fenced out of the call's buffers from now on: a late
    // READ or WRITE fails at the device (and ends the link), and a
    // node-local server finds the call given up before it copies.
    (void)l.wire->end_access(slot, detail::access_end::abandon);
    if (ss.late < UINT8_MAX)
        ++ss.late;
    // Taken last: calls go to other free slots first, which gives a slow
    // server's answer the time to come and leaves its call be.
    l.free_slots.push_back(static_cast<std::uint16_t>(slot));
    std::rotate(l.free_slots.begin(), l.free_slots.end() - 1, l.free_slots.end());
    --l.in_flight;
    ++(st == call_status::cancelled ? ep_.counters.cancelled : ep_.counters.timed_out);
    ++ep_.counters.failed;
    push_result({ss.cookie, session_id(l.session), st, {}},
                {index, no_slot, ss.seq, false, ss.call_id});
}

bool client::cancel(peer_id p, std::uint64_t cookie) noexcept {
    session* ss = find_session(p);
    if (ss == nullptr)
        return false;
    // Not sent yet (or to be sent again): it leaves the queue, and no
    // server sees it from now on.
    const auto waiting = std::find_if(ss->waiting.begin(), ss->waiting.end(),
                                      [&](const waiting_call& c) { return c.o.cookie == cookie; });
    if (waiting != ss->waiting.end()) {
        push_slotless(p.index, *waiting, call_status::cancelled);
        ss->waiting.erase(waiting);
        return true;
    }
    if (ss->link == no_link)
        return false;
    // In flight: given up as at its deadline. One replied already (fencing,
    // or its result queued) has ended: its result says how.
    peer& l = ep_.peers[ss->link];
    for (std::uint32_t k = 0; k < l.slots.size(); ++k) {
        if (l.slots[k].phase == slot_phase::in_flight && l.slots[k].cookie == cookie) {
            abandon(l, ss->link, k, call_status::cancelled);
            return true;
        }
    }
    return false;
}

bool client::fence_stalled(const peer& l, sched::coarse_clock::time_point now) const noexcept {
    if (l.fencing == 0)
        return false;
    return std::any_of(l.slots.begin(), l.slots.end(), [&](const slot_state& ss) {
        return ss.phase == slot_phase::fencing && ss.deadline + opts_.housekeeping <= now;
    });
}

void client::teardown_idle() noexcept {
    for (std::uint32_t i = 0; i < ep_.peers.size(); ++i) {
        peer& l = ep_.peers[i];
        if (!l.wire || !l.wire->broken || l.held != 0 || l.in_flight != 0)
            continue;
        // Only once every completion queued for it was taken: none is then
        // left for a queue pair number a later connection may reuse.
        ep_.take_inbox([this](const ibv_wc& wc) { on_receive(wc); }, true);
        if (l.held != 0 || l.in_flight != 0)
            continue;
        ep_.drop(i);
        l.slots.clear();
        l.free_slots.clear();
        --sessions_[l.session].links;
        release_session(l.session);
    }
}

} // namespace rdmax::rpc
