#pragma once
// rpc::server: serves many clients from one thread, one completion queue and
// one shared receive queue (LITE's RPC, seed 001; eRPC's sessions and
// credits). See wire.hpp for the protocol.
//
//     rpc::server srv(pd, "0.0.0.0", 7471);   // or srv("0.0.0.0", 7471): this node only
//     srv.on(1, [](rpc::request_context& c) { c.reply(c.body()); });  // echo
//     for (;;) srv.wait(100ms);   // or poll() in a spin loop, or fd() in epoll
//
// Handlers run in the thread that calls poll() or wait(), one at a time. A
// handler answers with reply() (inline in the caller's slot, or into the
// buffer the caller offered when it does not fit) or fail(status), or
// defers: defer() returns a token, and reply(token, ...) answers later. A
// handler that returns without answering or deferring answers
// handler_failed, and so does one that throws.
//
// A peer that breaks the protocol (a message of the wrong kind, a slot out
// of range, a bad length or header, a request into a slot still being
// answered, a send instead of a write-with-immediate) has the message
// dropped, the rejection counted, and its connection closed; no other
// connection's state is touched (each connection's ring has a key of its
// own). A request with an unknown method is answered unknown_method.
//
// The call path (receive, handler, reply) allocates nothing and makes no
// system call but the device's doorbell (a system call on soft-RoCE, a
// write to a mapped page on a NIC). New connections, peers that leave and
// deadlines are looked at every rpc_options::housekeeping, which costs a
// few system calls. A connection is accepted without waiting for its
// handshake to end: a peer that stalls there holds nobody, and is dropped
// after rpc_options::connect_timeout. That holds for peers on this node too:
// their hello is read a piece at a time as it comes, in the same loop, and
// their socket is never waited on (but the CMA reads of a local client's
// memory, its probe word and bodies over a slot, can block on a page the
// client never lets fault in: docs/rpc.md, Known limits). A refused
// connection is counted with its reason (rpc_counters::last_refusal).

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include <rdmax/detail/rpc/arena_block.hpp>
#include <rdmax/detail/rpc/endpoint.hpp>
#include <rdmax/detail/rpc/reply_cache.hpp>
#include <rdmax/detail/rpc/server_slot.hpp>
#include <rdmax/local/descriptor_passing.hpp>
#include <rdmax/rpc/call_status.hpp>
#include <rdmax/rpc/peer_id.hpp>
#include <rdmax/rpc/rpc_counters.hpp>
#include <rdmax/rpc/rpc_options.hpp>
#include <rdmax/sched/coarse_clock.hpp>
#include <rdmax/sched/priority.hpp>
#include <rdmax/verbs/listener.hpp>

namespace rdmax::rpc {

struct local_hello;
class server_group;
namespace detail {
class group_routes;
struct server_rails;
} // namespace detail

/// A deferred call, to answer later with server::reply or server::fail.
struct deferred_call {
    peer_id peer;
    std::uint32_t slot = 0;
    std::uint32_t call_seq = 0;
    /// The client's incarnation and id for the call: an answer given after
    /// the connection went is kept for the copy the client re-sends.
    std::uint64_t client = 0;
    std::uint64_t call_id = 0;
};

class server;

/// What a handler sees: the request, and how to answer it. Valid during the handler.
class request_context {
public:
    [[nodiscard]] std::uint16_t method() const noexcept { return method_; }
    [[nodiscard]] peer_id peer() const noexcept { return peer_; }
    [[nodiscard]] sched::priority priority() const noexcept { return prio_; }
    /// The request's body (in the ring slot, or read from the caller's buffer).
    [[nodiscard]] std::span<const std::byte> body() const noexcept { return body_; }
    /// Bytes the caller can take back: the slot's room, or its reply buffer's.
    [[nodiscard]] std::size_t reply_capacity() const noexcept;
    /// Room in the reply slot to build a reply in place (reply_in_place).
    [[nodiscard]] std::span<std::byte> reply_space() const noexcept { return space_; }
    /// The client's incarnation (random, one per rpc::client object) and its
    /// id for this call: (client_incarnation, call_id) names the call across
    /// the client's reconnects.
    [[nodiscard]] std::uint64_t client_incarnation() const noexcept { return client_; }
    [[nodiscard]] std::uint64_t call_id() const noexcept { return call_id_; }
    /// The caller marked the call idempotent (no reply of it is kept).
    [[nodiscard]] bool idempotent() const noexcept { return idempotent_; }

