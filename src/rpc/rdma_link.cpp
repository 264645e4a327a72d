#include <algorithm>

#include <rdmax/detail/rpc/rdma_link.hpp>

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
    sched_.reset();
    // A window holds on to its queue pair; deallocating one revokes it.
    for (window& w : windows_)
        if (w.mw != nullptr)
            ibv_dealloc_mw(w.mw);
    conn_.reset();
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
                              const buffer_descriptor& remote, std::uint64_t wr_id) noexcept {
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
    if (owed_ != 0)
        settle(); // the invalidations the send queue had no room for
    verbs::completion done[16];
    const int k = sched_->poll(std::span(done, std::min<std::size_t>(std::size(done), out.size())));
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
    if (going && sched_ && (sched_->queued() || fences_ != 0))
        (void)ibv_req_notify_cq(conn_->qp().send_cq().get(), 0);
    return true;
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
