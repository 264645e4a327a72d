#pragma once
// rpc::detail::link: what an RPC endpoint needs of one connection, whichever
// way the bytes go. Two implementations, named for the path:
//
//   rdma_link  through the device: rings written with write-with-immediate
//              (the immediates arrive on the endpoint's shared completion
//              queue), bodies by READ and WRITE under the priority scheduler,
//              a call's buffers shown through memory windows;
//   shm_link   between two processes on one node: the rings in a shared
//              segment, the immediates in a message ring (they come out of
//              poll()), bodies by CMA;
//   tcp_link   over one TCP socket: slots, immediates and bodies in frames
//              on the stream, the peer's reads and writes checked against
//              this side's own keys.
//
// The endpoint never asks which one it holds: everything a caller does with
// a connection is one of the ten operations below, each with a meaning on
// every path (a path where one has nothing to do says so in its answer).
// Rings and staging slots are plain memory, laid out by the implementation
// and read without a call.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include <rdmax/detail/rpc/wire.hpp>
#include <rdmax/mem/buffer.hpp>
#include <rdmax/mem/rights.hpp>
#include <rdmax/rpc/dmabuf_range.hpp>
#include <rdmax/rpc/rpc_counters.hpp>
#include <rdmax/rpc/transport.hpp>
#include <rdmax/sched/priority.hpp>
#include <rdmax/sched/scheduler_options.hpp>
#include <rdmax/status.hpp>
#include <rdmax/verbs/completion.hpp>

namespace rdmax::rpc::detail {

/// How a body transfer went: finished already (CMA), under way (its
/// completion comes from poll()), or refused (nothing moved).
enum class transfer : std::uint8_t { done, started, failed };

/// Which way a body goes: the peer's bytes into this side (a request body),
/// or this side's into the peer's buffer (a reply body).
enum class body_way : std::uint8_t { read, write };

/// What poll() hands the endpoint. Trivial (no initializers): the
/// endpoints' arrays of them cost nothing on a poll that finds nothing.
struct link_event {
    enum class kind : std::uint8_t {
        imm,      ///< an immediate from the peer (where it does not come through the CQ)
        transfer, ///< a body READ or WRITE ended (ok() or not)
        fenced,   ///< the call in `slot` is fenced: the peer's keys to its buffers are dead
    };
    std::uint64_t wr_id; ///< transfer: the wr_id it was started with
    std::uint32_t value; ///< imm: the immediate (host order); fenced: the slot
    ibv_wc_status status;
    kind what;
    /// transfer, failed: the call alone fails, the link goes on (tcp: the
    /// peer refused a read it was not granted). On the device an error
    /// completion leaves the queue pair in error.
    bool call_only;

    [[nodiscard]] bool ok() const noexcept { return status == IBV_WC_SUCCESS; }
    [[nodiscard]] std::uint32_t imm() const noexcept { return value; }
    [[nodiscard]] std::uint32_t slot() const noexcept { return value; }

    [[nodiscard]] static link_event of_imm(std::uint32_t imm) noexcept {
        return {0, imm, IBV_WC_SUCCESS, kind::imm, false};
    }
    [[nodiscard]] static link_event of_transfer(const verbs::completion& c) noexcept {
        return {c.wr_id, 0, c.status, kind::transfer, false};
    }
    [[nodiscard]] static link_event of_fenced(std::uint32_t slot) noexcept {
        return {0, slot, IBV_WC_SUCCESS, kind::fenced, false};
    }
};

/// What ended() looks at.
enum class look : std::uint8_t {
    failure, ///< did the link fail under this side (an error completion, a corrupt ring)?
    events,  ///< that, or (a connection event may be waiting) did the peer leave?
    cause,   ///< the link is ending (a post failed): what is known of why, always
};

/// A call's buffers made reachable by the peer (grant_access).
enum class access : std::uint8_t {
    ok,
    owed,                ///< the slot's last windows still owe an invalidation: try another slot
    no_room,             ///< the binds could not be posted (send queue full, or failed)
    registration_failed, ///< the device would not register the memory
    unreachable,         ///< dma-buf memory on a path that could only reach it with the CPU
    foreign,             ///< a dma-buf range whose cache is in another protection domain
};

/// What a call shows its peer: a body over the slot and a reply buffer, each
/// in host memory or in a dma-buf (one of the two, or none).
struct call_ranges {
    std::span<const std::byte> body = {};
    std::span<std::byte> reply = {};
    const dmabuf_range* dev_body = nullptr; ///< non-null: the body is there (body is empty)
    const dmabuf_range* dev_reply = nullptr;
};

/// How a call's buffers stop being the peer's (end_access).
enum class access_end : std::uint8_t {
    lazy,    ///< an invalidation queued behind the send queue (the request never went)
    fence,   ///< one whose completion poll() reports (fenced): false if none was posted
    now,     ///< dead when it returns (windows deallocated): the caller reuses the buffers
    abandon, ///< as now, for a call given up at its deadline: the peer must drop it too
};

class link {
public:
    link(std::uint16_t slots, std::uint32_t slot_bytes, rpc::transport kind) noexcept
        : slots_(slots)
        , slot_bytes_(slot_bytes)
        , kind_(kind) {}
    link(const link&) = delete;
    link& operator=(const link&) = delete;
    virtual ~link() = default;

