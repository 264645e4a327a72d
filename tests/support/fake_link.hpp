#pragma once
// A connection for the RPC protocol's unit tests: an rpc::detail::link that
// lives in memory, with no device. Two ends can be joined (a client's and a
// server's) so that a real rpc::client and a real rpc::server talk through
// it, or one end can be driven alone: the test writes a message into that
// side's ring by hand and hands the endpoint its immediate.
//
// What a side sends (send_slot) does not land at once: it waits in that
// side's outbox, bytes and immediate together, as a message in the network
// does, until the test delivers it (deliver_one / pump). Until then the test
// may withhold it, reorder, duplicate or corrupt it (the outbox is a plain
// deque). A body WRITE goes through the outbox too, ahead of the header
// message that follows it (a send queue is FIFO).
//
// Two paths, as the library has: path::device (the immediates come through
// the endpoint's completion queue: the test hands them to the endpoint's
// on_receive as an ibv_wc would come; body READs and WRITEs complete later,
// through the link's poll) and path::node_local (the immediates come out of
// the link's poll, as a shm_link's do; bodies move at once, as CMA).
//
// protocol_test_access builds an endpoint with no device (no queues, no
// listener) and adopts a link into it without a connection.

#include <arpa/inet.h>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <sys/eventfd.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <rdmax/detail/rpc/link.hpp>
#include <rdmax/detail/rpc/wire.hpp>
#include <rdmax/rpc/client.hpp>
#include <rdmax/rpc/server.hpp>
#include <rdmax/sched/coarse_clock.hpp>

#include "not_counted.hpp"

