#include <algorithm>
#include <arpa/inet.h>
#include <array>
#include <cerrno>
#include <cstring>
#include <new>
#include <system_error>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/local/cma.hpp>
#include <rdmax/rpc/server.hpp>

#include "../notice.hpp"

namespace rdmax::rpc {

namespace {
// What a scheduler completion's wr_id names: bits 56.. the kind (0: a
// reply, whose completions are failures only), 16..31 a generation, 0..15
// the slot.
constexpr std::uint64_t tag_read = 1;
constexpr std::uint64_t tag_external = 2;
constexpr std::uint64_t make_wr_id(std::uint64_t tag, std::uint32_t gen, std::uint32_t slot) {
    return (tag << 56) | (std::uint64_t{gen & 0xffffU} << 16) | slot;
}

std::uint32_t inbox_depth(const rpc_options& o) {
    return std::clamp<std::uint32_t>(std::uint32_t{o.slots} * 16U, 256, 16384);
}

handle_options ring_key_options() {
    handle_options h;
    // A registration of each ring alone, made before the connection is up
    // (its key goes in the accept), which a window could not be.
    h.revoke = revoke_by::memory_region;
    return h;
}
} // namespace

// ---- request_context ------------------------------------------------------------------------

std::size_t request_context::reply_capacity() const noexcept {
    const server::link* l = srv_->find(peer_);
    std::size_t most = space_.size();
    if (l != nullptr && l->slots[slot_].reply_buffer)
        most = std::max<std::size_t>(most, l->slots[slot_].reply_buffer->length);
    return most;
}

void request_context::reply(std::span<const std::byte> bytes) noexcept {
    if (answered_)
        return;
    answered_ = true;
    if (server::link* l = srv_->find(peer_))
        srv_->answer(*l, peer_.index, slot_, call_status::ok, bytes, false);
}

void request_context::reply_in_place(std::size_t n) noexcept {
    if (answered_)
        return;
    answered_ = true;
    if (server::link* l = srv_->find(peer_))
        srv_->answer(*l, peer_.index, slot_, call_status::ok,
                     space_.first(std::min(n, space_.size())), true);
}

void request_context::fail(call_status s) noexcept {
    if (answered_)
        return;
    answered_ = true;
    if (!server_status(static_cast<std::uint32_t>(s)) || s == call_status::ok)
        s = call_status::handler_failed;
    if (server::link* l = srv_->find(peer_))
        srv_->answer(*l, peer_.index, slot_, s, {}, false);
}

deferred_call request_context::defer() noexcept {
    answered_ = true;
    return {peer_, slot_, seq_};
}

// ---- server ---------------------------------------------------------------------------------

server::server(const verbs::protection_domain& pd, std::string_view addr, std::uint16_t port,
               rpc_options opts)
    : pd_(&pd)
    , opts_((opts.check("rpc::server"), opts))
    , arena_(verbs_registrar(pd), opts_.ring_arena())
    , issuer_(pd, ring_key_options())
    , inbox_(pd, inbox_depth(opts_))
    , listener_(addr, port) {
    inbox_.watch(listener_.fd());
    if (opts_.local) {
        // Peers on this node find the server by this name (the address as the
        // client names it, and the port). Another process may hold it: then
        // this one is reached through the device only.
        try {
            local_listener_.emplace(local_name(addr, listener_.port()));
            inbox_.watch(local_listener_->fd());
        } catch (const error& e) {
            local_listener_.reset();
            rdmax::detail::notice(
                fmt::format("rpc::server on {}:{}: no node-local path ({}); peers "
                            "here go through the device",
                            addr, listener_.port(), e.what()));
        }
    }
    links_.reserve(opts_.max_peers);
    by_qp_.reserve(std::size_t{opts_.max_peers} * 2);
}

server::server(detail::no_device_t no_device, rpc_options opts)
    : pd_(nullptr)
    , opts_((opts.check("rpc::server"), opts))
    , arena_(verbs_registrar(no_device), opts_.ring_arena())
    , inbox_(no_device) {
    links_.reserve(opts_.max_peers);
}

server::~server() {
    for (handshake& h : handshakes_)
        inbox_.forget(h.ch.fd());
    for (std::uint32_t i = 0; i < links_.size(); ++i)
        if (links_[i].wire)
            teardown(i);
}

void server::on(std::uint16_t method, handler h) {
    if (method == 0)
        throw_error("rpc::server::on", EINVAL, "method id 0 is reserved");
    if (handlers_.size() <= method)
        handlers_.resize(std::size_t{method} + 1);
    handlers_[method] = std::move(h);
}

std::optional<sched::scheduler_counters> server::scheduler_counters(peer_id p) noexcept {
    const link* l = find(p);
    return l != nullptr ? l->wire->scheduler_counters() : std::nullopt;
}

server::link* server::find(peer_id p) noexcept {
    if (p.index >= links_.size())
        return nullptr;
    link& l = links_[p.index];
    if (!l.wire || l.generation != p.generation)
        return nullptr;
    return &l;
}

bool server::is_local(peer_id p) const noexcept {
    const link* l = const_cast<server*>(this)->find(p);
    return l != nullptr && l->wire->is_local();
}

int server::poll() noexcept {
    const std::uint64_t before = counters_.calls;
    ibv_wc wcs[32];
    const int n = inbox_.poll(wcs);
    for (int i = 0; i < n; ++i)
        on_receive(wcs[i]);
    if (n > 0)
        inbox_.replenish(static_cast<std::uint32_t>(n));
    for (std::uint32_t i = 0; i < links_.size(); ++i) {
        link& l = links_[i];
        if (!l.wire || l.wire->broken)
            continue;
        if (l.wire->is_local()) {
            // Its immediates come through its own message ring.
            if (!l.wire->drain_imms([&](std::uint32_t imm) { on_imm(l, i, imm); }))
                reject(l, violation::malformed);
        } else if (l.reads != 0 || l.writes != 0 || l.wire->needs_progress()) {
            drive(l);
        }
    }
    if (sched::coarse_clock::now() >= next_housekeeping_)
        housekeeping();
    return static_cast<int>(counters_.calls - before);
}

int server::wait(std::chrono::microseconds timeout) noexcept {
    if (const int n = poll(); n != 0)
        return n;
    (void)inbox_.arm();
    // Peers on this node wake this side through an eventfd, if asked to.
    bool asleep = true;
    for (link& l : links_)
        if (l.wire && !l.wire->broken && !l.wire->prepare_sleep())
            asleep = false;
    if (const int n = poll(); n != 0 || !asleep) {
        for (link& l : links_)
            if (l.wire)
                l.wire->woke();
        return n != 0 ? n : poll();
    }
    inbox_.sleep(std::min<std::chrono::microseconds>(timeout, std::chrono::milliseconds(50)));
    for (link& l : links_)
        if (l.wire)
            l.wire->woke();
    // Whatever woke it (a completion, a connection event): look now.
    next_housekeeping_ = {};
    return poll();
}

void server::on_receive(const ibv_wc& wc) noexcept {
    const auto it = by_qp_.find(wc.qp_num);
    if (it == by_qp_.end()) {
        ++counters_.stray_completions;
        return;
    }
    link& l = links_[it->second];
    if (l.wire->broken) {
        ++counters_.stray_completions;
        return;
    }
    if (l.establish_by) {
        // The peer's first message may come before rdma_cm's ESTABLISHED
        // (which follows the peer's RTU): it proves the connection is up.
        l.wire->established_by_traffic();
        l.establish_by.reset();
    }
    if (wc.status != IBV_WC_SUCCESS) {
        // A flush is the connection going away; anything else is the peer's
        // doing (a send into a zero-length receive: local length error).
        if (wc.status == IBV_WC_WR_FLUSH_ERR)
            l.wire->broken = true;
        else
            reject(l, violation::bad_opcode);
        return;
    }
    if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM || (wc.wc_flags & IBV_WC_WITH_IMM) == 0) {
        reject(l, violation::bad_opcode);
        return;
    }
    on_imm(l, it->second, ntohl(wc.imm_data));
}

