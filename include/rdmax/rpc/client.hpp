#pragma once
// rpc::client: calls to one or more rpc::servers, from one thread, with one
// completion queue and one shared receive queue for all of them. See
// wire.hpp for the protocol and server.hpp for the other side.
//
//     rpc::client cli(pd);
//     rpc::peer_id srv = cli.connect("192.0.2.1", 7471);
//     rpc::call_result r = cli.call(srv, 1, rdmax::as_bytes_of(request));
//     if (r.status == rpc::call_status::ok) use(r.reply);   // valid until the next poll or call
//
// Or many calls in flight: start() them (each names a cookie) and poll()
// for their results. Every call has a deadline; a call whose peer leaves or
// whose connection fails ends peer_gone within rpc_options::housekeeping.
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

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include <rdmax/detail/rpc/endpoint.hpp>
#include <rdmax/local/descriptor_passing.hpp>
#include <rdmax/mem/verbs_cache.hpp>
#include <rdmax/rpc/call_status.hpp>
#include <rdmax/rpc/peer_id.hpp>
#include <rdmax/rpc/rpc_counters.hpp>
#include <rdmax/rpc/rpc_options.hpp>
#include <rdmax/sched/coarse_clock.hpp>
#include <rdmax/sched/priority.hpp>

namespace rdmax::rpc {

struct local_welcome;

struct call_options {
    sched::priority priority = sched::normal;
    /// 0: rpc_options::call_timeout.
    std::chrono::microseconds timeout{0};
    /// Where a reply larger than a slot may go (registered through the cache;
    /// keep it until the call ends). A reply that fits the slot stays there.
    std::span<std::byte> reply_into = {};
    /// The caller's name for the call, handed back in its result.
    std::uint64_t cookie = 0;
};

struct call_result {
    std::uint64_t cookie = 0;
    peer_id peer;
    call_status status = call_status::ok;
    /// The reply's body: in the reply slot or in reply_into. Valid until the
    /// next poll(), call() or release() (the slot then goes back to the server).
    std::span<const std::byte> reply;
};

class client {
public:
    /// The protection domain must outlive the client. Throws rdmax::error.
    explicit client(const verbs::protection_domain& pd,
                    rpc_options opts = rpc_options{}.with_env());
    client(const client&) = delete;
    client& operator=(const client&) = delete;
    ~client();

    /// Connects to the server at addr:port (asking for opts.slots slots of
    /// opts.slot_bytes; the server may grant fewer). Throws rdmax::error
    /// naming the step (address, route, refused, deadline).
    [[nodiscard]] peer_id connect(std::string_view addr, std::uint16_t port);
    /// Closes the connection; its calls in flight end peer_gone.
    void disconnect(peer_id p) noexcept;

    /// Starts a call of `method` (1 .. 65535) with `request`. Returns ok, or
    /// why it did not start (bad_peer, peer_gone, no_credit, too_large,
    /// registration_failed, invalid_method): then nothing was sent and no
    /// result will come.
    call_status start(peer_id p, std::uint16_t method, std::span<const std::byte> request,
                      const call_options& o = {}) noexcept;
    /// Results of calls that ended (at most out.size(); the rest wait).
    int poll(std::span<call_result> out) noexcept;
    /// Gives back now the slots of the results the last poll() handed out
    /// (the next poll() would): their replies are no longer valid. For a
    /// loop that starts new calls after taking results.
    void release() noexcept { release_handed_out(); }
    /// Starts a call and waits for its result (spinning; the deadline bounds
    /// it). Results of other calls that end meanwhile wait for poll().
    call_result call(peer_id p, std::uint16_t method, std::span<const std::byte> request,
                     const call_options& o = {}) noexcept;
    /// poll(), sleeping on fd() up to `timeout` when nothing has ended.
    int wait(std::span<call_result> out, std::chrono::microseconds timeout) noexcept;
    [[nodiscard]] int fd() const noexcept { return ep_.in.fd(); }
    bool arm() noexcept { return ep_.in.arm(); }

