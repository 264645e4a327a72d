#pragma once
// link_wire: what an RPC endpoint needs of one connection, whichever way the
// bytes go: through the RDMA device (peer_link: rings written with
// write-with-immediate, the immediates arriving on the endpoint's completion
// queue) or through the node's memory when both ends are on one node
// (local_link: the rings in a shared segment, the immediates in a message
// ring, large bodies by CMA). Server and client hold one per peer.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include <rdmax/local/spsc_ring.hpp>
#include <rdmax/mem/buffer.hpp>
#include <rdmax/mem/rights.hpp>
#include <rdmax/rpc/rpc_counters.hpp>
#include <rdmax/rpc/wire.hpp>
#include <rdmax/sched/priority.hpp>
#include <rdmax/sched/scheduler_options.hpp>
#include <rdmax/status.hpp>
#include <rdmax/verbs/completion.hpp>

namespace rdmax::rpc {

/// How a body transfer went: finished already (local), under way (its
/// completion comes from poll_transfers), or refused (nothing moved).
enum class transfer : std::uint8_t { done, started, failed };

class link_wire {
public:
    link_wire(std::uint16_t slots, std::uint32_t slot_bytes) noexcept
        : slots_(slots)
        , slot_bytes_(slot_bytes) {}
    link_wire(const link_wire&) = delete;
    link_wire& operator=(const link_wire&) = delete;
    virtual ~link_wire() = default;

    [[nodiscard]] std::uint16_t slots() const noexcept { return slots_; }
    [[nodiscard]] std::uint32_t slot_bytes() const noexcept { return slot_bytes_; }

