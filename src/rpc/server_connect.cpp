// rpc::server, connecting: rdma_cm requests accepted without waiting for
// their handshake, node-local clients' hellos read a piece at a time, both in
// housekeeping (never in the data path), each refusal counted with its reason.

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <new>
#include <system_error>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/detail/rpc/handoff.hpp>
#include <rdmax/detail/rpc/rdma_link.hpp>
#include <rdmax/detail/rpc/server_rails.hpp>
#include <rdmax/detail/rpc/shm_link.hpp>
#include <rdmax/detail/rpc/tcp_link.hpp>
#include <rdmax/error.hpp>
#include <rdmax/local/cma.hpp>
#include <rdmax/rpc/server.hpp>

#include "../notice.hpp"

namespace rdmax::rpc {

namespace {
std::uint32_t inbox_depth(const rpc_options& o) {
    return std::clamp<std::uint32_t>(std::uint32_t{o.slots} * 16U, 256, 16384);
}
detail::reply_cache_limits cache_limits(const rpc_options& o) {
    return {.calls = o.reply_cache_calls,
            .bytes = o.reply_cache_bytes,
            .records = std::size_t{2} * o.max_peers,
            .ttl = o.reply_cache_ttl,
            .linger = o.reply_cache_linger};
}
} // namespace

server::server(const verbs::protection_domain& pd, std::string_view addr, std::uint16_t port,
               rpc_options opts)
    : opts_((opts.check("rpc::server"), opts))
    , ep_(pd, opts_, inbox_depth(opts_))
    , listener_(opts_.transports.has(transport::rdma) ? verbs::listener(addr, port)
                                                      : verbs::listener())
    , port_(opts_.transports.has(transport::rdma) ? listener_.port() : port)
    , cache_(cache_limits(opts_)) {
    if (listener_.fd() >= 0)
        ep_.in.watch(listener_.fd());
    if (listener_.fd() < 0) {
        listen_without_rdma(addr);
    } else {
        listen_tcp(addr, false);
        listen_local(addr, false);
        if (opts_.rails != nullptr && opts_.rails->size() > 1) {
            if (&opts_.rails->pd(0) != &pd)
                throw_error("rpc::server", EINVAL,
                            "rpc_options::rails: the server's protection domain must be "
                            "rails->pd(0)");
            rails_ = std::make_unique<detail::server_rails>(*opts_.rails, port_);
            for (const auto& l : rails_->listeners)
                if (l)
                    ep_.in.watch(l->fd());
        }
    }
    ep_.peers.reserve(opts_.max_peers);
    ep_.by_qp.reserve(std::size_t{opts_.max_peers} * 2);
    housekept_ = ep_.now();
    ep_.open_stats("rpc_server", fmt::format("{}:{}", addr, port_));
}

server::server(std::string_view addr, std::uint16_t port, rpc_options opts)
    : server(detail::no_device, opts) {
    port_ = port;
    listen_without_rdma(addr);
    housekept_ = ep_.now();
    ep_.open_stats("rpc_server", fmt::format("{}:{}", addr, port_));
}

void server::listen_local(std::string_view addr, bool needed) {
    if (!opts_.node_local()) {
        if (needed)
            throw_no_transport("rpc::server", addr, port_,
                               ep_.pd != nullptr ? "so is rdma" : "there is no device");
        return;
    }
    try {
        // Peers on this node find the server by this name (the address as the
        // client names it, and the port). Another process may hold it: then
        // this one is reached through the device only.
        local_listener_.emplace(needed ? listen_without_device(addr, port_)
                                       : local::unix_listener(local_name(addr, port_)));
        ep_.in.watch(local_listener_->fd());
    } catch (const error& e) {
        local_listener_.reset();
        if (needed)
            throw;
        rdmax::detail::notice(fmt::format("rpc::server on {}:{}: no node-local path ({}); peers "
                                          "here go through the device",
                                          addr, port_, e.what()));
    }
}

server::server(detail::no_device_t none, rpc_options opts)
    : opts_((opts.check("rpc::server"), opts))
    , ep_(none, opts_)
    , cache_(cache_limits(opts_)) {
    ep_.peers.reserve(opts_.max_peers);
}

server::server(const verbs::protection_domain& pd, detail::group_routes& group, std::size_t worker,
               rpc_options opts)
    : group_(&group)
    , worker_(worker)
    , opts_((opts.check("rpc::server_group"), opts))
    , ep_(pd, opts_, inbox_depth(opts_))
    , cache_(cache_limits(opts_)) {
    // The mailbox wakes the worker's wait() and makes its housekeeping look.
    ep_.in.watch(group.box(worker).fd());
    ep_.peers.reserve(opts_.max_peers);
    ep_.by_qp.reserve(std::size_t{opts_.max_peers} * 2);
    housekept_ = ep_.now();
    ep_.open_stats("rpc_server", fmt::format("group worker {}", worker));
}

server::server(detail::no_device_t none, detail::group_routes& group, std::size_t worker,
               rpc_options opts)
    : group_(&group)
    , worker_(worker)
    , opts_((opts.check("rpc::server_group"), opts))
    , ep_(none, opts_)
    , cache_(cache_limits(opts_)) {
    ep_.in.watch(group.box(worker).fd());
    ep_.peers.reserve(opts_.max_peers);
    housekept_ = ep_.now();
    ep_.open_stats("rpc_server", fmt::format("group worker {}", worker));
}

server::~server() {
    for (handshake& h : handshakes_)
        ep_.in.forget(h.ch.fd());
    if (tcp_listener_ >= 0) {
        ep_.in.forget(tcp_listener_);
        ::close(tcp_listener_);
    }
    for (std::uint32_t i = 0; i < ep_.peers.size(); ++i)
        if (ep_.peers[i].wire)
            teardown(i);
}

void server::accept_new(bool events) noexcept {
    if (events && group_ != nullptr)
        take_handoffs();
    if (events) {
        try {
            accept_pending();
        } catch (...) {
            refuse_current("rdma_cm connection request");
        }
        accept_local_pending();
        accept_tcp_pending();
        if (rails_)
            detail::server_rails::accept(*this);
    }
    if (listener_paused_ && ep_.now() >= listener_back_) {
        try {
            // Readable: the next round accepts.
            if (local_listener_)
                ep_.in.watch(local_listener_->fd());
            if (tcp_listener_ >= 0)
                ep_.in.watch(tcp_listener_);
            listener_paused_ = false;
            ep_.housekeep_soon();
        } catch (...) {
            listener_back_ = ep_.now() + listener_pause();
        }
    }
    progress_handshakes(events);
}

void server::accept_local_pending() noexcept {
    // At most a round's worth: a flood of connections does not hold the
    // thread (the rest wait in the backlog for the next round).
    for (int k = 0; k < 64 && local_listener_ && !listener_paused_; ++k) {
        local::unix_channel ch;
        try {
            ch = local_listener_->accept(std::chrono::milliseconds(0));
        } catch (const std::system_error& e) {
            refuse_current("node-local connection");
            const int err = e.code().value();
            if (err == EMFILE || err == ENFILE)
                pause_listener();
            break;
        } catch (...) {
            refuse_current("node-local connection");
            break;
        }
        if (ch.fd() < 0)
            break;
        start_handshake(std::move(ch), false);
    }
}

void server::pause_listener() noexcept {
    // The connection stays in the backlog, the listener stays readable:
    // watched, it would wake every wait() at once. Not watched until a later
    // round, then tried again.
    if (local_listener_)
        ep_.in.forget(local_listener_->fd());
    if (tcp_listener_ >= 0)
        ep_.in.forget(tcp_listener_);
    listener_paused_ = true;
    listener_back_ = ep_.now() + listener_pause();
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
    if (draining_)
        bad = "draining";
    if (live_ >= opts_.max_peers || bad != nullptr) {
        if (bad != nullptr)
            ep_.counters.count_refusal_fmt(EPROTO, "rdma_cm connection request: {}", bad);
        else
            ep_.counters.count_refusal_fmt(
                EBUSY, "rdma_cm connection request: {} peers already (max_peers)", live_);
        req.reject();
        return;
    }
    const auto slots = std::min<std::uint16_t>(offer->slots, opts_.slots);
    const std::uint32_t slot_bytes = std::min(offer->slot_bytes, opts_.slot_bytes);
    auto wire = std::make_unique<detail::rdma_link>(ep_.arena, ep_.issuer, slots, slot_bytes);
    req.create_qp(*ep_.pd, detail::link_qp_config(ep_.in, slots, ep_.pd->device().limits(), false));
    ring_offer mine = wire->offer();
    mine.incarnation = ep_.incarnation;
    // With rails: the key the client's other rails join this link with.
    mine.first_call = rails_ ? detail::new_incarnation() : 0;
    // Not waiting for ESTABLISHED: housekeeping looks for it (or the first
    // message proves it), and drops the connection at connect_timeout.
    verbs::connection conn = req.accept_nowait(verbs::payload_of(mine));
    ring_offer peer_ring = *offer;
    peer_ring.slots = slots;
    peer_ring.slot_bytes = slot_bytes;
    // Room in the scheduler for every request the slots can have at once:
    // each block's READ or WRITE (3 x slots + 8 blocks, superseded calls'
    // included), a reply per slot, and what is posted but not yet reaped.
    // One it refused would end a connection whose peer kept to its credits.
    sched::scheduler_options so = opts_.scheduler;
    so.max_requests = std::max<std::uint32_t>(
        so.max_requests, 4U * slots + 8U + std::max<std::uint32_t>(so.budget_wqes, 16U));
    wire->attach(std::move(conn), peer_ring, so);
    const std::uint32_t index =
        add_link(std::move(wire), slots, offer->incarnation, offer->first_call);
    ep_.peers[index].establish_by = ep_.now() + opts_.connect_timeout;
    ep_.peers[index].join_key = mine.first_call;
}

std::uint32_t server::add_link(std::unique_ptr<detail::link> wire, std::uint16_t slots,
                               std::uint64_t client, std::uint64_t first_call) {
    peer fresh;
    fresh.slots = std::vector<slot_state>(slots);
    // Room for a body being read and a reply being written per slot, and as
    // many again whose slots were reused before their completion was reaped.
    const std::size_t blocks = std::min<std::size_t>(3U * slots + 8U, no_block);
    fresh.blocks = std::vector<detail::arena_block>(blocks);
    fresh.free_blocks.reserve(blocks);
    fresh.first_call = first_call;
    for (std::size_t i = blocks; i-- > 0;)
        fresh.free_blocks.push_back(static_cast<std::uint16_t>(i));
    cache_.attach(client, first_call); // its replies, kept across its reconnects
    const rpc::transport kind = wire->kind();
    std::uint32_t index = 0;
    try {
        index = ep_.add(std::move(wire), std::move(fresh), client);
    } catch (...) {
        cache_.detach(client, false, ep_.now());
        throw;
    }
    ++live_;
    ++ep_.counters.connected;
    ep_.counters.connected_local += kind == rpc::transport::shm ? 1 : 0;
    ep_.counters.connected_tcp += kind == rpc::transport::tcp ? 1 : 0;
    if (group_ != nullptr) {
        try {
            group_->claim(client, worker_); // its reconnections come here
        } catch (...) {
            // No memory: its next connection may land on another worker.
        }
    }
    return index;
}

void server::refuse(int err, std::string_view why) noexcept {
    ep_.counters.count_refusal(err, why);
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
        ep_.counters.count_refusal_fmt(e.code().value(), "{}: {}", what, w);
    } catch (const std::bad_alloc&) {
        refuse(ENOMEM, what);
    } catch (const std::exception& e) {
        ep_.counters.count_refusal_fmt(0, "{}: {}", what, std::string_view(e.what()));
    } catch (...) {
        refuse(0, what);
    }
}