    /// Answers with `bytes` (copied; over the slot's room into the caller's buffer).
    void reply(std::span<const std::byte> bytes) noexcept;
    /// Answers with the first n bytes of reply_space().
    void reply_in_place(std::size_t n) noexcept;
    /// Answers with a status and no body (a status the server may say).
    void fail(call_status s) noexcept;
    /// Answers later: the slot stays the caller's until server::reply or fail.
    [[nodiscard]] deferred_call defer() noexcept;

private:
    friend class server;
    server* srv_ = nullptr;
    peer_id peer_;
    std::uint32_t slot_ = 0;
    std::uint32_t seq_ = 0;
    std::uint16_t method_ = 0;
    sched::priority prio_;
    std::span<const std::byte> body_;
    std::span<std::byte> space_;
    std::uint64_t client_ = 0;
    std::uint64_t call_id_ = 0;
    bool idempotent_ = false;
    bool answered_ = false;
};

class server {
public:
    using handler = std::function<void(request_context&)>;

    /// Listens on addr:port (port 0: any; see port()). The protection domain
    /// must outlive the server and be on the device that carries addr (a
    /// request on another device is refused). Throws rdmax::error.
    server(const verbs::protection_domain& pd, std::string_view addr, std::uint16_t port,
           rpc_options opts = rpc_options{}.with_env());
    /// With no device: answers peers on this node (transport::shm) and over
    /// TCP (transport::tcp) on addr:port as they name it (addr: an address
    /// of this node, or a wildcard; port 0: a free one). Throws rdmax::error
    /// where opts leave both out, or another server holds addr:port.
    server(std::string_view addr, std::uint16_t port, rpc_options opts = rpc_options{}.with_env());
    server(const server&) = delete;
    server& operator=(const server&) = delete;
    ~server();

    /// Serves `method` (1 .. 65535) with `h`, replacing an earlier handler.
    void on(std::uint16_t method, handler h);

    /// Progress without blocking: takes what arrived, runs handlers, posts
    /// replies; every housekeeping interval, accepts and drops connections.
    /// Returns the requests handled.
    int poll() noexcept;
    /// poll(), sleeping on fd() up to `timeout` when there is nothing to do.
    int wait(std::chrono::microseconds timeout) noexcept;
    /// Readable when poll() may have work: for the caller's own epoll loop
    /// (or an Asio reactor): poll() until it returns 0, arm(), and sleep on
    /// fd() only if arm() returned true; poll() again when it wakes.
    [[nodiscard]] int fd() const noexcept { return ep_.in.fd(); }
    /// What wait() does before it sleeps: takes the completion events, arms
    /// the queue, and asks node-local peers to wake this side (poll() tells
    /// them it is awake). False when something is waiting already (a
    /// connection event for housekeeping, a message): poll() first.
    bool arm() noexcept;

    /// Answers a deferred call; false if its peer is gone (nothing sent).
    bool reply(const deferred_call& d, std::span<const std::byte> bytes) noexcept;
    bool fail(const deferred_call& d, call_status s) noexcept;

    /// True when the peer reached this server through the node's memory.
    [[nodiscard]] bool is_local(peer_id p) const noexcept;
    /// Closes a peer's connection (its calls in flight get no answer).
    void disconnect(peer_id p) noexcept;
    /// Drains, then closes: accepts no new connection, tells every client to
    /// go elsewhere (goaway: they send nothing new here and reconnect), keeps
    /// answering the calls that came until every client has acknowledged and
    /// has none left (deferred ones too), or `deadline` passes, then closes
    /// every connection. Blocks (it polls). Returns true when nothing was
    /// left unanswered. The server refuses connections after it (destroy it).
    bool drain(std::chrono::milliseconds deadline) noexcept;
    /// This server's incarnation (random, one per object): a client that
    /// reconnects learns from it whether the server restarted.
    [[nodiscard]] std::uint64_t incarnation() const noexcept { return ep_.incarnation; }
    /// Clients whose replies the reply cache keeps, and the calls it keeps.
    [[nodiscard]] std::size_t cached_clients() const noexcept { return cache_.clients(); }
    [[nodiscard]] std::size_t cached_calls() const noexcept { return cache_.entries(); }

