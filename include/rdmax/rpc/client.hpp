#pragma once
// rpc::client: calls to one or more rpc::servers, from one thread, with one
// completion queue and one shared receive queue for all of them. See
// wire.hpp for the protocol and server.hpp for the other side.
//
//     rpc::client cli(pd);   // or cli(): no device (servers on this node, or over TCP)
//     rpc::peer_id srv = cli.connect("192.0.2.1", 7471);
//     rpc::call_result r = cli.call(srv, 1, rdmax::as_bytes_of(request));
//     if (r.status == rpc::call_status::ok) use(r.reply);   // valid until the next poll or call
//
// Or many calls in flight: start() them (each names a cookie) and poll()
// for their results. Every call has a deadline.
//
// A peer_id outlives its connection: one that fails, goes silent (keepalive)
// or is drained is made again with backoff, and its calls in flight are
// re-sent under the same call id; the server's reply cache answers a copy of
// a call it ran, so none runs twice (unknown_outcome where it cannot tell).
// Calls started meanwhile wait, unless fail_fast. docs/rpc.md has the table.
//
// Requests that fit a slot are copied into it; larger ones stay in the
// caller's buffer, registered through the registration cache, and the server
// reads them (keep the buffer unchanged until the call ends). A caller that
// expects a reply larger than a slot offers a buffer (call_options::reply_into),
// which the server writes into.
//
// The call path (start, poll, call) allocates nothing and makes no system
// call but the device's doorbell, for messages that fit a slot; a larger
// one costs a registration the first time its buffer is seen.

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <rdmax/detail/rpc/client_slots.hpp>
#include <rdmax/detail/rpc/endpoint.hpp>
#include <rdmax/local/descriptor_passing.hpp>
#include <rdmax/mem/verbs_cache.hpp>
#include <rdmax/rpc/call_options.hpp>
#include <rdmax/rpc/call_status.hpp>
#include <rdmax/rpc/peer_id.hpp>
#include <rdmax/rpc/peer_state.hpp>
#include <rdmax/rpc/rpc_counters.hpp>
#include <rdmax/rpc/rpc_options.hpp>
#include <rdmax/sched/coarse_clock.hpp>
#include <rdmax/sched/priority.hpp>

namespace rdmax::rpc {

struct local_welcome;
namespace detail {
struct pending_dial;
struct client_rails;
} // namespace detail

class client {
public:
    /// The protection domain must outlive the client. Throws rdmax::error.
    explicit client(const verbs::protection_domain& pd,
                    rpc_options opts = rpc_options{}.with_env());
    /// With no device: reaches servers on this node only (transport::shm);
    /// connect() to one elsewhere throws saying so. Throws where opts leave shm out.
    explicit client(rpc_options opts = rpc_options{}.with_env());
    client(const client&) = delete;
    client& operator=(const client&) = delete;
    ~client();

    /// Connects to the server at addr:port (asking for opts.slots slots of
    /// opts.slot_bytes; the server may grant fewer). Throws rdmax::error
    /// naming the step (address, route, refused, deadline).
    [[nodiscard]] peer_id connect(std::string_view addr, std::uint16_t port);
    /// As connect(addr, port), and with rpc_options::rails the connection's
    /// other rails join it: this client's rail k dials the one of the
    /// server's `rail_addresses` on its subnet, before this returns (a rail
    /// that fails is dialed again later, as one that fails in use).
    [[nodiscard]] peer_id connect(std::string_view addr, std::uint16_t port,
                                  std::span<const std::string> rail_addresses);
    /// Closes the connection for good (the server may drop this client's
    /// replies at once); its calls end peer_gone, and `p` names nothing more.
    void disconnect(peer_id p) noexcept;
    /// Where the connection to `p` stands (closed for no such peer).
    [[nodiscard]] peer_state state(peer_id p) const noexcept;
    /// Called from poll(), wait(), call() after a connection changes state
    /// (for logs and metrics: it must not call into this client).
    void on_state_change(std::function<void(peer_id, peer_state)> f) { on_state_ = std::move(f); }
    /// This client's incarnation (random, one per object), which its calls'
    /// ids are unique within.
    [[nodiscard]] std::uint64_t incarnation() const noexcept { return ep_.incarnation; }

