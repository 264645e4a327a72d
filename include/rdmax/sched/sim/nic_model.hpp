#pragma once
// A ConnectX-class RDMA NIC in virtual time, as SendPorts: what the priority
// scheduler is for, where soft-RoCE under emulation cannot show it.
//
// What is modelled (times in picoseconds, integers, so that the arithmetic
// is exact and a run is the same on every machine):
// - the host: posting a work request costs `host_wqe` of CPU time, ringing
//   the doorbell `host_doorbell`, an empty poll of the completion queue
//   `host_poll`, each completion polled `host_cqe`; the host's time is
//   virtual_clock, which the scheduler reads too;
// - the doorbell reaches the NIC `doorbell_latency` after it was rung; the
//   NIC then fetches the work requests (`wqe_fetch_latency`, one DMA read
//   for a doorbell's whole chain) and a request's first payload bytes
//   (`dma_read_latency`); later payload streams at line rate (the NIC reads
//   ahead while it sends);
// - send queues drain in order onto one link at `gbps`: a request is cut
//   into packets of `mtu` payload bytes, each with `header_bytes` on the
//   wire (RoCEv2 framing, preamble and gap) and the first with `reth_bytes`
//   more; a request costs the NIC's engine `nic_wqe` before its first packet;
// - several send queues (one queue pair each) share the link: the NIC takes
//   them in turn, per packet or per work request (`arbitration`), and each
//   switch from one queue pair to another costs `qp_switch`;
// - a completion: `rtt` after the request's last packet left (the wire and
//   the switch both ways, the responder's acknowledgement), then
//   `cqe_latency` for the completion's DMA write into host memory; only
//   signaled requests complete, in order, as on an RC queue pair;
// - the receiver counts the packets, payload and wire bytes that arrive,
//   and the payload per address range within a time window (the bench's
//   measure of the stream's throughput).
// Not modelled: loss and retransmission, congestion control (one flow, no
// other traffic), PCIe bandwidth limits (taken above line rate), inline
// data and BlueFlame (a small request costs the same fetches as a large
// one), the NIC's caches of queue-pair contexts (two queue pairs fit).
//
// The figures for 25, 100 and 400 Gb/s (nic_params::cx5_25g, cx5_100g,
// cx7_400g) and where they come from: docs/bench-hol-sim.md. Those not from a
// data sheet are estimates, and say so.
//
// One model per thread at a time: virtual_clock is the thread's.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <span>
#include <vector>

#include <rdmax/sched/send_port.hpp>
#include <rdmax/status.hpp>
#include <rdmax/verbs/completion.hpp>

namespace rdmax::sched::sim {

using picoseconds = std::int64_t;
inline constexpr picoseconds ns = 1000;
inline constexpr picoseconds us = 1000 * ns;
inline constexpr picoseconds never = std::numeric_limits<picoseconds>::max();

/// The host's virtual time; the scheduler's Clock and FineClock in the model.
struct virtual_clock {
    using duration = std::chrono::nanoseconds;
    using rep = duration::rep;
    using period = duration::period;
    using time_point = std::chrono::time_point<virtual_clock>;
    static constexpr bool is_steady = true;

    [[nodiscard]] static time_point now() noexcept { return time_point(duration(ps / 1000)); }

    static inline thread_local picoseconds ps = 0; ///< the host's time now
};

/// The model moves no bytes: the local address its requests carry.
inline std::byte* const nominal_local = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 32);

/// An RDMA write of `length` bytes to `remote`, posted as it is (no
/// scheduler): what the plain modes and the model's own tests stage.
[[nodiscard]] inline slice_request write_request(std::uint64_t id, std::uint64_t remote,
                                                 std::uint64_t length,
                                                 bool signaled = true) noexcept {
    slice_request s;
    s.id = id;
    s.local = nominal_local;
    s.length = static_cast<std::uint32_t>(length);
    s.remote_addr = remote;
    s.signaled = signaled;
    return s;
}

enum class arbitration { per_packet, per_wqe };

struct nic_params {
    const char* name = "";
    std::uint32_t gbps = 100; ///< line rate
    std::uint32_t mtu = 4096; ///< payload bytes per packet
    /// Per packet on the wire: preamble+SFD 8, Ethernet 14, IPv4 20, UDP 8,
    /// BTH 12, ICRC 4, FCS 4, inter-frame gap 12.
    std::uint32_t header_bytes = 82;
    std::uint32_t reth_bytes = 16; ///< RETH, first packet of an RDMA write
    picoseconds host_wqe = 0;
    picoseconds host_doorbell = 0;
    picoseconds host_poll = 0;
    picoseconds host_cqe = 0;
    picoseconds doorbell_latency = 0;
    picoseconds wqe_fetch_latency = 0;
    picoseconds dma_read_latency = 0;
    picoseconds nic_wqe = 0;
    picoseconds rtt = 0;
    picoseconds cqe_latency = 0;
    picoseconds qp_switch = 0;
    std::uint32_t sq_depth = 8192;
    std::uint32_t max_message = 1U << 31;
    arbitration arbiter = arbitration::per_packet;