namespace rdmax::test {

enum class fake_path : std::uint8_t { device, node_local };

/// A message in flight from one end to the other.
struct fake_message {
    enum class what : std::uint8_t { slot, body } kind = what::slot;
    std::uint32_t imm = 0;        ///< slot messages: the immediate (host order)
    std::vector<std::byte> bytes; ///< what lands (the slot's first bytes, or a body)
    std::byte* body_at = nullptr; ///< body writes: where (the peer's buffer)
    sched::priority priority{};
};

/// How a body READ or WRITE goes.
enum class fake_transfer : std::uint8_t {
    ok,         ///< started; its completion is a success
    refuse,     ///< transfer::failed: nothing moved
    fail_later, ///< started; its completion is an error (remote access error)
};

/// One end's state; shared by the link the endpoint owns and the test, so
/// that it outlives the link (an endpoint tears its links down).
struct fake_end {
    fake_end(fake_path how, std::uint16_t slot_count, std::uint32_t slot_size)
        : path(how)
        , slots(slot_count)
        , slot_bytes(slot_size)
        , ring(std::size_t{slot_count} * slot_size)
        , staging(std::size_t{slot_count} * slot_size)
        , event_fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK))
        , wake_fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
        if (event_fd < 0 || wake_fd < 0) {
            if (event_fd >= 0)
                ::close(event_fd);
            if (wake_fd >= 0)
                ::close(wake_fd);
            throw std::runtime_error("eventfd");
        }
        static std::uint32_t next_qp = 0x100;
        qp_num = next_qp++;
    }
    fake_end(const fake_end&) = delete;
    fake_end& operator=(const fake_end&) = delete;
    ~fake_end() {
        ::close(event_fd);
        ::close(wake_fd);
    }

    const fake_path path;
    const std::uint16_t slots;
    const std::uint32_t slot_bytes;
    std::vector<std::byte> ring;       ///< this side's slots, as the peer writes them
    std::vector<std::byte> staging;    ///< where this side builds its messages
    std::deque<fake_message> outbox;   ///< sent by this side, not yet landed
    std::deque<std::uint32_t> arrived; ///< node-local: landed immediates for poll
    fake_end* peer = nullptr;          ///< the joined end, if any
    int event_fd;                      ///< readable once the peer is gone
    /// Readable once the test woke this side (wake()), as a completion
    /// event or a node-local peer would; the endpoint's wake-up reads it.
    int wake_fd;
    std::uint32_t qp_num = 0;

    // What the test makes happen.
    status send_result = status::ok; ///< what send_slot says (queue_full, qp_failed...)
    fake_transfer reads = fake_transfer::ok;
    fake_transfer writes = fake_transfer::ok;
    bool hold_completions = false; ///< transfers' completions wait (a slow READ)
    bool gone = false;             ///< peer_gone() says so (set with leave())
    bool corrupt = false;          ///< ended() says so; node-local: poll says corrupt
    /// hold_doorbell() holds, as rdma_link does (the device path), or not,
    /// as shm_link (node-local).
    bool holds = path == fake_path::device;

    // What happened.
    std::uint32_t sends = 0, reads_started = 0, writes_started = 0, closes = 0;
    /// Doorbells: a send not held rings one; a hold's end with messages
    /// held rings one for all of them.
    std::uint32_t doorbells = 0;
    bool held = false;               ///< hold_doorbell(true) said so
    std::deque<fake_message> unrung; ///< sent while held: not in the outbox yet
    /// The held messages go to the outbox, with one doorbell.
    void ring_unrung() {
        if (unrung.empty())
            return;
        ++doorbells;
        for (; !unrung.empty(); unrung.pop_front())
            outbox.push_back(std::move(unrung.front()));
    }
    bool destroyed = false; ///< the endpoint let its link go

    struct pending {
        verbs::completion c;
        std::byte* dst = nullptr; ///< READs: copied at completion
        const std::byte* src = nullptr;
        std::size_t bytes = 0;
    };
    std::deque<pending> completions;

    [[nodiscard]] std::byte* slot_in(std::uint32_t s) noexcept {
        return ring.data() + std::size_t{s} * slot_bytes;
    }
    [[nodiscard]] std::byte* slot_out(std::uint32_t s) noexcept {
        return staging.data() + std::size_t{s} * slot_bytes;
    }
    /// Writes `bytes` into this side's slot s, as the peer's WRITE would.
    void write_slot(std::uint32_t s, std::span<const std::byte> bytes) noexcept {
        std::memcpy(slot_in(s), bytes.data(), bytes.size());
    }
    /// The peer left: peer_gone() says so, and the endpoint's epoll sees it.
    void leave() noexcept {
        gone = true;
        const std::uint64_t one = 1;
        (void)!::write(event_fd, &one, sizeof one);
    }
    /// Wakes the endpoint asleep on this side's descriptors.
    void wake() const noexcept {
        const std::uint64_t one = 1;
        (void)!::write(wake_fd, &one, sizeof one);
    }
    /// Lands the oldest message of the outbox at the peer; its immediate (slot
    /// messages), or nullopt (a body write, or nothing to land).
    std::optional<std::uint32_t> land_one() {
        if (outbox.empty() || peer == nullptr)
            return std::nullopt;
        fake_message m = std::move(outbox.front());
        outbox.pop_front();
        return peer->land(m);
    }
    /// Lands `m` on this side: its bytes in the slot (or the body buffer).
    std::optional<std::uint32_t> land(const fake_message& m) {
        if (m.kind == fake_message::what::body) {
            std::memcpy(m.body_at, m.bytes.data(), m.bytes.size());
            return std::nullopt;
        }
        const rpc::imm_fields f = rpc::decode_imm(m.imm);
        // Node-local: the sender built the message in this ring already
        // (shared memory); only the immediate travels.
        // (A control message carries no bytes, and names a code, not a slot.)
        if (path == fake_path::device && !m.bytes.empty() && f.slot < slots &&
            m.bytes.size() <= slot_bytes)
            std::memcpy(slot_in(f.slot), m.bytes.data(), m.bytes.size());
        if (path == fake_path::node_local)
            arrived.push_back(m.imm);
        return m.imm;
    }
};

/// The link an endpoint owns; all its state is in the shared fake_end.
class fake_link final : public rpc::detail::link {
public:
    explicit fake_link(std::shared_ptr<fake_end> e)
        : link(e->slots, e->slot_bytes,
               e->path == fake_path::node_local ? rpc::transport::shm : rpc::transport::rdma)
        , e_(std::move(e)) {
        // Node-local: this side builds its messages in the peer's ring
        // itself, as in the shared segment.
        const bool shared = e_->path == fake_path::node_local && e_->peer != nullptr;
        lay_out(e_->slot_in(0), shared ? e_->peer->slot_in(0) : e_->slot_out(0));
        set_fds(e_->event_fd, e_->wake_fd);
        if (e_->path == fake_path::device)
            set_qp_num(e_->qp_num);
        set_hold_of([](link* l, bool on) noexcept { return static_cast<fake_link*>(l)->hold(on); });
    }
    ~fake_link() override { e_->destroyed = true; }
    fake_link(const fake_link&) = delete;
    fake_link& operator=(const fake_link&) = delete;

