#pragma once
// rdma_link: an RPC connection through the RDMA device. Its queue pair and
// the priority scheduler that posts on it, this side's ring (the peer writes
// into it, under a key that covers that ring alone), this side's staging
// slots (what it writes from), and the peer's ring.
//
// On a client it also owns what a call shows the server of the caller's
// memory: the registration cache's handles of a large body and a reply
// buffer, and, where the device has type-2 memory windows, two windows per
// slot bound over exactly those bytes for the call's life (docs/rpc.md).
//
// Rails (issue 31): a link may have up to three more connections to the
// same peer, each from another device of this host to one of the peer's
// (rail_join). They carry no messages, only pieces of large bodies: the
// server cuts a call's READ and reply WRITE across them with a striper
// (its pieces re-posted on the rails left when one fails); the client
// shows the call's buffers on each rail through windows of that rail's own.
// Rail 0 is the link's own connection: when it goes, the link goes.

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include <rdmax/detail/rpc/arena_block.hpp>
#include <rdmax/detail/rpc/inbox.hpp>
#include <rdmax/detail/rpc/link.hpp>
#include <rdmax/detail/rpc/window_set.hpp>
#include <rdmax/detail/rpc/wire.hpp>
#include <rdmax/mem/dmabuf_cache.hpp>
#include <rdmax/mem/handle_issuer.hpp>
#include <rdmax/mem/remote_handle.hpp>
#include <rdmax/mem/verbs_cache.hpp>
#include <rdmax/sched/basic_striper.hpp>
#include <rdmax/sched/priority_scheduler.hpp>
#include <rdmax/verbs/connection.hpp>

namespace rdmax::detail {
/// Test seams of rdma_link (tests/rxe/test_rpc.cpp); null in production.
struct rdma_link_hooks {
    /// Replaces ibv_alloc_mw (a device out of windows).
    ibv_mw* (*alloc_mw)(ibv_pd* pd, ibv_mw_type type) = nullptr;
    /// Asked before an invalidation is staged (unsignaled, or a fence's):
    /// true refuses it, as a full send queue would.
    bool (*refuse_invalidate)() = nullptr;
};
[[nodiscard]] rdma_link_hooks& rdma_link_test_hooks() noexcept;
} // namespace rdmax::detail

namespace rdmax::rpc::detail {

/// What a client's link needs to expose its calls' buffers: the cache that
/// registers them (made at the first use) and the counters windows count in.
struct call_memory {
    verbs_cache& (*cache)(void* owner) = nullptr;
    void* owner = nullptr;
    rpc_counters* counters = nullptr;
};

/// What a rail that joins a link brings besides its connection.
struct rail_context {
    /// Registers memory on the rail's device: the client's calls' buffers,
    /// the server's body blocks. The endpoint's; outlives the link.
    verbs_cache* cache = nullptr;
    double gbps = 0; ///< the rail's line rate (its weight before it measured one)
    /// A server's: striped_bodies and rail_bytes are counted there.
    rpc_counters* counters = nullptr;
    /// How bodies are cut (RDMAX_STRIPE_*): from stripe_min bytes, in chunks.
    sched::stripe_options stripe = {};
    /// This side's rail (in its rail_set) the connection is on: its port's
    /// state is watched (ports_down()).
    std::uint32_t device = 0;
};

class rdma_link final : public link {
public:
    /// This side's ring and staging slots for `slots` x `slot_bytes`, and the
    /// key (a registration of the ring alone, remote write only) the peer gets.
    rdma_link(registered_arena& arena, handle_issuer& issuer, std::uint16_t slots,
              std::uint32_t slot_bytes);
    /// Scheduler, then windows and queue pair (no more DMA), then the ring's
    /// key, then the memory; the calls' registrations last (a registration
    /// with a window bound to it cannot go before the window).
    ~rdma_link() override;