    /// This side's slot s, as the peer wrote it (`bytes` from the immediate).
    [[nodiscard]] virtual std::span<const std::byte>
    inbound(std::uint32_t s, std::uint32_t bytes) const noexcept = 0;
    /// Where this side builds the message for slot s before send_slot.
    [[nodiscard]] virtual std::byte* staging(std::uint32_t s) const noexcept = 0;
    /// Sends the first `bytes` of staging slot s to the peer's slot s, with
    /// the immediate naming them and the slot's epoch, at priority p.
    [[nodiscard]] virtual status send_slot(message_kind k, std::uint32_t s, std::uint32_t bytes,
                                           sched::priority p, bool epoch) noexcept = 0;
    /// Reads `dst.length` bytes of the peer's buffer `src` into `dst`.
    [[nodiscard]] virtual transfer read_body(sched::priority p,
                                             local_buffer<rights::local_write> dst,
                                             const buffer_descriptor& src,
                                             std::uint64_t wr_id) noexcept = 0;
    /// Writes `src` into the peer's buffer `dst`.
    [[nodiscard]] virtual transfer write_body(sched::priority p,
                                              local_buffer<rights::local_write> src,
                                              const buffer_descriptor& dst,
                                              std::uint64_t wr_id) noexcept = 0;
    /// Withdraws the transfer started with `wr_id` if it has not reached the
    /// device yet (then it never completes); false if it has, or is unknown.
    [[nodiscard]] virtual bool cancel(std::uint64_t wr_id) noexcept {
        (void)wr_id;
        return false;
    }
    /// Completions of transfers that started, and failures.
    [[nodiscard]] virtual int poll_transfers(std::span<verbs::completion> out) noexcept = 0;
    /// Something to do at the next poll (queued work, completions to reap).
    [[nodiscard]] virtual bool needs_progress() const noexcept = 0;
    [[nodiscard]] virtual bool has_outstanding() const noexcept = 0;
    /// The link failed under this side (an error completion, a corrupt ring).
    [[nodiscard]] virtual bool failed() const noexcept = 0;
    /// Why it ended, when a work completion (retry exceeded, remote
    /// access...) or a connection event says; nothing said by default.
    [[nodiscard]] virtual link_end why_ended() const noexcept { return {}; }
    /// The counters of the connection's priority scheduler (its budget, as
    /// measured, and slices); nullopt where there is none (node-local links).
    [[nodiscard]] virtual std::optional<sched::scheduler_counters>
    scheduler_counters() const noexcept {
        return std::nullopt;
    }
    /// The peer left (reads connection events: housekeeping only).
    [[nodiscard]] virtual bool peer_gone() noexcept = 0;
    /// Readable when a connection event may be waiting (for the endpoint's epoll).
    [[nodiscard]] virtual int event_fd() const noexcept = 0;
    /// The handshake is over (a server accepts without waiting for it).
    [[nodiscard]] virtual bool established() noexcept { return true; }
    /// The peer's first message arrived: the connection is up.
    virtual void established_by_traffic() noexcept {}
    /// The next immediate from the peer, where they do not come through the
    /// endpoint's completion queue (local links).
    [[nodiscard]] virtual local::ring_status next_imm(std::uint32_t& imm) noexcept {
        (void)imm;
        return local::ring_status::empty;
    }
    /// Hands up to `most` waiting immediates from next_imm() to on_imm, a
    /// few at a time so that no peer holds the others; stops when the link
    /// breaks. False if the peer's ring was found corrupt.
    template <class OnImm>
    [[nodiscard]] bool drain_imms(OnImm&& on_imm, int most = 32) noexcept {
        std::uint32_t imm = 0;
        for (int k = 0; k < most && !broken; ++k) {
            const local::ring_status st = next_imm(imm);
            if (st == local::ring_status::empty)
                break;
            if (st != local::ring_status::ok)
                return false;
            on_imm(imm);
        }
        return true;
    }
    /// Readable when the peer woke this side (local links: their messages
    /// have no completion channel); -1 where the endpoint's channel does it.
    [[nodiscard]] virtual int wake_fd() const noexcept { return -1; }
    /// About to sleep: asks the peer to wake this side, and says false when
    /// something already arrived (then do not sleep).
    [[nodiscard]] virtual bool prepare_sleep() noexcept { return true; }
    /// Awake again: the peer need not wake this side any more.
    virtual void woke() noexcept {}
    /// Starts closing the connection (the peer sees it go).
    virtual void close() noexcept = 0;
    /// What expose() binds: exactly [addr, addr + len) of the registration
    /// `mr`, with `r` (remote read or write), through window `window` (2 per
    /// slot: 2s the request body, 2s + 1 the reply buffer); the fresh key
    /// comes back in `rkey`.
    struct exposure {
        std::uint32_t window = 0;
        void* mr = nullptr;
        std::uint64_t addr = 0;
        std::uint64_t len = 0;
        rights r = rights::remote_read;
        std::uint32_t rkey = 0;
    };
    /// Binds every exposure (one doorbell). False where the link has no
    /// windows (node-local, or a device without type 2) or the binds cannot
    /// be posted: then nothing was exposed.
    [[nodiscard]] virtual bool expose(std::span<exposure> e) noexcept {
        (void)e;
        return false;
    }
    /// expose() binds windows (else large bodies go under registrations' keys).
    [[nodiscard]] virtual bool has_windows() const noexcept { return false; }
    /// Ends what expose() gave windows [first, first + count) (one doorbell):
    /// from the time this executes, the peer's use of their keys fails (and
    /// breaks the connection).
    virtual void revoke(std::uint32_t first, std::uint32_t count) noexcept {
        (void)first, (void)count;
    }
    /// Ends what expose() gave windows [first, first + count) with an
    /// invalidation whose completion is asked for: true if it was posted,
    /// and take_fenced() names `first` once it completed (from then on the
    /// peer's keys are dead); false if nothing was posted (no windows bound,
    /// the queue pair full or failed): revoke_now() them instead. Only for a
    /// call whose request ran (its binds ran before it).
    [[nodiscard]] virtual bool fence(std::uint32_t first, std::uint32_t count) noexcept {
        (void)first, (void)count;
        return false;
    }
    /// The `first` of fence()s whose invalidation completed, up to
    /// out.size() of them. One that failed is never named: the queue pair
    /// failed with it (failed() says so), and the windows are revoke_now()'s.
    [[nodiscard]] virtual std::size_t take_fenced(std::span<std::uint32_t> out) noexcept {
        (void)out;
        return 0;
    }
    /// No invalidation of windows [first, first + count) is still owed (one
    /// revoke() could not queue): they may be bound again. Tries to post it.
    [[nodiscard]] virtual bool settled(std::uint32_t first, std::uint32_t count) noexcept {
        (void)first, (void)count;
        return true;
    }
    /// As revoke(), but done when it returns: the windows are deallocated
    /// (a verbs call, not queued behind the send queue) and fresh ones take
    /// their place. For a call that timed out, whose caller takes its
    /// buffers back at once.
    virtual void revoke_now(std::uint32_t first, std::uint32_t count) noexcept {
        (void)first, (void)count;
    }
    [[nodiscard]] virtual bool is_local() const noexcept { return false; }
    /// A large body needs a registration the peer can use (RDMA), or none (CMA).
    [[nodiscard]] virtual bool needs_registration() const noexcept { return true; }

    /// The connection failed, the peer left, or it broke the protocol: no
    /// more posts; the endpoint tears it down.
    bool broken = false;

protected:
    /// The geometry granted (at most what this side built its rings for).
    void grant(std::uint16_t slots, std::uint32_t slot_bytes) noexcept {
        slots_ = slots;
        slot_bytes_ = slot_bytes;
    }

private:
    std::uint16_t slots_;
    std::uint32_t slot_bytes_;
};

} // namespace rdmax::rpc
