#pragma once
// basic_striper<Scheduler>: one transfer cut across several rails (a NIC
// port each, a queue pair to the peer's matching rail each, and a priority
// scheduler on each), completed once to the caller.
//
// How a transfer is shared: a WRITE or READ of stripe_min bytes or more is
// cut into pieces of `chunk` bytes, and each rail takes the next piece when
// it holds fewer than chunks_ahead of them. A rail that delivers faster asks
// more often, so the rails share a transfer in proportion to what each
// actually delivers (a slow or congested rail takes less), with no rate to
// configure. The last pieces, once what is left would fit in one chunk per
// rail, are cut in proportion to the rails' rates (the scheduler's measured
// rate, or the line rate given at attach() before it measured one), so that
// the rails end together. A shorter transfer goes whole to the least-loaded
// rail (bytes outstanding over rate), where its rail's scheduler gives it its
// priority: an urgent 64-byte write waits for no bulk bytes of its own rail
// beyond the scheduler's budget, and for none of the other rails'.
//
// An urgent lane: a rail may be attached with a second scheduler on a queue
// pair of its own to the same peer. Whole transfers of the most urgent
// levels (stripe_options::lane_levels) go there, and the NIC arbitrates
// between the two queue pairs packet by packet: they wait for a packet of
// the rail's bulk bytes, not for the scheduler's budget of them. That
// budget grows with the host's round over the rails (host_away()), so
// without a lane an urgent write's wait grows with the number of rails
// (docs/bench-multirail-sim.md). A rail with a lane is one rail: if
// either queue pair fails, the rail is out, and it comes back with both.
//
// What is guaranteed:
// - one completion per transfer, with the caller's wr_id, once every piece
//   completed (or on failure, once none of its pieces is in a scheduler):
//   no completion of it, and no DMA by this side's queue pairs, comes after
//   it. A WRITE piece that went again after its rail failed may have sent
//   packets that are still on their way to the peer's end of that rail,
//   whose queue pair did not fail with ours: the peer must take that end
//   down (or see it in error) before it reuses memory such a WRITE wrote
//   (docs/multirail.md);
// - failover: a piece that ends IBV_WC_WR_FLUSH_ERR, RETRY_EXC_ERR or
//   RNR_RETRY_EXC_ERR (or, once per transfer, LOC_QP_OP_ERR: see
//   rail_failure()) failed with its rail, not for its own reason. That
//   rail is taken out, and the piece goes again, whole, on the rails left:
//   RDMA WRITE and READ are idempotent byte by byte (the same bytes land on
//   the same addresses again), and a piece's flush completion means its
//   queue pair, in the error state, moves none of its bytes afterwards. The
//   transfer sees no error while a rail is left. rail_down() takes a rail
//   out at once (a port event, a lost connection): its scheduler fails, its
//   pieces come back flushed, and they go again likewise;
// - with none of its rails left, a transfer fails with the status that took
//   the last one out (a flush if that was another transfer's own failure);
//   any other failure (a key the peer refuses: it would be refused on every
//   rail) fails its transfer once its other pieces settled, and its pieces
//   no scheduler started are withdrawn rather than failed on their rails;
// - a transfer uses only the rails both its buffers have keys for
//   (rail_local::rails, rail_remote::rails);
// - no order between transfers: they run on several queue pairs. A transfer
//   submitted with `fence` starts only once every transfer submitted before
//   it completed, so a READ with fence sees every earlier WRITE;
// - a rail comes back with attach(k, new scheduler) once none of the old
//   one's pieces is out (rail_idle(k)): after a reconnect, a new queue pair.
//
// The rails' schedulers are the caller's: it builds them (one per rail's
// queue pair), keeps them alive while attached, and may submit its own
// requests to them (SENDs, a WRITE_WITH_IMM after a striped WRITE): poll()
// passes their completions on as they are (counted `foreign`). The wr_ids of
// the striper's own pieces have their top byte `piece_tag`: keep it out of
// the caller's.
//
// Progress: the caller's poll() or wait() drives everything. The data path
// is noexcept and allocates nothing: transfers and pieces come from pools
// sized up front. Used by one thread at a time, as its schedulers are.