    /// What the peer needs to write into this side's ring.
    [[nodiscard]] ring_offer offer() const noexcept;
    /// The connection is up: the peer's ring (already checked against the
    /// geometry) and the scheduler over the queue pair.
    void attach(verbs::connection conn, const ring_offer& peer,
                const sched::scheduler_options& opts);
    /// A client's link: its calls' bodies and reply buffers are registered
    /// through `memory`, and shown through windows if `windows` (the device
    /// has type 2). False if windows were wanted and none could be had: the
    /// registrations' own keys are shown then.
    bool serve_calls(const call_memory& memory, bool windows);
    [[nodiscard]] bool has_windows() const noexcept { return !wins_[0].empty(); }

    [[nodiscard]] status send_slot(message_kind k, std::uint32_t s, std::uint32_t bytes,
                                   sched::priority p, bool epoch) noexcept override;
    /// A body of stripe_min bytes or more with keys on the link's other
    /// rails goes through the striper, cut across rail 0 and the rails up.
    [[nodiscard]] transfer move_body(body_way way, sched::priority p,
                                     local_buffer<rights::local_write> local,
                                     const buffer_descriptor& remote, std::uint64_t wr_id,
                                     std::span<const std::uint32_t> rail_rkeys) noexcept override;
    [[nodiscard]] bool cancel(std::uint64_t wr_id) noexcept override;
    /// The scheduler's completions (failures of unsignaled work, and the
    /// signaled READs and WRITEs), and fences that ended. Unless `thorough`,
    /// only when the scheduler has work to post or enough in flight that
    /// its budget wants completions reaped: the rest can wait for
    /// housekeeping, and the poll loop stays short (what a call waits for is
    /// the receive side, which comes through the endpoint's queue).
    [[nodiscard]] int poll(std::span<link_event> out, bool thorough) noexcept override;
    [[nodiscard]] std::optional<link_end> ended(look what) noexcept override;
    /// Work queued behind the byte budget moves on only when a send
    /// completion frees room: arm the send queue, so that its next completion
    /// wakes the endpoint (the caller polls once more after this).
    [[nodiscard]] bool sleep(bool going) noexcept override;
    void close() noexcept override { conn_->disconnect(std::chrono::milliseconds(0)); }
    [[nodiscard]] bool established(bool by_traffic) noexcept override;
    [[nodiscard]] access grant_access(std::uint32_t slot, const call_ranges& r,
                                      buffer_descriptor& body,
                                      buffer_descriptor& reply) noexcept override;
    bool end_access(std::uint32_t slot, access_end how) noexcept override;

    // ---- rails ----