void server::on_imm(link& l, std::uint32_t index, std::uint32_t imm) noexcept {
    const imm_fields f = decode_imm(imm);
    if (const violation v =
            check_imm(f, message_kind::request, l.wire->slots(), l.wire->slot_bytes());
        v != violation::none) {
        reject(l, v);
        return;
    }
    on_request(l, index, f.slot, f.bytes, f.epoch);
}

bool server::abandoned_locally(link& l, std::uint32_t slot) noexcept {
    if (!l.wire->is_local())
        return false; // the device path fences with the caller's windows
    // The caller flips the epoch in its request when it gives the call up:
    // then nothing goes into its buffer by CMA (which cannot be revoked).
    const slot_state& ss = l.slots[slot];
    const auto h =
        detail::load<message_header>(l.wire->inbound(slot, sizeof(message_header)).data());
    return h.call_seq != ss.seq || ((h.flags & flag_epoch) != 0) != ss.epoch;
}

void server::release_block(link& l, std::uint16_t at) noexcept {
    l.blocks[at].reset();
    l.free_blocks.push_back(at); // room reserved for every block
}

void server::on_request(link& l, std::uint32_t index, std::uint32_t slot, std::uint32_t bytes,
                        bool epoch) noexcept {
    slot_state& ss = l.slots[slot];
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
    parsed_request pr;
    if (const violation v = parse_request(in, pr); v != violation::none) {
        reject(l, v);
        return;
    }
    if (ss.busy) {
        if (epoch == ss.epoch) {
            reject(l, violation::credit);
            return;
        }
        // The other epoch: the caller gave up on the call in this slot (its
        // deadline passed) and took the slot back. That call is dropped
        // unanswered: a deferred answer finds it gone (another call_seq), a
        // READ of its body still in flight lands in a block no longer the
        // slot's, which its completion gives back. A READ still waiting in
        // the scheduler is withdrawn: the caller revoked the window it names
        // when it gave up, and posting it would fail the queue pair (and
        // end the caller's new call with it).
        if (ss.body_at != no_block && l.wire->cancel(make_wr_id(tag_read, ss.body_at, slot))) {
            if (l.reads > 0)
                --l.reads;
            ++counters_.cancelled_reads;
            release_block(l, ss.body_at);
        }
        ss.busy = false;
        ss.body_at = no_block;
    }
    counters_.bytes_in += bytes;
    ss.accepted_any = true;
    ss.last_seq = pr.header.call_seq;
    ss.busy = true;
    ss.epoch = epoch;
    ss.seq = pr.header.call_seq;
    ss.prio = pr.header.priority;
    ss.method = pr.header.method;
    ss.reply_buffer = pr.reply_buffer;
    if (!pr.external_body) {
        run_handler(l, index, slot, pr.inline_body);
        return;
    }
    // The body stays in the caller's memory: read it, then run the handler.
    const buffer_descriptor d = *pr.external_body;
    if (d.length > opts_.max_message) {
        ++counters_.calls;
        answer(l, index, slot, call_status::request_too_large, {}, false);
        return;
    }
    bool got = false;
    if (!l.free_blocks.empty()) {
        try {
            l.blocks[l.free_blocks.back()] = arena_block(arena_, d.length);
            got = true;
        } catch (...) {
        }
    }
    if (!got) {
        ++counters_.calls;
        answer(l, index, slot, call_status::read_failed, {}, false);
        return;
    }
    const std::uint16_t at = l.free_blocks.back();
    l.free_blocks.pop_back();
    ss.body_at = at;
    const arena_block& blk = l.blocks[at];
    if (abandoned_locally(l, slot)) {
        // Checked again right before the CMA read (the block's allocation
        // came between): the caller gave the call up, its memory is not
        // read. Dropped unanswered, as a late immediate is.
        ss.body_at = no_block;
        ss.busy = false;
        release_block(l, at);
        return;
    }
    ++counters_.external_bodies;
    switch (l.wire->read_body(sched::priority{ss.prio}, blk.local(0, d.length), d,
                              make_wr_id(tag_read, at, slot))) {
    case transfer::started: ++l.reads; break;
    case transfer::done: // read already (by CMA): the handler runs now
        run_handler(l, index, slot, {blk.data(), d.length});
        break;
    case transfer::failed:
        ss.body_at = no_block;
        release_block(l, at);
        ++counters_.calls;
        answer(l, index, slot, call_status::read_failed, {}, false);
        break;
    }
}

