// rpc::client, the call path: start a call in a free slot (expose its
// memory over the slot, encode it, post it), and hand results out.

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <ctime>

#include <rdmax/rpc/client.hpp>

namespace rdmax::rpc {

call_status client::start(peer_id p, std::uint16_t method, std::span<const std::byte> request,
                          const call_options& o) noexcept {
    slot_ref taken;
    return start_on(p, method, request, o, taken);
}

call_status client::start_on(peer_id p, std::uint16_t method, std::span<const std::byte> request,
                             const call_options& o, slot_ref& taken) noexcept {
    if (method == 0)
        return call_status::invalid_method;
    session* ss = find_session(p);
    if (ss == nullptr)
        return call_status::bad_peer;
    // Refused now rather than accepted to wait for a connection and refused then.
    if (const call_status st = check_dmabuf_options(request, o); st != call_status::ok)
        return st;
    if (ss->link != no_link && ep_.peers[ss->link].wire->broken)
        fail_link(ep_.peers[ss->link], ss->link); // seen now, not at the next housekeeping
    // No connection to take it (or calls wait ahead of it): it waits too.
    if (ss->state != peer_state::ready || !ss->waiting.empty())
        return wait_for_link(p.index, method, request, o, taken);
    outgoing call{.request = request,
                  .call_id = next_call_id_,
                  .flags = static_cast<std::uint8_t>(o.idempotent ? flag_idempotent : 0)};
    const std::uint32_t index = ss->link;
    const call_status st = send_on(index, method, call, o, deadline_of(o), taken, true);
    if (st == call_status::ok)
        ++next_call_id_;
    if (st != call_status::peer_gone || !ep_.peers[index].wire->broken)
        return st;
    // The connection failed under this call (nothing went): it waits for the next.
    fail_link(ep_.peers[index], index);
    return wait_for_link(p.index, method, request, o, taken);
}

call_status client::send_on(std::uint32_t index, std::uint16_t method, outgoing& call,
                            const call_options& o, sched::coarse_clock::time_point deadline,
                            slot_ref& taken, bool fresh) noexcept {
    peer& l = ep_.peers[index];
    // Every call started and not yet handed back has a place in results_
    // (one re-sent has had its place since it started).
    if (l.free_slots.empty() || (fresh && in_flight_ >= results_.size())) {
        ++ep_.counters.no_credit;
        return call_status::no_credit;
    }
    if (o.idempotent)
        call.flags |= flag_idempotent;
    const std::uint32_t slot = l.free_slots.back();
    if (const call_status st = expose_call(l, slot, o, call); st != call_status::ok)
        return st;
    const std::uint32_t call_seq = l.next_seq++;
    const bool epoch = !l.slots[slot].epoch; // a new epoch for every call in the slot
    const std::uint32_t bytes = encode_request(l, slot, method, o, call, call_seq, epoch);
    if (holding_ && !l.doorbell_held)
        hold_link(l, index);
    if (const status s = l.wire->send_slot(message_kind::request, slot, bytes, o.priority, epoch);
        s != status::ok)
        return send_refused(l, slot, s);
    track_call(l, slot, method, o, call, call_seq, epoch, bytes, deadline, taken);
    if (!fresh) {
        --in_flight_; // counted since it started
        --ep_.counters.calls;
    }
    return call_status::ok;
}

sched::coarse_clock::time_point client::deadline_of(const call_options& o) const noexcept {
    const auto timeout =
        o.timeout.count() > 0
            ? o.timeout
            : std::chrono::duration_cast<std::chrono::microseconds>(opts_.call_timeout);
    if (ep_.clock != &sched::coarse_clock::now)
        return ep_.now() + timeout; // a clock the tests inject has no lag
    // Counted from the precise clock, checked against the coarse one. The
    // coarse clock is the time of the last tick and lags the time by a jiffy
    // or more (7.8 ms measured with 4 ms jiffies: idle CPUs skip ticks), so a
    // deadline counted from it ends calls early by an unknown amount. Both
    // read CLOCK_MONOTONIC's time line, so the coarse clock reaches this
    // deadline only after the timeout has truly passed: a call ends timed_out
    // never early, at most a tick and a housekeeping interval late. One
    // precise read per call (the vDSO, ~20 ns; a system call under qemu TCG,
    // next to a round trip of 100 us there).
    timespec ts{};
    ::clock_gettime(CLOCK_MONOTONIC, &ts);
    const sched::coarse_clock::time_point start(std::chrono::seconds(ts.tv_sec) +
                                                std::chrono::nanoseconds(ts.tv_nsec));
    return start + timeout;
}

call_status client::check_dmabuf_options(std::span<const std::byte> request,
                                         const call_options& o) const noexcept {
    const bool dev_body = !o.body_dmabuf.empty();
    const bool dev_reply = !o.reply_dmabuf.empty();
    if (!dev_body && !dev_reply)
        return call_status::ok;
    // A body in one place, a reply buffer in one place.
    if ((dev_body && !request.empty()) || (dev_reply && !o.reply_into.empty()))
        return call_status::bad_options;
    // Only the device reaches it (a connection over another path refuses
    // it too, at the call's start: link::grant_access).
    if (!device_ok())
        return call_status::dmabuf_unreachable;
    // Each range with its cache, in this client's protection domain (the
    // keys it gives are no use on this client's queue pairs otherwise).
    for (const dmabuf_range* d : {&o.body_dmabuf, &o.reply_dmabuf})
        if (!d->empty() && (d->cache == nullptr || d->cache->pd().get() != ep_.pd->get()))
            return call_status::bad_options;
    if (dev_body && o.body_dmabuf.length > opts_.max_message)
        return call_status::too_large;
    return call_status::ok;
}

call_status client::expose_call(peer& l, std::uint32_t slot, const call_options& o,
                                outgoing& call) noexcept {
    const bool dev_body = !o.body_dmabuf.empty();
    const bool dev_reply = !o.reply_dmabuf.empty();
    const std::size_t descriptors = o.reply_into.empty() && !dev_reply ? 0 : 1;
    const std::size_t room =
        l.wire->slot_bytes() - sizeof(message_header) - descriptors * sizeof(buffer_descriptor);
    // A dma-buf body is read by the peer at any size: the CPU never copies it
    // into the slot.
    call.external = dev_body || call.request.size() > room;
    const std::size_t body_bytes = dev_body ? o.body_dmabuf.length : call.request.size();
    if (body_bytes > opts_.max_message || (call.external && room < sizeof(buffer_descriptor)))
        return call_status::too_large;
    // Bodies and reply buffers over a slot: registered through the cache (a
    // registration the first time, nanoseconds after), and shown to the peer
    // through windows over exactly their bytes where the link has them;
    // dma-buf ranges registered for the call alone (rdma_link's call_access).
    const detail::call_ranges ranges{
        .body = call.external && !dev_body ? call.request : std::span<const std::byte>{},
        .reply = o.reply_into,
        .dev_body = dev_body ? &o.body_dmabuf : nullptr,
        .dev_reply = dev_reply ? &o.reply_dmabuf : nullptr};
    const detail::access granted = l.wire->grant_access(slot, ranges, call.body, call.reply);
    switch (granted) {
    case detail::access::ok: return call_status::ok;
    case detail::access::owed:
        // Taken last from now on: the next start() tries the other free slots.
        std::rotate(l.free_slots.begin(), l.free_slots.end() - 1, l.free_slots.end());
        ++ep_.counters.no_credit;
        return call_status::no_credit;
    case detail::access::no_room: ++ep_.counters.no_credit; return call_status::no_credit;
    case detail::access::registration_failed: return call_status::registration_failed;
    case detail::access::unreachable: return call_status::dmabuf_unreachable;
    case detail::access::foreign: return call_status::bad_options;
    }
    return call_status::registration_failed;
}

std::uint32_t client::encode_request(peer& l, std::uint32_t slot, std::uint16_t method,
                                     const call_options& o, const outgoing& call,
                                     std::uint32_t call_seq, bool epoch) noexcept {
    message_header header;
    header.call_seq = call_seq;
    header.method = method;
    header.priority = std::min<std::uint8_t>(o.priority.level, sched::priority_levels - 1);
    header.body_bytes =
        call.external ? call.body.length : static_cast<std::uint32_t>(call.request.size());
    header.call_id = call.call_id;
    header.flags = call.flags;
    std::byte* out = l.wire->staging(slot);
    std::size_t at = sizeof(message_header);
    const auto put = [&](const buffer_descriptor& d) {
        std::memcpy(out + at, &d, sizeof d);
        at += sizeof d;
    };
    if (call.external) {
        header.flags |= flag_external_body;
        put(call.body);
        ++ep_.counters.external_bodies;
    }
    if (call.reply.length != 0) {
        header.flags |= flag_reply_buffer;
        if (!o.reply_dmabuf.empty())
            header.flags |= flag_reply_in_buffer;
        put(call.reply);
    }
    // The buffers' keys on the link's other rails, where it showed them
    // there and they fit beside the inline body (else rail 0 alone).
    rail_keys keys;
    if ((call.external || call.reply.length != 0) && l.wire->rail_keys_of(slot, keys) &&
        at + sizeof keys + (call.external ? 0 : call.request.size()) <= l.wire->slot_bytes()) {
        header.flags |= flag_rail_keys;
        std::memcpy(out + at, &keys, sizeof keys);
        at += sizeof keys;
    }
    if (!call.external && !call.request.empty()) {
        std::memcpy(out + at, call.request.data(), call.request.size());
        at += call.request.size();
    }
    if (epoch)
        header.flags |= flag_epoch;
    std::memcpy(out, &header, sizeof header);
    return static_cast<std::uint32_t>(at);
}

call_status client::send_refused(peer& l, std::uint32_t slot, status s) noexcept {
    // The request was not posted, so the peer never learned the keys; the
    // windows are invalidated all the same (their registrations are held
    // until the slot's next call: one cannot go while bound).
    (void)l.wire->end_access(slot, detail::access_end::lazy);
    if (s == status::queue_full) {
        ++ep_.counters.no_credit;
        return call_status::no_credit;
    }
    ep_.counters.count_link_end(l.wire->ended(detail::look::cause).value_or(link_end{}));
    ++ep_.counters.disconnected; // fail_link (in housekeeping) counts a broken link no more
    l.wire->broken = true;
    ep_.housekeep_soon();
    return call_status::peer_gone;
}

void client::track_call(peer& l, std::uint32_t slot, std::uint16_t method, const call_options& o,
                        const outgoing& call, std::uint32_t call_seq, bool epoch,
                        std::uint32_t bytes, sched::coarse_clock::time_point deadline,
                        slot_ref& taken) noexcept {
    l.free_slots.pop_back();
    slot_state& ss = l.slots[slot];
    ss.phase = slot_phase::in_flight;
    ss.epoch = epoch;
    ss.seq = call_seq;
    ss.bytes = bytes;
    ss.at_body = call.external ? bytes : bytes - static_cast<std::uint32_t>(call.request.size());
    ss.method = method;
    ss.flags = call.flags & flag_idempotent;
    ss.priority = std::min<std::uint8_t>(o.priority.level, sched::priority_levels - 1);
    ss.external = call.external ? call.request : std::span<const std::byte>{};
    ss.call_id = call.call_id;
    ss.cookie = o.cookie;
    ss.reply_into = o.reply_into;
    ss.body_dmabuf = o.body_dmabuf;
    ss.reply_dmabuf = o.reply_dmabuf;
    ss.dmabuf_reply_bytes = 0;
    ss.deadline = deadline;
    ++l.in_flight;
    ++in_flight_;
    ++ep_.counters.calls;
    ep_.counters.bytes_out += bytes;
    taken = {static_cast<std::uint32_t>(&l - ep_.peers.data()), slot, call_seq, true, call.call_id};
}

// ---- results --------------------------------------------------------------------------------

void client::grow_results(std::size_t more) {
    std::size_t need = more;
    for (const peer& l : ep_.peers)
        need += l.slots.size();
    if (need <= results_.size())
        return;
    std::vector<call_result> r(need);
    std::vector<slot_ref> q(need);
    for (std::size_t i = 0; i < results_count_; ++i) {
        r[i] = results_[(results_head_ + i) % results_.size()];
        q[i] = queued_slots_[(results_head_ + i) % results_.size()];
    }
    results_ = std::move(r);
    queued_slots_ = std::move(q);
    results_head_ = 0;
    handed_out_.reserve(need);
}

void client::push_result(const call_result& r, const slot_ref& ref) noexcept {
    // Never full: it holds one result per slot at most, and has room for every slot.
    const std::size_t at = (results_head_ + results_count_) % results_.size();
    results_[at] = r;
    queued_slots_[at] = ref;
    ++results_count_;
}

void client::release_handed_out() noexcept {
    for (const slot_ref& r : handed_out_) {
        if (!r.release || r.slot == no_slot || r.link == no_link)
            continue;
        peer& l = ep_.peers[r.link];
        if (!l.wire)
            continue;
        slot_state& ss = l.slots[r.slot];
        if (ss.phase == slot_phase::done && ss.seq == r.seq) {
            ss.phase = slot_phase::free;
            --l.held;
            if (!l.wire->broken)
                l.free_slots.push_back(static_cast<std::uint16_t>(r.slot));
        }
    }
    handed_out_.clear();
}

void client::release(std::uint64_t cookie) noexcept {
    for (slot_ref& r : handed_out_) {
        if (!r.release || r.slot == no_slot || r.link == no_link)
            continue;
        peer& l = ep_.peers[r.link];
        if (!l.wire)
            continue;
        slot_state& ss = l.slots[r.slot];
        if (ss.phase != slot_phase::done || ss.seq != r.seq || ss.cookie != cookie)
            continue;
        ss.phase = slot_phase::free;
        --l.held;
        if (!l.wire->broken)
            l.free_slots.push_back(static_cast<std::uint16_t>(r.slot));
        r.release = false; // the next poll() finds it given back already
        return;
    }
}

void client::hold_link(peer& l, std::uint32_t index) noexcept {
    if (held_count_ == held_.size() || !l.wire->hold_doorbell(true))
        return; // the list is full, or the link posts at once anyway
    l.doorbell_held = true;
    held_[held_count_++] = index;
}

void client::ring_held() noexcept {
    holding_ = false;
    for (std::size_t i = 0; i < held_count_; ++i) {
        // A connection torn down meanwhile (its entry empty, or another's
        // since) holds nothing: its calls went with it.
        if (held_[i] >= ep_.peers.size())
            continue;
        peer& l = ep_.peers[held_[i]];
        if (!l.wire || !l.doorbell_held)
            continue;
        l.doorbell_held = false;
        // A broken link posts nothing more (its queue pair is in error):
        // its held requests end with it.
        if (!l.wire->broken)
            (void)l.wire->hold_doorbell(false);
    }
    held_count_ = 0;
}

int client::poll(std::span<call_result> out) noexcept {
    release_handed_out();
    progress();
    report_states();
    int n = 0;
    while (results_count_ > 0 && static_cast<std::size_t>(n) < out.size()) {
        out[static_cast<std::size_t>(n++)] = results_[results_head_];
        handed_out_.push_back(queued_slots_[results_head_]);
        results_head_ = (results_head_ + 1) % results_.size();
        --results_count_;
        --in_flight_;
    }
    return n;
}

bool client::take_result(const slot_ref& taken, call_result& mine) noexcept {
    for (std::size_t i = 0; i < results_count_; ++i) {
        const std::size_t at = (results_head_ + i) % results_.size();
        const slot_ref& r = queued_slots_[at];
        // By its id: the call may have moved to another connection since.
        if (r.call_id != taken.call_id)
            continue;
        mine = results_[at];
        handed_out_.push_back(r);
        for (std::size_t j = i; j + 1 < results_count_; ++j) {
            const std::size_t from = (results_head_ + j + 1) % results_.size();
            const std::size_t to = (results_head_ + j) % results_.size();
            results_[to] = results_[from];
            queued_slots_[to] = queued_slots_[from];
        }
        --results_count_;
        --in_flight_;
        return true;
    }
    return false;
}

call_result client::call(peer_id p, std::uint16_t method, std::span<const std::byte> request,
                         const call_options& o) noexcept {
    // What is held goes first (and this call with it), even if this one
    // cannot start.
    if (holding_)
        ring_held();
    release_handed_out();
    slot_ref taken;
    if (const call_status s = start_on(p, method, request, o, taken); s != call_status::ok)
        return {o.cookie, p, s, {}};
    call_result mine;
    for (;;) {
        progress();
        report_states();
        if (take_result(taken, mine))
            return mine;
    }
}

int client::wait(std::span<call_result> out, std::chrono::microseconds timeout) noexcept {
    return ep_.wait(timeout, [&] { return poll(out); });
}

// ---- what a caller asks about a peer ---------------------------------------------------------

bool client::is_local(peer_id p) const noexcept {
    const peer* l = link_of(p);
    return l != nullptr && l->wire->node_local();
}

std::optional<rpc::transport> client::transport(peer_id p) const noexcept {
    const peer* l = link_of(p);
    if (l == nullptr)
        return std::nullopt;
    return l->wire->kind();
}

std::optional<sched::scheduler_counters> client::scheduler_counters(peer_id p) const noexcept {
    const peer* l = link_of(p);
    return l != nullptr ? l->wire->scheduler_counters() : std::nullopt;
}

bool client::connected(peer_id p) const noexcept {
    const peer* l = link_of(p);
    return l != nullptr && !l->wire->broken && state(p) == peer_state::ready;
}

std::uint16_t client::slots(peer_id p) const noexcept {
    const session* ss = find_session(p);
    return ss != nullptr ? ss->slots : 0;
}

std::uint32_t client::slot_bytes(peer_id p) const noexcept {
    const session* ss = find_session(p);
    return ss != nullptr ? ss->slot_bytes : 0;
}

} // namespace rdmax::rpc