    /// Rail k (1 .. max_link_rails - 1) joins over `conn`, a connection to
    /// the peer's rail k, which it takes. False, `conn` untouched, while the
    /// rail is still joined (it goes first: rail_lost) or its old pieces are
    /// still out: try again later. Throws rdmax::error for a k out of range
    /// or a link that takes no rails.
    bool join_rail(std::uint32_t k, verbs::connection&& conn, const rail_context& ctx,
                   const sched::scheduler_options& opts);
    /// Rail k is out now (its queue pair failed, its port went down, the
    /// peer closed it): nothing more goes to it, its windows die.
    void rail_lost(std::uint32_t k) noexcept;
    [[nodiscard]] bool rail_up(std::uint32_t k) const noexcept {
        return k < max_link_rails && rails_[k].up;
    }
    /// Takes out the rails whose queue pair failed or whose peer closed
    /// them (a look at their connections' events): link::tend_rails.
    void tend() noexcept;
    /// link::rail_keys_of.
    [[nodiscard]] bool keys_of(std::uint32_t slot, rail_keys& out) const noexcept;
    /// The rails on this side's rails in `down` (bit d: rail d of its
    /// rail_set, whose port is not ACTIVE) are lost: their queue pairs go
    /// to the error state, and their pieces come back flushed at once
    /// rather than after their retries (soft-RoCE may never end them).
    void ports_down(std::uint8_t down) noexcept;
    /// The rails a call's keys cover now: rail 0 and those up from 1 in a
    /// row (1: no rail but the link's own).
    [[nodiscard]] std::uint32_t keyed_rails() const noexcept;
    /// The striper's counters (a server's link with rails), else nullopt.
    [[nodiscard]] std::optional<sched::striper_counters> striper_counters() const noexcept {
        return striper_ ? std::optional(striper_->counters()) : std::nullopt;
    }

private:
    /// hold_doorbell: the requests send_slot sends while held are deferred
    /// in the scheduler (request_flags::deferred); the hold's end flushes them.
    bool hold(bool on) noexcept;
    using handle = verbs_cache::handle;
    static constexpr std::uint8_t all_rails = (1U << max_link_rails) - 1;
    /// What slot s's call shows the peer: on each rail k of `windows`, that
    /// rail's windows 2s (the body) and 2s + 1 (the reply buffer), over the
    /// rail's registrations. The registrations are kept until the slot's next
    /// call once the windows are revoked (one with a window bound cannot be
    /// deregistered, and the revocation is only posted) or until their fence
    /// completed.
    ///
    /// A dma-buf range is shown by a registration's own key: the kernel
    /// registers dma-bufs without IB_ACCESS_MW_BIND (every device: the uAPI
    /// refuses the flag), so no window can be bound over one. So that the key
    /// still shows exactly the call's bytes with exactly the rights it needs,
    /// and dies with the call, each range is registered on its own for the
    /// call (dmabuf_cache::register_exact: never merged, never shared) and
    /// deregistered when the call ends, before its result is handed out. It
    /// goes over rail 0 alone.
    struct call_access {
        std::array<handle, max_link_rails> body; ///< per rail
        std::array<handle, max_link_rails> reply;
        ibv_mr* dev_body = nullptr; ///< exact registrations, this call's alone
        ibv_mr* dev_reply = nullptr;
        rail_keys keys{};         ///< rails 1..: what the request says (keys.rails 0: none)
        std::uint8_t windows = 0; ///< rails whose windows are bound for this call (bit k)
        std::uint8_t fencing = 0; ///< rails whose fence of them is awaited
        bool fenced = false;      ///< ended with a fence: handed out once `fencing` is 0
        call_access() = default;
        call_access(call_access&& o) noexcept
            : body(std::move(o.body))
            , reply(std::move(o.reply))
            , dev_body(std::exchange(o.dev_body, nullptr))
            , dev_reply(std::exchange(o.dev_reply, nullptr))
            , keys(o.keys)
            , windows(o.windows)
            , fencing(o.fencing)
            , fenced(o.fenced) {}
        call_access(const call_access&) = delete;
        call_access& operator=(const call_access&) = delete;
        call_access& operator=(call_access&&) = delete;
        ~call_access() { drop_dmabufs(); }
        [[nodiscard]] bool shown() const noexcept { return body[0] || reply[0]; }
        /// The dma-buf ranges' keys die now (nothing is bound to them).
        void drop_dmabufs() noexcept {
            for (ibv_mr** mr : {&dev_body, &dev_reply})
                if (*mr != nullptr)
                    (void)ibv_dereg_mr(std::exchange(*mr, nullptr));
        }
        void release() noexcept {
            for (handle& h : body)
                h.reset();
            for (handle& h : reply)
                h.reset();
            keys = {};
            drop_dmabufs();
        }
    };
    /// One of the link's other connections (rails_[0] is unused: rail 0 is
    /// conn_ and sched_).
    struct rail_link {
        std::optional<verbs::connection> conn;
        std::optional<sched::priority_scheduler<>> sched;
        verbs_cache* cache = nullptr;
        std::uint32_t device = 0; ///< rail_context::device
        bool up = false;
    };
    /// A striped body's registrations of its block on rails 1.., held until
    /// the transfer completes.
    struct striped_body {
        std::uint64_t wr_id = 0;
        std::uint64_t write_seq = 0; ///< a WRITE's number (0: a READ)
        bool busy = false;
        std::array<handle, max_link_rails - 1> keep;
    };
    /// A reply whose header waits for its body's striped WRITE: the pieces
    /// go on other queue pairs, which keep no order with rail 0's send
    /// queue, and the header tells the peer its reply landed.
    struct held_reply {
        std::uint32_t slot = 0;
        std::uint32_t bytes = 0;
        sched::priority p{};
        bool epoch = false;
        std::uint32_t body = 0;      ///< its WRITE's striped_ entry
        std::uint64_t write_seq = 0; ///< and that WRITE's number (the entry may be reused)
    };
    using striper = sched::basic_striper<sched::priority_scheduler<>>;