    /// Starts a call of `method` (1 .. 65535) with `request`. Returns ok, or
    /// why it did not start (bad_peer, peer_gone, no_credit, too_large,
    /// registration_failed, invalid_method): then nothing was sent and no
    /// result will come. While the connection is being made again the call
    /// waits (its body copied when it fits a slot), unless fail_fast.
    call_status start(peer_id p, std::uint16_t method, std::span<const std::byte> request,
                      const call_options& o = {}) noexcept;
    /// Results of calls that ended (at most out.size(); the rest wait).
    int poll(std::span<call_result> out) noexcept;
    /// Gives back now the slots of the results the last poll() handed out
    /// (the next poll() would): their replies are no longer valid. For a
    /// loop that starts new calls after taking results.
    void release() noexcept { release_handed_out(); }
    /// The same for one of them, the result named `cookie`: the others' replies stay valid.
    void release(std::uint64_t cookie) noexcept;
    /// Starts a call and waits for its result (spinning; the deadline bounds
    /// it). Results of other calls that end meanwhile wait for poll().
    call_result call(peer_id p, std::uint16_t method, std::span<const std::byte> request,
                     const call_options& o = {}) noexcept;
    /// poll(), sleeping on fd() up to `timeout` when nothing has ended.
    int wait(std::span<call_result> out, std::chrono::microseconds timeout) noexcept;
    /// Ends the call to `p` named `cookie` (the first found, if several
    /// share it) at once: it ends cancelled, its result comes at the next
    /// poll(), and its buffers are fenced from the peer as a timed-out call's
    /// (a late reply is dropped unread). A call waiting for a connection
    /// leaves the queue unsent. False when no such call is under way: it
    /// ended already (its reply came: the result tells) or never started.
    bool cancel(peer_id p, std::uint64_t cookie) noexcept;

    /// Holds the doorbells of the calls started from here to ring_held():
    /// their requests wait, then go together, one doorbell per connection (on
    /// soft-RoCE a system call each), not one per call: for a loop that starts
    /// calls in a row. Only connections through the device hold, at most
    /// held_links (others post at once). poll(), wait(), call(), arm() and a
    /// call's revocation (cancel, timeout) ring what is held first.
    void hold_doorbells() noexcept { holding_ = true; }
    /// Ends the hold: what the held connections queued is posted now.
    void ring_held() noexcept;
    static constexpr std::size_t held_links = 8;

    /// Your own loop (epoll, an io_context): sleep on fd() only after arm()
    /// said true, and call awake() when it was readable (or the sleep ended).
    [[nodiscard]] int fd() const noexcept { return ep_.in.fd(); }
    /// Arms the completion channel and asks every peer to wake this side;
    /// false when something came meanwhile (or the device refused): poll()
    /// again instead of sleeping.
    bool arm() noexcept;
    /// Takes fd()'s events, tells the peers this side is awake, and has the
    /// next poll() look at connection events and deadlines.
    void awake() noexcept { ep_.woke(); }

    /// Calls started and not yet handed back.
    [[nodiscard]] std::size_t in_flight() const noexcept { return in_flight_; }
    /// Slots of `p`: calls it may have in flight at once (0 if no such peer).
    [[nodiscard]] std::uint16_t slots(peer_id p) const noexcept;
    /// Slot bytes granted by `p`'s server (what fits inline: this less 16..48).
    [[nodiscard]] std::uint32_t slot_bytes(peer_id p) const noexcept;
    [[nodiscard]] bool connected(peer_id p) const noexcept;
    /// True when the calls to `p` go through the node's memory (transport::shm).
    [[nodiscard]] bool is_local(peer_id p) const noexcept;
    /// How the calls to `p` go now (nullopt: no connection at the moment).
    [[nodiscard]] std::optional<rpc::transport> transport(peer_id p) const noexcept;
    /// The priority scheduler's counters of the connection to `p` (budget, slices,
    /// the rate and latency it measured); nullopt: no such peer, or not the device.
    [[nodiscard]] std::optional<sched::scheduler_counters>
    scheduler_counters(peer_id p) const noexcept;
    [[nodiscard]] const rpc_counters& counters() const noexcept { return ep_.counters; }
    [[nodiscard]] const rpc_options& options() const noexcept { return opts_; }

private:
    /// Tests (tests/support/fake_link.hpp): a client with no device, and
    /// links adopted without a connection (add_link).
    friend struct protocol_test_access;
    client(detail::no_device_t none, rpc_options opts);

