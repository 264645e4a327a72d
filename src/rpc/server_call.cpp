// rpc::server, the call path: a request arrives (checked against the slot's
// state), its body is read if it stayed in the caller's memory, the handler
// runs, and the answer goes into the caller's slot (or its reply buffer).

#include <algorithm>
#include <cstring>

#include <rdmax/rpc/server.hpp>

namespace rdmax::rpc {

namespace {
/// What a handler may answer with fail(): a status the server may say but
/// ok, and but those the server itself decides (read_failed: the body never
/// came, so the call never ran; unknown_outcome: the reply cache's).
bool handler_status(call_status s) noexcept {
    return server_status(static_cast<std::uint32_t>(s)) && s != call_status::ok &&
           s != call_status::read_failed && s != call_status::unknown_outcome;
}
} // namespace

// ---- request_context ------------------------------------------------------------------------

std::size_t request_context::reply_capacity() const noexcept {
    const server::peer* l = srv_->ep_.find(peer_);
    std::size_t most = space_.size();
    if (l == nullptr || !l->slots[slot_].reply_buffer)
        return most;
    const std::size_t buffer = l->slots[slot_].reply_buffer->length;
    return l->slots[slot_].reply_in_buffer ? buffer : std::max(most, buffer);
}

void request_context::reply(std::span<const std::byte> bytes) noexcept {
    if (answered_)
        return;
    answered_ = true;
    if (server::peer* l = srv_->ep_.find(peer_))
        srv_->answer(*l, peer_.index, slot_, call_status::ok, bytes, false);
}

void request_context::reply_in_place(std::size_t n) noexcept {
    if (answered_)
        return;
    answered_ = true;
    if (server::peer* l = srv_->ep_.find(peer_))
        srv_->answer(*l, peer_.index, slot_, call_status::ok,
                     space_.first(std::min(n, space_.size())), true);
}

void request_context::fail(call_status s) noexcept {
    if (answered_)
        return;
    answered_ = true;
    if (!handler_status(s))
        s = call_status::handler_failed;
    if (server::peer* l = srv_->ep_.find(peer_))
        srv_->answer(*l, peer_.index, slot_, s, {}, false);
}

deferred_call request_context::defer() noexcept {
    answered_ = true;
    return {peer_, slot_, seq_, client_, call_id_};
}

// ---- a request arrives ----------------------------------------------------------------------

void server::on_receive(const ibv_wc& wc) noexcept {
    std::uint32_t index = 0;
    peer* l = ep_.receiver(wc, index);
    if (l == nullptr)
        return;
    if (l->establish_by) {
        (void)l->wire->established(true); // the peer's first message proves the connection
        l->establish_by.reset();
    }
    // A flush is the connection going away; anything else but an
    // immediate is the peer's doing.
    std::uint32_t imm = 0;
    const detail::receipt r = detail::receipt_of(wc, imm);
    if (r == detail::receipt::imm) {
        on_imm(*l, index, imm);
    } else if (r == detail::receipt::flushed) {
        l->wire->broken = true;
    } else {
        reject(*l, violation::bad_opcode);
    }
}

void server::on_imm(peer& l, std::uint32_t index, std::uint32_t imm) noexcept {
    imm_fields f;
    l.heard = true;
    if (const violation v = detail::checked_imm(imm, message_kind::request, *l.wire, f);
        v != violation::none)
        reject(l, v);
    else if (is_control(f))
        on_control(l, static_cast<control>(f.slot));
    else
        on_request(l, index, f.slot, f.bytes, f.epoch);
}

void server::on_control(peer& l, control c) noexcept {
    switch (c) {
    case control::ping:
        // Answered at housekeeping, once per round: a flood of probes is the
        // peer's fault, not a load this side carries.
        if (!detail::endpoint<peer>::pinged(l))
            reject(l, violation::malformed);
        break;
    case control::pong: break; // heard: that is all a probe asks
    case control::goaway_ack: l.goaway_acked = true; break;
    case control::bye:
        l.said_bye = true;
        l.wire->broken = true;
        ep_.housekeep_soon();
        break;
    case control::goaway: reject(l, violation::malformed); break; // the server's to say
    }
}

void server::on_request(peer& l, std::uint32_t index, std::uint32_t slot, std::uint32_t bytes,
                        bool epoch) noexcept {
    const slot_state& ss = l.slots[slot];
    // The header's epoch first (check_imm let through a header's bytes at
    // least): an immediate taken late finds the slot holding the caller's
    // next call already (whose own immediate follows, and whose length this
    // one does not say), or a call the caller gave up. Dropped unread.
    const std::span<const std::byte> in = l.wire->inbound(slot, bytes);
    const auto head = detail::load<message_header>(in.data());
    if (((head.flags & flag_epoch) != 0) != epoch)
        return;
    // The epoch is one bit: an immediate two calls back carries the same
    // one. Its byte count differs from the header's (dropped as stale), or
    // the slot's bytes are the call's whose own immediate follows: it runs
    // now, and that immediate then finds its call_seq taken already (the
    // caller's call_seq grows per link, so per slot too). Neither counts as
    // the peer's fault.
    if (request_bytes(head) != bytes)
        return;
    if (ss.accepted_any && static_cast<std::int32_t>(head.call_seq - ss.last_seq) <= 0)
        return;
    parsed_request request;
    if (const violation v = parse_request(in, request); v != violation::none) {
        reject(l, v);
        return;
    }
    if (ss.busy) {
        if (epoch == ss.epoch) {
            reject(l, violation::credit);
            return;
        }
        supersede(l, slot);
    }
    accept_request(l, slot, epoch, bytes, request);
    dispatch(l, index, slot, request);
}

void server::dispatch(peer& l, std::uint32_t index, std::uint32_t slot,
                      const parsed_request& request) noexcept {
    if ((request.header.flags & flag_idempotent) == 0 && !admit(l, index, slot, request.header))
        return;
    if (request.external_body)
        read_request_body(l, index, slot, *request.external_body);
    else
        run_handler(l, index, slot, request.inline_body);
}

void server::forget_call(const detail::reply_cache::entry_ref& e) noexcept {
    if (const std::optional<detail::reply_cache::waiter> w = cache_.forget(e)) {
        try {
            orphans_.push_back(*w);
        } catch (...) {
            // No memory: that copy gets no answer; its caller's deadline ends it.
        }
    }
}

void server::run_orphans() noexcept {
    while (!orphans_.empty()) {
        const detail::reply_cache::waiter w = orphans_.back();
        orphans_.pop_back();
        peer* l = ep_.find(w.peer);
        if (l == nullptr || l->wire->broken || w.slot >= l->slots.size())
            continue;
        slot_state& ss = l->slots[w.slot];
        if (!ss.busy || ss.seq != w.call_seq || abandoned(*l, w.slot))
            continue;
        // Its request is still in the ring (the slot is busy: the caller
        // writes nothing there until answered): read again, as it came.
        parsed_request request;
        if (parse_request(l->wire->inbound(w.slot, ss.bytes), request) != violation::none)
            continue;
        ss.ran = false;
        dispatch(*l, w.peer.index, w.slot, request);
    }
}

void server::supersede(peer& l, std::uint32_t slot) noexcept {
    slot_state& ss = l.slots[slot];
    // The other epoch: the caller gave up on the call in this slot (its
    // deadline passed) and took the slot back. That call is dropped
    // unanswered: a deferred answer finds it gone (another call_seq), a READ
    // of its body still in flight lands in a block no longer the slot's,
    // which its completion gives back. A READ still waiting in the scheduler
    // is withdrawn: the caller revoked the window it names when it gave up,
    // and posting it would fail the queue pair (and end the caller's new
    // call with it).
    if (ss.body_at != no_block && l.wire->cancel(make_wr_id(tag_read, ss.body_at, slot))) {
        if (l.reads > 0)
            --l.reads;
        ++ep_.counters.cancelled_reads;
        release_block(l, ss.body_at);
    }
    ss.busy = false;
    ss.body_at = no_block;
    if (ss.kept && !ss.ran)
        forget_call(*ss.kept); // never ran: a copy re-sent later may
    ss.kept.reset();
}

bool server::admit(peer& l, std::uint32_t index, std::uint32_t slot,
                   const message_header& h) noexcept {
    slot_state& ss = l.slots[slot];
    const bool retry = (h.flags & flag_retry) != 0;
    // A copy of a call sent on an earlier connection has an id under this
    // connection's first, and a connection carries at most a slot count of
    // them: more is a client that makes the server search for nothing.
    if (retry && (h.call_id >= l.first_call || ++l.retries > opts_.slots)) {
        reject(l, violation::malformed);
        return false;
    }
    std::optional<detail::reply_cache::entry_ref> at;
    using verdict = detail::reply_cache::verdict;
    switch (cache_.admit(l.incarnation, h.call_id, retry, housekept_, at)) {
    case verdict::run: ss.kept = at; return true;
    case verdict::cached: {
        std::span<const std::byte> body;
        const call_status st = cache_.reply(*at, body);
        ++ep_.counters.duplicates;
        answer(l, index, slot, st, body, false);
        return false;
    }
    case verdict::running:
        // Its first copy is a deferred call still running: this one waits
        // for that answer, as a deferred call does.
        cache_.set_waiter(*at, {ep_.id_of(index), slot, ss.seq});
        ss.ran = true;
        ++ep_.counters.duplicates;
        return false;
    case verdict::unknown: break;
    }
    ++ep_.counters.unknown_outcomes;
    answer(l, index, slot, call_status::unknown_outcome, {}, false);
    return false;
}

void server::accept_request(peer& l, std::uint32_t slot, bool epoch, std::uint32_t bytes,
                            const parsed_request& request) noexcept {
    slot_state& ss = l.slots[slot];
    ep_.counters.bytes_in += bytes;
    ss.accepted_any = true;
    ss.last_seq = request.header.call_seq;
    ss.busy = true;
    ss.epoch = epoch;
    ss.seq = request.header.call_seq;
    ss.prio = request.header.priority;
    ss.method = request.header.method;
    ss.reply_buffer = request.reply_buffer;
    ss.rails = request.rails.value_or(rail_keys{});
    ss.rail_epoch = l.wire->rail_epoch();
    ss.reply_in_buffer = (request.header.flags & flag_reply_in_buffer) != 0;
    ss.call_id = request.header.call_id;
    ss.idempotent = (request.header.flags & flag_idempotent) != 0;
    ss.ran = false;
    ss.kept.reset();
    ss.bytes = bytes;
}

void server::read_request_body(peer& l, std::uint32_t index, std::uint32_t slot,
                               const buffer_descriptor& d) noexcept {
    slot_state& ss = l.slots[slot];
    const auto refuse_call = [&](call_status st) {
        ++ep_.counters.calls;
        answer(l, index, slot, st, {}, false);
    };
    if (d.length > opts_.max_message) {
        refuse_call(call_status::request_too_large);
        return;
    }
    if (l.free_blocks.empty())
        return refuse_call(call_status::read_failed);
    const std::uint16_t at = l.free_blocks.back();
    try {
        l.blocks[at] = detail::arena_block(ep_.arena, d.length);
    } catch (...) {
        return refuse_call(call_status::read_failed);
    }
    l.free_blocks.pop_back();
    ss.body_at = at;
    const detail::arena_block& blk = l.blocks[at];
    if (abandoned(l, slot)) {
        // Checked again right before the copy (the block's allocation came
        // between): the caller gave the call up, its memory is not read (a
        // CMA read could not be revoked once under way). Dropped unanswered,
        // as a late immediate is.
        ss.body_at = no_block;
        ss.busy = false;
        if (ss.kept)
            forget_call(*ss.kept);
        ss.kept.reset();
        release_block(l, at);
        return;
    }
    ++ep_.counters.external_bodies;
    switch (l.wire->move_body(detail::body_way::read, sched::priority{ss.prio},
                              blk.local(0, d.length), d, make_wr_id(tag_read, at, slot),
                              ss.rail_rkeys(true, l.wire->rail_epoch()))) {
    case detail::transfer::started: ++l.reads; break;
    case detail::transfer::done: // read already (by CMA): the handler runs now
        run_handler(l, index, slot, {blk.data(), d.length});
        break;
    case detail::transfer::failed:
        ss.body_at = no_block;
        release_block(l, at);
        refuse_call(call_status::read_failed);
        break;
    }
}

void server::release_block(peer& l, std::uint16_t at) noexcept {
    l.blocks[at].reset();
    l.free_blocks.push_back(at); // room reserved for every block
}

bool server::abandoned(const peer& l, std::uint32_t slot) noexcept {
    // A caller that gives a call up flips the epoch in its request where it
    // can (node-local: the ring is shared memory), and its next call in the
    // slot writes another request there: either way the ring no longer
    // holds the call this slot is busy with.
    const slot_state& ss = l.slots[slot];
    const auto h =
        detail::load<message_header>(l.wire->inbound(slot, sizeof(message_header)).data());
    return h.call_seq != ss.seq || ((h.flags & flag_epoch) != 0) != ss.epoch;
}

void server::run_handler(peer& l, std::uint32_t index, std::uint32_t slot,
                         std::span<const std::byte> body) noexcept {
    slot_state& ss = l.slots[slot];
    ss.ran = true;
    ++ep_.counters.calls;
    // The body read from the caller is the handler's only while it runs.
    const auto done_with_body = [&] {
        slot_state& now = l.slots[slot];
        if (now.body_at != no_block) {
            release_block(l, now.body_at);
            now.body_at = no_block;
        }
    };
    if (ss.method >= handlers_.size() || !handlers_[ss.method]) {
        ++ep_.counters.unknown_method;
        answer(l, index, slot, call_status::unknown_method, {}, false);
        done_with_body();
        return;
    }
    request_context ctx;
    ctx.srv_ = this;
    ctx.peer_ = ep_.id_of(index);
    ctx.slot_ = slot;
    ctx.seq_ = ss.seq;
    ctx.method_ = ss.method;
    ctx.prio_ = sched::priority{ss.prio};
    ctx.body_ = body;
    ctx.client_ = l.incarnation;
    ctx.call_id_ = ss.call_id;
    ctx.idempotent_ = ss.idempotent;
    ctx.space_ = {l.wire->staging(slot) + sizeof(message_header),
                  l.wire->slot_bytes() - sizeof(message_header)};
    try {
        handlers_[ss.method](ctx);
    } catch (...) {
        // Answered below, if the handler had not yet.
    }
    // The handler may have dropped the connection (disconnect()).
    if (ep_.find(ctx.peer_) == nullptr)
        return;
    if (!ctx.answered_)
        answer(l, index, slot, call_status::handler_failed, {}, false);
    done_with_body();
}

// ---- the answer -----------------------------------------------------------------------------

void server::answer(peer& l, std::uint32_t index, std::uint32_t slot, call_status st,
                    std::span<const std::byte> body, bool in_place) noexcept {
    (void)index;
    slot_state& ss = l.slots[slot];
    if (!ss.busy)
        return;
    if (ss.kept)
        keep_answer(l, slot, st, body); // also when the connection went: a copy may come
    if (l.wire->broken)
        return;
    ss.busy = false;
    message_header h;
    h.call_seq = ss.seq;
    h.call_id = ss.call_id;
    h.priority = ss.prio;
    h.status = static_cast<std::uint32_t>(st);
    std::byte* out = l.wire->staging(slot);
    const std::size_t room = l.wire->slot_bytes() - sizeof(message_header);
    std::uint32_t bytes = sizeof(message_header);
    // Inline if it fits, unless the caller wants every body in its buffer
    // (memory its CPU does not touch: a dma-buf).
    if (body.size() <= room && (body.empty() || !ss.reply_in_buffer)) {
        if (!in_place && !body.empty())
            std::memmove(out + sizeof(message_header), body.data(), body.size());
        h.body_bytes = static_cast<std::uint32_t>(body.size());
        bytes += h.body_bytes;
    } else {
        h.status = static_cast<std::uint32_t>(write_reply_body(l, slot, body, h));
        if (l.wire->broken)
            return;
    }
    std::memcpy(out, &h, sizeof h);
    if (l.wire->send_slot(message_kind::reply, slot, bytes, sched::priority{ss.prio}, ss.epoch) !=
        status::ok) {
        ep_.counters.count_link_end(l.wire->ended(detail::look::cause).value_or(link_end{}));
        l.wire->broken = true;
        return;
    }
    ep_.counters.bytes_out += bytes;
}

call_status server::write_reply_body(peer& l, std::uint32_t slot, std::span<const std::byte> body,
                                     message_header& h) noexcept {
    const slot_state& ss = l.slots[slot];
    const auto st = static_cast<call_status>(h.status);
    if (!ss.reply_buffer || body.size() > ss.reply_buffer->length ||
        body.size() > opts_.max_message || abandoned(l, slot) || l.free_blocks.empty())
        return call_status::reply_too_large;
    // Too large for the slot: into the buffer the caller offered, then the
    // header says so (same level, so posted after the data). The block stays
    // the WRITE's until its completion: the slot may be reused (and answered
    // again) before then.
    const std::uint16_t at = l.free_blocks.back();
    detail::arena_block& blk = l.blocks[at];
    try {
        blk = detail::arena_block(ep_.arena, body.size());
    } catch (...) {
        return call_status::reply_too_large;
    }
    std::memcpy(blk.data(), body.data(), body.size());
    if (abandoned(l, slot)) {
        // Checked again right before the copy into the caller's memory (the
        // copy above came between): only the header goes, which the caller drops.
        blk.reset();
        return call_status::reply_too_large;
    }
    switch (l.wire->move_body(detail::body_way::write, sched::priority{ss.prio},
                              blk.local(0, body.size()), *ss.reply_buffer,
                              make_wr_id(tag_external, at, slot),
                              ss.rail_rkeys(false, l.wire->rail_epoch()))) {
    case detail::transfer::started:
        l.free_blocks.pop_back();
        ++l.writes;
        break;
    case detail::transfer::done: blk.reset(); break; // copied already (CMA)
    case detail::transfer::failed:
        blk.reset();
        ep_.counters.count_link_end(l.wire->ended(detail::look::cause).value_or(link_end{}));
        l.wire->broken = true;
        return st;
    }
    ++ep_.counters.external_replies;
    h.flags = flag_external_reply;
    h.body_bytes = static_cast<std::uint32_t>(body.size());
    ep_.counters.bytes_out += body.size();
    return st;
}

void server::keep_answer(peer& l, std::uint32_t slot, call_status st,
                         std::span<const std::byte> body) noexcept {
    slot_state& ss = l.slots[slot];
    const detail::reply_cache::entry_ref e = *ss.kept;
    ss.kept.reset();
    if (!ss.ran) {
        // The handler never ran (its body could not be read, perhaps for the
        // connection's failure): a copy re-sent later may run.
        forget_call(e);
        return;
    }
    if (const std::optional<detail::reply_cache::waiter> w = cache_.done(e, st, body, housekept_))
        answer_waiter(*w, st, body);
}

void server::answer_waiter(const detail::reply_cache::waiter& w, call_status st,
                           std::span<const std::byte> body) noexcept {
    peer* l = ep_.find(w.peer);
    if (l == nullptr || l->wire->broken || w.slot >= l->slots.size() || !l->slots[w.slot].busy ||
        l->slots[w.slot].seq != w.call_seq)
        return;
    answer(*l, w.peer.index, w.slot, st, body, false);
}

server::peer* server::deferred_peer(const deferred_call& d) noexcept {
    peer* l = ep_.find(d.peer);
    if (l == nullptr || l->wire->broken || d.slot >= l->slots.size() || !l->slots[d.slot].busy ||
        l->slots[d.slot].seq != d.call_seq)
        return nullptr;
    return l;
}

bool server::keep_orphan(const deferred_call& d, call_status st,
                         std::span<const std::byte> bytes) noexcept {
    // The call's connection went (or the call was given up): its answer is
    // kept for the copy the client re-sends, or goes to one waiting already.
    const std::optional<detail::reply_cache::entry_ref> e = cache_.find(d.client, d.call_id);
    if (!e)
        return false;
    const std::optional<detail::reply_cache::waiter> w = cache_.done(*e, st, bytes, housekept_);
    if (!w)
        return false;
    answer_waiter(*w, st, bytes);
    return true;
}

bool server::reply(const deferred_call& d, std::span<const std::byte> bytes) noexcept {
    peer* l = deferred_peer(d);
    if (l == nullptr)
        return keep_orphan(d, call_status::ok, bytes);
    answer(*l, d.peer.index, d.slot, call_status::ok, bytes, false);
    return !l->wire->broken;
}

bool server::fail(const deferred_call& d, call_status s) noexcept {
    if (!handler_status(s))
        s = call_status::handler_failed;
    peer* l = deferred_peer(d);
    if (l == nullptr)
        return keep_orphan(d, s, {});
    answer(*l, d.peer.index, d.slot, s, {}, false);
    return !l->wire->broken;
}

} // namespace rdmax::rpc
