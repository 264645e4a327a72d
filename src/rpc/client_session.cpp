// rpc::client, sessions: a peer_id names a server across its connections.
// When one ends, the calls in flight on it wait (their bodies taken back out
// of the staging slots) while a new connection is made with backoff; then
// they are re-sent under the same call id, flagged as retries, and the
// server's reply cache sees that none runs twice. docs/rpc.md, "Failures and
// retries".

#include <algorithm>
#include <cstring>

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
    slot_state& ss = l.slots[slot];
    // The request as this side wrote it (node-local: in memory the server
    // shares, so read as a peer's message is: checked).
    parsed_request r;
    if (ss.bytes > l.wire->slot_bytes() ||
        parse_request({l.wire->staging(slot), ss.bytes}, r) != violation::none)
        return false;
    waiting_call c;
    c.call_id = ss.call_id;
    c.method = r.header.method;
    c.o.priority = sched::priority{r.header.priority};
    c.o.reply_into = ss.reply_into;
    c.o.cookie = ss.cookie;
    c.o.idempotent = (r.header.flags & flag_idempotent) != 0;
    c.deadline = ss.deadline;
    c.sent = true;
    try {
        if (r.external_body)
            c.external = {reinterpret_cast<const std::byte*>(r.external_body->addr),
                          r.external_body->length};
        else
            c.body.assign(r.inline_body.begin(), r.inline_body.end());
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
    // A link that failed is tried again at once; one drained by its server
    // after a backoff (that server is going away).
    const auto now = ep_.now();
    if (ss.state == peer_state::ready)
        ss.lost_at = now;
    ss.next_attempt = ss.state == peer_state::draining ? now + ss.backoff : now;
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
        const std::size_t room = ss.slot_bytes - sizeof(message_header) -
                                 (o.reply_into.empty() ? 0 : sizeof(buffer_descriptor));
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
        const call_status st = send_on(ss.link, c.method, call, c.o, c.deadline, taken);
        if (st == call_status::no_credit)
            return; // room later
        if (st == call_status::ok) {
            // In flight once more: counted in in_flight_ since it started.
            --in_flight_;
            --ep_.counters.calls;
            if (c.sent)
                ++ep_.counters.retried_calls;
        } else {
            push_slotless(s, c, st);
        }
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
    if (st == call_status::unknown_outcome)
        ++ep_.counters.unknown_outcomes;
    push_result({c.o.cookie, session_id(s), st, {}}, {no_link, no_slot, 0, false, c.call_id});
}

void client::close_session(std::uint32_t s, call_status st) noexcept {
    session& ss = sessions_[s];
    set_state(s, peer_state::closed);
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
    const std::uint32_t s = static_cast<std::uint32_t>(&ss - sessions_.data());
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
        std::unique_ptr<detail::link> wire = redial_ ? redial_(s) : dial(ss.addr, ss.port);
        attach(s, std::move(wire));
    } catch (...) {
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
    ss.backoff = opts_.reconnect_backoff;
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