void server::run_handler(link& l, std::uint32_t index, std::uint32_t slot,
                         std::span<const std::byte> body) noexcept {
    slot_state& ss = l.slots[slot];
    ++counters_.calls;
    // The body read from the caller is the handler's only while it runs.
    const auto done_with_body = [&] {
        slot_state& now = l.slots[slot];
        if (now.body_at != no_block) {
            release_block(l, now.body_at);
            now.body_at = no_block;
        }
    };
    if (ss.method >= handlers_.size() || !handlers_[ss.method]) {
        ++counters_.unknown_method;
        answer(l, index, slot, call_status::unknown_method, {}, false);
        done_with_body();
        return;
    }
    request_context ctx;
    ctx.srv_ = this;
    ctx.peer_ = {index, l.generation};
    ctx.slot_ = slot;
    ctx.seq_ = ss.seq;
    ctx.method_ = ss.method;
    ctx.prio_ = sched::priority{ss.prio};
    ctx.body_ = body;
    ctx.space_ = {l.wire->staging(slot) + sizeof(message_header),
                  l.wire->slot_bytes() - sizeof(message_header)};
    try {
        handlers_[ss.method](ctx);
    } catch (...) {
        // Answered below, if the handler had not yet.
    }
    // The handler may have dropped the connection (disconnect()).
    if (find(ctx.peer_) == nullptr)
        return;
    if (!ctx.answered_)
        answer(l, index, slot, call_status::handler_failed, {}, false);
    done_with_body();
}