    [[nodiscard]] std::uint16_t port() const noexcept { return port_; }
    [[nodiscard]] std::size_t peers() const noexcept { return live_; }
    /// The priority scheduler's counters of the connection to `p`; nullopt
    /// for no such peer or a node-local one.
    [[nodiscard]] std::optional<sched::scheduler_counters> scheduler_counters(peer_id p) noexcept;
    [[nodiscard]] const rpc_counters& counters() const noexcept { return ep_.counters; }
    [[nodiscard]] const rpc_options& options() const noexcept { return opts_; }

private:
    friend class request_context;
    friend struct server_test_access; // tests: a failure injected where none can be caused
    /// Tests (tests/support/fake_link.hpp): a server with no device and no
    /// listener, and links adopted without a connection (add_link).
    friend struct protocol_test_access;
    server(detail::no_device_t none, rpc_options opts);
    /// A server_group's worker `worker`: no listener of its own; its
    /// connections come through its mailbox in `group` (server_worker.cpp).
    friend class server_group;
    server(const verbs::protection_domain& pd, detail::group_routes& group, std::size_t worker,
           rpc_options opts);
    server(detail::no_device_t none, detail::group_routes& group, std::size_t worker,
           rpc_options opts);
    void take_handoffs() noexcept;
    /// A client (node-local, or over `tcp`) the group knows is another
    /// worker's: handed to it.
    bool forward_local(local::unix_channel& ch, std::span<const std::byte> hello,
                       std::uint64_t client, bool tcp = false);
    void publish_load() noexcept;
    detail::group_routes* group_ = nullptr;
    std::size_t worker_ = 0;

    using slot_state = detail::server_slot;
    static constexpr std::uint16_t no_block = detail::no_block;
    // What a body transfer's wr_id names: bits 56.. the kind, 16..31 the
    // block, 0..15 the slot (a reply's send completes only on failure).
    static constexpr std::uint64_t tag_read = 1;
    static constexpr std::uint64_t tag_external = 2;
    static constexpr std::uint64_t make_wr_id(std::uint64_t tag, std::uint32_t block,
                                              std::uint32_t slot) {
        return (tag << 56) | (std::uint64_t{block & 0xffffU} << 16) | slot;
    }
    /// A connection: the endpoint's, the calls in its slots, and the blocks
    /// its bodies move through.
    struct peer : detail::peer_base {
        std::vector<slot_state> slots;
        /// Blocks a transfer owns: request bodies being read from the
        /// callers and reply bodies being written into their buffers, each
        /// kept until its READ or WRITE completes (a reply's slices may still
        /// be queued long after the reply was posted and the slot reused; a
        /// superseded call's READ may still land), by the index its wr_id
        /// names; free_blocks lists the empty ones.
        std::vector<detail::arena_block> blocks;
        std::vector<std::uint16_t> free_blocks;
        std::uint32_t reads = 0;  ///< request bodies being read (signaled, awaited)
        std::uint32_t writes = 0; ///< reply bodies being written (signaled, awaited)
        /// Accepted, not yet established: dropped if still so at this time.
        std::optional<sched::coarse_clock::time_point> establish_by;
        bool said_bye = false; ///< the client left for good (its replies may go)
        /// The first call id the client sends here: copies of earlier calls
        /// (retries) have lower ids, at most `slots` of them per connection.
        std::uint64_t first_call = 0;
        std::uint32_t retries = 0;
        bool goaway_sent = false;   ///< draining: the client was told to go
        bool goaway_acked = false;  ///< and said it sends nothing more here
        std::uint64_t join_key = 0; ///< what its other rails join with (0: it takes none)
    };
    friend struct detail::server_rails;
    std::unique_ptr<detail::server_rails> rails_; ///< rpc_options::rails