    using slot_phase = detail::client_slot_phase;
    using slot_state = detail::client_slot;
    using slot_ref = detail::client_slot_ref;
    using peer = detail::client_link;
    using outgoing = detail::outgoing_call;
    /// A result that names no slot (timed out, or ended waiting for a connection).
    static constexpr std::uint32_t no_slot = UINT32_MAX;
    static constexpr std::uint32_t no_link = UINT32_MAX;
    /// A call waiting for a connection (`sent`: in flight on one that ended).
    struct waiting_call {
        std::uint64_t call_id = 0;
        std::uint16_t method = 0;
        call_options o;
        sched::coarse_clock::time_point deadline{};
        bool sent = false;
        std::span<const std::byte> external; ///< a body over a slot: the caller's buffer
        std::vector<std::byte> body;         ///< one that fits: a copy
    };
    /// What a peer_id names: a server, across its connections.
    struct session {
        std::uint32_t generation = 0;
        bool used = false;
        std::uint32_t link = no_link; ///< its connection's index in ep_, if it has one
        std::uint32_t links = 0;      ///< its links in ep_ (ended ones not yet torn down too)
        peer_state state = peer_state::closed;
        std::string addr; ///< empty: adopted (tests), made again only through dial_
        std::uint16_t port = 0;
        std::uint64_t server_incarnation = 0;
        std::uint16_t slots = 0;      ///< the last connection's: calls that may wait
        std::uint32_t slot_bytes = 0; ///< and what fitted its slots
        std::chrono::nanoseconds backoff{};
        sched::coarse_clock::time_point next_attempt{};
        sched::coarse_clock::time_point lost_at{};
        std::deque<waiting_call> waiting;
        std::shared_ptr<detail::pending_dial> dialing; ///< a reconnect under way (device, tcp)
    };
    void open_stats(); ///< its stat records, numbered in the process (client_connect.cpp)
    /// To addr:port: node-local, else the device, else TCP (finish_dial: where the
    /// device found no path; with `then` that dial is started there, not waited for).
    std::unique_ptr<detail::link> dial(std::string_view addr, std::uint16_t port);
    std::shared_ptr<detail::pending_dial> begin_tcp(std::string_view addr, std::uint16_t port);
    std::unique_ptr<detail::link> finish_tcp(detail::pending_dial& d, std::string_view addr,
                                             std::uint16_t port);
    std::unique_ptr<detail::link>
    finish_dial(detail::pending_dial& d, std::string_view addr, std::uint16_t port,
                std::shared_ptr<detail::pending_dial>* then = nullptr);
    /// The node-local path to addr:port, or nullptr (why not in local_miss_).
    std::unique_ptr<detail::link> connect_local(std::string_view addr, std::uint16_t port);
    std::string local_miss_;
    /// The device may carry connections (a protection domain, and rdma in transports).
    [[nodiscard]] bool device_ok() const noexcept;
    [[noreturn]] void unreachable(std::string_view addr, std::uint16_t port) const; ///< throws why
    /// The node-local handshake on `ch`, or nullptr (refused: the device).
    std::unique_ptr<detail::link> local_handshake(local::unix_channel ch, std::string_view addr,
                                                  std::uint16_t port);
    std::size_t exchange_hello(local::unix_channel& ch, local_welcome& w, std::vector<int>& fds);
    /// Maps the welcome's segment (fds: segment, wake server, wake this side).
    std::unique_ptr<detail::link> map_segment(local::unix_channel ch, const local_welcome& w,
                                              std::vector<int>& fds, std::string_view addr,
                                              std::uint16_t port);
    /// connect_local() turned down: closes `fds`, counts, says why, returns nullptr.
    std::unique_ptr<detail::link> refuse_local(std::vector<int>& fds, int err,
                                               std::string_view reason, std::string_view addr,
                                               std::uint16_t port, std::string_view what);
    /// Through the device: begun here (a thread for rdma_cm), finished later (throws why not).
    std::shared_ptr<detail::pending_dial> begin_device(std::string_view addr, std::uint16_t port);
    std::unique_ptr<detail::link> finish_device(detail::pending_dial& d, std::string_view addr,
                                                std::uint16_t port);
    /// Lets `server` use CMA on this process where Yama asks, as ptracer allows.
    void grant_cma(pid_t server) noexcept;
    /// A new peer_id over `wire` (addr empty: never made again but by dial_).
    peer_id add_link(std::unique_ptr<detail::link> wire, std::string_view addr = {},
                     std::uint16_t port = 0);
    /// Makes `wire` session s's connection; all or nothing (throws).
    void attach(std::uint32_t s, std::unique_ptr<detail::link> wire);
    /// Connections through this device bind type-2 windows.
    [[nodiscard]] bool windows_wanted() const noexcept;
    verbs_cache& cache();