void server::answer(link& l, std::uint32_t index, std::uint32_t slot, call_status st,
                    std::span<const std::byte> body, bool in_place) noexcept {
    (void)index;
    slot_state& ss = l.slots[slot];
    if (!ss.busy || l.wire->broken)
        return;
    ss.busy = false;
    message_header h;
    h.call_seq = ss.seq;
    h.priority = ss.prio;
    h.status = static_cast<std::uint32_t>(st);
    std::byte* out = l.wire->staging(slot);
    const std::size_t room = l.wire->slot_bytes() - sizeof(message_header);
    const sched::priority p{ss.prio};
    std::uint32_t bytes = sizeof(message_header);
    if (body.size() <= room) {
        if (!in_place && !body.empty())
            std::memmove(out + sizeof(message_header), body.data(), body.size());
        h.body_bytes = static_cast<std::uint32_t>(body.size());
        bytes += h.body_bytes;
    } else if (ss.reply_buffer && body.size() <= ss.reply_buffer->length &&
               body.size() <= opts_.max_message && !abandoned_locally(l, slot)) {
        // Too large for the slot: into the buffer the caller offered, then
        // the header says so (same level, so posted after the data). The
        // block stays the WRITE's until its completion: the slot may be
        // reused (and answered again) before then.
        arena_block* blk = nullptr;
        if (!l.free_blocks.empty()) {
            blk = &l.blocks[l.free_blocks.back()];
            try {
                *blk = arena_block(arena_, body.size());
            } catch (...) {
                blk = nullptr;
            }
        }
        if (blk != nullptr) {
            std::memcpy(blk->data(), body.data(), body.size());
            if (abandoned_locally(l, slot)) {
                // Checked again right before the CMA write (the copy came
                // between): only the header goes, which the caller drops.
                blk->reset();
                blk = nullptr;
            }
        }
        if (blk == nullptr) {
            h.status = static_cast<std::uint32_t>(call_status::reply_too_large);
        } else {
            const std::uint16_t at = l.free_blocks.back();
            switch (l.wire->write_body(p, blk->local(0, body.size()), *ss.reply_buffer,
                                       make_wr_id(tag_external, at, slot))) {
            case transfer::started:
                l.free_blocks.pop_back();
                ++l.writes;
                break;
            case transfer::done: blk->reset(); break; // copied already (CMA)
            case transfer::failed:
                blk->reset();
                counters_.count_link_end(l.wire->why_ended());
                l.wire->broken = true;
                return;
            }
            ++counters_.external_replies;
            h.flags = flag_external_reply;
            h.body_bytes = static_cast<std::uint32_t>(body.size());
            counters_.bytes_out += body.size();
        }
    } else {
        h.status = static_cast<std::uint32_t>(call_status::reply_too_large);
    }
    std::memcpy(out, &h, sizeof h);
    if (l.wire->send_slot(message_kind::reply, slot, bytes, p, ss.epoch) != status::ok) {
        counters_.count_link_end(l.wire->why_ended());
        l.wire->broken = true;
        return;
    }
    counters_.bytes_out += bytes;
}