bool server::handshake_room(uid_t uid) noexcept {
    // One user cannot hold every handshake: at most a quarter of max_peers
    // (and 4) each, so that a user's silent connections leave room for
    // others. TCP peers (no credentials) share one user's share.
    const std::size_t per_uid = std::max<std::size_t>(4, opts_.max_peers / 4);
    const auto same = static_cast<std::size_t>(std::count_if(
        handshakes_.begin(), handshakes_.end(), [&](const handshake& h) { return h.uid == uid; }));
    if (same >= per_uid) {
        if (uid == tcp_peers)
            ep_.counters.count_refusal_fmt(EBUSY,
                                           "tcp connection: {} tcp handshakes under way already "
                                           "(max_peers / 4)",
                                           same);
        else
            ep_.counters.count_refusal_fmt(EBUSY,
                                           "node-local connection: {} handshakes of uid {} under "
                                           "way already (max_peers / 4)",
                                           same, uid);
        return false;
    }
    return true;
}

void server::start_handshake(local::unix_channel ch, bool tcp) noexcept {
    const char* what = tcp ? "tcp connection" : "node-local connection";
    if (handshakes_.size() >= opts_.max_peers) {
        ep_.counters.count_refusal_fmt(EBUSY, "{}: {} handshakes under way already (max_peers)",
                                       what, handshakes_.size());
        return; // closed as it goes
    }
    uid_t uid = tcp_peers;
    try {
        if (!tcp)
            uid = ch.peer().uid;
    } catch (...) {
        refuse_current(what);
        return;
    }
    if (!handshake_room(uid))
        return; // closed as it goes
    const int fd = ch.fd();
    try {
        ep_.in.watch(fd);
    } catch (...) {
        refuse_current(what);
        return;
    }
    // Held here until it is in the table: if that throws, the socket is
    // forgotten by the epoll set before it closes (its number may be reused).
    handshake h{std::move(ch),
                local::message_reader(tcp ? sizeof(tcp_hello) : sizeof(local_hello), 0),
                ep_.now() + opts_.connect_timeout, uid, tcp};
    try {
        handshakes_.push_back(std::move(h));
    } catch (...) {
        ep_.in.forget(fd);
        refuse_current(what);
    }
}