    /// Wire time of `bytes` at the line rate (exact for 25/100/400 Gb/s).
    [[nodiscard]] constexpr picoseconds wire(std::uint64_t bytes) const noexcept {
        return static_cast<picoseconds>(bytes * 8000 / gbps);
    }
    /// Packets of a request of `length` payload bytes (a zero-length one is one packet).
    [[nodiscard]] constexpr std::uint64_t packets(std::uint64_t length) const noexcept {
        return length == 0 ? 1 : (length + mtu - 1) / mtu;
    }
    /// Bytes on the wire for a request of `length` payload bytes.
    [[nodiscard]] constexpr std::uint64_t wire_bytes(std::uint64_t length) const noexcept {
        return length + packets(length) * header_bytes + reth_bytes;
    }
    /// Posting one request alone to its completion being seen, with no queue:
    /// what the unit test checks the model against.
    [[nodiscard]] constexpr picoseconds lone_latency(std::uint64_t length) const noexcept {
        return host_wqe + host_doorbell + doorbell_latency + wqe_fetch_latency + dma_read_latency +
               nic_wqe + wire(wire_bytes(length)) + rtt + cqe_latency;
    }

    // Sources and estimates: docs/bench-hol-sim.md, "Model parameters".
    static constexpr nic_params cx5_25g() noexcept {
        nic_params p = cx5_100g();
        p.name = "25 Gb/s (ConnectX-4 Lx/5 class, PCIe 3.0 x8)";
        p.gbps = 25;
        return p;
    }
    static constexpr nic_params cx5_100g() noexcept {
        nic_params p;
        p.name = "100 Gb/s (ConnectX-5 class, PCIe 3.0 x16)";
        p.gbps = 100;
        p.host_wqe = 40 * ns;
        p.host_doorbell = 100 * ns;
        p.host_poll = 40 * ns;
        p.host_cqe = 20 * ns;
        p.doorbell_latency = 250 * ns;
        p.wqe_fetch_latency = 500 * ns;
        p.dma_read_latency = 500 * ns;
        p.nic_wqe = 5 * ns;
        p.rtt = 1500 * ns;
        p.cqe_latency = 250 * ns;
        p.qp_switch = 10 * ns;
        return p;
    }
    static constexpr nic_params cx7_400g() noexcept {
        nic_params p = cx5_100g();
        p.name = "400 Gb/s (ConnectX-7 class, PCIe 5.0 x16)";
        p.gbps = 400;
        p.nic_wqe = 3 * ns;
        return p;
    }
};

/// What arrived at the far end.
struct receiver {
    std::uint64_t packets = 0;
    std::uint64_t messages = 0;
    std::uint64_t bytes = 0;          ///< payload
    std::uint64_t wire_bytes = 0;     ///< with headers
    picoseconds last_arrival = 0;     ///< when the last packet left the link
    std::uint64_t split_addr = ~0ULL; ///< counts below / at-or-above apart
    picoseconds window_start = 0;     ///< counted: packets that end in the window
    picoseconds window_end = never;
    std::uint64_t window_bytes[2] = {0, 0}; ///< below split_addr, at or above
    /// Payload below split_addr per `bin_ps` of time (packets that end in
    /// the bin), when `bins` is set: a stream's throughput over time.
    std::vector<std::uint64_t>* bins = nullptr;
    picoseconds bin_ps = 0;
};

class nic;

/// One RC send queue of the NIC, as the scheduler's SendPort.
class nic_port {
public:
    nic_port(nic& n, std::uint32_t qp) noexcept
        : nic_(&n)
        , qp_(qp) {}
    status stage(const slice_request& s) noexcept;
    status post() noexcept;
    [[nodiscard]] std::uint32_t accepted() const noexcept { return accepted_; }
    void fail() noexcept;
    int poll(std::span<verbs::completion> out) noexcept;
    [[nodiscard]] std::uint32_t slots_free() const noexcept;
    [[nodiscard]] std::uint32_t max_rd_atomic() const noexcept { return 16; }
    [[nodiscard]] std::uint32_t max_message() const noexcept;
    [[nodiscard]] bool ready() const noexcept;
    [[nodiscard]] bool failed() const noexcept { return !ready(); }
    [[nodiscard]] nic& device() const noexcept { return *nic_; }

private:
    nic* nic_;
    std::uint32_t qp_;
    std::uint32_t accepted_ = 0;
};

