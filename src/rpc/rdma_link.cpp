#include <algorithm>
#include <cerrno>

#include <fmt/format.h>

#include <rdmax/detail/rpc/rdma_link.hpp>
#include <rdmax/error.hpp>

namespace rdmax::rpc::detail {

rdma_link::rdma_link(registered_arena& arena, handle_issuer& issuer, std::uint16_t slots,
                     std::uint32_t slot_bytes)
    : link(slots, slot_bytes, transport::rdma)
    , issuer_(&issuer)
    , ring_(arena, std::size_t{slots} * slot_bytes)
    , staging_(arena, std::size_t{slots} * slot_bytes)
    , key_(issuer.issue(ring_.data(), ring_.size(), rights::remote_write)) {
    // A slot read before the peer wrote it holds zeros, not old bytes.
    std::fill_n(ring_.data(), ring_.size(), std::byte{0});
    lay_out(ring_.data(), staging_.data());
}

rdma_link::~rdma_link() {
    // The striper first (it points at the schedulers), the rails' held
    // registrations after their queue pairs (no more DMA by them).
    striper_.reset();
    sched_.reset();
    for (rail_link& r : rails_)
        r.sched.reset();
    // A window holds on to its queue pair; deallocating one revokes it.
    for (window_set& w : wins_)
        w.release();
    for (rail_link& r : rails_)
        r.conn.reset();
    conn_.reset();
    striped_.clear();
    issuer_->revoke(key_);
}

ring_offer rdma_link::offer() const noexcept {
    ring_offer o;
    o.slots = slots();
    o.slot_bytes = slot_bytes();
    o.rkey = key_.rkey;
    o.addr = key_.addr;
    return o;
}

void rdma_link::attach(verbs::connection conn, const ring_offer& peer,
                       const sched::scheduler_options& opts) {
    // The geometry granted (the server's, at most what was asked for) addresses both rings.
    grant(std::min(slots(), peer.slots), std::min(slot_bytes(), peer.slot_bytes));
    peer_ring_ = {peer.addr, std::uint64_t{slots()} * slot_bytes(), peer.rkey, 0};
    conn_.emplace(std::move(conn));
    qp_ = &conn_->qp();
    sched_.emplace(conn_->qp(), opts);
    set_qp_num(conn_->qp().qp_num());
    set_fds(conn_->id()->channel->fd, -1);
    set_counters_of(
        [](const link* l) { return static_cast<const rdma_link*>(l)->sched_->counters(); });
    set_hold_of([](link* l, bool on) noexcept { return static_cast<rdma_link*>(l)->hold(on); });
    static constexpr rail_ops ops{
        [](const link* l, std::uint32_t slot, rail_keys& out) noexcept {
            return static_cast<const rdma_link*>(l)->keys_of(slot, out);
        },
        [](link* l) noexcept { static_cast<rdma_link*>(l)->tend(); },
        [](const link* l) noexcept { return static_cast<const rdma_link*>(l)->joins_; },
    };
    set_rails_of(&ops);
}

bool rdma_link::serve_calls(const call_memory& memory, bool windows) {
    calls_.resize(slots());
    memory_ = memory;
    windows_wanted_ = windows && enable_windows();
    return !windows || windows_wanted_;
}

link_end rdma_link::why_ended() const noexcept {
    link_end e{.failure = sched_->failure()};
    if (const auto by = conn_->ended_by()) {
        e.event = static_cast<int>(by->event);
        e.event_status = by->status;
    }
    return e;
}

std::optional<link_end> rdma_link::ended(look what) noexcept {
    if (what == look::cause || sched_->failed() ||
        (what == look::events && conn_->peer_disconnected()))
        return why_ended();
    return std::nullopt;
}

bool rdma_link::established(bool by_traffic) noexcept {
    if (!by_traffic)
        return conn_->established();
    // The peer's first message may come before rdma_cm's ESTABLISHED (which
    // follows the peer's RTU): it proves the connection is up.
    conn_->established_by_traffic();
    return true;
}

status rdma_link::send_slot(message_kind k, std::uint32_t s, std::uint32_t bytes, sched::priority p,
                            bool epoch) noexcept {
    // The reply whose body a striped WRITE just started to move waits for
    // it (held_reply); every other message goes at once.
    if (last_write_ < striped_.size() && k == message_kind::reply && bytes != 0) {
        const striped_body& b = striped_[last_write_];
        const auto body = static_cast<std::uint32_t>(std::exchange(last_write_, SIZE_MAX));
        if (b.busy) {
            if (held_replies_.size() >= held_replies_.capacity())
                return status::queue_full; // one per slot: a peer that broke its credits
            held_replies_.push_back({s, bytes, p, epoch, body, b.write_seq});
            return status::ok;
        }
    }
    return post_slot(k, s, bytes, p, epoch);
}

status rdma_link::post_slot(message_kind k, std::uint32_t s, std::uint32_t bytes, sched::priority p,
                            bool epoch) noexcept {
    // A control message (no bytes) names a code where the slot goes: it
    // writes nothing, at the ring's start.
    const std::uint64_t at = bytes == 0 ? 0 : std::uint64_t{s} * slot_bytes();
    return sched_->write_imm(p, staging_.local(at, bytes), peer_ring_, at,
                             encode_imm(k, s, bytes, epoch), s,
                             sched::request_flags{.signaled = false, .deferred = held_});
}

bool rdma_link::hold(bool on) noexcept {
    if (!sched_)
        return false;
    held_ = on;
    if (!on)
        sched_->flush();
    return true;
}

transfer rdma_link::move_body(body_way way, sched::priority p,
                              local_buffer<rights::local_write> local,
                              const buffer_descriptor& remote, std::uint64_t wr_id,
                              std::span<const std::uint32_t> rail_rkeys) noexcept {
    if (striper_ && !rail_rkeys.empty() && remote.length >= stripe_min_ &&
        local.length >= stripe_min_) {
        const transfer t = move_striped(way, p, local, remote, wr_id, rail_rkeys);
        if (t != transfer::failed)
            return t;
        // Not cut (no rail took it, no room to hold its keys): rail 0 alone.
    }
    status st = status::ok;
    if (way == body_way::read) {
        const remote_buffer<rights::remote_read> from{remote.addr, remote.length, remote.rkey, 0};
        st = sched_->read(p, local, from, 0, wr_id);
    } else {
        // Signaled: the header that follows at the same level tells the peer
        // it landed, but only the completion tells this side that its source
        // may go.
        const remote_buffer<rights::remote_write> to{remote.addr, remote.length, remote.rkey, 0};
        st = sched_->write(p, local, to, 0, wr_id);
    }
    return st == status::ok ? transfer::started : transfer::failed;
}

int rdma_link::poll(std::span<link_event> out, bool thorough) noexcept {
    if (!has_outstanding() || (!thorough && !needs_progress()))
        return 0;
    if (!broken)
        for (window_set& w : wins_)
            if (w.owed() != 0)
                w.settle(); // the invalidations the send queue had no room for
    verbs::completion done[16];
    const std::span<verbs::completion> room(done,
                                            std::min<std::size_t>(std::size(done), out.size()));
    // Striped bodies out: everything through the striper, which polls rail
    // 0's scheduler too and passes its own completions on (a client's
    // rails: their schedulers carry only the windows' requests).
    const int k = striper_ && striper_->pending() ? poll_striped(room) : sched_->poll(room);
    if (!striper_) // a client's rails: their windows' requests (a fence's completion)
        for (std::uint32_t r = 1; r < max_link_rails; ++r)
            if (rails_[r].sched)
                (void)rails_[r].sched->poll(std::span<verbs::completion>{});
    int n = 0;
    for (int i = 0; i < k; ++i)
        out[static_cast<std::size_t>(n++)] = link_event::of_transfer(done[i]);
    if (fencing_calls_ != 0)
        n += take_fenced(out.subspan(static_cast<std::size_t>(n)));
    return n;
}

bool rdma_link::sleep(bool going) noexcept {
    // Unsignaled replies complete quietly; only work waiting for room in the
    // budget needs the completion that makes room (one event, then re-armed
    // at the next sleep). On rxe, arming is a system call: only here.
    // A fence's completion hands a result out: it must wake the endpoint too.
    if (going && sched_ && (sched_->queued() || wins_[0].fences() != 0))
        (void)ibv_req_notify_cq(conn_->qp().send_cq().get(), 0);
    // The rails' queues raise no event on this side's channel (another
    // device's): while a striped body or a rail's fence is out, no sleep.
    if (going && striper_ && striper_->pending())
        return false;
    for (std::uint32_t k = 1; k < max_link_rails; ++k)
        if (going && wins_[k].fences() != 0)
            return false;
    return true;
}

// ---- rails ----

namespace {
constexpr std::uint8_t bit(std::uint32_t k) noexcept {
    return static_cast<std::uint8_t>(1U << k);
}
} // namespace

bool rdma_link::join_rail(std::uint32_t k, verbs::connection&& conn, const rail_context& ctx,
                          const sched::scheduler_options& opts) {
    if (k == 0 || k >= max_link_rails || !conn_ || broken || ctx.cache == nullptr)
        throw_error("rpc rail join", EINVAL, fmt::format("rail {} of a link that takes none", k));
    rail_link& r = rails_[k];
    // Still joined, or the old queue pair's pieces not all back (the
    // striper polls its scheduler until they are): not yet. Nor while a
    // striped body is under way: its keys for rail k name the old queue
    // pair's windows, which the new one would meet with its pieces.
    if (r.up || (striper_ && !striper_->rail_idle(k)) ||
        std::any_of(striped_.begin(), striped_.end(), [](const striped_body& b) { return b.busy; }))
        return false;
    const bool client = !calls_.empty();
    stripe_min_ = ctx.stripe.stripe_min;
    if (!client && !striper_) {
        // The server's first rail: the striper over rail 0 and it.
        striper_.emplace(ctx.stripe);
        striped_.resize(std::size_t{slots()} * 2);
        held_replies_.reserve(slots());
        if (!striper_->attach(0, *sched_, ctx.gbps)) {
            striper_.reset();
            throw_error("rpc rail join", EINVAL, "the link's own rail refused by its striper");
        }
    }
    r.sched.reset();
    r.conn.reset();
    r.conn.emplace(std::move(conn));
    r.sched.emplace(r.conn->qp(), opts);
    r.cache = ctx.cache;
    r.device = ctx.device;
    if (ctx.counters != nullptr)
        rail_counters_ = ctx.counters;
    if (client) {
        // Windows of the rail's own, where rail 0 shows windows: a type-2
        // window is reached only through the queue pair it was bound through.
        wins_[k].release();
        if (windows_wanted_ &&
            wins_[k].allocate(r.conn->qp().get()->pd, std::size_t{slots()} * 2, k)) {
            wins_[k].use(r.conn->qp());
            windowed_ |= bit(k);
        }
        r.sched->on_foreign(&rdma_link::on_window_completion, this);
    } else if (!striper_->attach(k, *r.sched, ctx.gbps)) {
        r.sched.reset();
        r.conn.reset();
        throw_error("rpc rail join", EINVAL, fmt::format("rail {} refused by the striper", k));
    }
    r.up = true;
    ++joins_;
    return true;
}

void rdma_link::rail_lost(std::uint32_t k) noexcept {
    if (k == 0 || k >= max_link_rails || !rails_[k].up)
        return;
    rail_link& r = rails_[k];
    r.up = false;
    if (striper_) {
        // Its scheduler fails (its queue pair to the error state); its
        // pieces come back flushed and go again on the rails left. The
        // scheduler and queue pair stay until then (the striper polls them).
        // The client hears of it by the disconnect (its queue pair only
        // binds and invalidates: it would not see the failure) and dials
        // the rail again.
        striper_->rail_down(k);
        r.conn->disconnect(std::chrono::milliseconds(0));
        return;
    }
    // A client's rail: its windows die now (their keys with them), and its
    // fences with them; then its queue pair.
    for (std::uint32_t s = 0; s < calls_.size(); ++s) {
        calls_[s].windows = static_cast<std::uint8_t>(calls_[s].windows & ~bit(k));
        fence_over(k, s);
    }
    wins_[k].release();
    windowed_ = static_cast<std::uint8_t>(windowed_ & ~bit(k));
    r.sched.reset();
    r.conn.reset();
}

void rdma_link::tend() noexcept {
    for (std::uint32_t k = 1; k < max_link_rails; ++k) {
        rail_link& r = rails_[k];
        if (!r.up)
            continue;
        // Its queue pair failed (a piece, or a window's request, in error),
        // the striper took it out, or the peer closed it.
        if (r.sched->failed() || (striper_ && !striper_->rail_up(k)) || r.conn->peer_disconnected())
            rail_lost(k);
    }
}

void rdma_link::ports_down(std::uint8_t down) noexcept {
    for (std::uint32_t k = 1; k < max_link_rails; ++k)
        if (rails_[k].up && rails_[k].device < 8 && ((down >> rails_[k].device) & 1U) != 0)
            rail_lost(k);
}

std::uint32_t rdma_link::keyed_rails() const noexcept {
    std::uint32_t k = 1;
    while (k < max_link_rails && rails_[k].up)
        ++k;
    return k;
}

bool rdma_link::cancel(std::uint64_t wr_id) noexcept {
    if (striper_ && striper_->cancel(wr_id)) {
        // Withdrawn before any piece went: no completion comes for it, so
        // its held registrations go now.
        for (striped_body& b : striped_)
            if (b.busy && b.wr_id == wr_id) {
                free_striped(b);
                if (!held_replies_.empty())
                    release_replies();
                break;
            }
        return true;
    }
    return sched_->cancel(wr_id);
}

int rdma_link::poll_striped(std::span<verbs::completion> out) noexcept {
    const int n = striper_->poll(out);
    if (rail_counters_ != nullptr) {
        std::uint64_t bytes = 0;
        for (std::size_t k = 1; k < max_link_rails; ++k)
            bytes += striper_->counters().rail_bytes[k];
        rail_counters_->rail_bytes += bytes - rail_bytes_seen_;
        rail_bytes_seen_ = bytes;
    }
    for (int i = 0; i < n; ++i) {
        const verbs::completion& c = out[static_cast<std::size_t>(i)];
        for (striped_body& b : striped_) {
            if (!b.busy || b.wr_id != c.wr_id)
                continue;
            free_striped(b); // its pieces are all back
            if (!c.ok() && b.write_seq != 0) {
                // A reply body that did not land whole: its header must not
                // say it did. The link ends (as a failed WRITE on rail 0
                // ends it), and no held header goes.
                broken = true;
                held_replies_.clear();
            }
            break;
        }
    }
    if (!held_replies_.empty())
        release_replies();
    return n;
}

void rdma_link::release_replies() noexcept {
    // The held headers whose WRITE completed go now, in the order they were sent.
    std::size_t kept = 0;
    for (const held_reply& h : held_replies_) {
        const striped_body& b = striped_[h.body];
        if (b.busy && b.write_seq == h.write_seq) {
            held_replies_[kept++] = h;
            continue;
        }
        if (broken)
            continue;
        // One the scheduler refuses (its pool full) would be lost: the link
        // ends rather than leave its call to time out.
        if (post_slot(message_kind::reply, h.slot, h.bytes, h.p, h.epoch) != status::ok)
            broken = true;
    }
    held_replies_.resize(kept);
}

namespace {
/// The peer's buffer on rails 0 .. n - 1: its descriptor's key on rail 0,
/// its request's on the others.
template <rights R>
rail_remote<R> remote_on_rails(const buffer_descriptor& d, std::span<const std::uint32_t> keys,
                               std::uint32_t n) noexcept {
    rail_remote<R> r;
    r.addr = d.addr;
    r.length = d.length;
    r.rkey[0] = d.rkey;
    for (std::uint32_t k = 1; k < n; ++k)
        r.rkey[k] = keys[k - 1];
    r.rails = n;
    return r;
}
} // namespace

std::uint32_t rdma_link::key_block(striped_body& b, rail_local<rights::local_write>& l,
                                   std::span<const std::uint32_t> rail_rkeys) noexcept {
    // The block's keys on rails 1.. (its registrations there, held until
    // the transfer completes). A rail down now is keyed all the same: the
    // striper uses only the rails up.
    std::uint32_t n = 1;
    for (; n < max_link_rails && n <= rail_rkeys.size(); ++n) {
        if (rails_[n].cache == nullptr || rail_rkeys[n - 1] == 0)
            break;
        try {
            b.keep[n - 1] = rails_[n].cache->get<rights::local_write>(l.addr, l.length);
        } catch (...) {
            break; // the rail's device would not register it: the rails end here
        }
        l.lkey[n] = b.keep[n - 1].lkey();
    }
    l.rails = n;
    return n;
}

transfer rdma_link::move_striped(body_way way, sched::priority p,
                                 local_buffer<rights::local_write> local,
                                 const buffer_descriptor& remote, std::uint64_t wr_id,
                                 std::span<const std::uint32_t> rail_rkeys) noexcept {
    const auto free = std::find_if(striped_.begin(), striped_.end(),
                                   [](const striped_body& x) { return !x.busy; });
    if (free == striped_.end())
        return transfer::failed;
    striped_body& b = *free;
    rail_local<rights::local_write> l;
    l.addr = static_cast<std::byte*>(local.addr);
    l.length = local.length;
    l.lkey[0] = local.lkey;
    const std::uint32_t n = key_block(b, l, rail_rkeys);
    status st = status::out_of_range; // fewer than two rails keyed: not cut
    if (n >= 2 && way == body_way::read)
        st = striper_->read(p, l, remote_on_rails<rights::remote_read>(remote, rail_rkeys, n), 0,
                            wr_id);
    else if (n >= 2) // signaled, as on rail 0: the completion frees the source
        st = striper_->write(p, l, remote_on_rails<rights::remote_write>(remote, rail_rkeys, n), 0,
                             wr_id);
    if (st != status::ok) {
        free_striped(b);
        return transfer::failed;
    }
    b.busy = true;
    b.wr_id = wr_id;
    b.write_seq = way == body_way::write ? ++write_seq_ : 0;
    if (way == body_way::write)
        last_write_ = static_cast<std::size_t>(&b - striped_.data());
    if (rail_counters_ != nullptr)
        ++rail_counters_->striped_bodies;
    return transfer::started;
}

verbs::qp_config rail_qp_config(std::uint16_t slots, const verbs::device_limits& limits,
                                bool windows) {
    verbs::qp_config cfg;
    // The server's: the striper's pieces, sliced by the rail's scheduler
    // (it keeps at most half the queue in flight). The client's: its
    // windows' binds and invalidations, four per slot at worst.
    std::uint32_t depth = windows ? std::max<std::uint32_t>(64, 4U * slots + 16) : 256;
    cfg.send_depth = std::max<std::uint32_t>(
        1, std::min({depth, limits.max_qp_wr, limits.max_cqe != 0 ? limits.max_cqe : depth}));
    cfg.recv_depth = 1; // no receives: its own small queue, never posted to
    cfg.max_send_sge = 2;
    cfg.max_recv_sge = 1;
    return cfg;
}

verbs::qp_config link_qp_config(inbox& in, std::uint16_t slots, const verbs::device_limits& limits,
                                bool windows) {
    verbs::qp_config cfg;
    // Each call posts one or two requests through the scheduler, which keeps
    // at most half the queue in flight.
    std::uint32_t depth = std::clamp<std::uint32_t>(4U * slots, 64, 1024);
    // Beside it, a call with windows posts 2 binds ahead of its request and,
    // once answered, 2 invalidations: all of them in the queue at once for
    // every slot at worst (unsignaled, they are known done only at a later
    // signaled completion). Without that room, a burst of calls would find
    // the send queue full while it still has free slots (no_credit).
    if (windows)
        depth += 4U * slots;
    cfg.send_depth = std::max<std::uint32_t>(
        1, std::min({depth, limits.max_qp_wr, limits.max_cqe != 0 ? limits.max_cqe : depth}));
    cfg.max_send_sge = 2;
    cfg.max_recv_sge = 1;
    cfg.max_inline = 256;
    cfg.recv_cq = &in.cq();
    cfg.srq = &in.srq();
    cfg.send_channel = &in.channel();
    return cfg;
}

} // namespace rdmax::rpc::detail