void server::progress_handshakes(bool readable) noexcept {
    const auto now = ep_.now();
    for (std::size_t i = 0; i < handshakes_.size();) {
        handshake& h = handshakes_[i];
        // Never waits: what the socket has now, at most the hello.
        const local::message_reader::state st =
            readable ? h.hello.read_some(h.ch.fd()) : h.hello.current();
        if (st == local::message_reader::state::more && now < h.deadline) {
            ++i;
            continue;
        }
        end_handshake(i, st);
    }
}

void server::end_handshake(std::size_t i, local::message_reader::state st) noexcept {
    handshake done = std::move(handshakes_[i]);
    if (i + 1 != handshakes_.size())
        handshakes_[i] = std::move(handshakes_.back());
    handshakes_.pop_back();
    ep_.in.forget(done.ch.fd());
    const std::string_view what = done.tcp ? "tcp handshake" : "node-local handshake";
    switch (st) {
    case local::message_reader::state::more:
        ep_.counters.count_refusal_fmt(ETIMEDOUT, "{}: no hello before connect_timeout", what);
        break;
    case local::message_reader::state::failed:
        ep_.counters.count_refusal_fmt(done.hello.error(), "{}: the hello did not come whole",
                                       what);
        break;
    case local::message_reader::state::done:
        try {
            if (done.tcp)
                accept_tcp(std::move(done.ch), done.hello.message());
            else
                accept_local(std::move(done.ch), done.hello.message());
        } catch (...) {
            refuse_current(what); // the channel closes as it goes
        }
        break;
    }
    // `done` goes here, closing its channel and any descriptor a peer sent.
}