#include <array>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <boost/intrusive/list.hpp>
#include <boost/intrusive/slist.hpp>

#include <rdmax/mem/rail_buffer.hpp>
#include <rdmax/sched/priority.hpp>
#include <rdmax/sched/request_flags.hpp>
#include <rdmax/sched/stripe_options.hpp>
#include <rdmax/status.hpp>
#include <rdmax/verbs/completion.hpp>

namespace rdmax::sched {

template <class Scheduler>
class basic_striper {
public:
    /// The top byte of the wr_id of every piece the striper posts.
    static constexpr std::uint64_t piece_tag = 0x5fULL << 56;

    explicit basic_striper(stripe_options opts);
    basic_striper(const basic_striper&) = delete;
    basic_striper& operator=(const basic_striper&) = delete;
    ~basic_striper();

    // ---- rails ------------------------------------------------------------------------------

    /// Rail k runs on `s` from now on; `gbps` is its line rate, its weight
    /// until the scheduler measured one. False if k is out of range or
    /// pieces of k's previous scheduler are still out (poll until
    /// rail_idle(k)). A scheduler that failed or is not connected is
    /// attached but not used (rail_up(k) false). `lane`, if given, is the
    /// rail's urgent lane: a scheduler on a second queue pair to the same
    /// peer rail, for whole transfers of a level under lane_levels. False
    /// too if `s` or `lane` is another rail's scheduler or lane, or both
    /// are one.
    bool attach(std::size_t k, Scheduler& s, double gbps, Scheduler* lane = nullptr) noexcept;
    /// Takes rail k out now (its port went down, its connection was lost):
    /// nothing more goes to it, its scheduler fails (its queue pair to the
    /// error state), and its pieces come back flushed and go again on the
    /// other rails.
    void rail_down(std::size_t k) noexcept;
    [[nodiscard]] bool rail_up(std::size_t k) const noexcept {
        return k < max_rails && rails_[k].up;
    }
    /// None of rail k's pieces is out: it may be attached anew.
    [[nodiscard]] bool rail_idle(std::size_t k) const noexcept {
        return k < max_rails && rails_[k].pieces == 0;
    }
    [[nodiscard]] std::size_t rails_up() const noexcept {
        return static_cast<std::size_t>(std::popcount(live_mask()));
    }
    /// The live rail where a request of priority `p` waits least: the
    /// fewest bytes ahead of it (on the wire, or pieces as urgent) for its
    /// rate. Where a whole transfer goes; max_rails when none is up.
    [[nodiscard]] std::size_t least_loaded(priority p = bulk,
                                           std::uint8_t mask = 0xff) const noexcept;
    /// Rail k's weight: its measured rate in MB/s, else its line rate's.
    [[nodiscard]] double weight(std::size_t k) const noexcept;

    // ---- submission -------------------------------------------------------------------------

    /// RDMA write of `src` to dst + dst_offset.
    template <rights L, rights R>
        requires(has(R, rights::remote_write))
    status write(priority p, const rail_local<L>& src, const rail_remote<R>& dst,
                 std::uint64_t dst_offset, std::uint64_t wr_id, request_flags f = {}) noexcept {
        return submit(p, IBV_WR_RDMA_WRITE, src.addr, src.length, src.lkey, dst.addr, dst.length,
                      dst.rkey, std::min(src.rails, dst.rails), dst_offset, wr_id, f);
    }
    /// RDMA read of src + src_offset into `dst`.
    template <rights L, rights R>
        requires(has(L, rights::local_write) && has(R, rights::remote_read))
    status read(priority p, const rail_local<L>& dst, const rail_remote<R>& src,
                std::uint64_t src_offset, std::uint64_t wr_id, request_flags f = {}) noexcept {
        return submit(p, IBV_WR_RDMA_READ, dst.addr, dst.length, dst.lkey, src.addr, src.length,
                      src.rkey, std::min(dst.rails, src.rails), src_offset, wr_id, f);
    }
    /// Withdraws a transfer none of which went to a rail yet: no completion
    /// comes for it. False otherwise (it runs its course).
    bool cancel(std::uint64_t wr_id) noexcept;