void server::drive(link& l) noexcept {
    verbs::completion out[16];
    const int n = l.wire->poll_transfers(out);
    for (int i = 0; i < n; ++i) {
        const verbs::completion& c = out[i];
        const std::uint64_t tag = c.wr_id >> 56;
        const auto at = static_cast<std::uint16_t>((c.wr_id >> 16) & 0xffffU);
        const auto slot = static_cast<std::uint32_t>(c.wr_id & 0xffffU);
        if (!c.ok())
            l.wire->broken = true;
        // The transfer is over (done or flushed): its block is free again,
        // once the handler had a request body.
        const bool owned = at < l.blocks.size() && l.blocks[at];
        if (tag == tag_external && owned) {
            release_block(l, at);
            --l.writes;
        } else if (tag == tag_read) {
            if (l.reads > 0)
                --l.reads;
            if (!owned)
                continue;
            // Still the body of the call in its slot (not one superseded)?
            slot_state* ss = slot < l.slots.size() ? &l.slots[slot] : nullptr;
            const bool current = ss != nullptr && ss->busy && ss->body_at == at;
            if (current && !l.wire->broken) {
                const auto index = static_cast<std::uint32_t>(&l - links_.data());
                run_handler(l, index, slot, {l.blocks[at].data(), l.blocks[at].size()});
            } else {
                if (current)
                    ss->body_at = no_block;
                release_block(l, at);
            }
        }
    }
    if (l.wire->failed() && !l.wire->broken) {
        counters_.count_link_end(l.wire->why_ended());
        l.wire->broken = true;
    }
}

void server::reject(link& l, violation v) noexcept {
    if (v == violation::none)
        return;
    counters_.count(v);
    // Closed at the next housekeeping, after the completions already queued
    // for it are taken; from now on they are dropped.
    l.wire->broken = true;
    next_housekeeping_ = {};
}

void server::housekeeping() noexcept {
    next_housekeeping_ = sched::coarse_clock::now() + opts_.housekeeping;
    // The rdma_cm channels (new requests, peers that left) are read only when
    // one has something: otherwise this costs one epoll_wait.
    const bool events = inbox_.events_pending();
    if (events) {
        try {
            accept_pending();
        } catch (...) {
            refuse_current("rdma_cm connection request");
        }
        // At most a round's worth: a flood of connections does not hold the
        // thread (the rest wait in the backlog for the next round).
        for (int k = 0; k < 64 && local_listener_ && !listener_paused_; ++k) {
            local::unix_channel ch;
            try {
                ch = local_listener_->accept(std::chrono::milliseconds(0));
            } catch (const std::system_error& e) {
                refuse_current("node-local connection");
                const int err = e.code().value();
                if (err == EMFILE || err == ENFILE) {
                    // The connection stays in the backlog, the listener stays
                    // readable: watched, it would wake every wait() at once.
                    // Not watched until a later round, then tried again.
                    inbox_.forget(local_listener_->fd());
                    listener_paused_ = true;
                    listener_back_ = sched::coarse_clock::now() + listener_pause();
                }
                break;
            } catch (...) {
                refuse_current("node-local connection");
                break;
            }
            if (ch.fd() < 0)
                break;
            start_local(std::move(ch));
        }
    }
    if (listener_paused_ && sched::coarse_clock::now() >= listener_back_) {
        try {
            inbox_.watch(local_listener_->fd()); // readable: the next round accepts
            listener_paused_ = false;
            next_housekeeping_ = {};
        } catch (...) {
            listener_back_ = sched::coarse_clock::now() + listener_pause();
        }
    }
    progress_handshakes(events);
    bool any_broken = false;
    const auto now = sched::coarse_clock::now();
    for (link& l : links_) {
        if (!l.wire)
            continue;
        // Reaps what poll() left (unsignaled requests' slots, failures).
        if (!l.wire->broken && l.wire->has_outstanding())
            drive(l);
        if (!l.wire->broken && (l.wire->failed() || (events && l.wire->peer_gone()))) {
            counters_.count_link_end(l.wire->why_ended());
            l.wire->broken = true;
        }
        if (l.establish_by && !l.wire->broken) {
            if (l.wire->established())
                l.establish_by.reset();
            else if (now >= *l.establish_by)
                l.wire->broken = true; // its handshake never ended
        }
        any_broken = any_broken || l.wire->broken;
    }
    if (!any_broken)
        return;
    // Take every completion already queued (a broken link's are dropped), so
    // that none is left for a queue pair number a new connection may reuse.
    ibv_wc wcs[32];
    for (int n; (n = inbox_.poll(wcs)) > 0;) {
        for (int i = 0; i < n; ++i)
            on_receive(wcs[i]);
        inbox_.replenish(static_cast<std::uint32_t>(n));
    }
    for (std::uint32_t i = 0; i < links_.size(); ++i)
        if (links_[i].wire && links_[i].wire->broken)
            teardown(i);
}