std::uint32_t server::judge_hello(const local_hello& hello, std::size_t bytes,
                                  const local::unix_channel& ch) {
    const bool sane = bytes == sizeof hello && hello.magic == protocol_magic &&
                      hello.version == protocol_version && hello.slots != 0 &&
                      hello.slots <= max_slots && hello.slot_bytes >= min_slot_bytes &&
                      hello.slot_bytes <= max_slot_bytes && hello.slot_bytes % 8 == 0 &&
                      hello.incarnation != 0;
    if (!sane) {
        refuse(EPROTO, "node-local handshake: a hello that is not an rdmax client's");
        return local_refused;
    }
    if (draining_) {
        refuse(EAGAIN, "node-local handshake: draining");
        return local_refused;
    }
    if (live_ >= opts_.max_peers) {
        ep_.counters.count_refusal_fmt(EBUSY, "node-local handshake: {} peers already (max_peers)",
                                       live_);
        return local_refused;
    }
    // CMA carries the bodies over a slot: make sure the kernel lets this
    // process reach the client's memory, else the client takes the device.
    std::uint64_t probe = 0;
    if (local::cma_read(ch.peer().pid, hello.probe_addr,
                        std::as_writable_bytes(std::span(&probe, 1))) != local::cma_status::ok ||
        probe != hello.probe_value)
        return local_no_cma;
    return local_ok;
}

void server::accept_local(local::unix_channel ch, std::span<const std::byte> hello_bytes) {
    local_hello hello;
    std::memcpy(&hello, hello_bytes.data(), std::min(hello_bytes.size(), sizeof hello));
    if (group_ != nullptr && hello_bytes.size() == sizeof hello &&
        forward_local(ch, hello_bytes, hello.incarnation))
        return;
    local_welcome w;
    w.status = judge_hello(hello, hello_bytes.size(), ch);
    if (w.status != local_ok) {
        ch.send(std::as_bytes(std::span(&w, 1)));
        return;
    }
    w.slots = std::min<std::uint16_t>(hello.slots, opts_.slots);
    w.slot_bytes = std::min(hello.slot_bytes, opts_.slot_bytes);
    w.segment_bytes = detail::shm_link::segment_bytes(w.slots, w.slot_bytes);
    w.incarnation = ep_.incarnation;
    const pid_t pid = ch.peer().pid;
    auto wire = std::make_unique<detail::shm_link>(std::move(ch), pid, w.slots, w.slot_bytes);
    const std::array<int, 3> handed{wire->segment().fd(), wire->wake_fds()[0], wire->wake_fds()[1]};
    wire->send(std::as_bytes(std::span(&w, 1)), handed);
    (void)add_link(std::move(wire), w.slots, hello.incarnation, hello.first_call);
}

} // namespace rdmax::rpc