    /// Calls started and not yet handed back.
    [[nodiscard]] std::size_t in_flight() const noexcept { return in_flight_; }
    /// Slots of `p`: calls it may have in flight at once (0 if no such peer).
    [[nodiscard]] std::uint16_t slots(peer_id p) const noexcept;
    /// Slot bytes granted by `p`'s server (what fits inline: this less 16..48).
    [[nodiscard]] std::uint32_t slot_bytes(peer_id p) const noexcept;
    [[nodiscard]] bool connected(peer_id p) const noexcept;
    /// True when the calls to `p` go through the node's memory, not the device.
    [[nodiscard]] bool is_local(peer_id p) const noexcept;
    /// The priority scheduler's counters of the connection to `p` (budget,
    /// slices, the rate and latency it measured); nullopt for no such peer
    /// or a node-local one.
    [[nodiscard]] std::optional<sched::scheduler_counters>
    scheduler_counters(peer_id p) const noexcept;
    [[nodiscard]] const rpc_counters& counters() const noexcept { return ep_.counters; }
    [[nodiscard]] const rpc_options& options() const noexcept { return opts_; }

private:
    /// Tests (tests/support/fake_link.hpp): a client with no device, and
    /// links adopted without a connection (add_link).
    friend struct protocol_test_access;
    client(detail::no_device_t none, rpc_options opts);

    enum class slot_phase : std::uint8_t {
        free,      ///< the caller's credit, unused
        in_flight, ///< request sent, no reply yet
        fencing,   ///< replied; its result waits for its windows' invalidation to complete
        done,      ///< its result is queued or handed out; freed at the next poll
    };
    struct slot_state {
        slot_phase phase = slot_phase::free;
        /// Flipped at each call in the slot; the reply echoes it.
        bool epoch = false;
        /// Calls in this slot that timed out and whose reply has not come:
        /// replies of an earlier epoch to drop unread.
        std::uint8_t late = 0;
        std::uint32_t seq = 0;
        std::uint64_t cookie = 0;
        sched::coarse_clock::time_point deadline{};
        std::span<std::byte> reply_into;
        /// While fencing: the result the reply gave, handed out once the
        /// peer's keys to the call's buffers are dead.
        call_status fenced_status = call_status::ok;
        std::span<const std::byte> fenced_reply;
    };
    /// A slot_ref of a result that names no slot (a call that timed out: its
    /// slot was the caller's again at once).
    static constexpr std::uint32_t no_slot = UINT32_MAX;
    struct slot_ref {
        std::uint32_t link = 0;
        std::uint32_t slot = 0;
        std::uint32_t seq = 0;
        bool release = false; ///< handing the result out gives the slot back at the next poll
    };
    /// A connection: the endpoint's, and the calls in its slots.
    struct peer : detail::peer_base {
        std::vector<slot_state> slots;
        std::vector<std::uint16_t> free_slots;
        std::uint32_t next_seq = 1;
        std::uint32_t in_flight = 0;
        std::uint32_t held = 0;    ///< slots done: results queued or handed out
        std::uint32_t fencing = 0; ///< of in_flight, slots fencing
    };
    /// A call as start() encodes it: where its body and reply go.
    struct outgoing {
        std::span<const std::byte> request;
        bool external = false; ///< the body stays in the caller's buffer (over the slot)
        std::uint32_t body_key = 0;
        std::uint32_t reply_key = 0;
    };

    // Connecting (client_connect.cpp).
    /// The node-local path to addr:port, if the server is on this node and
    /// may use CMA on this process; nullptr otherwise (take the device).
    std::unique_ptr<detail::link> connect_local(std::string_view addr, std::uint16_t port);
    /// The Unix channel of a server on this node that answers addr:port, if any.
    [[nodiscard]] local::unix_channel find_local_server(std::string_view addr, std::uint16_t port);
    /// The node-local handshake on `ch`: the server's welcome, or nullptr
    /// (refused: take the device).
    std::unique_ptr<detail::link> local_handshake(local::unix_channel ch, std::string_view addr,
                                                  std::uint16_t port);
    /// Sends the hello; the welcome's bytes and the descriptors beside it.
    std::size_t exchange_hello(local::unix_channel& ch, local_welcome& w, std::vector<int>& fds);
    /// Maps the segment the welcome offered (fds: segment, wake the server,
    /// wake this side), or nullptr where it is not sealed (take the device).
    std::unique_ptr<detail::link> map_segment(local::unix_channel ch, const local_welcome& w,
                                              std::vector<int>& fds, std::string_view addr,
                                              std::uint16_t port);
    /// connect_local() turned down by the server (it closed the handshake,
    /// refused, or offered a segment that is not sealed): closes `fds`, counts
    /// the refusal (err, reason), says on stderr that addr:port is on this node
    /// but `what`, and returns nullptr, so that connect() takes the device.
    std::unique_ptr<detail::link> refuse_local(std::vector<int>& fds, int err,
                                               std::string_view reason, std::string_view addr,
                                               std::uint16_t port, std::string_view what);
    std::unique_ptr<detail::link> connect_device(std::string_view addr, std::uint16_t port);
    /// Lets the server process `server` use CMA on this one where Yama asks
    /// for it, as rpc_options::ptracer allows.
    void grant_cma(pid_t server) noexcept;
    peer_id add_link(std::unique_ptr<detail::link> wire);
    /// Connections through this device bind type-2 windows.
    [[nodiscard]] bool windows_wanted() const noexcept;
    verbs_cache& cache();