    // Connecting (server_connect.cpp).
    /// New connections, every housekeeping round: through the device, and
    /// node-local ones (their hellos, a piece at a time).
    void accept_new(bool events) noexcept;
    void accept_pending();
    void accept_one(verbs::connection_request req);
    /// Up to a round's worth of node-local (or TCP) connections from the listener.
    void accept_local_pending() noexcept;
    void accept_tcp_pending() noexcept;
    /// Out of descriptors at accept: the listener is left alone a while.
    void pause_listener() noexcept;
    /// A node-local (or `tcp`) connection: its hello is awaited in progress_handshakes().
    void start_handshake(local::unix_channel ch, bool tcp) noexcept;
    /// Room for another handshake from `uid`: each user gets a share
    /// (counted as refused if not).
    [[nodiscard]] bool handshake_room(uid_t uid) noexcept;
    /// Reads the hellos that came (`readable`: something may have), answers
    /// those that are whole, drops those past their deadline or broken.
    void progress_handshakes(bool readable) noexcept;
    void end_handshake(std::size_t i, local::message_reader::state st) noexcept;
    void accept_local(local::unix_channel ch, std::span<const std::byte> hello_bytes);
    void accept_tcp(local::unix_channel ch, std::span<const std::byte> hello_bytes);
    /// The welcome's status for this hello (local_ok, or why not).
    std::uint32_t judge_hello(const local_hello& hello, std::size_t bytes,
                              const local::unix_channel& ch);
    /// Makes the connection live; all or nothing (throws, nothing changed).
    std::uint32_t add_link(std::unique_ptr<detail::link> wire, std::uint16_t slots,
                           std::uint64_t client, std::uint64_t first_call);
    /// Counts a refused connection, and why.
    void refuse(int err, std::string_view why) noexcept;
    /// refuse() for the exception being handled.
    void refuse_current(std::string_view what) noexcept;

    // The call path (server_call.cpp).
    void on_receive(const ibv_wc& wc) noexcept;
    void on_imm(peer& l, std::uint32_t index, std::uint32_t imm) noexcept;
    void on_control(peer& l, control c) noexcept;
    /// A request not idempotent: what the reply cache says of it. False when
    /// it must not run (answered from the cache, or waiting for its first copy).
    bool admit(peer& l, std::uint32_t index, std::uint32_t slot, const message_header& h) noexcept;
    /// The answer of a kept call: into the cache, and to a copy that waits.
    void keep_answer(peer& l, std::uint32_t slot, call_status st,
                     std::span<const std::byte> body) noexcept;
    /// Admits and runs (or reads the body of) the request accepted into `slot`.
    void dispatch(peer& l, std::uint32_t index, std::uint32_t slot,
                  const parsed_request& request) noexcept;
    /// The kept call `e` never ran: forgotten, and a copy that waited for it
    /// runs in its stead (at the end of this poll).
    void forget_call(const detail::reply_cache::entry_ref& e) noexcept;
    /// Runs the copies forget_call() left.
    void run_orphans() noexcept;
    /// The answer of call `e` goes to the waiting copy `w` too.
    void answer_waiter(const detail::reply_cache::waiter& w, call_status st,
                       std::span<const std::byte> body) noexcept;
    void on_request(peer& l, std::uint32_t index, std::uint32_t slot, std::uint32_t bytes,
                    bool epoch) noexcept;
    /// The slot's request is taken (after the checks of on_request).
    void accept_request(peer& l, std::uint32_t slot, bool epoch, std::uint32_t bytes,
                        const parsed_request& request) noexcept;
    /// A request into a busy slot with the other epoch: the caller gave up
    /// the call in it. Dropped unanswered.
    void supersede(peer& l, std::uint32_t slot) noexcept;
    /// The body stays in the caller's memory: read it, then run the handler.
    void read_request_body(peer& l, std::uint32_t index, std::uint32_t slot,
                           const buffer_descriptor& d) noexcept;
    static void release_block(peer& l, std::uint16_t at) noexcept;
    /// The caller gave up the call in `slot`: the request in this side's ring
    /// is not the call's any more (its epoch flipped, or another call's).
    [[nodiscard]] static bool abandoned(const peer& l, std::uint32_t slot) noexcept;
    void run_handler(peer& l, std::uint32_t index, std::uint32_t slot,
                     std::span<const std::byte> body) noexcept;
    /// Posts the answer of slot s: status and body.
    void answer(peer& l, std::uint32_t index, std::uint32_t slot, call_status st,
                std::span<const std::byte> body, bool in_place) noexcept;
    /// A reply over the slot's room, into the caller's buffer: the status
    /// and flags for the header, the WRITE started or done.
    call_status write_reply_body(peer& l, std::uint32_t slot, std::span<const std::byte> body,
                                 message_header& h) noexcept;
    /// A deferred call's answer whose connection went: kept (returns true
    /// when a waiting copy got it).
    bool keep_orphan(const deferred_call& d, call_status st,
                     std::span<const std::byte> bytes) noexcept;
    /// A deferred call still waiting in its slot, or null.
    [[nodiscard]] peer* deferred_peer(const deferred_call& d) noexcept;