    [[nodiscard]] std::uint16_t slots() const noexcept { return slots_; }
    [[nodiscard]] std::uint32_t slot_bytes() const noexcept { return slot_bytes_; }
    /// This side's slot s, as the peer wrote it (`bytes` from the immediate).
    [[nodiscard]] std::span<const std::byte> inbound(std::uint32_t s,
                                                     std::uint32_t bytes) const noexcept {
        return {in_slots_ + std::size_t{s} * slot_bytes_, bytes};
    }
    /// Where this side builds the message for slot s before send_slot.
    [[nodiscard]] std::byte* staging(std::uint32_t s) const noexcept {
        return out_slots_ + std::size_t{s} * slot_bytes_;
    }
    /// Readable when a connection event may be waiting (for the endpoint's epoll).
    [[nodiscard]] int event_fd() const noexcept { return event_fd_; }
    /// Readable when the peer woke this side; -1 where the endpoint's
    /// completion channel does it.
    [[nodiscard]] int wake_fd() const noexcept { return wake_fd_; }
    /// The queue pair whose receive completions are this link's, or 0.
    [[nodiscard]] std::uint32_t qp_num() const noexcept { return qp_num_; }
    /// Through the node's memory, not the device (for rpc::client::is_local).
    [[nodiscard]] bool node_local() const noexcept { return kind_ == rpc::transport::shm; }
    /// Which way the bytes go (rpc::client::transport).
    [[nodiscard]] rpc::transport kind() const noexcept { return kind_; }
    /// The priority scheduler's counters, where the link posts through one.
    [[nodiscard]] std::optional<sched::scheduler_counters> scheduler_counters() const noexcept {
        return counters_of_ != nullptr ? std::optional(counters_of_(this)) : std::nullopt;
    }

    // ---- the ten operations ----

    /// Sends the first `bytes` of staging slot s to the peer's slot s, with
    /// the immediate naming them and the slot's epoch, at priority p.
    [[nodiscard]] virtual status send_slot(message_kind k, std::uint32_t s, std::uint32_t bytes,
                                           sched::priority p, bool epoch) noexcept = 0;
    /// Reads the peer's buffer `remote` into `local`, or writes `local` into
    /// it. `rail_rkeys`: the buffer's keys on the link's rails 1.. (the
    /// request's rail_keys), which a path with rails may cut it across.
    [[nodiscard]] virtual transfer
    move_body(body_way way, sched::priority p, local_buffer<rights::local_write> local,
              const buffer_descriptor& remote, std::uint64_t wr_id,
              std::span<const std::uint32_t> rail_rkeys) noexcept = 0;
    /// Withdraws the transfer started with `wr_id` if it has not begun (then
    /// it never completes); false if it has, is done already, or is unknown.
    [[nodiscard]] virtual bool cancel(std::uint64_t wr_id) noexcept = 0;
    /// What happened since the last poll: immediates, ended transfers, fenced
    /// calls. `thorough`: also reap what could wait (housekeeping, or
    /// transfers the endpoint awaits). -1: the peer corrupted the connection.
    [[nodiscard]] virtual int poll(std::span<link_event> out, bool thorough) noexcept = 0;
    /// Why the link ended, if it did, as `what` asks (look::cause: always an answer).
    [[nodiscard]] virtual std::optional<link_end> ended(look what) noexcept = 0;
    /// About to sleep (`going`): asks the peer to wake this side, and says
    /// false when something came already (do not sleep). Awake again
    /// (!going): the peer need not wake it any more.
    [[nodiscard]] virtual bool sleep(bool going) noexcept = 0;
    /// Starts closing the connection (the peer sees it go).
    virtual void close() noexcept = 0;
    /// The handshake is over; `by_traffic`: the peer's first message came,
    /// which proves it (a server accepts without waiting for it).
    [[nodiscard]] virtual bool established(bool by_traffic) noexcept = 0;
    /// Makes the call in `slot` reachable from the peer's side: `r.body`
    /// (its request, when over the slot; else empty), `r.reply` (the
    /// caller's reply buffer, or empty), or a dma-buf range instead of either
    /// (which only a path through a device reaches without the CPU: the
    /// others answer unreachable). Fills their descriptors (where the peer
    /// finds them, the key, the length; key 0 where none is needed). On any
    /// answer but ok, nothing was exposed.
    [[nodiscard]] virtual access grant_access(std::uint32_t slot, const call_ranges& r,
                                              buffer_descriptor& body,
                                              buffer_descriptor& reply) noexcept = 0;
    /// The call in `slot` ended (or never went): the peer loses what
    /// grant_access gave it, as `how` says. False only for a fence that was
    /// not posted: then end it `now`.
    virtual bool end_access(std::uint32_t slot, access_end how) noexcept = 0;