std::chrono::nanoseconds server::listener_pause() const noexcept {
    return std::max<std::chrono::nanoseconds>(opts_.housekeeping, std::chrono::milliseconds(50));
}

void server::accept_pending() {
    while (std::optional<verbs::connection_request> req = listener_.poll_request()) {
        try {
            accept_one(std::move(*req));
        } catch (...) {
            refuse_current("rdma_cm connection request"); // rejected as it goes
        }
    }
}

void server::accept_one(verbs::connection_request req) {
    const std::optional<ring_offer> offer = req.peer_payload_as<ring_offer>();
    const char* bad = !offer ? "no ring offer" : check_offer(*offer);
    if (live_ >= opts_.max_peers || bad != nullptr) {
        if (bad != nullptr)
            counters_.count_refusal_fmt(EPROTO, "rdma_cm connection request: {}", bad);
        else
            counters_.count_refusal_fmt(
                EBUSY, "rdma_cm connection request: {} peers already (max_peers)", live_);
        req.reject();
        return;
    }
    const auto slots = std::min<std::uint16_t>(offer->slots, opts_.slots);
    const std::uint32_t slot_bytes = std::min(offer->slot_bytes, opts_.slot_bytes);
    auto wire = std::make_unique<peer_link>(arena_, issuer_, slots, slot_bytes);
    req.create_qp(*pd_, link_qp_config(inbox_, slots, pd_->device().limits(), false));
    const ring_offer mine = wire->offer();
    // Not waiting for ESTABLISHED: housekeeping looks for it (or the first
    // message proves it), and drops the connection at connect_timeout.
    verbs::connection conn = req.accept_nowait(verbs::payload_of(mine));
    ring_offer peer = *offer;
    peer.slots = slots;
    peer.slot_bytes = slot_bytes;
    // Room in the scheduler for every request the slots can have at once:
    // each block's READ or WRITE (3 x slots + 8 blocks, superseded calls'
    // included), a reply per slot, and what is posted but not yet reaped.
    // One it refused would end a connection whose peer kept to its credits.
    sched::scheduler_options so = opts_.scheduler;
    so.max_requests = std::max<std::uint32_t>(
        so.max_requests, 4U * slots + 8U + std::max<std::uint32_t>(so.budget_wqes, 16U));
    wire->attach(std::move(conn), peer, so);
    peer_link* v = wire.get();
    const std::uint32_t index = add_link(std::move(wire), slots);
    links_[index].verbs = v;
    links_[index].establish_by = sched::coarse_clock::now() + opts_.connect_timeout;
    try {
        by_qp_[v->qp_num()] = index;
    } catch (...) {
        links_[index].wire->broken = true; // torn down at the next housekeeping
        next_housekeeping_ = {};
        throw;
    }
}

std::uint32_t server::add_link(std::unique_ptr<link_wire> wire, std::uint16_t slots) {
    // Whatever may throw comes first, undone on the way out; then the
    // commit, which cannot fail: a link is live (and counted in live_) or
    // not there at all.
    std::vector<slot_state> fresh(slots);
    // Room for a body being read and a reply being written per slot, and as
    // many again whose slots were reused before their completion was reaped.
    const std::size_t blocks = std::min<std::size_t>(3U * slots + 8U, no_block);
    std::vector<arena_block> fresh_blocks(blocks);
    std::vector<std::uint16_t> fresh_free;
    fresh_free.reserve(blocks);
    for (std::size_t i = blocks; i-- > 0;)
        fresh_free.push_back(static_cast<std::uint16_t>(i));
    if (free_links_.empty()) {
        free_links_.reserve(links_.size() + 1);
        links_.emplace_back();
        free_links_.push_back(static_cast<std::uint32_t>(links_.size() - 1));
    }
    const int event_fd = wire->event_fd();
    const int wake_fd = wire->wake_fd();
    inbox_.watch(event_fd);
    if (wake_fd >= 0) {
        try {
            inbox_.watch(wake_fd);
        } catch (...) {
            inbox_.forget(event_fd);
            throw;
        }
    }
    const std::uint32_t index = free_links_.back();
    free_links_.pop_back();
    link& l = links_[index];
    l.generation = ++generations_;
    l.slots = std::move(fresh);
    l.blocks = std::move(fresh_blocks);
    l.free_blocks = std::move(fresh_free);
    l.reads = 0;
    l.writes = 0;
    l.establish_by.reset();
    l.verbs = nullptr;
    l.wire = std::move(wire);
    ++live_;
    ++counters_.connected;
    return index;
}