    // ---- progress ---------------------------------------------------------------------------

    /// Takes in the rails' completions, hands pieces to rails with room,
    /// and returns finished transfers and foreign completions (at most
    /// out.size(); the rest wait for the next call).
    int poll(std::span<verbs::completion> out) noexcept;
    /// Like poll(), spinning until something finished or `timeout` passed; 0
    /// on timeout, at once when nothing is outstanding.
    int wait(std::span<verbs::completion> out, std::chrono::microseconds timeout) noexcept;
    /// Posts what the rails' schedulers hold deferred.
    void flush() noexcept;

    // ---- state ------------------------------------------------------------------------------

    /// Transfers submitted and not yet finished.
    [[nodiscard]] std::size_t outstanding() const noexcept { return live_; }
    /// Transfers submitted and not yet handed back by poll(): outstanding,
    /// or finished and waiting for room in a poll's `out`.
    [[nodiscard]] bool pending() const noexcept { return live_ != 0 || !done_.empty(); }
    [[nodiscard]] const striper_counters& counters() const noexcept { return counters_; }
    [[nodiscard]] const stripe_options& options() const noexcept { return opts_; }

private:
    using slist_hook = boost::intrusive::slist_base_hook<
        boost::intrusive::link_mode<boost::intrusive::normal_link>>;
    struct order_tag;
    using order_hook = boost::intrusive::list_base_hook<
        boost::intrusive::tag<order_tag>,
        boost::intrusive::link_mode<boost::intrusive::normal_link>>;

    struct transfer;

    /// A piece of a transfer, in a rail's scheduler or waiting to go again.
    struct piece : slist_hook {
        transfer* owner = nullptr;
        std::uint64_t offset = 0; ///< from the transfer's start
        std::uint32_t length = 0;
        std::uint64_t fed = 0; ///< when it went to its rail (the striper's count)
        std::uint8_t rail = 0;
        bool retry = false;   ///< its rail failed under it once
        bool in_rail = false; ///< in a rail's scheduler
        bool in_lane = false; ///< that scheduler is the rail's urgent lane
    };
    using piece_list = boost::intrusive::slist<piece, boost::intrusive::base_hook<slist_hook>,
                                               boost::intrusive::constant_time_size<false>>;

    struct transfer : slist_hook, order_hook {
        ibv_wr_opcode op = IBV_WR_RDMA_WRITE;
        std::byte* local = nullptr;
        std::uint64_t remote_addr = 0;
        std::uint64_t remote_length = 0;
        std::uint64_t remote_offset = 0;
        std::uint64_t length = 0;
        std::array<std::uint32_t, max_rails> lkey{};
        std::array<std::uint32_t, max_rails> rkey{};
        std::uint64_t wr_id = 0;
        std::uint64_t cut = 0;       ///< bytes cut into pieces so far
        std::uint64_t confirmed = 0; ///< bytes of pieces that completed
        std::uint64_t tail_from = 0; ///< bytes left when the last pieces were sized
        double tail_weight = 0;      ///< the live rails' summed weight then
        piece_list again;            ///< pieces back from a failed rail
        std::uint32_t out = 0;       ///< pieces in a scheduler
        ibv_wc_status result = IBV_WC_SUCCESS;
        priority prio{};
        request_flags flags{};
        std::uint8_t mask = 0;         ///< the rails it has keys for
        std::uint8_t loc_qp_rails = 0; ///< rails where a piece ended IBV_WC_LOC_QP_OP_ERR
        bool whole = false;            ///< shorter than stripe_min: one piece
        bool queued = false;           ///< in its level's queue: has bytes to hand out
        bool fed = false;              ///< some piece went to a rail
    };
    using level_queue = boost::intrusive::slist<transfer, boost::intrusive::base_hook<slist_hook>,
                                                boost::intrusive::cache_last<true>,
                                                boost::intrusive::constant_time_size<false>>;
    using order_list = boost::intrusive::list<transfer, boost::intrusive::base_hook<order_hook>,
                                              boost::intrusive::constant_time_size<false>>;

