// rpc::client, sessions: a peer_id names a server across its connections.
// When one ends, the calls in flight on it wait (their bodies taken back out
// of the staging slots) while a new connection is made with backoff; then
// they are re-sent under the same call id, flagged as retries, and the
// server's reply cache sees that none runs twice. docs/rpc.md, "Failures and
// retries".

#include <algorithm>
#include <cstring>

#include <rdmax/detail/rpc/pending_dial.hpp>
#include <rdmax/rpc/client.hpp>

namespace rdmax::rpc {

client::session* client::find_session(peer_id p) noexcept {
    if (p.index >= sessions_.size() || !sessions_[p.index].used ||
        sessions_[p.index].generation != p.generation)
        return nullptr;
    return &sessions_[p.index];
}

const client::session* client::find_session(peer_id p) const noexcept {
    return const_cast<client*>(this)->find_session(p);
}

const client::peer* client::link_of(peer_id p) const noexcept {
    const session* ss = find_session(p);
    return ss == nullptr || ss->link == no_link ? nullptr : &ep_.peers[ss->link];
}

peer_state client::state(peer_id p) const noexcept {
    const session* ss = find_session(p);
    return ss == nullptr ? peer_state::closed : ss->state;
}

void client::set_state(std::uint32_t s, peer_state st) noexcept {
    session& ss = sessions_[s];
    if (ss.state == st)
        return;
    ss.state = st;
    if (!on_state_)
        return;
    try {
        state_changes_.emplace_back(session_id(s), st);
    } catch (...) {
        // No memory for the report: the state itself is right (state()).
    }
}

void client::report_states() noexcept {
    if (state_changes_.empty() || !on_state_)
        return;
    for (const auto& [p, st] : state_changes_) {
        try {
            on_state_(p, st);
        } catch (...) {
            // A report, not a control path: what it throws is dropped.
        }
    }
    state_changes_.clear();
}

bool client::requeue(peer& l, std::uint32_t slot, std::deque<waiting_call>& into) noexcept {
    const slot_state& ss = l.slots[slot];
    // What the call was, from this side's own record of it; only an inline
    // body is read back from the staging slot (node-local: memory the server
    // shares, whose bytes it could have changed as it could have read them).
    if (ss.bytes > l.wire->slot_bytes() || ss.at_body > ss.bytes)
        return false;
    waiting_call c;
    c.call_id = ss.call_id;
    c.method = ss.method;
    c.o.priority = sched::priority{ss.priority};
    c.o.reply_into = ss.reply_into;
    c.o.body_dmabuf = ss.body_dmabuf;
    c.o.reply_dmabuf = ss.reply_dmabuf;
    c.o.cookie = ss.cookie;
    c.o.idempotent = (ss.flags & flag_idempotent) != 0;
    c.deadline = ss.deadline;
    c.sent = true;
    c.external = ss.external;
    try {
        if (ss.external.empty()) {
            const std::byte* from = l.wire->staging(slot) + ss.at_body;
            c.body.assign(from, from + (ss.bytes - ss.at_body));
        }
        into.push_back(std::move(c));
    } catch (...) {
        return false;
    }
    return true;
}

void client::lose_link(std::uint32_t s) noexcept {
    session& ss = sessions_[s];
    ss.link = no_link;
    if (ss.state == peer_state::closed)
        return;
    const bool again = opts_.reconnect && (redial_ || !ss.addr.empty());
    if (!again) {
        close_session(s, call_status::peer_gone);
        return;
    }
    // A link that failed is tried again soon (a random part of the first
    // step: a restarted server's clients do not all come back at once); one
    // drained by its server after a whole backoff (that server is going away).
    // The step doubles here too: a connection that ends before it proved
    // itself (keep_alive resets the step once its server is heard from) is
    // a failed attempt, as with a server that accepts and drops at once.
    const auto now = ep_.now();
    if (ss.state != peer_state::reconnecting)
        ss.lost_at = now;
    const std::chrono::nanoseconds step = ss.backoff;
    const bool proven = step <= opts_.reconnect_backoff; // it worked before it ended
    ss.backoff = std::min<std::chrono::nanoseconds>(2 * step, opts_.reconnect_backoff_max);
    std::uniform_int_distribution<std::int64_t> pick(proven ? 0 : step.count() / 2,
                                                     proven ? step.count() / 2 : step.count());
    ss.next_attempt =
        now + (ss.state == peer_state::draining ? step : std::chrono::nanoseconds(pick(jitter_)));
    set_state(s, peer_state::reconnecting);
    ep_.housekeep_soon();
}

call_status client::wait_for_link(std::uint32_t s, std::uint16_t method,
                                  std::span<const std::byte> request, const call_options& o,
                                  slot_ref& taken) noexcept {
    session& ss = sessions_[s];
    if (ss.state == peer_state::closed || (o.fail_fast && ss.state != peer_state::ready))
        return call_status::peer_gone;
    // As many as the last connection had slots: the credits the caller had.
    if (ss.waiting.size() >= std::max<std::size_t>(ss.slots, 1) || in_flight_ >= results_.size()) {
        ++ep_.counters.no_credit;
        return call_status::no_credit;
    }
    if (request.size() > opts_.max_message)
        return call_status::too_large;
    waiting_call c;
    c.call_id = next_call_id_++;
    c.method = method;
    c.o = o;
    c.deadline = deadline_of(o);
    try {
        const std::size_t room =
            ss.slot_bytes - sizeof(message_header) -
            (o.reply_into.empty() && o.reply_dmabuf.empty() ? 0 : sizeof(buffer_descriptor));
        if (request.size() > room)
            c.external = request; // the caller keeps it until the call ends, as always
        else
            c.body.assign(request.begin(), request.end());
        ss.waiting.push_back(std::move(c));
    } catch (...) {
        ++ep_.counters.no_credit;
        return call_status::no_credit;
    }
    ++in_flight_;
    ++ep_.counters.calls;
    taken = {no_link, no_slot, 0, false, ss.waiting.back().call_id};
    return call_status::ok;
}

void client::send_waiting(std::uint32_t s) noexcept {
    session& ss = sessions_[s];
    while (!ss.waiting.empty() && ss.state == peer_state::ready && ss.link != no_link) {
        peer& l = ep_.peers[ss.link];
        if (l.wire->broken || l.free_slots.empty())
            return;
        waiting_call& c = ss.waiting.front();
        outgoing call{.request =
                          c.external.empty() ? std::span<const std::byte>(c.body) : c.external,
                      .call_id = c.call_id,
                      .flags = static_cast<std::uint8_t>(c.sent ? flag_retry : 0)};
        slot_ref taken;
        const std::uint32_t index = ss.link;
        const call_status st = send_on(index, c.method, call, c.o, c.deadline, taken, false);
        if (st == call_status::no_credit)
            return; // room later
        if (st == call_status::peer_gone && ep_.peers[index].wire->broken) {
            // The new connection failed under it: it waits for the next one.
            fail_link(ep_.peers[index], index);
            return;
        }
        if (st == call_status::ok && c.sent)
            ++ep_.counters.retried_calls;
        else if (st != call_status::ok)
            // Refused on the new connection (its slots are smaller, its path
            // cannot reach dma-buf memory, a registration failed): a call that
            // went before may have run there all the same.
            push_slotless(s, c, c.sent ? call_status::unknown_outcome : st);
        ss.waiting.pop_front();
    }
}

void client::push_slotless(std::uint32_t s, const waiting_call& c, call_status st) noexcept {
    if (st == call_status::ok)
        ++ep_.counters.completed;
    else
        ++ep_.counters.failed;
    if (st == call_status::timed_out)
        ++ep_.counters.timed_out;
    if (st == call_status::cancelled)
        ++ep_.counters.cancelled;
    if (st == call_status::unknown_outcome)
        ++ep_.counters.unknown_outcomes;
    push_result({c.o.cookie, session_id(s), st, {}}, {no_link, no_slot, 0, false, c.call_id});
}

void client::close_session(std::uint32_t s, call_status st) noexcept {
    session& ss = sessions_[s];
    set_state(s, peer_state::closed);
    // A connect under way is let go (its thread ends within connect_timeout;
    // the connection it made, if any, is closed).
    ss.dialing.reset();
    for (const waiting_call& c : ss.waiting)
        push_slotless(s, c, st);
    ss.waiting.clear();
    release_session(s);
}

void client::release_session(std::uint32_t s) noexcept {
    session& ss = sessions_[s];
    if (!ss.used || ss.state != peer_state::closed || ss.links != 0)
        return;
    ss.used = false;
    ss.addr.clear();
    free_sessions_.push_back(s); // room reserved at attach
}

void client::server_restarted(session& ss) noexcept {
    const auto s = static_cast<std::uint32_t>(&ss - sessions_.data());
    std::erase_if(ss.waiting, [&](const waiting_call& c) {
        if (!c.sent || c.o.idempotent)
            return false; // never reached the old server, or harmless to run again
        push_slotless(s, c, call_status::unknown_outcome);
        return true;
    });
}

void client::try_reconnect(std::uint32_t s, sched::coarse_clock::time_point now) noexcept {
    session& ss = sessions_[s];
    try {
        std::unique_ptr<detail::link> wire;
        if (redial_) {
            wire = redial_(s);
        } else if (ss.dialing) {
            if (!ss.dialing->ready())
                return; // rdma_cm is still at it, on its thread
            const std::shared_ptr<detail::pending_dial> d = std::move(ss.dialing);
            wire = finish_dial(*d, ss.addr, ss.port, &ss.dialing);
            if (!wire)
                return; // no RDMA path: TCP is dialling, on its thread
        } else {
            // The node-local path first (a Unix handshake, bounded by
            // connect_timeout), then the device, whose connect runs on a
            // thread: this one goes on serving its other connections; with
            // no device, TCP, on a thread too.
            local_miss_ = "shm is left out (RDMAX_RPC_TRANSPORTS or RDMAX_RPC_LOCAL)";
            if (opts_.node_local())
                wire = connect_local(ss.addr, ss.port);
            if (!wire && device_ok()) {
                ss.dialing = begin_device(ss.addr, ss.port);
                return;
            }
            if (!wire && !opts_.transports.has(transport::tcp))
                unreachable(ss.addr, ss.port); // counted as a failed attempt
            if (!wire) {
                ss.dialing = begin_tcp(ss.addr, ss.port); // on its thread, as the device's
                return;
            }
        }
        attach(s, std::move(wire));
    } catch (...) {
        ss.dialing.reset();
        ++ep_.counters.reconnect_attempts;
        if (opts_.reconnect_give_up.count() > 0 && now - ss.lost_at >= opts_.reconnect_give_up) {
            close_session(s, call_status::peer_gone);
            return;
        }
        // Each wait a random 50-100 % of the step, which doubles up to the most.
        const auto step = ss.backoff;
        ss.backoff =
            std::min<std::chrono::nanoseconds>(2 * ss.backoff, opts_.reconnect_backoff_max);
        std::uniform_int_distribution<std::int64_t> pick(step.count() / 2, step.count());
        ss.next_attempt = ep_.now() + std::chrono::nanoseconds(pick(jitter_));
        return;
    }
    ++ep_.counters.reconnects;
    // The backoff starts again once the new connection proves itself (the
    // server is heard from: keep_alive), not at once: a server that accepts
    // and drops is not redialled every round.
    const std::uint64_t incarnation = ep_.peers[ss.link].incarnation;
    if (incarnation != ss.server_incarnation)
        server_restarted(ss);
    ss.server_incarnation = incarnation;
    set_state(s, peer_state::ready);
    send_waiting(s);
}

void client::tend_sessions(sched::coarse_clock::time_point now) noexcept {
    for (std::uint32_t s = 0; s < sessions_.size(); ++s) {
        session& ss = sessions_[s];
        if (!ss.used)
            continue;
        std::erase_if(ss.waiting, [&](const waiting_call& c) {
            if (c.deadline > now)
                return false;
            push_slotless(s, c, call_status::timed_out);
            return true;
        });
        if (ss.state == peer_state::reconnecting && ss.link == no_link && now >= ss.next_attempt)
            try_reconnect(s, now);
        else if (ss.state == peer_state::ready)
            send_waiting(s);
    }
}

} // namespace rdmax::rpc