void server::refuse(int err, std::string_view why) noexcept {
    counters_.count_refusal(err, why);
}

void server::refuse_current(std::string_view what) noexcept {
    try {
        throw;
    } catch (const std::system_error& e) {
        // what() ends in the error's text, which last_refusal's printer adds
        // again after its errno: kept once.
        std::string_view w = e.what();
        if (e.code().category() == std::generic_category()) {
            const std::string_view text = std::strerror(e.code().value());
            if (w.size() > text.size() + 2 && w.ends_with(text) &&
                w.substr(w.size() - text.size() - 2, 2) == ": ")
                w.remove_suffix(text.size() + 2);
        }
        counters_.count_refusal_fmt(e.code().value(), "{}: {}", what, w);
    } catch (const std::bad_alloc&) {
        refuse(ENOMEM, what);
    } catch (const std::exception& e) {
        counters_.count_refusal_fmt(0, "{}: {}", what, std::string_view(e.what()));
    } catch (...) {
        refuse(0, what);
    }
}

void server::start_local(local::unix_channel ch) noexcept {
    if (handshakes_.size() >= opts_.max_peers) {
        counters_.count_refusal_fmt(EBUSY,
                                    "node-local connection: {} handshakes under way already "
                                    "(max_peers)",
                                    handshakes_.size());
        return; // closed as it goes
    }
    // One user cannot hold every handshake: at most a quarter of max_peers
    // (and 4) each, so that a user's silent connections leave room for others.
    uid_t uid = 0;
    try {
        uid = ch.peer().uid;
    } catch (...) {
        refuse_current("node-local connection");
        return;
    }
    const std::size_t per_uid = std::max<std::size_t>(4, opts_.max_peers / 4);
    const auto same = static_cast<std::size_t>(std::count_if(
        handshakes_.begin(), handshakes_.end(), [&](const handshake& h) { return h.uid == uid; }));
    if (same >= per_uid) {
        counters_.count_refusal_fmt(EBUSY,
                                    "node-local connection: {} handshakes of uid {} under way "
                                    "already (max_peers / 4)",
                                    same, uid);
        return; // closed as it goes
    }
    const int fd = ch.fd();
    try {
        inbox_.watch(fd);
    } catch (...) {
        refuse_current("node-local connection");
        return;
    }
    // Held here until it is in the table: if that throws, the socket is
    // forgotten by the epoll set before it closes (its number may be reused).
    handshake h{std::move(ch), local::message_reader(sizeof(local_hello), 0),
                sched::coarse_clock::now() + opts_.connect_timeout, uid};
    try {
        handshakes_.push_back(std::move(h));
    } catch (...) {
        inbox_.forget(fd);
        refuse_current("node-local connection");
    }
}

void server::progress_handshakes(bool readable) noexcept {
    if (handshakes_.empty())
        return;
    const auto now = sched::coarse_clock::now();
    for (std::size_t i = 0; i < handshakes_.size();) {
        handshake& h = handshakes_[i];
        // Never waits: what the socket has now, at most the hello.
        const local::message_reader::state st =
            readable ? h.hello.read_some(h.ch.fd()) : h.hello.current();
        if (st == local::message_reader::state::more && now < h.deadline) {
            ++i;
            continue;
        }
        handshake done = std::move(h);
        if (i + 1 != handshakes_.size())
            handshakes_[i] = std::move(handshakes_.back());
        handshakes_.pop_back();
        inbox_.forget(done.ch.fd());
        switch (st) {
        case local::message_reader::state::more:
            refuse(ETIMEDOUT, "node-local handshake: no hello before connect_timeout");
            break;
        case local::message_reader::state::failed:
            refuse(done.hello.error(), "node-local handshake: the hello did not come whole");
            break;
        case local::message_reader::state::done:
            try {
                accept_local(std::move(done.ch), done.hello.message());
            } catch (...) {
                refuse_current("node-local handshake"); // the channel closes as it goes
            }
            break;
        }
        // `done` goes here, closing its channel and any descriptor a peer sent.
    }
}