    [[nodiscard]] status send_slot(rpc::message_kind k, std::uint32_t s, std::uint32_t bytes,
                                   sched::priority p, bool epoch) noexcept override {
        if (e_->send_result != status::ok)
            return e_->send_result;
        const not_counted scaffolding; // the copy of the message is the fake network's
        ++e_->sends;
        fake_message m;
        m.imm = rpc::encode_imm(k, s, bytes, epoch);
        if (bytes != 0) // a control message names a code, not a slot
            m.bytes.assign(staging(s), staging(s) + bytes);
        m.priority = p;
        if (e_->held) {
            e_->unrung.push_back(std::move(m));
        } else {
            ++e_->doorbells;
            e_->outbox.push_back(std::move(m));
        }
        return status::ok;
    }
    bool hold(bool on) noexcept {
        if (!e_->holds)
            return false;
        e_->held = on;
        if (!on) {
            const not_counted scaffolding;
            e_->ring_unrung();
        }
        return true;
    }
    [[nodiscard]] rpc::detail::transfer
    move_body(rpc::detail::body_way way, sched::priority p, local_buffer<rights::local_write> local,
              const rpc::buffer_descriptor& remote, std::uint64_t wr_id,
              std::span<const std::uint32_t>) noexcept override {
        return way == rpc::detail::body_way::read ? read_body(local, remote, wr_id)
                                                  : write_body(p, local, remote, wr_id);
    }
    [[nodiscard]] bool cancel(std::uint64_t) noexcept override { return false; }
    [[nodiscard]] int poll(std::span<rpc::detail::link_event> out, bool) noexcept override {
        if (e_->path == fake_path::node_local) {
            if (e_->corrupt)
                return -1;
            int n = 0;
            for (; !e_->arrived.empty() && static_cast<std::size_t>(n) < out.size(); ++n) {
                out[static_cast<std::size_t>(n)] =
                    rpc::detail::link_event::of_imm(e_->arrived.front());
                e_->arrived.pop_front();
            }
            return n;
        }
        if (e_->hold_completions)
            return 0;
        int n = 0;
        while (!e_->completions.empty() && static_cast<std::size_t>(n) < out.size()) {
            const fake_end::pending& p = e_->completions.front();
            if (p.dst != nullptr && p.c.ok())
                std::memcpy(p.dst, p.src, p.bytes);
            out[static_cast<std::size_t>(n++)] = rpc::detail::link_event::of_transfer(p.c);
            e_->completions.pop_front();
        }
        return n;
    }
    [[nodiscard]] std::optional<rpc::link_end> ended(rpc::detail::look what) noexcept override {
        using rpc::detail::look;
        if (what == look::cause || (e_->corrupt && e_->path == fake_path::device) ||
            (what == look::events && e_->gone))
            return rpc::link_end{};
        return std::nullopt;
    }
    [[nodiscard]] bool sleep(bool going) noexcept override {
        if (!going) {
            std::uint64_t n = 0;
            (void)!::read(e_->wake_fd, &n, sizeof n);
        }
        return true;
    }
    void close() noexcept override { ++e_->closes; }
    [[nodiscard]] bool established(bool) noexcept override { return true; }
    [[nodiscard]] rpc::detail::access
    grant_access(std::uint32_t, const rpc::detail::call_ranges& r, rpc::buffer_descriptor& body,
                 rpc::buffer_descriptor& reply) noexcept override {
        return describe_host(r, body, reply); // host memory by address, no keys
    }
    bool end_access(std::uint32_t slot, rpc::detail::access_end how) noexcept override {
        // As rdma_link: nothing held is overtaken by what ends the access.
        {
            const not_counted scaffolding;
            e_->ring_unrung();
        }
        if (how == rpc::detail::access_end::fence)
            return false;
        // Node-local: a call given up flips its request's epoch in the
        // server's ring (shared memory), as shm_link does.
        if (how == rpc::detail::access_end::abandon && e_->path == fake_path::node_local)
            staging(slot)[offsetof(rpc::message_header, flags)] ^= std::byte{rpc::flag_epoch};
        return true;
    }

private:
    rpc::detail::transfer read_body(local_buffer<rights::local_write> dst,
                                    const rpc::buffer_descriptor& src, std::uint64_t wr_id) {
        if (e_->reads == fake_transfer::refuse)
            return rpc::detail::transfer::failed;
        ++e_->reads_started;
        auto* to = static_cast<std::byte*>(dst.addr);
        const auto* from = reinterpret_cast<const std::byte*>(src.addr);
        if (e_->path == fake_path::node_local) { // as CMA: done when it returns
            std::memcpy(to, from, dst.length);
            return rpc::detail::transfer::done;
        }
        fake_end::pending p;
        p.c.wr_id = wr_id;
        p.c.opcode = IBV_WC_RDMA_READ;
        p.c.status = e_->reads == fake_transfer::ok ? IBV_WC_SUCCESS : IBV_WC_REM_ACCESS_ERR;
        p.dst = to;
        p.src = from;
        p.bytes = dst.length;
        e_->completions.push_back(p);
        return rpc::detail::transfer::started;
    }
    rpc::detail::transfer write_body(sched::priority p, local_buffer<rights::local_write> src,
                                     const rpc::buffer_descriptor& dst, std::uint64_t wr_id) {
        if (e_->writes == fake_transfer::refuse)
            return rpc::detail::transfer::failed;
        ++e_->writes_started;
        const auto* from = static_cast<const std::byte*>(src.addr);
        auto* to = reinterpret_cast<std::byte*>(dst.addr);
        if (e_->path == fake_path::node_local) {
            std::memcpy(to, from, src.length);
            return rpc::detail::transfer::done;
        }
        // Lands in order with the messages that follow it.
        fake_message m;
        m.kind = fake_message::what::body;
        m.bytes.assign(from, from + src.length);
        m.body_at = to;
        m.priority = p;
        e_->outbox.push_back(std::move(m));
        fake_end::pending c;
        c.c.wr_id = wr_id;
        c.c.opcode = IBV_WC_RDMA_WRITE;
        c.c.status = e_->writes == fake_transfer::ok ? IBV_WC_SUCCESS : IBV_WC_REM_ACCESS_ERR;
        e_->completions.push_back(c);
        return rpc::detail::transfer::started;
    }