    /// grant_access: registers, binds, describes.
    [[nodiscard]] access grant_call(std::uint32_t slot, const call_ranges& r,
                                    buffer_descriptor& body, buffer_descriptor& reply) noexcept;
    /// Shows the call on rails 1.. as well (a body or reply buffer large
    /// enough to be cut): the keys go into a.keys. A rail that cannot ends
    /// the keys there; rail 0 alone is always enough.
    void grant_rails(std::uint32_t slot, call_access& a, const call_ranges& r,
                     const buffer_descriptor& body, const buffer_descriptor& reply) noexcept;

    [[nodiscard]] bool needs_progress() const noexcept {
        return sched_->queued() || sched_->in_flight() * 2 >= sched_->options().budget_wqes ||
               (striper_ && striper_->pending()) || windows_busy();
    }
    [[nodiscard]] bool has_outstanding() const noexcept {
        return sched_->outstanding() != 0 || (striper_ && striper_->pending()) || windows_busy();
    }
    /// A rail's windows' binds and invalidations (unsignaled, posted beside
    /// the scheduler) hold half its send queue, a fence is awaited, or an
    /// invalidation is owed: reap now, or calls would wait for housekeeping
    /// to give their slots back.
    [[nodiscard]] bool windows_busy() const noexcept {
        if (fencing_calls_ != 0)
            return true;
        for (const window_set& w : wins_)
            if (w.low() || w.owed() != 0)
                return true;
        return false;
    }
    [[nodiscard]] link_end why_ended() const noexcept;
    /// Posts the deferred requests before a request posted beside the
    /// scheduler (an invalidation, a window deallocated): what fences a
    /// call's buffers never overtakes the header that names them.
    void ring_before_direct() noexcept {
        if (held_ && sched_->queued())
            sched_->flush();
    }
    /// The rail's scheduler, rail 0's included.
    [[nodiscard]] sched::priority_scheduler<>* sched_of(std::uint32_t k) noexcept {
        return k == 0 ? &*sched_ : rails_[k].sched ? &*rails_[k].sched : nullptr;
    }

    // Windows (rdma_windows.cpp).
    bool enable_windows() noexcept;
    /// Registers the call's memory through the caches (false: one would not).
    bool register_call(call_access& a, const call_ranges& r, bool windows) noexcept;
    /// Binds windows over the call's rail-k registrations (one doorbell)
    /// and gives their keys; false if the binds could not be posted.
    bool bind_call(std::uint32_t k, std::uint32_t slot, call_access& a, buffer_descriptor& body,
                   buffer_descriptor& reply) noexcept;
    /// end_access(fence): a signaled invalidation of the call's windows on
    /// each rail it is bound on (false: rail 0's could not be posted).
    bool fence_call(std::uint32_t slot, call_access& a) noexcept;
    /// Rail k's last binds ran (their signaled completion came): a rail's
    /// queue pair keeps no order with rail 0's, whose request names their
    /// keys, so the request waits for it (briefly: false if not in time).
    [[nodiscard]] bool binds_ran(std::uint32_t k) noexcept;
    /// Deallocates windows 2s, 2s + 1 of every rail in `rails` now,
    /// counted; a link whose rail 0 has none left says so once.
    void revoke_now(std::uint32_t slot, std::uint8_t rails) noexcept;
    /// Counts (once) a link that gave its windows up for want of a replacement.
    void windows_lost() noexcept;
    /// Rail k's fence of slot s's windows is over (completed, or moot): the
    /// call is handed out once no rail's is awaited.
    void fence_over(std::uint32_t k, std::uint32_t slot) noexcept;
    /// Hands out the calls whose fences ended.
    int take_fenced(std::span<link_event> out) noexcept;
    /// The schedulers' foreign completions: a fence's.
    static void on_window_completion(void* self, const verbs::completion& c) noexcept;