    struct rail {
        Scheduler* s = nullptr;
        Scheduler* lane = nullptr; ///< its urgent lane, if it has one
        double gbps = 0;
        std::uint64_t lane_bytes = 0; ///< of pieces in its lane (in bytes_out too)
        std::uint64_t bytes_out = 0;  ///< of pieces in its scheduler
        std::array<std::uint64_t, priority_levels> bytes_at{}; ///< the same by level
        std::uint32_t pieces = 0;                              ///< pieces in its scheduler
        std::uint32_t striped = 0; ///< of those, striped transfers' (chunks_ahead counts these)
        bool up = false;
    };
    [[nodiscard]] std::uint8_t attached_mask() const noexcept;
    [[nodiscard]] std::size_t attached() const noexcept {
        return static_cast<std::size_t>(std::popcount(attached_mask()));
    }
    static constexpr std::uint64_t tag_mask = 0xffULL << 56;
    /// The wr_id a piece is posted with: the tag and its index in the pool.
    [[nodiscard]] std::uint64_t id_of(const piece& pc) const noexcept {
        return piece_tag | static_cast<std::uint64_t>(&pc - pieces_.data());
    }

    status submit(priority p, ibv_wr_opcode op, std::byte* local, std::uint64_t local_length,
                  const std::array<std::uint32_t, max_rails>& lkey, std::uint64_t remote_addr,
                  std::uint64_t remote_length, const std::array<std::uint32_t, max_rails>& rkey,
                  std::uint32_t keyed_rails, std::uint64_t remote_offset, std::uint64_t wr_id,
                  request_flags f) noexcept;