void server::accept_local(local::unix_channel ch, std::span<const std::byte> hello_bytes) {
    local_hello hello;
    const std::size_t n = hello_bytes.size();
    std::memcpy(&hello, hello_bytes.data(), std::min(n, sizeof hello));
    local_welcome w;
    const bool sane = n == sizeof hello && hello.magic == protocol_magic &&
                      hello.version == protocol_version && hello.slots != 0 &&
                      hello.slots <= max_slots && hello.slot_bytes >= min_slot_bytes &&
                      hello.slot_bytes <= max_slot_bytes && hello.slot_bytes % 8 == 0;
    if (!sane || live_ >= opts_.max_peers) {
        if (!sane)
            refuse(EPROTO, "node-local handshake: a hello that is not an rdmax client's");
        else
            counters_.count_refusal_fmt(EBUSY, "node-local handshake: {} peers already (max_peers)",
                                        live_);
        w.status = local_refused;
        ch.send(std::as_bytes(std::span(&w, 1)));
        return;
    }
    // CMA carries the bodies over a slot: make sure the kernel lets this
    // process reach the client's memory, else the client takes the device.
    const pid_t pid = ch.peer().pid;
    std::uint64_t probe = 0;
    if (local::cma_read(pid, hello.probe_addr, std::as_writable_bytes(std::span(&probe, 1))) !=
            local::cma_status::ok ||
        probe != hello.probe_value) {
        w.status = local_no_cma;
        ch.send(std::as_bytes(std::span(&w, 1)));
        return;
    }
    w.slots = std::min<std::uint16_t>(hello.slots, opts_.slots);
    w.slot_bytes = std::min(hello.slot_bytes, opts_.slot_bytes);
    w.segment_bytes = local_link::segment_bytes(w.slots, w.slot_bytes);
    auto wire = std::make_unique<local_link>(std::move(ch), pid, w.slots, w.slot_bytes);
    const std::array<int, 3> handed{wire->segment().fd(), wire->wake_fds()[0], wire->wake_fds()[1]};
    wire->send(std::as_bytes(std::span(&w, 1)), handed);
    (void)add_link(std::move(wire), w.slots);
}

void server::teardown(std::uint32_t index) noexcept {
    link& l = links_[index];
    inbox_.forget(l.wire->event_fd());
    if (l.wire->wake_fd() >= 0)
        inbox_.forget(l.wire->wake_fd());
    if (l.verbs != nullptr)
        by_qp_.erase(l.verbs->qp_num());
    l.verbs = nullptr;
    l.wire.reset(); // no more DMA into or out of the slots' blocks
    l.slots.clear();
    l.blocks.clear();
    l.free_blocks.clear();
    free_links_.push_back(index);
    --live_;
    ++counters_.disconnected;
}

void server::disconnect(peer_id p) noexcept {
    if (link* l = find(p)) {
        l->wire->broken = true;
        next_housekeeping_ = {};
    }
}

bool server::reply(const deferred_call& d, std::span<const std::byte> bytes) noexcept {
    link* l = find(d.peer);
    if (l == nullptr || l->wire->broken || d.slot >= l->slots.size() || !l->slots[d.slot].busy ||
        l->slots[d.slot].seq != d.call_seq)
        return false;
    answer(*l, d.peer.index, d.slot, call_status::ok, bytes, false);
    return !l->wire->broken;
}

bool server::fail(const deferred_call& d, call_status s) noexcept {
    link* l = find(d.peer);
    if (l == nullptr || l->wire->broken || d.slot >= l->slots.size() || !l->slots[d.slot].busy ||
        l->slots[d.slot].seq != d.call_seq)
        return false;
    if (!server_status(static_cast<std::uint32_t>(s)) || s == call_status::ok)
        s = call_status::handler_failed;
    answer(*l, d.peer.index, d.slot, s, {}, false);
    return !l->wire->broken;
}

} // namespace rdmax::rpc