    // Rails (rdma_link.cpp).
    /// Rail k's pieces of striped bodies, polled through the striper.
    int poll_striped(std::span<verbs::completion> out) noexcept;
    /// l's keys on rails 1.. for as many rails as rail_rkeys and this
    /// side's caches key (registrations held in b): the rails keyed, 1 on.
    std::uint32_t key_block(striped_body& b, rail_local<rights::local_write>& l,
                            std::span<const std::uint32_t> rail_rkeys) noexcept;
    /// Striped body b is over (completed, withdrawn, or never started):
    /// its registrations go and the entry is free.
    static void free_striped(striped_body& b) noexcept {
        b.busy = false;
        for (handle& h : b.keep)
            h.reset();
    }
    /// Posts the held replies whose WRITEs all completed.
    void release_replies() noexcept;
    /// send_slot on rail 0, now.
    [[nodiscard]] status post_slot(message_kind k, std::uint32_t s, std::uint32_t bytes,
                                   sched::priority p, bool epoch) noexcept;
    [[nodiscard]] transfer move_striped(body_way way, sched::priority p,
                                        local_buffer<rights::local_write> local,
                                        const buffer_descriptor& remote, std::uint64_t wr_id,
                                        std::span<const std::uint32_t> rail_rkeys) noexcept;

    handle_issuer* issuer_;
    arena_block ring_;
    arena_block staging_;
    remote_handle key_;
    remote_buffer<rights::remote_write> peer_ring_{};
    std::vector<call_access> calls_; ///< per slot; a client's link only
    call_memory memory_;
    bool windows_wanted_ = false; ///< windows were had (counted once if lost)
    std::optional<verbs::connection> conn_;
    std::optional<sched::priority_scheduler<>> sched_;
    std::array<rail_link, max_link_rails> rails_;
    std::optional<striper> striper_;        ///< a server's, once a rail joined
    std::vector<striped_body> striped_;     ///< a server's, 2 per slot
    std::uint64_t stripe_min_ = 256 * 1024; ///< bodies cut across the rails from here
    rpc_counters* rail_counters_ = nullptr; ///< a server's (rail_context::counters)
    std::uint64_t write_seq_ = 0;           ///< striped WRITEs started
    std::uint32_t joins_ = 0;               ///< rails joined (link::rail_epoch)
    /// The striped WRITE move_body just started, whose reply header is the
    /// next reply send_slot sends (the server posts them so: a call's
    /// body, then its header); none: striped_.size().
    std::size_t last_write_ = SIZE_MAX;
    std::vector<held_reply> held_replies_;        ///< a server's, one per slot at most
    std::uint64_t rail_bytes_seen_ = 0;           ///< the striper's rails 1.. bytes, counted
    std::array<window_set, max_link_rails> wins_; ///< per rail: 2 per slot, or none
    std::vector<std::uint32_t> ready_;            ///< slots whose fences all ended, not yet taken
    std::uint32_t fencing_calls_ = 0;             ///< calls_ fencing
    std::uint8_t windowed_ = 0; ///< rails whose windows were allocated (their loss is looked for)
    std::array<std::uint32_t, max_link_rails> binds_asked_{}; ///< per rail: signaled binds posted
    std::array<std::uint32_t, max_link_rails> binds_seen_{};  ///< and those whose completion came
    const verbs::queue_pair<verbs::rc>* qp_ = nullptr;        ///< conn_'s, once attached
    bool held_ = false; ///< hold_doorbell: send_slot defers its requests
};

/// The queue pair configuration of an RPC connection on `in`'s queues, its
/// send queue's events on `in`'s channel.
/// `windows`: room for the type-2 windows' own requests too (a client on a
/// device that has them: 2 binds and 2 invalidations per slot may be queued
/// beside the scheduler's work); clamped to the device's limits.
[[nodiscard]] verbs::qp_config link_qp_config(inbox& in, std::uint16_t slots,
                                              const verbs::device_limits& limits, bool windows);

/// The queue pair configuration of a link's other rail: no receives, its
/// own completion queues (on the rail's device), room for the pieces of
/// striped bodies (a server's) or for `windows`' requests (a client's).
[[nodiscard]] verbs::qp_config rail_qp_config(std::uint16_t slots,
                                              const verbs::device_limits& limits, bool windows);

} // namespace rdmax::rpc::detail