    /// Beside the ten (a plain function, as for the counters): holds this
    /// side's doorbell (`on`), so that what send_slot sends waits, queued,
    /// for the next doorbell, at the latest the hold's end (false), which
    /// rings it. False where the link does not hold (the node-local path:
    /// no doorbell to save).
    bool hold_doorbell(bool on) noexcept { return hold_of_ != nullptr && hold_of_(this, on); }

    /// Beside the ten too, where the link has other rails (rdma_link):
    /// what grant_access showed of slot's call on them (false: nothing, the
    /// request carries no rail_keys).
    [[nodiscard]] bool rail_keys_of(std::uint32_t slot, rail_keys& out) const noexcept {
        return rails_of_ != nullptr && rails_of_->keys(this, slot, out);
    }
    /// Takes out the rails whose queue pair failed or whose peer closed
    /// them (housekeeping's; a system call or two per rail).
    void tend_rails() noexcept {
        if (rails_of_ != nullptr)
            rails_of_->tend(this);
    }
    /// Counts the rails that joined (0 without): a request's rail keys name
    /// the windows of the rails joined when it came, and a rail that joined
    /// since is another queue pair, which they do not reach.
    [[nodiscard]] std::uint32_t rail_epoch() const noexcept {
        return rails_of_ != nullptr ? rails_of_->epoch(this) : 0;
    }

    /// The connection failed, the peer left, or it broke the protocol: no
    /// more posts; the endpoint tears it down.
    bool broken = false;
    /// The peer's incarnation, as its handshake said (ring_offer::incarnation).
    std::uint64_t peer_incarnation = 0;
    /// A client's link through the device: the key its other rails join it
    /// with (the server's ring_offer::first_call; 0: the server takes none).
    std::uint64_t join_key = 0;

protected:
    /// grant_access for a path that reaches host memory only: r's buffers
    /// described at their addresses with key 0; unreachable for a dma-buf range.
    [[nodiscard]] static access describe_host(const call_ranges& r, buffer_descriptor& body,
                                              buffer_descriptor& reply) noexcept {
        body = {};
        reply = {};
        if (r.dev_body != nullptr || r.dev_reply != nullptr)
            return access::unreachable;
        if (!r.body.empty())
            body = {reinterpret_cast<std::uint64_t>(r.body.data()), 0,
                    static_cast<std::uint32_t>(std::min<std::size_t>(r.body.size(), UINT32_MAX))};
        if (!r.reply.empty())
            reply = {reinterpret_cast<std::uint64_t>(r.reply.data()), 0,
                     static_cast<std::uint32_t>(std::min<std::size_t>(r.reply.size(), UINT32_MAX))};
        return access::ok;
    }
    /// The geometry granted (at most what this side built its rings for).
    void grant(std::uint16_t slots, std::uint32_t slot_bytes) noexcept {
        slots_ = slots;
        slot_bytes_ = slot_bytes;
    }
    void lay_out(std::byte* in_slots, std::byte* out_slots) noexcept {
        in_slots_ = in_slots;
        out_slots_ = out_slots;
    }
    void set_fds(int event_fd, int wake_fd) noexcept {
        event_fd_ = event_fd;
        wake_fd_ = wake_fd;
    }
    void set_qp_num(std::uint32_t qp_num) noexcept { qp_num_ = qp_num; }
    /// How scheduler_counters() reads them (a plain function: no virtual for it).
    void set_counters_of(sched::scheduler_counters (*of)(const link*)) noexcept {
        counters_of_ = of;
    }
    /// How hold_doorbell() holds, where the link does.
    void set_hold_of(bool (*of)(link*, bool) noexcept) noexcept { hold_of_ = of; }
    /// The rail operations, where the link has rails.
    struct rail_ops {
        bool (*keys)(const link*, std::uint32_t slot, rail_keys& out) noexcept;
        void (*tend)(link*) noexcept;
        std::uint32_t (*epoch)(const link*) noexcept;
    };
    void set_rails_of(const rail_ops* of) noexcept { rails_of_ = of; }

private:
    std::uint16_t slots_;
    std::uint32_t slot_bytes_;
    rpc::transport kind_;
    std::byte* in_slots_ = nullptr;
    std::byte* out_slots_ = nullptr;
    int event_fd_ = -1;
    int wake_fd_ = -1;
    std::uint32_t qp_num_ = 0;
    sched::scheduler_counters (*counters_of_)(const link*) = nullptr;
    bool (*hold_of_)(link*, bool) noexcept = nullptr;
    const rail_ops* rails_of_ = nullptr;
};

} // namespace rdmax::rpc::detail