    // Sessions (client_session.cpp): peer_ids across connections.
    [[nodiscard]] session* find_session(peer_id p) noexcept;
    [[nodiscard]] const session* find_session(peer_id p) const noexcept;
    [[nodiscard]] peer_id session_id(std::uint32_t s) const noexcept {
        return {s, sessions_[s].generation};
    }
    /// The live connection of `p`, or null.
    [[nodiscard]] const peer* link_of(peer_id p) const noexcept;
    void set_state(std::uint32_t s, peer_state st) noexcept;
    /// The connection of session s ended: its calls wait for the next one
    /// (or end, where it is not made again), and the attempts start.
    void lose_link(std::uint32_t s) noexcept;
    /// A call of link l's slot, in flight when the link ended, waits for the
    /// next connection (false: it could not; the caller ends it).
    bool requeue(peer& l, std::uint32_t slot, std::deque<waiting_call>& into) noexcept;
    /// start() while session s has no connection to take it.
    call_status wait_for_link(std::uint32_t s, std::uint16_t method,
                              std::span<const std::byte> request, const call_options& o,
                              slot_ref& taken) noexcept;
    /// Sends session s's waiting calls, in order, while its connection has room.
    void send_waiting(std::uint32_t s) noexcept;
    /// Housekeeping of the sessions: waiting calls past their deadline, attempts due.
    void tend_sessions(sched::coarse_clock::time_point now) noexcept;
    void try_reconnect(std::uint32_t s, sched::coarse_clock::time_point now) noexcept;
    /// The server restarted: calls sent before, not idempotent, end unknown_outcome.
    void server_restarted(session& ss) noexcept;
    /// Session s is over: its waiting calls end `st`, and it is closed; its
    /// peer_id names nothing once its last link is torn down.
    void close_session(std::uint32_t s, call_status st) noexcept;
    void release_session(std::uint32_t s) noexcept;
    /// The result of a call that ended holding no slot.
    void push_slotless(std::uint32_t s, const waiting_call& c, call_status st) noexcept;
    void report_states() noexcept;

    // The call path (client_call.cpp).
    /// start() for call(): the slot it took, or why it refused.
    call_status start_on(peer_id p, std::uint16_t method, std::span<const std::byte> request,
                         const call_options& o, slot_ref& taken) noexcept;
    /// Sends a call on connection `index` (a free slot there): new, or waiting.
    call_status send_on(std::uint32_t index, std::uint16_t method, outgoing& call,
                        const call_options& o, sched::coarse_clock::time_point deadline,
                        slot_ref& taken, bool fresh) noexcept;
    /// Shows the server the call's memory over the slot (its body, its reply buffer).
    call_status expose_call(peer& l, std::uint32_t slot, const call_options& o,
                            outgoing& call) noexcept;
    /// Writes the call's header, descriptors and inline body into the slot's
    /// staging bytes; returns how many.
    std::uint32_t encode_request(peer& l, std::uint32_t slot, std::uint16_t method,
                                 const call_options& o, const outgoing& call,
                                 std::uint32_t call_seq, bool epoch) noexcept;
    /// The slot's call is under way: its state, and the counts.
    void track_call(peer& l, std::uint32_t slot, std::uint16_t method, const call_options& o,
                    const outgoing& call, std::uint32_t call_seq, bool epoch, std::uint32_t bytes,
                    sched::coarse_clock::time_point deadline, slot_ref& taken) noexcept;
    [[nodiscard]] sched::coarse_clock::time_point deadline_of(const call_options& o) const noexcept;
    /// A call's dma-buf ranges against its other options and the transports
    /// (ok: none, or nothing against them yet).
    [[nodiscard]] call_status check_dmabuf_options(std::span<const std::byte> request,
                                                   const call_options& o) const noexcept;
    /// send_slot refused the request: why, for the caller.
    call_status send_refused(peer& l, std::uint32_t slot, status s) noexcept;
    void push_result(const call_result& r, const slot_ref& ref) noexcept;
    /// The queued result of the call `taken`, taken out of the queue (the
    /// others keep their order); false if it has not ended yet.
    bool take_result(const slot_ref& taken, call_result& mine) noexcept;
    /// Room in the results for every slot, and `more` besides.
    void grow_results(std::size_t more);
    void release_handed_out() noexcept;