class nic {
public:
    /// `queue_pairs` send queues on one link. Resets the virtual clock to 0.
    explicit nic(const nic_params& p, std::uint32_t queue_pairs = 1)
        : p_(p)
        , sqs_(queue_pairs) {
        virtual_clock::ps = 0;
        for (auto& q : sqs_)
            q.chain.reserve(p_.sq_depth);
    }

    [[nodiscard]] const nic_params& params() const noexcept { return p_; }
    receiver rx;
    std::uint64_t doorbells = 0;
    std::uint64_t wqes = 0;
    std::uint64_t qp_switches = 0;

    /// Sends the packets that start before `limit`. With `stop_at_completion`,
    /// stops at the first completion that becomes visible before `limit`, and
    /// returns when: what the host does from then on cannot change what the
    /// NIC did before, as a doorbell reaches the NIC only doorbell_latency
    /// after it was rung.
    picoseconds run_until(picoseconds limit, bool stop_at_completion) noexcept {
        for (;;) {
            if (stop_at_completion)
                limit = std::min(limit, earliest_cqe_);
            picoseconds first_ready = never;
            for (const auto& q : sqs_)
                if (!q.wqes.empty())
                    first_ready = std::min(first_ready, q.wqes.front().ready);
            if (first_ready == never || down_)
                return limit;
            const picoseconds start = std::max(wire_free_, first_ready);
            if (start >= limit)
                return limit;
            send_packet(pick(start), start);
        }
    }
    /// Runs the NIC up to the host's time now.
    void catch_up() noexcept { run_until(virtual_clock::ps, false); }
    /// The link goes down now (a cable pulled, a switch port failed): no
    /// packet starts from now on, and nothing sent is acknowledged any
    /// more. The host learns it from a port event or a retry timeout: then
    /// it fails the queue pairs (nic_port::fail), and their work flushes.
    void link_down() noexcept {
        catch_up();
        down_ = true;
        // Acknowledgements on their way back are lost with the link.
        for (auto& q : sqs_)
            for (auto& c : q.cqes)
                if (c.visible > virtual_clock::ps)
                    c.visible = never;
        recompute_earliest();
    }
    /// The link is back; a failed queue pair stays failed (use another).
    void link_up() noexcept {
        catch_up();
        down_ = false;
        wire_free_ = std::max(wire_free_, virtual_clock::ps);
    }
    [[nodiscard]] bool link_is_down() const noexcept { return down_; }
    /// When the host can next see a completion: at most `horizon`.
    [[nodiscard]] picoseconds next_completion(picoseconds horizon) noexcept {
        return std::min(run_until(horizon, true), earliest_cqe_);
    }
    /// Nothing queued or in flight on any queue pair.
    [[nodiscard]] bool idle() const noexcept {
        for (const auto& q : sqs_)
            if (!q.wqes.empty() || !q.cqes.empty())
                return false;
        return true;
    }

private:
    friend class nic_port;

    struct wqe {
        slice_request s;
        picoseconds ready = 0;  ///< its first payload bytes are in the NIC
        std::uint64_t sent = 0; ///< payload bytes sent
        bool started = false;
    };
    struct cqe {
        verbs::completion c;
        picoseconds visible = 0;
    };
    struct send_queue {
        std::deque<wqe> wqes;
        std::deque<cqe> cqes;
        std::vector<slice_request> chain;
        bool failed = false;
    };

    /// Which queue pair sends the packet that starts at `start`.
    std::uint32_t pick(picoseconds start) noexcept;

    void send_packet(std::uint32_t qp, picoseconds start) noexcept;

    void recompute_earliest() noexcept {
        earliest_cqe_ = never;
        for (const auto& q : sqs_)
            if (!q.cqes.empty())
                earliest_cqe_ = std::min(earliest_cqe_, q.cqes.front().visible);
    }

    nic_params p_;
    std::vector<send_queue> sqs_;
    picoseconds wire_free_ = 0;
    picoseconds earliest_cqe_ = never;
    std::uint32_t last_ = 0;
    bool down_ = false;
};

static_assert(SendPort<nic_port>);

} // namespace rdmax::sched::sim

// The member bodies.
#include <rdmax/sched/sim/nic_model-inl.hpp>