    // The call path (client_call.cpp).
    /// start() for call(): the slot it took, or the status it refused with.
    call_status start_on(peer_id p, std::uint16_t method, std::span<const std::byte> request,
                         const call_options& o, slot_ref& taken) noexcept;
    /// Shows the server the call's memory over the slot (its body, its reply buffer).
    call_status expose_call(peer& l, std::uint32_t slot, const call_options& o,
                            outgoing& call) noexcept;
    /// Writes the call's header, descriptors and inline body into the slot's
    /// staging bytes; returns how many.
    std::uint32_t encode_request(peer& l, std::uint32_t slot, std::uint16_t method,
                                 const call_options& o, const outgoing& call,
                                 std::uint32_t call_seq, bool epoch) noexcept;
    /// The slot's call is under way: its state, and the counts.
    void track_call(peer& l, std::uint32_t slot, const call_options& o, std::uint32_t call_seq,
                    bool epoch, std::uint32_t bytes, slot_ref& taken) noexcept;
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
    /// A reply for no call in flight in its slot: late (dropped), or the
    /// server's fault (the link ends).
    void stray_reply(peer& l, std::uint32_t index, std::uint32_t slot, violation v) noexcept;
    void finish(peer& l, std::uint32_t index, std::uint32_t slot, call_status st,
                std::span<const std::byte> reply) noexcept;
    /// The call in `slot` was fencing: its result goes out now; `dealloc`:
    /// its windows are deallocated first (the invalidation failed, or the
    /// link did).
    void fenced(peer& l, std::uint32_t index, std::uint32_t slot, bool dealloc) noexcept;
    /// The result of a call that ended, queued for the caller.
    void push_done(peer& l, std::uint32_t index, std::uint32_t slot, call_status st,
                   std::span<const std::byte> reply) noexcept;
    void fail_link(peer& l, std::uint32_t index) noexcept;
    void housekeeping() noexcept;
    /// The calls of `l` past their deadline end timed_out.
    void expire_calls(peer& l, std::uint32_t index, sched::coarse_clock::time_point now) noexcept;
    /// A fencing slot is past its call's deadline (and a housekeeping period).
    [[nodiscard]] bool fence_stalled(const peer& l,
                                     sched::coarse_clock::time_point now) const noexcept;
    void teardown_idle() noexcept;

    rpc_options opts_;
    /// The registration cache of large bodies and reply buffers, made at the
    /// first; declared before the endpoint, whose links hold its handles.
    std::unique_ptr<verbs_cache> cache_;
    detail::endpoint<peer> ep_;
    /// What a server on this node reads by CMA to see that it may.
    std::uint64_t probe_ = 0;
    /// Whom this process let use CMA on it (Yama scope 1): 0 nobody yet, -1
    /// any process, else a server's pid.
    pid_t ptracer_ = 0;
    // Results: a ring of those not yet handed out, and the slots handed out
    // by the last poll (freed at the next). Sized at connect for every slot.
    std::vector<call_result> results_;
    std::size_t results_head_ = 0, results_count_ = 0;
    std::vector<slot_ref> queued_slots_; ///< parallel to results_: its slot, or link UINT32_MAX
    std::vector<slot_ref> handed_out_;
    std::size_t in_flight_ = 0;
};

} // namespace rdmax::rpc
