// rpc::client, connecting: through the node's memory when the server is on
// this node (a Unix socket handshake, a shared segment, CMA), else through
// the device (rdma_cm, the rings' keys in its private data).

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string_view>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/detail/rpc/client_rails.hpp>
#include <rdmax/detail/rpc/pending_dial.hpp>
#include <rdmax/detail/rpc/rdma_link.hpp>
#include <rdmax/detail/rpc/shm_link.hpp>
#include <rdmax/detail/rpc/tcp_link.hpp>
#include <rdmax/error.hpp>
#include <rdmax/local/cma.hpp>
#include <rdmax/local/node_address.hpp>
#include <rdmax/rpc/client.hpp>
#include <rdmax/stats/proc_identity.hpp>
#include <rdmax/verbs/listener.hpp>

#include "../notice.hpp"

namespace rdmax::rpc {

namespace {
std::uint32_t inbox_depth(const rpc_options& o) {
    return std::clamp<std::uint32_t>(std::uint32_t{o.slots} * 8U, 256, 8192);
}

/// Closes the descriptors a node-local server sent, and forgets them.
void close_fds(std::vector<int>& fds) noexcept {
    for (int fd : fds)
        ::close(fd);
    fds.clear();
}

/// The Unix channel of a server on this node that answers addr:port, if any
/// (a name held by a process of another user, not root, is passed over: why,
/// in `untrusted`).
local::unix_channel find_local_server(std::string_view addr, std::uint16_t port,
                                      std::string& untrusted) {
    local::unix_channel ch;
    // Only an address of this node can have its server here. The abstract
    // namespace has no owners: a name for another node's address is anyone's
    // to take, and a client that tried it would hand its calls to whoever
    // did, not to the server it named.
    if (!local::is_node_address(addr))
        return ch;
    // The server on addr itself, else one on a wildcard address, which
    // answers for every address of the node. Whoever holds a name gets this
    // client's requests: only a process of this user, or root, is trusted
    // with them (another user's could not read this process's memory by CMA
    // anyway, so no real server is lost); a name another user took is passed
    // over, so that it does not hide a server on a wildcard address.
    for (const std::string_view a : {addr, std::string_view{"0.0.0.0"}, std::string_view{"::"}}) {
        const std::string name = local_name(a, port);
        try {
            ch = local::unix_channel::connect(name);
        } catch (const error&) {
            continue;
        }
        try {
            const local::peer_credentials who = ch.peer();
            if (who.uid == ::geteuid() || who.uid == 0)
                return ch;
            untrusted = fmt::format("its node-local name @{} is held by uid {} (pid {}), neither "
                                    "this user nor root: not trusted with calls",
                                    name, who.uid, who.pid);
        } catch (const error& e) {
            untrusted = fmt::format("the holder of its node-local name @{} is unknown ({})", name,
                                    e.what());
        }
        ch = local::unix_channel();
    }
    return ch;
}
} // namespace

client::client(const verbs::protection_domain& pd, rpc_options opts)
    : opts_((opts.check("rpc::client"), opts))
    , ep_(pd, opts_, inbox_depth(opts_)) {
    open_stats();
    if (opts_.rails != nullptr && opts_.rails->size() > 1) {
        if (&opts_.rails->pd(0) != &pd)
            throw_error("rpc::client", EINVAL,
                        "rpc_options::rails: the client's protection domain must be "
                        "rails->pd(0)");
        rails_ = std::make_unique<detail::client_rails>(*opts_.rails);
    }
    if (!opts_.node_local() && !opts_.transports.has(transport::rdma) &&
        !opts_.transports.has(transport::tcp))
        throw_error("rpc::client", EINVAL,
                    "no transport: rdma, shm and tcp are all left out (RDMAX_RPC_TRANSPORTS, "
                    "RDMAX_RPC_LOCAL)");
}

client::client(detail::no_device_t none, rpc_options opts)
    : opts_((opts.check("rpc::client"), opts))
    , ep_(none, opts_) {
    open_stats();
}

void client::open_stats() {
    // Clients have no address of their own: numbered in the process.
    static std::atomic<std::uint64_t> clients{0};
    ep_.open_stats("rpc_client", fmt::format("#{}", clients.fetch_add(1) + 1));
}

client::client(rpc_options opts)
    : client(detail::no_device, opts) {
    if (!opts_.node_local() && !opts_.transports.has(transport::tcp))
        throw_error("rpc::client", EINVAL,
                    "no transport: shm and tcp are left out (RDMAX_RPC_TRANSPORTS or "
                    "RDMAX_RPC_LOCAL), and there is no device for rdma");
}

bool client::arm() noexcept {
    if (holding_)
        ring_held(); // nothing sleeps on a request not yet posted
    return ep_.prepare_sleep();
}

bool client::device_ok() const noexcept {
    return ep_.pd != nullptr && opts_.transports.has(transport::rdma);
}

void client::unreachable(std::string_view addr, std::uint16_t port) const {
    throw_error("rpc::client::connect", EHOSTUNREACH,
                fmt::format("{}:{}: {}, {}, and tcp is left out (RDMAX_RPC_TRANSPORTS)", addr, port,
                            ep_.pd == nullptr ? "no RDMA device here"
                                              : "rdma is left out (RDMAX_RPC_TRANSPORTS)",
                            local_miss_));
}

client::~client() {
    ring_held(); // what a hold kept back goes before the goodbye
    // Goodbye on every connection: the servers may drop this client's
    // replies at once (a client that crashes leaves them to the linger).
    for (peer& l : ep_.peers)
        if (l.wire && !l.wire->broken)
            (void)ep_.send_control(l, message_kind::request, control::bye);
}

verbs_cache& client::cache() {
    // The cache cannot move, so make_unique (which forwards a reference)
    // cannot take make_verbs_cache's result: new builds it in place.
    if (!cache_) {
        // NOLINTBEGIN(modernize-make-unique)
        cache_ =
            std::unique_ptr<verbs_cache>(new verbs_cache(make_verbs_cache(*ep_.pd, opts_.cache)));
        // NOLINTEND(modernize-make-unique)
    }
    return *cache_;
}

peer_id client::connect(std::string_view addr, std::uint16_t port) {
    const peer_id p = add_link(dial(addr, port), addr, port);
    if (rails_ && p.index < rails_->sessions.size())
        rails_->sessions[p.index] = {}; // a session used before: not its rails
    return p;
}

peer_id client::connect(std::string_view addr, std::uint16_t port,
                        std::span<const std::string> rail_addresses) {
    const peer_id p = connect(addr, port);
    if (!rails_)
        return p;
    rails_->name_rails(p.index, rail_addresses);
    // The first dials start now, and are waited for (each bounded by the
    // connect timeout): the calls that follow find the rails joined.
    const auto until = ep_.now() + opts_.connect_timeout + std::chrono::seconds(1);
    for (;;) {
        detail::client_rails::tend(*this, ep_.now());
        const auto& dials = rails_->sessions[p.index].dials;
        const bool dialing =
            std::any_of(dials.begin(), dials.end(), [](const auto& d) { return d.conn.valid(); });
        if (!dialing || ep_.now() >= until)
            return p;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
}

std::unique_ptr<detail::link> client::dial(std::string_view addr, std::uint16_t port) {
    local_miss_ = "shm is left out (RDMAX_RPC_TRANSPORTS or RDMAX_RPC_LOCAL)";
    if (opts_.node_local())
        if (std::unique_ptr<detail::link> local = connect_local(addr, port))
            return local;
    if (!device_ok()) {
        if (opts_.transports.has(transport::tcp))
            return finish_tcp(*begin_tcp(addr, port), addr, port); // waits for the thread
        unreachable(addr, port);
    }
    const std::shared_ptr<detail::pending_dial> d = begin_device(addr, port);
    return finish_dial(*d, addr, port); // waits for the thread
}

namespace {
/// The device found no RDMA path to the server (rather than a server that
/// refused, or said nonsense): TCP may still reach it. A server's own
/// rdma_reject comes as REJECTED with the consumer-defined reason (28).
bool no_rdma_path(const error& e) noexcept {
    switch (e.code().value()) {
    case ENODEV:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case ENETDOWN:
    case EADDRNOTAVAIL: return true;
    case ECONNREFUSED: return std::string_view(e.what()).find("(status 28)") == std::string::npos;
    default: return false;
    }
}
} // namespace

std::unique_ptr<detail::link> client::finish_dial(detail::pending_dial& d, std::string_view addr,
                                                  std::uint16_t port,
                                                  std::shared_ptr<detail::pending_dial>* then) {
    if (d.tcp.valid()) {
        auto link = finish_tcp(d, addr, port);
        // Said once it connected: an attempt that fails throws with every
        // reason, and a reconnect loop through an outage would repeat it.
        if (!d.rdma_miss.empty())
            rdmax::detail::notice(
                fmt::format("rpc::client: {}:{}: {}: connected over TCP", addr, port, d.rdma_miss));
        return link;
    }
    if (!opts_.transports.has(transport::tcp))
        return finish_device(d, addr, port);
    std::string rdma_miss;
    try {
        return finish_device(d, addr, port);
    } catch (const error& e) {
        if (!no_rdma_path(e))
            throw;
        rdma_miss = fmt::format("no RDMA path ({})", e.what());
    }
    // TCP on its thread: a reconnect goes on serving its other connections
    // meanwhile (`then`); connect() waits for it here.
    std::shared_ptr<detail::pending_dial> tcp = begin_tcp(addr, port);
    tcp->rdma_miss = std::move(rdma_miss);
    if (then != nullptr) {
        *then = std::move(tcp);
        return nullptr;
    }
    return finish_dial(*tcp, addr, port);
}

std::shared_ptr<detail::pending_dial> client::begin_tcp(std::string_view addr, std::uint16_t port) {
    auto d = std::make_shared<detail::pending_dial>();
    tcp_hello hello;
    hello.slots = opts_.slots;
    hello.slot_bytes = opts_.slot_bytes;
    hello.incarnation = ep_.incarnation;
    hello.first_call = next_call_id_;
    // The thread touches nothing of this client: what it reads is copied.
    d->tcp = std::async(std::launch::async, [where = std::string(addr), port, hello,
                                             timeout = opts_.connect_timeout] {
        detail::tcp_dialed r;
        r.ch = local::unix_channel(tcp_connect(where, port, timeout)); // throws: no path
        try {
            r.ch.send(std::as_bytes(std::span(&hello, 1)));
            std::vector<int> fds; // none comes over TCP
            r.bytes = r.ch.receive(std::as_writable_bytes(std::span(&r.welcome, 1)), fds, timeout);
        } catch (const error& e) {
            r.handshake_error = e.what();
            r.handshake_errno = e.code().value();
        }
        return r;
    });
    return d;
}

std::unique_ptr<detail::link> client::finish_tcp(detail::pending_dial& d, std::string_view addr,
                                                 std::uint16_t port) {
    const std::string_view rdma_miss = d.rdma_miss;
    detail::tcp_dialed r;
    try {
        r = d.tcp.get();
    } catch (const error& e) {
        // No path at all: every reason, as unreachable() gives them.
        throw_error("rpc::client::connect", EHOSTUNREACH,
                    fmt::format("{}:{}: {}, {}, and over tcp: {}", addr, port,
                                !rdma_miss.empty() ? rdma_miss
                                : ep_.pd == nullptr
                                    ? std::string_view("no RDMA device here")
                                    : std::string_view("rdma is left out (RDMAX_RPC_TRANSPORTS)"),
                                local_miss_, e.what()));
    }
    if (!r.handshake_error.empty())
        throw_error(
            "rpc::client::connect", r.handshake_errno,
            fmt::format("{}:{}: the tcp handshake failed: {}", addr, port, r.handshake_error));
    const tcp_welcome& w = r.welcome;
    const bool welcome = r.bytes == sizeof w && w.magic == protocol_magic;
    if (welcome && w.status == tcp_refused) {
        ep_.counters.count_refusal(ECONNREFUSED, "the tcp server refused the connection");
        throw_error("rpc::client::connect", ECONNREFUSED,
                    fmt::format("{}:{}: the server refused the tcp connection (its "
                                "last_refusal says why)",
                                addr, port));
    }
    if (!welcome || w.version != protocol_version || w.status != tcp_ok || w.slots == 0 ||
        w.slots > opts_.slots || w.slot_bytes < min_slot_bytes || w.slot_bytes > opts_.slot_bytes ||
        w.slot_bytes % 8 != 0 || w.incarnation == 0) {
        ep_.counters.count_refusal(EPROTO, "the tcp server answered nonsense");
        throw_error("rpc::client::connect", EPROTO,
                    fmt::format("{}:{}: the tcp server answered nonsense", addr, port));
    }
    local::unix_channel& ch = r.ch;
    auto wire = std::make_unique<detail::tcp_link>(ch.fd(), false, w.slots, w.slot_bytes);
    (void)ch.release(); // the link's now
    wire->peer_incarnation = w.incarnation;
    return wire;
}

std::shared_ptr<detail::pending_dial> client::begin_device(std::string_view addr,
                                                           std::uint16_t port) {
    const verbs::protection_domain& pd = *ep_.pd;
    auto d = std::make_shared<detail::pending_dial>();
    d->wire =
        std::make_unique<detail::rdma_link>(ep_.arena, ep_.issuer, opts_.slots, opts_.slot_bytes);
    d->mine = d->wire->offer();
    d->mine.incarnation = ep_.incarnation;
    d->mine.first_call = next_call_id_;
    // The thread makes the rdma_cm connection alone: what it reads is copied
    // (the offer, the queue pair's configuration, the address) or
    // thread-safe (the protection domain, the shared queues).
    d->conn = std::async(std::launch::async, [&pd, where = std::string(addr), port, mine = d->mine,
                                              cfg = detail::link_qp_config(ep_.in, opts_.slots,
                                                                           pd.device().limits(),
                                                                           windows_wanted()),
                                              timeout = opts_.connect_timeout] {
        return verbs::connection::connect(pd, where, port, verbs::payload_of(mine), cfg, timeout);
    });
    return d;
}

std::unique_ptr<detail::link> client::finish_device(detail::pending_dial& d, std::string_view addr,
                                                    std::uint16_t port) {
    verbs::connection conn = d.conn.get(); // throws what the connect threw
    const std::optional<ring_offer> granted = conn.peer_payload_as<ring_offer>();
    const char* why = granted ? check_offer(*granted) : "no ring offer in the reply";
    if (why == nullptr &&
        (granted->slots > d.mine.slots || granted->slot_bytes > d.mine.slot_bytes))
        why = "the server granted more than was asked";
    if (why != nullptr) {
        ep_.counters.count_refusal(EPROTO, why);
        throw_error("rpc::client::connect", EPROTO, fmt::format("{}:{}: {}", addr, port, why));
    }
    std::unique_ptr<detail::rdma_link> wire = std::move(d.wire);
    wire->attach(std::move(conn), *granted, opts_.scheduler);
    wire->peer_incarnation = granted->incarnation;
    wire->join_key = granted->first_call;
    const detail::call_memory memory{
        .cache = [](void* self) -> verbs_cache& { return static_cast<client*>(self)->cache(); },
        .owner = this,
        .counters = &ep_.counters};
    if (!wire->serve_calls(memory, windows_wanted())) {
        // Not silently: the server then sees the registrations' keys.
        const int err = errno;
        ++ep_.counters.windows_unavailable;
        rdmax::detail::notice(fmt::format(
            "rpc::client: {}:{}: no memory windows for this connection (ibv_alloc_mw: {}): "
            "its calls' large bodies and reply buffers go under the cached registrations' own "
            "keys, which the server keeps for as long as the registrations live",
            addr, port, std::strerror(err)));
    }
    return wire;
}

bool client::windows_wanted() const noexcept {
    // Windows need type 2 and a pinned registration to bind to (not ODP).
    return ep_.pd->device().limits().memory_windows && !opts_.cache.on_demand;
}

peer_id client::add_link(std::unique_ptr<detail::link> wire, std::string_view addr,
                         std::uint16_t port) {
    std::string where(addr); // may throw: nothing changed yet
    if (free_sessions_.empty()) {
        sessions_.emplace_back();
        free_sessions_.push_back(static_cast<std::uint32_t>(sessions_.size() - 1));
    }
    const std::uint32_t s = free_sessions_.back();
    attach(s, std::move(wire)); // all or nothing
    free_sessions_.pop_back();
    session& ss = sessions_[s];
    ss.generation = ++session_generations_;
    ss.used = true;
    ss.addr = std::move(where);
    ss.port = port;
    ss.server_incarnation = ep_.peers[ss.link].incarnation;
    ss.state = peer_state::ready;
    ss.backoff = opts_.reconnect_backoff;
    return session_id(s);
}

void client::attach(std::uint32_t s, std::unique_ptr<detail::link> wire) {
    // Room for the new slots' results first: once the link is in the table,
    // nothing may throw.
    grow_results(wire->slots());
    free_sessions_.reserve(sessions_.size());
    peer fresh;
    fresh.session = s;
    fresh.slots = std::vector<slot_state>(wire->slots());
    fresh.free_slots.reserve(wire->slots());
    for (std::uint32_t k = wire->slots(); k-- > 0;)
        fresh.free_slots.push_back(static_cast<std::uint16_t>(k));
    const std::uint64_t incarnation = wire->peer_incarnation;
    const std::uint16_t slots = wire->slots();
    const std::uint32_t slot_bytes = wire->slot_bytes();
    const rpc::transport kind = wire->kind();
    const std::uint32_t index = ep_.add(std::move(wire), std::move(fresh), incarnation);
    session& ss = sessions_[s];
    ss.link = index;
    ++ss.links;
    ss.slots = slots;
    ss.slot_bytes = slot_bytes;
    ++ep_.counters.connected;
    ep_.counters.connected_local += kind == rpc::transport::shm ? 1 : 0;
    ep_.counters.connected_tcp += kind == rpc::transport::tcp ? 1 : 0;
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
    } else if ((ptracer_ == 0 || stats::start_ticks_of(ptracer_) != ptracer_start_) &&
               local::allow_cma_from(server)) {
        // One process at a time: a second server is not granted while the
        // first lives. Once it is gone (Yama drops its grant as it exits), the
        // next one is: a server restarted on its port is reached again.
        ptracer_ = server;
        ptracer_start_ = stats::start_ticks_of(server);
    }
}

std::unique_ptr<detail::link> client::connect_local(std::string_view addr, std::uint16_t port) {
    std::string untrusted;
    local::unix_channel ch = find_local_server(addr, port, untrusted);
    if (ch.fd() < 0) {
        if (!untrusted.empty()) {
            std::vector<int> none;
            return refuse_local(none, EACCES, "the node-local name is another user's", addr, port,
                                untrusted);
        }
        local_miss_ = fmt::format("no node-local server at {}:{}", addr, port);
        return nullptr; // the server is not on this node
    }
    try {
        grant_cma(ch.peer().pid); // the process that listens on the name
    } catch (const error&) {
        // No credentials: the probe in the handshake tells whether CMA works anyway.
    }
    return local_handshake(std::move(ch), addr, port);
}

std::size_t client::exchange_hello(local::unix_channel& ch, local_welcome& w,
                                   std::vector<int>& fds) {
    if (probe_ == 0)
        probe_ = std::random_device{}() | 1U;
    local_hello hello;
    hello.slots = opts_.slots;
    hello.slot_bytes = opts_.slot_bytes;
    hello.probe_addr = reinterpret_cast<std::uint64_t>(&probe_);
    hello.probe_value = probe_;
    hello.incarnation = ep_.incarnation;
    hello.first_call = next_call_id_;
    ch.send(std::as_bytes(std::span(&hello, 1)));
    return ch.receive(std::as_writable_bytes(std::span(&w, 1)), fds, opts_.connect_timeout);
}

std::unique_ptr<detail::link> client::local_handshake(local::unix_channel ch, std::string_view addr,
                                                      std::uint16_t port) {
    local_welcome w;
    std::vector<int> fds;
    std::size_t n = 0;
    try {
        n = exchange_hello(ch, w, fds);
    } catch (const error& e) {
        const int err = e.code().value();
        if (err == ECONNRESET || err == EPIPE) {
            // The server closed without a welcome: it refused this connection
            // (too many handshakes under way, from this user or all). The
            // device may still take it.
            return refuse_local(fds, err, "the node-local server closed the handshake", addr, port,
                                fmt::format("it closed the node-local handshake ({})", e.what()));
        }
        close_fds(fds);
        throw_error(
            "rpc::client::connect", EPROTO,
            fmt::format("{}:{}: the node-local handshake failed: {}", addr, port, e.what()));
    }
    const bool welcome = n == sizeof w && w.magic == protocol_magic;
    if (welcome && w.status == local_no_cma) {
        close_fds(fds);
        local_miss_ = fmt::format(
            "{}:{} is on this node, but it may not read this process's memory (CMA: {}{})", addr,
            port, local::why_not_permitted(getpid()),
            opts_.ptracer == rpc_options::ptracer_grant::any
                ? ""
                : "; RDMAX_RPC_PTRACER=any lets every server of this user do it");
        if (device_ok())
            rdmax::detail::notice(fmt::format("rpc::client: {}: through the device", local_miss_));
        return nullptr;
    }
    if (welcome && w.status == local_refused)
        return refuse_local(fds, EBUSY, "the node-local server refused the connection", addr, port,
                            "it refused the node-local connection");
    if (!welcome || w.version != protocol_version || w.status != local_ok || fds.size() != 3 ||
        w.slots == 0 || w.slots > opts_.slots || w.slot_bytes < min_slot_bytes ||
        w.slot_bytes > opts_.slot_bytes || w.incarnation == 0 ||
        w.segment_bytes < detail::shm_link::segment_bytes(w.slots, w.slot_bytes)) {
        close_fds(fds);
        ep_.counters.count_refusal(EPROTO, "the node-local server answered nonsense");
        throw_error("rpc::client::connect", EPROTO,
                    fmt::format("{}:{}: the node-local server answered nonsense", addr, port));
    }
    return map_segment(std::move(ch), w, fds, addr, port);
}

std::unique_ptr<detail::link> client::map_segment(local::unix_channel ch, const local_welcome& w,
                                                  std::vector<int>& fds, std::string_view addr,
                                                  std::uint16_t port) {
    local::shared_segment seg;
    try {
        seg = local::shared_segment::attach(fds[0], w.segment_bytes, true, /*require_sealed=*/true);
    } catch (const error& e) {
        if (e.code().value() == EPERM) {
            // A server older than sealed segments: its peers could cut the
            // segment under this process. Not node-local, then.
            return refuse_local(fds, EPERM, "the node-local server's segment is not sealed", addr,
                                port, "its shared segment is not sealed (an older server)");
        }
        close_fds(fds);
        throw;
    } catch (...) {
        close_fds(fds);
        throw;
    }
    ::close(fds[0]); // mapped: the mapping keeps the memory
    const pid_t server_pid = ch.peer().pid;
    auto wire = std::make_unique<detail::shm_link>(std::move(ch), std::move(seg), server_pid,
                                                   w.slots, w.slot_bytes, fds[1], fds[2]);
    if (wire->corrupt())
        throw_error("rpc::client::connect", EPROTO,
                    fmt::format("{}:{}: the node-local segment is not laid out", addr, port));
    wire->peer_incarnation = w.incarnation;
    return wire;
}

std::unique_ptr<detail::link> client::refuse_local(std::vector<int>& fds, int err,
                                                   std::string_view reason, std::string_view addr,
                                                   std::uint16_t port, std::string_view what) {
    close_fds(fds);
    ep_.counters.count_refusal(err, reason);
    local_miss_ = fmt::format("{}:{} is on this node, but {}", addr, port, what);
    if (device_ok())
        rdmax::detail::notice(fmt::format("rpc::client: {}: through the device", local_miss_));
    return nullptr;
}

void client::disconnect(peer_id p) noexcept {
    session* ss = find_session(p);
    if (ss == nullptr)
        return;
    const std::uint32_t s = p.index;
    if (holding_)
        ring_held(); // held calls go before the goodbye, not after the close
    if (ss->link != no_link) {
        peer& l = ep_.peers[ss->link];
        // Goodbye first: the server may drop this client's replies at once.
        if (!l.wire->broken)
            (void)ep_.send_control(l, message_kind::request, control::bye);
        set_state(s, peer_state::closed); // its calls end, not wait
        fail_link(l, ss->link);
        l.wire->close();
    }
    close_session(s, call_status::peer_gone); // the peer_id goes with its last link
}

} // namespace rdmax::rpc
