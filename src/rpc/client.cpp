#include <algorithm>
#include <arpa/inet.h>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <random>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/local/cma.hpp>
#include <rdmax/local/node_address.hpp>
#include <rdmax/rpc/client.hpp>
#include <rdmax/rpc/local_link.hpp>
#include <rdmax/verbs/listener.hpp>

#include "../notice.hpp"

namespace rdmax::rpc {

namespace {
handle_options ring_key_options() {
    handle_options h;
    h.revoke = revoke_by::memory_region; // the key goes in the connect request
    return h;
}
constexpr std::uint32_t no_slot = UINT32_MAX;
} // namespace

client::client(const verbs::protection_domain& pd, rpc_options opts)
    : pd_(&pd)
    , opts_((opts.check("rpc::client"), opts))
    , arena_(verbs_registrar(pd), opts_.ring_arena())
    , issuer_(pd, ring_key_options())
    , inbox_(pd, std::clamp<std::uint32_t>(std::uint32_t{opts_.slots} * 8U, 256, 8192)) {}

client::client(detail::no_device_t no_device, rpc_options opts)
    : pd_(nullptr)
    , opts_((opts.check("rpc::client"), opts))
    , arena_(verbs_registrar(no_device), opts_.ring_arena())
    , inbox_(no_device) {}

client::~client() {
    for (link& l : links_) {
        if (!l.wire)
            continue;
        inbox_.forget(l.wire->event_fd());
        l.wire.reset();
    }
}

verbs_cache& client::cache() {
    // The cache cannot move, so make_unique (which forwards a reference)
    // cannot take make_verbs_cache's result: new builds it in place.
    if (!cache_) {
        // NOLINTNEXTLINE(modernize-make-unique)
        cache_ = std::unique_ptr<verbs_cache>(new verbs_cache(make_verbs_cache(*pd_, opts_.cache)));
    }
    return *cache_;
}

client::link* client::find(peer_id p) noexcept {
    if (p.index >= links_.size() || !links_[p.index].wire ||
        links_[p.index].generation != p.generation)
        return nullptr;
    return &links_[p.index];
}
const client::link* client::find(peer_id p) const noexcept {
    return const_cast<client*>(this)->find(p);
}

bool client::is_local(peer_id p) const noexcept {
    const link* l = find(p);
    return l != nullptr && l->wire->is_local();
}

std::optional<sched::scheduler_counters> client::scheduler_counters(peer_id p) const noexcept {
    const link* l = find(p);
    return l != nullptr ? l->wire->scheduler_counters() : std::nullopt;
}

bool client::connected(peer_id p) const noexcept {
    const link* l = find(p);
    return l != nullptr && !l->wire->broken;
}
std::uint16_t client::slots(peer_id p) const noexcept {
    const link* l = find(p);
    return l != nullptr ? l->wire->slots() : 0;
}
std::uint32_t client::slot_bytes(peer_id p) const noexcept {
    const link* l = find(p);
    return l != nullptr ? l->wire->slot_bytes() : 0;
}

peer_id client::connect(std::string_view addr, std::uint16_t port) {
    if (opts_.local)
        if (std::unique_ptr<link_wire> local = connect_local(addr, port))
            return add_link(std::move(local));
    auto wire = std::make_unique<peer_link>(arena_, issuer_, opts_.slots, opts_.slot_bytes);
    const ring_offer mine = wire->offer();
    verbs::connection conn = verbs::connection::connect(
        *pd_, addr, port, verbs::payload_of(mine),
        link_qp_config(inbox_, opts_.slots, pd_->device().limits(), windows_wanted()),
        opts_.connect_timeout);
    const std::optional<ring_offer> granted = conn.peer_payload_as<ring_offer>();
    const char* why = granted ? check_offer(*granted) : "no ring offer in the reply";
    if (why == nullptr && (granted->slots > mine.slots || granted->slot_bytes > mine.slot_bytes))
        why = "the server granted more than was asked";
    if (why != nullptr) {
        counters_.count_refusal(EPROTO, why);
        throw_error("rpc::client::connect", EPROTO, fmt::format("{}:{}: {}", addr, port, why));
    }
    wire->attach(std::move(conn), *granted, opts_.scheduler);
    bool lost = false;
    if (windows_wanted() && !wire->enable_windows()) {
        // Not silently: the server then sees the registrations' keys.
        const int err = errno;
        lost = true;
        rdmax::detail::notice(fmt::format(
            "rpc::client: {}:{}: no memory windows for this connection (ibv_alloc_mw: {}): "
            "its calls' large bodies and reply buffers go under the cached registrations' own "
            "keys, which the server keeps for as long as the registrations live",
            addr, port, std::strerror(err)));
    }
    peer_link* v = wire.get();
    const peer_id id = add_link(std::move(wire));
    links_[id.index].verbs = v;
    links_[id.index].windows = !lost && v->has_windows();
    if (lost)
        ++counters_.windows_unavailable;
    by_qp_[v->qp_num()] = id.index;
    return id;
}

bool client::windows_wanted() const noexcept {
    // Windows need type 2 and a pinned registration to bind to (not ODP).
    return pd_->device().limits().memory_windows && !opts_.cache.on_demand;
}

void client::revoke_slot_now(link& l, std::uint32_t slot) noexcept {
    if (l.wire->has_windows())
        counters_.window_reallocs += 2;
    l.wire->revoke_now(2 * slot, 2);
    windows_lost(l);
}

void client::windows_lost(link& l) noexcept {
    if (!l.windows || l.wire->has_windows())
        return;
    // A replacement window could not be allocated: the link gave its windows up.
    l.windows = false;
    ++counters_.windows_unavailable;
    rdmax::detail::notice("rpc::client: a connection lost its memory windows (ibv_alloc_mw "
                          "failed): its calls' large bodies and reply buffers go under the "
                          "cached registrations' own keys from now on");
}

peer_id client::add_link(std::unique_ptr<link_wire> wire) {
    const auto index = static_cast<std::uint32_t>(links_.size());
    links_.emplace_back();
    link& l = links_.back();
    l.generation = ++generations_;
    l.slots = std::vector<slot_state>(wire->slots());
    l.free_slots.reserve(wire->slots());
    for (std::uint32_t s = wire->slots(); s-- > 0;)
        l.free_slots.push_back(static_cast<std::uint16_t>(s));
    l.wire = std::move(wire);
    inbox_.watch(l.wire->event_fd());
    if (l.wire->wake_fd() >= 0)
        inbox_.watch(l.wire->wake_fd());
    grow_results();
    ++counters_.connected;
    return {index, l.generation};
}

void client::grant_cma(pid_t server) noexcept {
    using grant = rpc_options::ptracer_grant;
    if (opts_.ptracer == grant::off || ptracer_ == -1 || ptracer_ == server || server <= 0)
        return;
    // Only where Yama asks for it: under scope 0 the user's own processes
    // may already, and under 2 or 3 no grant helps.
    int scope = -1;
    if (std::FILE* f = std::fopen("/proc/sys/kernel/yama/ptrace_scope", "re")) {
        if (std::fscanf(f, "%d", &scope) != 1)
            scope = -1;
        std::fclose(f);
    }
    if (scope != 1)
        return;
    if (opts_.ptracer == grant::any) {
        if (local::allow_cma_from(0))
            ptracer_ = -1;
    } else if (ptracer_ == 0 && local::allow_cma_from(server)) {
        ptracer_ = server; // one process at a time: a second server is not granted
    }
}

std::unique_ptr<link_wire> client::connect_local(std::string_view addr, std::uint16_t port) {
    local::unix_channel ch;
    try {
        ch = local::unix_channel::connect(local_name(addr, port));
    } catch (const error&) {
        // Nobody answers that name. A server on this node listening on a
        // wildcard address answers for every address of the node: try its
        // names, but only if addr is this node's (else the server on the
        // port here would be the wrong one).
        if (!local::is_node_address(addr))
            return nullptr;
        for (const std::string_view any : {"0.0.0.0", "::"}) {
            try {
                ch = local::unix_channel::connect(local_name(any, port));
                break;
            } catch (const error&) {
            }
        }
        if (ch.fd() < 0)
            return nullptr; // the server is not on this node
    }
    try {
        grant_cma(ch.peer().pid); // the process that listens on the name
    } catch (const error&) {
        // No credentials: the probe below tells whether CMA works anyway.
    }
    if (probe_ == 0)
        probe_ = std::random_device{}() | 1U;
    local_hello hello;
    hello.slots = opts_.slots;
    hello.slot_bytes = opts_.slot_bytes;
    hello.probe_addr = reinterpret_cast<std::uint64_t>(&probe_);
    hello.probe_value = probe_;
    local_welcome w;
    std::vector<int> fds;
    const auto close_all = [&] {
        for (int fd : fds)
            ::close(fd);
    };
    std::size_t n = 0;
    try {
        ch.send(std::as_bytes(std::span(&hello, 1)));
        n = ch.receive(std::as_writable_bytes(std::span(&w, 1)), fds, opts_.connect_timeout);
    } catch (const error& e) {
        const int err = e.code().value();
        if (err == ECONNRESET || err == EPIPE) {
            // The server closed without a welcome: it refused this connection
            // (too many handshakes under way, from this user or all). The
            // device may still take it.
            return refuse_local(fds, err, "the node-local server closed the handshake", addr, port,
                                fmt::format("it closed the node-local handshake ({})", e.what()));
        }
        close_all();
        throw_error(
            "rpc::client::connect", EPROTO,
            fmt::format("{}:{}: the node-local handshake failed: {}", addr, port, e.what()));
    }
    if (n == sizeof w && w.magic == protocol_magic && w.status == local_no_cma) {
        close_all();
        rdmax::detail::notice(fmt::format(
            "rpc::client: {}:{} is on this node, but it may not read this process's memory "
            "(CMA: {}{}): through the device",
            addr, port, local::why_not_permitted(getpid()),
            opts_.ptracer == rpc_options::ptracer_grant::any
                ? ""
                : "; RDMAX_RPC_PTRACER=any lets every server of this user do it"));
        return nullptr;
    }
    if (n == sizeof w && w.magic == protocol_magic && w.status == local_refused)
        return refuse_local(fds, EBUSY, "the node-local server refused the connection", addr, port,
                            "it refused the node-local connection");
    if (n != sizeof w || w.magic != protocol_magic || w.version != protocol_version ||
        w.status != local_ok || fds.size() != 3 || w.slots == 0 || w.slots > opts_.slots ||
        w.slot_bytes < min_slot_bytes || w.slot_bytes > opts_.slot_bytes ||
        w.segment_bytes < local_link::segment_bytes(w.slots, w.slot_bytes)) {
        close_all();
        counters_.count_refusal(EPROTO, "the node-local server answered nonsense");
        throw_error("rpc::client::connect", EPROTO,
                    fmt::format("{}:{}: the node-local server answered nonsense", addr, port));
    }
    local::shared_segment seg;
    try {
        seg = local::shared_segment::attach(fds[0], w.segment_bytes, true, /*require_sealed=*/true);
    } catch (const error& e) {
        if (e.code().value() != EPERM) {
            close_all();
            throw;
        }
        // A server older than sealed segments: its peers could cut the
        // segment under this process. Not node-local, then.
        return refuse_local(fds, EPERM, "the node-local server's segment is not sealed", addr, port,
                            "its shared segment is not sealed (an older server)");
    } catch (...) {
        close_all();
        throw;
    }
    ::close(fds[0]); // mapped: the mapping keeps the memory
    const pid_t server_pid = ch.peer().pid;
    auto wire = std::make_unique<local_link>(std::move(ch), std::move(seg), server_pid, w.slots,
                                             w.slot_bytes, fds[1], fds[2]);
    if (wire->failed())
        throw_error("rpc::client::connect", EPROTO,
                    fmt::format("{}:{}: the node-local segment is not laid out", addr, port));
    return wire;
}

std::unique_ptr<link_wire> client::refuse_local(std::vector<int>& fds, int err,
                                                std::string_view reason, std::string_view addr,
                                                std::uint16_t port, std::string_view what) {
    for (int fd : fds)
        ::close(fd);
    fds.clear();
    counters_.count_refusal(err, reason);
    rdmax::detail::notice(fmt::format(
        "rpc::client: {}:{} is on this node, but {}: through the device", addr, port, what));
    return nullptr;
}

void client::grow_results() {
    std::size_t need = 0;
    for (const link& l : links_)
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

call_status client::start(peer_id p, std::uint16_t method, std::span<const std::byte> request,
                          const call_options& o) noexcept {
    slot_ref taken;
    return start_on(p, method, request, o, taken);
}

call_status client::start_on(peer_id p, std::uint16_t method, std::span<const std::byte> request,
                             const call_options& o, slot_ref& taken) noexcept {
    if (method == 0)
        return call_status::invalid_method;
    link* l = find(p);
    if (l == nullptr)
        return call_status::bad_peer;
    if (l->wire->broken)
        return call_status::peer_gone;
    // Every call started and not yet handed back has a place in results_.
    if (l->free_slots.empty() || in_flight_ >= results_.size()) {
        ++counters_.no_credit;
        return call_status::no_credit;
    }
    const std::uint32_t slot = l->free_slots.back();
    slot_state& ss = l->slots[slot];
    const std::size_t descs = o.reply_into.empty() ? 0 : 1;
    const std::size_t room =
        l->wire->slot_bytes() - sizeof(message_header) - descs * sizeof(buffer_descriptor);
    const bool external = request.size() > room;
    if (request.size() > opts_.max_message || (external && room < sizeof(buffer_descriptor)))
        return call_status::too_large;
    // Bodies and reply buffers over a slot: registered through the cache
    // (a registration the first time, nanoseconds after), and shown to the
    // peer through windows over exactly their bytes where the link has them.
    const bool reg = l->wire->needs_registration(); // not on the node-local path (CMA)
    const bool windows = reg && l->wire->has_windows();
    constexpr rights read_bind = rights::remote_read | rights::mw_bind;
    constexpr rights write_bind = rights::local_write | rights::remote_write | rights::mw_bind;
    // The previous call's windows: an invalidation the send queue had no
    // room for is still owed (the window stays bound, its registration held):
    // not bound again, nor the registration released, before it is posted.
    if (windows && (ss.body_reg || ss.reply_reg) && !l->wire->settled(2 * slot, 2)) {
        // Taken last from now on: the next start() tries the other free slots.
        std::rotate(l->free_slots.begin(), l->free_slots.end() - 1, l->free_slots.end());
        ++counters_.no_credit;
        return call_status::no_credit;
    }
    ss.body_reg.reset(); // the previous call's, kept until now (its windows are revoked)
    ss.reply_reg.reset();
    std::uint32_t body_key = 0;
    std::uint32_t reply_key = 0;
    try {
        if (external && reg) {
            ss.body_reg = windows
                              ? cache().get<read_bind>(request.data(), request.size())
                              : cache().get<rights::remote_read>(request.data(), request.size());
            body_key = ss.body_reg.rkey();
        }
        if (!o.reply_into.empty() && reg) {
            ss.reply_reg =
                windows
                    ? cache().get<write_bind>(o.reply_into.data(), o.reply_into.size())
                    : cache().get<rights::remote_write>(o.reply_into.data(), o.reply_into.size());
            reply_key = ss.reply_reg.rkey();
        }
    } catch (...) {
        // Memory the device cannot pin (or a registration limit): not a size.
        ss.body_reg.reset();
        ss.reply_reg.reset();
        return call_status::registration_failed;
    }
    if (windows && (ss.body_reg || ss.reply_reg)) {
        link_wire::exposure e[2];
        std::size_t n = 0;
        if (ss.body_reg)
            e[n++] = {2 * slot, ss.body_reg.registration(),
                      reinterpret_cast<std::uint64_t>(request.data()), request.size(),
                      rights::remote_read};
        if (ss.reply_reg)
            e[n++] = {2 * slot + 1, ss.reply_reg.registration(),
                      reinterpret_cast<std::uint64_t>(o.reply_into.data()), o.reply_into.size(),
                      rights::remote_write};
        if (!l->wire->expose(std::span(e, n))) {
            // The send queue is full (or failed): nothing goes out unfenced.
            ss.body_reg.reset();
            ss.reply_reg.reset();
            windows_lost(*l);
            ++counters_.no_credit;
            return call_status::no_credit;
        }
        ss.windows = true;
        for (std::size_t i = 0; i < n; ++i)
            (e[i].window == 2 * slot ? body_key : reply_key) = e[i].rkey;
    }
    message_header h;
    h.call_seq = l->next_seq++;
    h.method = method;
    h.priority = std::min<std::uint8_t>(o.priority.level, sched::priority_levels - 1);
    h.body_bytes = static_cast<std::uint32_t>(request.size());
    std::byte* out = l->wire->staging(slot);
    std::size_t at = sizeof(message_header);
    if (external) {
        h.flags |= flag_external_body;
        const buffer_descriptor d{reinterpret_cast<std::uint64_t>(request.data()), body_key,
                                  static_cast<std::uint32_t>(request.size())};
        std::memcpy(out + at, &d, sizeof d);
        at += sizeof d;
        ++counters_.external_bodies;
    }
    if (!o.reply_into.empty()) {
        h.flags |= flag_reply_buffer;
        const buffer_descriptor d{
            reinterpret_cast<std::uint64_t>(o.reply_into.data()), reply_key,
            static_cast<std::uint32_t>(std::min<std::size_t>(o.reply_into.size(), UINT32_MAX))};
        std::memcpy(out + at, &d, sizeof d);
        at += sizeof d;
    }
    if (!external && !request.empty()) {
        std::memcpy(out + at, request.data(), request.size());
        at += request.size();
    }
    const bool epoch = !ss.epoch; // a new epoch for every call in the slot
    if (epoch)
        h.flags |= flag_epoch;
    std::memcpy(out, &h, sizeof h);
    const status s = l->wire->send_slot(message_kind::request, slot, static_cast<std::uint32_t>(at),
                                        o.priority, epoch);
    if (s != status::ok) {
        // The request was not posted, so the peer never learned the keys;
        // the windows are invalidated all the same (their registrations are
        // held until the slot's next call: one cannot go while bound).
        end_exposure(*l, slot);
        if (s == status::queue_full) {
            ++counters_.no_credit;
            return call_status::no_credit;
        }
        counters_.count_link_end(l->wire->why_ended());
        ++counters_.disconnected; // fail_link (in housekeeping) counts a broken link no more
        l->wire->broken = true;
        next_housekeeping_ = {};
        return call_status::peer_gone;
    }
    l->free_slots.pop_back();
    ss.phase = slot_phase::in_flight;
    ss.epoch = epoch;
    ss.seq = h.call_seq;
    ss.cookie = o.cookie;
    ss.reply_into = o.reply_into;
    const auto timeout =
        o.timeout.count() > 0
            ? o.timeout
            : std::chrono::duration_cast<std::chrono::microseconds>(opts_.call_timeout);
    ss.deadline = sched::coarse_clock::now() + timeout;
    ++l->in_flight;
    ++in_flight_;
    ++counters_.calls;
    counters_.bytes_out += at;
    taken = {static_cast<std::uint32_t>(l - links_.data()), slot, h.call_seq, true};
    return call_status::ok;
}

void client::progress() noexcept {
    ibv_wc wcs[32];
    const int n = inbox_.poll(wcs);
    for (int i = 0; i < n; ++i)
        on_receive(wcs[i]);
    if (n > 0)
        inbox_.replenish(static_cast<std::uint32_t>(n));
    const bool due = sched::coarse_clock::now() >= next_housekeeping_;
    for (std::uint32_t i = 0; i < links_.size(); ++i) {
        link& l = links_[i];
        if (!l.wire || l.wire->broken)
            continue;
        if (l.wire->is_local()) {
            if (!l.wire->drain_imms([&](std::uint32_t imm) { on_imm(l, i, imm); })) {
                ++counters_.rejected_malformed;
                fail_link(l, i);
            }
            continue;
        }
        // Every window deallocated (none could be allocated in one's place):
        // each fence is moot, and nothing would complete for it.
        if (l.fencing != 0 && !l.wire->has_windows())
            end_fences(l, i, false);
        // A scheduler with nothing to post and room in its budget waits for
        // housekeeping: a call waits for its reply, not for these.
        if (!l.wire->has_outstanding() || (!due && !l.wire->needs_progress()))
            continue;
        verbs::completion out[16];
        const int k = l.wire->poll_transfers(out);
        for (int j = 0; j < k; ++j)
            if (!out[j].ok())
                fail_link(l, i);
        if (l.fencing != 0) {
            if (!l.wire->broken && l.wire->failed()) {
                // A fence's invalidation (or another request) failed.
                counters_.count_link_end(l.wire->why_ended());
                fail_link(l, i);
            } else {
                take_fenced(l, i);
            }
        }
    }
    if (due)
        housekeeping();
}

void client::on_receive(const ibv_wc& wc) noexcept {
    const auto it = by_qp_.find(wc.qp_num);
    if (it == by_qp_.end()) {
        ++counters_.stray_completions;
        return;
    }
    const std::uint32_t index = it->second;
    link& l = links_[index];
    if (l.wire->broken) {
        ++counters_.stray_completions;
        return;
    }
    const auto bad = [&](violation v) {
        counters_.count(v);
        fail_link(l, index);
    };
    if (wc.status != IBV_WC_SUCCESS) {
        link_end e = l.wire->why_ended();
        if (wc.status != IBV_WC_WR_FLUSH_ERR)
            e.failure = wc.status;
        counters_.count_link_end(e);
        if (wc.status == IBV_WC_WR_FLUSH_ERR)
            fail_link(l, index);
        else
            bad(violation::bad_opcode);
        return;
    }
    if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM || (wc.wc_flags & IBV_WC_WITH_IMM) == 0) {
        bad(violation::bad_opcode);
        return;
    }
    on_imm(l, index, ntohl(wc.imm_data));
}

void client::on_imm(link& l, std::uint32_t index, std::uint32_t imm) noexcept {
    const auto bad = [&](violation v) {
        counters_.count(v);
        fail_link(l, index);
    };
    const imm_fields f = decode_imm(imm);
    if (const violation v =
            check_imm(f, message_kind::reply, l.wire->slots(), l.wire->slot_bytes());
        v != violation::none) {
        bad(v);
        return;
    }
    slot_state& ss = l.slots[f.slot];
    if (ss.phase != slot_phase::in_flight || f.epoch != ss.epoch) {
        if (ss.late == 0) {
            bad(violation::credit); // a reply for no call
            return;
        }
        // The reply of a call that timed out: the slot is not its any more
        // (free, or another call's), so it is dropped unread.
        --ss.late;
        ++counters_.late_replies;
        return;
    }
    // The header's call_seq before the strict parse: a late immediate taken
    // against the bytes of this slot's next reply (or of a call two epochs
    // back, the same bit) disagrees in length or call_seq; it is late, not
    // malformed (check_imm let through a header's bytes at least).
    if (detail::load<message_header>(l.wire->inbound(f.slot, sizeof(message_header)).data())
            .call_seq != ss.seq) {
        if (ss.late == 0) {
            bad(violation::malformed);
            return;
        }
        --ss.late;
        ++counters_.late_replies;
        return;
    }
    parsed_reply pr;
    const auto offered =
        static_cast<std::uint32_t>(std::min<std::size_t>(ss.reply_into.size(), UINT32_MAX));
    if (const violation v = parse_reply(l.wire->inbound(f.slot, f.bytes), offered, pr);
        v != violation::none) {
        bad(v);
        return;
    }
    counters_.bytes_in += f.bytes;
    std::span<const std::byte> body = pr.inline_body;
    if ((pr.header.flags & flag_external_reply) != 0) {
        body = {ss.reply_into.data(), pr.header.body_bytes};
        ++counters_.external_replies;
    }
    finish(l, index, f.slot, static_cast<call_status>(pr.header.status), body);
}

void client::end_exposure(link& l, std::uint32_t slot, bool now) noexcept {
    slot_state& ss = l.slots[slot];
    if (now && ss.windows && l.wire) {
        // The caller reuses its buffers as soon as it sees the result, so
        // the windows die before (a LOCAL_INV could wait behind a stalled
        // send queue); then the registrations can go at once.
        ss.windows = false;
        revoke_slot_now(l, slot);
        ss.body_reg.reset();
        ss.reply_reg.reset();
        return;
    }
    if (!ss.windows) {
        // Registrations' own keys (no windows): nothing to revoke; the
        // registration goes back to the cache.
        ss.body_reg.reset();
        ss.reply_reg.reset();
        return;
    }
    ss.windows = false;
    if (l.wire) {
        l.wire->revoke(2 * slot, 2);
    }
}

void client::finish(link& l, std::uint32_t index, std::uint32_t slot, call_status st,
                    std::span<const std::byte> reply) noexcept {
    slot_state& ss = l.slots[slot];
    // The caller owns its buffers again once it sees the result: the windows
    // die before, not at an invalidation that runs later (7.x soft-RoCE
    // posts from a work queue; a stalled send queue holds it). A signaled
    // invalidation, and the result once its completion is in (the reply's
    // bytes are in the ring or the caller's buffer already); where it cannot
    // be posted, the windows are deallocated now (the reply came, so the
    // request and the binds before it ran).
    if (ss.windows && l.wire && !l.wire->broken && l.wire->fence(2 * slot, 2)) {
        ss.windows = false;
        ss.phase = slot_phase::fencing;
        ss.fenced_status = st;
        ss.fenced_reply = reply;
        ++l.fencing;
        return;
    }
    end_exposure(l, slot, true);
    push_done(l, index, slot, st, reply);
}

void client::push_done(link& l, std::uint32_t index, std::uint32_t slot, call_status st,
                       std::span<const std::byte> reply) noexcept {
    slot_state& ss = l.slots[slot];
    ss.phase = slot_phase::done;
    --l.in_flight;
    ++l.held;
    if (st == call_status::ok)
        ++counters_.completed;
    else
        ++counters_.failed;
    push_result({ss.cookie, {index, l.generation}, st, reply}, {index, slot, ss.seq, true});
}

void client::fenced(link& l, std::uint32_t index, std::uint32_t slot, bool dealloc) noexcept {
    slot_state& ss = l.slots[slot];
    --l.fencing;
    if (dealloc && l.wire)
        revoke_slot_now(l, slot);
    // Its windows are dead: the registrations may go.
    ss.body_reg.reset();
    ss.reply_reg.reset();
    push_done(l, index, slot, ss.fenced_status, ss.fenced_reply);
}

void client::take_fenced(link& l, std::uint32_t index) noexcept {
    std::uint32_t firsts[32];
    for (std::size_t n; l.fencing != 0 && (n = l.wire->take_fenced(firsts)) != 0;)
        for (std::size_t i = 0; i < n; ++i) {
            const std::uint32_t slot = firsts[i] / 2;
            if (slot < l.slots.size() && l.slots[slot].phase == slot_phase::fencing)
                fenced(l, index, slot, false);
        }
}

void client::end_fences(link& l, std::uint32_t index, bool dealloc) noexcept {
    for (std::uint32_t s = 0; s < l.slots.size() && l.fencing != 0; ++s)
        if (l.slots[s].phase == slot_phase::fencing)
            fenced(l, index, s, dealloc);
}

void client::fail_link(link& l, std::uint32_t index) noexcept {
    if (l.wire->broken && l.in_flight == 0)
        return;
    if (!l.wire->broken)
        ++counters_.disconnected;
    l.wire->broken = true;
    for (std::uint32_t s = 0; s < l.slots.size(); ++s) {
        slot_state& ss = l.slots[s];
        if (ss.phase == slot_phase::in_flight)
            finish(l, index, s, call_status::peer_gone, {});
        else if (ss.phase == slot_phase::fencing)
            // Answered, but its invalidation will not complete now (or
            // failed): deallocated, then the answer goes out.
            fenced(l, index, s, true);
    }
    next_housekeeping_ = {};
}

void client::housekeeping() noexcept {
    const auto now = sched::coarse_clock::now();
    next_housekeeping_ = now + opts_.housekeeping;
    // Connection events are read only when a channel has one (one epoll_wait).
    const bool events = inbox_.events_pending();
    for (std::uint32_t i = 0; i < links_.size(); ++i) {
        link& l = links_[i];
        if (!l.wire)
            continue;
        if (!l.wire->broken && (l.wire->failed() || (events && l.wire->peer_gone()))) {
            counters_.count_link_end(l.wire->why_ended());
            fail_link(l, i);
        } else if (l.wire->broken && l.in_flight != 0) {
            fail_link(l, i); // broken by a send that failed: its other calls end too
        }
        if (l.wire->broken || l.in_flight == 0)
            continue;
        if (fence_stalled(l, now)) {
            // An answered call's invalidation did not complete by the call's
            // deadline: the send queue is stalled (a peer that answers but
            // posts no receives holds it in retries for ever). The link ends;
            // the answers go out once their windows are deallocated.
            ++counters_.fence_stalls;
            counters_.count_link_end(l.wire->why_ended());
            fail_link(l, i);
            continue;
        }
        for (std::uint32_t s = 0; s < l.slots.size(); ++s) {
            slot_state& ss = l.slots[s];
            if (ss.phase != slot_phase::in_flight || ss.deadline > now)
                continue;
            // The slot is the caller's again at once: its next call goes
            // with the other epoch, which tells the server to drop this one,
            // and a late reply of this one is dropped unread.
            ss.phase = slot_phase::free;
            // The server is fenced out of the call's buffers from now on: a
            // late READ or WRITE fails at the device (and ends the link).
            end_exposure(l, s, true);
            if (l.wire->is_local()) {
                // The request is in the server's ring, in shared memory:
                // flip its epoch there, which the server checks before it
                // reads the body or writes the reply by CMA (which cannot be
                // revoked once under way).
                std::byte* flags = l.wire->staging(s) + offsetof(message_header, flags);
                *flags ^= std::byte{flag_epoch};
            }
            if (ss.late < UINT8_MAX)
                ++ss.late;
            // Taken last: calls go to other free slots first, which gives a
            // slow server's answer the time to come and leaves its call be.
            l.free_slots.push_back(static_cast<std::uint16_t>(s));
            std::rotate(l.free_slots.begin(), l.free_slots.end() - 1, l.free_slots.end());
            --l.in_flight;
            ++counters_.timed_out;
            ++counters_.failed;
            push_result({ss.cookie, {i, l.generation}, call_status::timed_out, {}},
                        {i, no_slot, ss.seq, false});
        }
    }
    teardown_idle();
}

bool client::fence_stalled(const link& l, sched::coarse_clock::time_point now) const noexcept {
    if (l.fencing == 0)
        return false;
    for (const slot_state& ss : l.slots)
        if (ss.phase == slot_phase::fencing && ss.deadline + opts_.housekeeping <= now)
            return true;
    return false;
}

void client::release_handed_out() noexcept {
    for (const slot_ref& r : handed_out_) {
        link& l = links_[r.link];
        if (!r.release || r.slot == no_slot || !l.wire)
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

void client::teardown_idle() noexcept {
    for (link& l : links_) {
        if (!l.wire || !l.wire->broken || l.held != 0 || l.in_flight != 0)
            continue;
        // Only once every completion queued for it was taken: none is then
        // left for a queue pair number a later connection may reuse.
        ibv_wc wcs[32];
        for (int n; (n = inbox_.poll(wcs)) > 0;) {
            for (int i = 0; i < n; ++i)
                on_receive(wcs[i]);
            inbox_.replenish(static_cast<std::uint32_t>(n));
        }
        if (l.held != 0 || l.in_flight != 0)
            continue;
        inbox_.forget(l.wire->event_fd());
        if (l.wire->wake_fd() >= 0)
            inbox_.forget(l.wire->wake_fd());
        if (l.verbs != nullptr)
            by_qp_.erase(l.verbs->qp_num());
        l.verbs = nullptr;
        l.wire.reset();
        l.slots.clear();
        l.free_slots.clear();
    }
}

int client::poll(std::span<call_result> out) noexcept {
    release_handed_out();
    progress();
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

call_result client::call(peer_id p, std::uint16_t method, std::span<const std::byte> request,
                         const call_options& o) noexcept {
    release_handed_out();
    slot_ref taken;
    if (const call_status s = start_on(p, method, request, o, taken); s != call_status::ok)
        return {o.cookie, p, s, {}};
    for (;;) {
        progress();
        // Its result, taken out of the queue; the others keep their order.
        for (std::size_t i = 0; i < results_count_; ++i) {
            const std::size_t at = (results_head_ + i) % results_.size();
            const slot_ref& r = queued_slots_[at];
            if (r.link != taken.link || r.seq != taken.seq)
                continue;
            const call_result mine = results_[at];
            handed_out_.push_back(r);
            for (std::size_t j = i; j + 1 < results_count_; ++j) {
                const std::size_t from = (results_head_ + j + 1) % results_.size();
                const std::size_t to = (results_head_ + j) % results_.size();
                results_[to] = results_[from];
                queued_slots_[to] = queued_slots_[from];
            }
            --results_count_;
            --in_flight_;
            return mine;
        }
    }
}

int client::wait(std::span<call_result> out, std::chrono::microseconds timeout) noexcept {
    if (const int n = poll(out); n != 0)
        return n;
    (void)inbox_.arm();
    bool asleep = true;
    for (link& l : links_)
        if (l.wire && !l.wire->broken && !l.wire->prepare_sleep())
            asleep = false;
    if (const int n = poll(out); n != 0 || !asleep) {
        for (link& l : links_)
            if (l.wire)
                l.wire->woke();
        return n != 0 ? n : poll(out);
    }
    inbox_.sleep(std::min<std::chrono::microseconds>(
        timeout, std::chrono::duration_cast<std::chrono::microseconds>(opts_.housekeeping)));
    for (link& l : links_)
        if (l.wire)
            l.wire->woke();
    next_housekeeping_ = {};
    return poll(out);
}

void client::disconnect(peer_id p) noexcept {
    if (link* l = find(p)) {
        fail_link(*l, p.index);
        l->wire->close();
    }
}

} // namespace rdmax::rpc