    // Progress (client_progress.cpp).
    void progress() noexcept;
    void on_receive(const ibv_wc& wc) noexcept;
    void on_link_events(peer& l, std::uint32_t index, bool due) noexcept;
    void on_imm(peer& l, std::uint32_t index, std::uint32_t imm) noexcept;
    void on_control(peer& l, std::uint32_t index, control c) noexcept;
    /// A reply for no call in its slot: late (dropped), or the server's fault.
    void stray_reply(peer& l, std::uint32_t index, std::uint32_t slot, violation v) noexcept;
    void finish(peer& l, std::uint32_t index, std::uint32_t slot, call_status st,
                std::span<const std::byte> reply) noexcept;
    /// The fencing call in `slot` ends now (`dealloc`: windows deallocated first).
    void fenced(peer& l, std::uint32_t index, std::uint32_t slot, bool dealloc) noexcept;
    /// The result of a call that ended, queued for the caller.
    void push_done(peer& l, std::uint32_t index, std::uint32_t slot, call_status st,
                   std::span<const std::byte> reply) noexcept;
    /// The link ended: answered calls go out, the others wait for the
    /// session's next connection (or end peer_gone where none comes).
    void fail_link(peer& l, std::uint32_t index) noexcept;
    void housekeeping() noexcept;
    /// Probes an idle link, or ends a silent one.
    void keep_alive(peer& l, std::uint32_t index, sched::coarse_clock::time_point now) noexcept;
    /// The in-flight call in `slot` ends `st` now (timed out, cancelled): fenced, its slot freed.
    void abandon(peer& l, std::uint32_t index, std::uint32_t slot, call_status st) noexcept;
    /// The calls of `l` past their deadline end timed_out.
    void expire_calls(peer& l, std::uint32_t index, sched::coarse_clock::time_point now) noexcept;
    /// A fencing slot past its call's deadline (and a housekeeping period).
    [[nodiscard]] bool fence_stalled(const peer& l,
                                     sched::coarse_clock::time_point now) const noexcept;
    void teardown_idle() noexcept;

    rpc_options opts_;
    /// Large bodies' registrations; before the endpoint, whose links hold its handles.
    std::unique_ptr<verbs_cache> cache_;
    /// rpc_options::rails; before ep_: its caches outlive the links' handles.
    std::unique_ptr<detail::client_rails> rails_;
    detail::endpoint<peer> ep_;
    /// What a server on this node reads by CMA to see that it may.
    std::uint64_t probe_ = 0;
    /// Whom this process let use CMA on it: 0 nobody yet, -1 anyone, else a pid.
    pid_t ptracer_ = 0;
    /// When that process started (0: unknown): a later one on its pid differs.
    std::uint64_t ptracer_start_ = 0;
    // Results not yet handed out (a ring sized for every slot), and the slots
    // handed out by the last poll (freed at the next).
    std::vector<call_result> results_;
    std::size_t results_head_ = 0, results_count_ = 0;
    std::vector<slot_ref> queued_slots_; ///< parallel to results_: its slot, or link UINT32_MAX
    std::vector<slot_ref> handed_out_;
    std::size_t in_flight_ = 0;
    // Doorbells held (hold_doorbells): the connections whose requests wait.
    bool holding_ = false;
    std::array<std::uint32_t, held_links> held_{};
    std::size_t held_count_ = 0;
    /// Connection `index` holds its doorbell for the next call, if it can and the list has room.
    void hold_link(peer& l, std::uint32_t index) noexcept;
    // Sessions: what peer_ids name.
    std::vector<session> sessions_;
    std::vector<std::uint32_t> free_sessions_;
    std::uint32_t session_generations_ = 0;
    std::uint64_t next_call_id_ = 1;
    /// How a session's connection is made again: dial(addr, port), or a test's.
    std::function<std::unique_ptr<detail::link>(std::uint32_t session)> redial_;
    std::function<void(peer_id, peer_state)> on_state_;
    std::vector<std::pair<peer_id, peer_state>> state_changes_;
    std::minstd_rand jitter_{static_cast<std::minstd_rand::result_type>(ep_.incarnation)};
    friend struct detail::client_rails;
};

} // namespace rdmax::rpc