    /// Hands pieces to rails with room, most urgent transfers first.
    void feed() noexcept;
    /// The most urgent transfer with a piece to hand out, among the whole
    /// ones or the striped ones that may use rail k (max_rails: any).
    transfer* next_transfer(bool whole, std::size_t k) noexcept;
    /// The next piece of `t` for rail k (one back from a failed rail first);
    /// nullptr when the pool is empty.
    piece* take_piece(transfer& t, std::size_t k) noexcept;
    /// How long the piece of `t` cut next for rail k is.
    [[nodiscard]] std::uint64_t cut_length(transfer& t, std::size_t k) noexcept;
    /// Submits `pc` to rail k's scheduler. False (the piece back in its
    /// transfer's `again`) if the scheduler had no room or failed.
    bool send_piece(piece& pc, std::size_t k) noexcept;
    /// `t` goes by a rail's urgent lane where rail k has one.
    [[nodiscard]] bool lane_transfer(const transfer& t) const noexcept {
        return t.whole && t.prio.level < opts_.lane_levels;
    }
    /// The scheduler `pc` is in.
    [[nodiscard]] Scheduler& scheduler_of(const piece& pc) const noexcept {
        return pc.in_lane ? *rails_[pc.rail].lane : *rails_[pc.rail].s;
    }
    /// `f` on each of rail r's schedulers: its own, then its lane's.
    template <class F>
    static void each_queue_pair(const rail& r, F&& f) {
        if (r.s != nullptr)
            f(*r.s);
        if (r.lane != nullptr)
            f(*r.lane);
    }
    /// Rail j out if its scheduler or lane failed (both queue pairs failed then).
    void take_out_if_failed(std::size_t j) noexcept;
    /// Rail j's scheduler or lane that failed, if any.
    [[nodiscard]] Scheduler* failed_part(std::size_t j) const noexcept {
        const rail& r = rails_[j];
        if (r.s->failed())
            return r.s;
        return r.lane != nullptr && r.lane->failed() ? r.lane : nullptr;
    }
    /// Which rail poll() takes first.
    [[nodiscard]] std::size_t first_to_poll() const noexcept;
    /// Takes rail j's completions in; the caller's go to out[k..]. Returns
    /// the new k.
    std::size_t poll_rail(std::size_t j, std::span<verbs::completion> out, std::size_t k) noexcept;
    /// The same for one of rail j's schedulers (its lane if `lane`).
    std::size_t poll_part(std::size_t j, bool lane, std::span<verbs::completion> out,
                          std::size_t k) noexcept;
    /// One timed round over the rails took `round`: the rails' host_away().
    void note_round(std::chrono::nanoseconds round) noexcept;
    /// A completion from rail k (its lane if `lane`) with the piece tag:
    /// false if it is not one of ours there (the caller's own wr_id: passed on).
    bool piece_done(std::size_t k, bool lane, std::uint64_t wr_id, ibv_wc_status st) noexcept;
    /// A live rail with room and nothing to take: it takes the last piece
    /// of the rail expected to finish last, if none of that was posted yet
    /// and it finishes sooner here.
    void steal() noexcept;
    /// Transfers with bytes still to send and none of their rails up fail.
    void fail_unsendable() noexcept;
    /// Rail k failed (`why`): nothing more goes to it (with a lane, both its
    /// queue pairs fail now).
    void take_out(std::size_t k, ibv_wc_status why) noexcept;
    /// `pc` goes back to its transfer, to be handed out again (re-queued).
    void send_again(piece& pc) noexcept;
    /// `t` sends nothing more: its pieces waiting to go again are freed.
    void drop_unsent(transfer& t) noexcept;
    void finish_if_done(transfer& t) noexcept;
    void unqueue(transfer& t) noexcept;
    void release(transfer& t) noexcept;
    /// A transfer may start now: not fenced behind an earlier one.
    [[nodiscard]] bool startable(const transfer& t) const noexcept;
    /// A rail's failure, whoever's request saw it.
    [[nodiscard]] static bool rail_status(ibv_wc_status st) noexcept {
        return st == IBV_WC_WR_FLUSH_ERR || st == IBV_WC_RETRY_EXC_ERR ||
               st == IBV_WC_RNR_RETRY_EXC_ERR || st == IBV_WC_LOC_QP_OP_ERR;
    }
    /// A piece of `t` that ended `st` on rail k failed with its rail, not for
    /// its own reason. IBV_WC_LOC_QP_OP_ERR is what soft-RoCE on Linux 6.1
    /// gives a request posted while its port is down (6.12 on: a flush);
    /// elsewhere it can be the request's own fault, so it counts as the
    /// rail's only while no other rail gave it for the same transfer.
    [[nodiscard]] static bool rail_failure(ibv_wc_status st, const transfer& t,
                                           std::size_t k) noexcept {
        if (st == IBV_WC_LOC_QP_OP_ERR)
            return (t.loc_qp_rails & ~(1U << k)) == 0;
        return rail_status(st);
    }
    /// The rails up, as a mask.
    [[nodiscard]] std::uint8_t live_mask() const noexcept;
    /// `t`'s pieces in a rail's scheduler that have not started go back
    /// (its own failure: they would fail too, and take their rails down).
    void withdraw(transfer& t) noexcept;
    /// Takes `pc` out of its rail's books (it left its scheduler).
    void unbook(piece& pc) noexcept;

    stripe_options opts_;
    std::array<rail, max_rails> rails_{};
    std::vector<transfer> transfers_;
    std::vector<piece> pieces_;
    level_queue free_transfers_;
    piece_list free_pieces_;
    std::array<level_queue, priority_levels> queues_;
    order_list order_; ///< live transfers, oldest first (fences)
    level_queue done_; ///< finished, to hand back
    std::size_t live_ = 0;
    std::size_t next_rail_ = 0; ///< where poll() starts, in turn
    std::uint64_t polls_ = 0;
    std::uint64_t fed_ = 0; ///< pieces handed to rails, ever (piece::fed)
    double away_ns_ = 0;    ///< the host's time for a round over the rails (average)
    ibv_wc_status last_rail_failure_ = IBV_WC_SUCCESS;
    striper_counters counters_;
};

} // namespace rdmax::sched

// The member bodies.
#include <rdmax/sched/basic_striper-inl.hpp>