    // Progress (server_progress.cpp).
    /// Reaps the link's events: body transfers that ended, immediates.
    void on_link_events(peer& l, std::uint32_t index, bool thorough) noexcept;
    void transfer_ended(peer& l, std::uint32_t index, const detail::link_event& c) noexcept;
    void reject(peer& l, violation v) noexcept;
    /// Ends the link (counted) when it failed under this side.
    void check_failed(peer& l) noexcept;
    void housekeeping() noexcept;
    /// Probes idle links, ends silent ones, and (draining) sends goaways.
    void keep_alive(peer& l, sched::coarse_clock::time_point now) noexcept;
    /// drain(), in steps (the tests drive them): goaways at the next poll...
    void begin_drain() noexcept;
    /// ...until every client was told, acknowledged, and has no call left...
    [[nodiscard]] bool drained() const noexcept;
    /// ...then every connection closes, and the server takes new ones again.
    void end_drain() noexcept;
    /// Links that failed, left, or never finished their handshake: torn down.
    void reap_links(bool events) noexcept;
    void teardown(std::uint32_t index) noexcept;

    rpc_options opts_;
    detail::endpoint<peer> ep_;
    verbs::listener listener_; ///< listens nowhere without a device (or rdma)
    std::uint16_t port_ = 0;
    std::optional<local::unix_listener> local_listener_; ///< peers on this node
    /// The node-local listener on addr:port (port 0: a free one); `needed`:
    /// throws if it cannot be made, else says why and goes on without.
    void listen_local(std::string_view addr, bool needed);
    /// The TCP listener on addr:port (port 0: a free one, then port_), likewise.
    void listen_tcp(std::string_view addr, bool needed);
    /// Without rdma: TCP (which takes the port) and the node-local name.
    void listen_without_rdma(std::string_view addr);
    int tcp_listener_ = -1; ///< peers with neither rdma nor shm to this server
    /// A node-local connection whose hello has not all come yet.
    struct handshake {
        local::unix_channel ch;
        local::message_reader hello;
        sched::coarse_clock::time_point deadline;
        uid_t uid = 0;    ///< the peer's (SO_PEERCRED): each user gets a share of the handshakes
        bool tcp = false; ///< over TCP: uid is tcp_peers (they share one user's share)
    };
    static constexpr uid_t tcp_peers = static_cast<uid_t>(-1);
    std::vector<handshake> handshakes_; ///< at most max_peers
    /// Out of descriptors at accept: the node-local listener is not watched
    /// until listener_back_ (else its pending connection wakes every wait()).
    bool listener_paused_ = false;
    sched::coarse_clock::time_point listener_back_{};
    [[nodiscard]] std::chrono::nanoseconds listener_pause() const noexcept;
    std::vector<handler> handlers_;
    std::size_t live_ = 0;
    detail::reply_cache cache_;
    /// When housekeeping last ran: the reply cache's clock (no clock read per call).
    sched::coarse_clock::time_point housekept_{};
    /// Copies that waited for a first copy that never ran (forget_call).
    std::vector<detail::reply_cache::waiter> orphans_;
    bool draining_ = false;
    bool asleep_ = false; ///< arm() asked the node-local peers to wake this side
};

} // namespace rdmax::rpc