    std::shared_ptr<fake_end> e_;
};

} // namespace rdmax::test

namespace rdmax::rpc {

/// Befriended by client and server: endpoints with no device, links adopted
/// without a connection, immediates handed in, and their state looked at.
struct protocol_test_access {
    static std::unique_ptr<client> make_client(rpc_options o) {
        return std::unique_ptr<client>(new client(detail::no_device, o));
    }
    static std::unique_ptr<server> make_server(rpc_options o) {
        return std::unique_ptr<server>(new server(detail::no_device, o));
    }
    static peer_id adopt(client& c, const std::shared_ptr<test::fake_end>& e) {
        return c.add_link(std::make_unique<test::fake_link>(e));
    }
    static peer_id adopt(server& s, const std::shared_ptr<test::fake_end>& e,
                         std::uint64_t client_incarnation = 1, std::uint64_t first_call = 1) {
        return s.ep_.id_of(s.add_link(std::make_unique<test::fake_link>(e), e->slots,
                                      client_incarnation, first_call));
    }
    /// The first call id the client's next connection would name.
    static std::uint64_t next_call(const client& c) { return c.next_call_id_; }
    /// A link whose handshake named the server's incarnation.
    static peer_id adopt(client& c, const std::shared_ptr<test::fake_end>& e,
                         std::uint64_t server_incarnation) {
        auto w = std::make_unique<test::fake_link>(e);
        w->peer_incarnation = server_incarnation;
        return c.add_link(std::move(w));
    }
    /// How the client makes its connections again (throw: the attempt failed).
    static void redial(client& c, std::function<std::unique_ptr<detail::link>()> f) {
        c.redial_ = [f = std::move(f)](std::uint32_t) { return f(); };
    }
    /// The endpoints' deadlines on another clock (a virtual one). What was
    /// stamped on the old clock is stamped again on the new: a connection's
    /// silence counted from a real time on a virtual clock (which starts at
    /// one hour) ended every call peer_gone on a machine up for less.
    static void use_clock(client& c, detail::clock_fn f) {
        c.ep_.clock = f;
        restamp(c.ep_);
    }
    static void use_clock(server& s, detail::clock_fn f) {
        s.ep_.clock = f;
        s.housekept_ = f();
        restamp(s.ep_);
    }
    template <class Endpoint>
    static void restamp(Endpoint& ep) {
        for (auto& p : ep.peers) {
            p.last_heard = ep.now();
            p.probed = {};
        }
        ep.housekeep_soon(); // its next housekeeping was set on the old clock
    }
    static void begin_drain(server& s) { s.begin_drain(); }
    static bool drained(const server& s) { return s.drained(); }
    static void end_drain(server& s) { s.end_drain(); }

    /// A receive completion as the device gives it: on_receive, as poll() would.
    template <class Endpoint>
    static void receive(Endpoint& ep, const ibv_wc& wc) {
        ep.on_receive(wc);
    }
    /// The immediate `imm` arriving on `e`'s connection (a write-with-immediate).
    template <class Endpoint>
    static void receive_imm(Endpoint& ep, const test::fake_end& e, std::uint32_t imm) {
        if (e.destroyed)
            return; // its queue pair is gone: no completion comes
        ibv_wc wc{};
        wc.qp_num = e.qp_num;
        wc.status = IBV_WC_SUCCESS;
        wc.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
        wc.wc_flags = IBV_WC_WITH_IMM;
        wc.imm_data = htonl(imm);
        ep.on_receive(wc);
    }

    /// Time passes for the client's calls: every deadline of a call in
    /// flight moves `by` earlier, and housekeeping is due at the next poll.
    static void advance(client& c, std::chrono::nanoseconds by) {
        for (client::peer& l : c.ep_.peers)
            for (client::slot_state& ss : l.slots)
                if (ss.phase == client::slot_phase::in_flight)
                    ss.deadline -= by;
        c.ep_.housekeep_soon();
    }
    static void housekeep_next_poll(client& c) { c.ep_.housekeep_soon(); }
    static void housekeep_next_poll(server& s) { s.ep_.housekeep_soon(); }

    /// The live connection `p` (a test that asks about a gone one is wrong).
    static server::peer& live(server& e, peer_id p) {
        auto* l = e.ep_.find(p);
        if (l == nullptr)
            throw std::logic_error("protocol_test_access: no such peer");
        return *l;
    }
    /// The client's: the connection its session `p` has now.
    static const client::peer& live(const client& c, peer_id p) {
        const client::peer* l = c.link_of(p);
        if (l == nullptr)
            throw std::logic_error("protocol_test_access: no such peer");
        return *l;
    }

    // ---- the client's state ----
    static std::size_t free_slots(const client& c, peer_id p) {
        const client::peer* l = c.link_of(p);
        return l != nullptr ? l->free_slots.size() : 0;
    }
    static bool slot_in_flight(const client& c, peer_id p, std::uint32_t s) {
        return live(c, p).slots[s].phase == client::slot_phase::in_flight;
    }
    static bool slot_free(const client& c, peer_id p, std::uint32_t s) {
        return live(c, p).slots[s].phase == client::slot_phase::free;
    }
    static bool slot_epoch(const client& c, peer_id p, std::uint32_t s) {
        return live(c, p).slots[s].epoch;
    }
    static std::uint32_t slot_seq(const client& c, peer_id p, std::uint32_t s) {
        return live(c, p).slots[s].seq;
    }
    static unsigned slot_late(const client& c, peer_id p, std::uint32_t s) {
        return live(c, p).slots[s].late;
    }
    /// The slot the next call takes.
    static std::uint32_t next_slot(const client& c, peer_id p) {
        return live(c, p).free_slots.back();
    }
    static bool link_alive(const client& c, std::uint32_t index) {
        return index < c.ep_.peers.size() && c.ep_.peers[index].wire != nullptr;
    }

    // ---- the server's state ----
    static bool slot_busy(server& s, peer_id p, std::uint32_t slot) {
        return live(s, p).slots[slot].busy;
    }
    static std::size_t free_blocks(server& s, peer_id p) { return live(s, p).free_blocks.size(); }
    static std::size_t blocks(server& s, peer_id p) { return live(s, p).blocks.size(); }
    static bool broken(server& s, peer_id p) {
        const server::peer* l = s.ep_.find(p);
        return l == nullptr || l->wire->broken;
    }
};

} // namespace rdmax::rpc
