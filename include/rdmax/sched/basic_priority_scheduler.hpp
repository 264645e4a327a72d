#pragma once
// basic_priority_scheduler<Policy, Port>: priority and slicing inside one
// send queue (sRDMA, seed 004; Justitia's chunk sizes). priority_scheduler.hpp
// puts it on an RC queue pair; unit tests put it on a simulated send queue.
//
// A send queue is FIFO: a 64-byte urgent write waits behind every byte posted
// before it. The scheduler keeps requests in one FIFO queue per priority
// level, cuts RDMA writes and reads into slices, and posts slices only while
// the bytes and work requests in flight are under a budget. So a new request
// waits for at most the budget's bytes, plus one slice, whatever is queued.
//
// A small request (at most one small slice) of the most urgent level that has
// work is not held by the byte budget: it goes at once, and waits only for
// the bytes already in flight.
//
// What is guaranteed:
// - one completion per request, with the caller's wr_id, once all its slices
//   completed (or at once on failure, when the slices it did post are done);
//   the first failed slice gives its status; requests that were never posted,
//   or partly posted, when the queue pair failed complete with
//   IBV_WC_WR_FLUSH_ERR, and later submissions are refused (qp_failed). That
//   holds too when the failure was another request's on the queue pair (a
//   window's bind): the port says so, and nothing more is posted;
// - FIFO within a level: a request's slices are all posted before the next
//   request of its level starts, so a READ after a WRITE of the same level
//   to the same range sees the write;
// - across levels, no order: a more urgent request overtakes a less urgent
//   one, even between two of its slices. A request submitted with
//   `fence = true` is posted only once every request submitted before it, of
//   any level, was posted whole, and its first slice carries IBV_SEND_FENCE
//   (it also waits for earlier reads): so a READ with fence sees every write
//   submitted before it;
// - WRITE, WRITE_WITH_IMM (the immediate on the last slice only) and READ
//   are sliced; SEND is posted whole; READ slices in flight stay within the
//   queue pair's max_rd_atomic;
// - the slice size adapts: small while a more urgent level has work or had
//   some within `hold`, large otherwise; a large slice fills what is left of
//   the budget, no more (a quarter of a measured one, an eighth while
//   host_away() is set); a measured budget is rate x lone latency + a small
//   slice + the host's time away, small slices an eighth of it (measure());
// - only the last slice of a request is signaled, and those others that the
//   budget's accounting needs (so that a completion always comes back
//   before the budget runs dry); with a measured budget, every slice.
//
// Posting can cost as much as sending: on soft-RoCE the doorbell system call
// transmits the slices it carries, in the caller's thread. So a doorbell that
// carries a level's slices carries none of a less urgent level (they go with
// the next call), and poll() hands back finished requests before it posts
// more: the caller learns that its urgent request finished without first
// paying for the next bulk slices. On a NIC, both only delay a refill by one
// call.
//
// Progress: the caller's poll() or wait() drives everything (completions in,
// slices out); submission also posts at once when the budget allows, unless
// the request is `deferred` (request_flags): then it waits, queued, for the
// next flush(), poll() or submission that is not, and a run of deferred
// requests goes out with one doorbell. There is
// no thread of its own. Like the queue pair, a scheduler is used by one thread
// at a time, and it owns the queue pair's send side: do not post on the queue
// pair directly while the scheduler uses it (receives are yours).
//
// The data path (submissions, poll) is noexcept and allocates nothing: the
// request descriptors and the in-flight slice ring are allocated up front.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include <boost/intrusive/slist.hpp>

#include <rdmax/mem/buffer.hpp>
#include <rdmax/sched/coarse_clock.hpp>
#include <rdmax/sched/priority.hpp>
#include <rdmax/sched/request_flags.hpp>
#include <rdmax/sched/scheduler_options.hpp>
#include <rdmax/sched/scheduling_policy.hpp>
#include <rdmax/sched/send_port.hpp>
#include <rdmax/sched/strict_priority.hpp>
#include <rdmax/status.hpp>
#include <rdmax/verbs/completion.hpp>

namespace rdmax::sched {

/// `Clock` serves `hold` (cheap, coarse); `FineClock` times the budget's
/// samples (one signaled slice per round trip). Production uses coarse_clock
/// and steady_clock; the NIC model (sched/sim/) puts its virtual time in both.
/// The member bodies are in basic_priority_scheduler-inl.hpp.
template <SchedulingPolicy Policy, SendPort Port, class Clock = coarse_clock,
          class FineClock = std::chrono::steady_clock>
class basic_priority_scheduler {
public:
    using clock = Clock;
    using fine_clock = FineClock;

    /// The port is built from `port_args` (a queue pair, for queue_pair_port).
    template <class... PortArgs>
    explicit basic_priority_scheduler(scheduler_options opts, Policy policy,
                                      PortArgs&&... port_args)
        : port_(std::forward<PortArgs>(port_args)...)
        , policy_(std::move(policy))
        , opts_(clamp(opts, port_))
        , pool_(opts_.max_requests)
        , ring_(opts_.budget_wqes)
        , budget_(opts_.budget_bytes != 0 ? opts_.budget_bytes : adaptive_initial_budget) {
        for (request& r : pool_)
            free_.push_front(r);
        // Never active: not the clock's epoch, which is only the boot.
        last_active_.fill(clock::time_point::min());
        counters_.budget_bytes = budget_;
        counters_.small_slice = small_slice_;
    }
    basic_priority_scheduler(const basic_priority_scheduler&) = delete;
    basic_priority_scheduler& operator=(const basic_priority_scheduler&) = delete;
    ~basic_priority_scheduler();

    /// The budget is measured (options' budget_bytes 0), not fixed.
    [[nodiscard]] bool adaptive() const noexcept { return opts_.budget_bytes == 0; }

    /// Where the completions of work requests someone else posted on the
    /// port go (an RPC link's window invalidations): `sink(ctx, c)` from
    /// poll(), before the scheduler looks at their status; nullptr: dropped
    /// (counted in foreign_completions either way).
    using foreign_sink = void (*)(void* ctx, const verbs::completion& c) noexcept;
    void on_foreign(foreign_sink sink, void* ctx) noexcept {
        foreign_sink_ = sink;
        foreign_ctx_ = ctx;
    }

    // ---- submission -------------------------------------------------------------------------

    /// RDMA write of `src` to dst + dst_offset, sliced.
    template <rights L, rights R>
        requires(has(R, rights::remote_write))
    status write(priority p, local_buffer<L> src, remote_buffer<R> dst, std::uint64_t dst_offset,
                 std::uint64_t wr_id, request_flags f = {}) noexcept {
        return submit(p, IBV_WR_RDMA_WRITE, src, remote_view(dst), dst_offset, std::nullopt, wr_id,
                      f);
    }
    /// RDMA write whose immediate arrives with the last slice.
    template <rights L, rights R>
        requires(has(R, rights::remote_write))
    status write_imm(priority p, local_buffer<L> src, remote_buffer<R> dst,
                     std::uint64_t dst_offset, std::uint32_t imm, std::uint64_t wr_id,
                     request_flags f = {}) noexcept {
        return submit(p, IBV_WR_RDMA_WRITE_WITH_IMM, src, remote_view(dst), dst_offset, imm, wr_id,
                      f);
    }
    /// RDMA read of src + src_offset into `dst`, sliced.
    template <rights L, rights R>
        requires(has(L, rights::local_write) && has(R, rights::remote_read))
    status read(priority p, local_buffer<L> dst, remote_buffer<R> src, std::uint64_t src_offset,
                std::uint64_t wr_id, request_flags f = {}) noexcept {
        return submit(p, IBV_WR_RDMA_READ, dst, remote_view(src), src_offset, std::nullopt, wr_id,
                      f);
    }
    /// A send, posted whole (the peer's receive must hold all of it).
    template <rights L>
    status send(priority p, local_buffer<L> src, std::uint64_t wr_id,
                request_flags f = {}) noexcept {
        return submit(p, IBV_WR_SEND, src, std::nullopt, 0, std::nullopt, wr_id, f);
    }
    template <rights L>
    status send_imm(priority p, local_buffer<L> src, std::uint32_t imm, std::uint64_t wr_id,
                    request_flags f = {}) noexcept {
        return submit(p, IBV_WR_SEND_WITH_IMM, src, std::nullopt, 0, imm, wr_id, f);
    }

    // ---- progress ---------------------------------------------------------------------------

    /// Takes in the port's completions and returns finished requests (at
    /// most out.size(); the rest wait for the next call). A call that has
    /// none to return posts what the budget allows instead, and so does
    /// every second call in a row that has some.
    ///
    /// Finished requests go back before more is posted because posting can
    /// take long: on soft-RoCE the doorbell does the device's work, the
    /// slices' packets, in this thread. Posting first would make the caller
    /// of an urgent request wait for the next budget of bulk bytes to learn
    /// that it finished. The exception keeps less urgent work moving for a
    /// caller that finds a finished request at every call.
    int poll(std::span<verbs::completion> out) noexcept;

    /// Withdraws the request submitted with `wr_id` if none of it was posted
    /// yet: it then never reaches the device, and no completion is reported
    /// for it (its owner settles what it held). False when there is no such
    /// request, or it was posted, in part or whole: it runs its course. For
    /// work that lost its purpose while it waited (an RPC server's READ of a
    /// body whose call the caller gave up: the key it names is dead, and the
    /// READ would fail the queue pair).
    bool cancel(std::uint64_t wr_id) noexcept;

    /// Posts what is queued, as far as the budget allows (one doorbell, or
    /// more when the port's batch fills): the deferred requests
    /// (request_flags::deferred) of every level go now, less urgent ones
    /// too (a poll would post them after the urgent ones' completion).
    /// Completions are not taken in.
    void flush() noexcept { pump(true); }

    /// Like poll(), spinning until a request finished or `timeout` passed; 0
    /// on timeout, at once when nothing is queued or in flight.
    int wait(std::span<verbs::completion> out, std::chrono::microseconds timeout) noexcept;

    /// How long the host takes to come back to this scheduler while it is
    /// busy: a striper's round over its rails, when one thread drives them
    /// all. A measured budget then covers at least what the link sends
    /// meanwhile besides the bandwidth-delay product, so that the link does
    /// not drain while the host serves the others; 0 (the default): a
    /// thread that polls nothing else.
    void host_away(std::chrono::nanoseconds away) noexcept {
        host_away_ns_ = static_cast<double>(away.count());
    }

    // ---- state ------------------------------------------------------------------------------

    /// Requests submitted and not yet handed back by poll().
    [[nodiscard]] std::size_t outstanding() const noexcept {
        return opts_.max_requests - free_count_;
    }
    /// Requests (or parts) submitted and not yet posted: poll() posts them.
    [[nodiscard]] bool queued() const noexcept { return any_queued(); }
    /// Work requests posted and not yet known complete (what the budget counts).
    [[nodiscard]] std::uint32_t in_flight() const noexcept { return in_flight_wqes_; }
    /// An earlier request failed: the queue pair is in the error state.
    [[nodiscard]] bool failed() const noexcept { return broken_; }
    /// Why: the first completion in error that was not a flush (what broke the
    /// queue pair: retry exceeded, remote access...), else the first flush;
    /// IBV_WC_SUCCESS while nothing failed.
    [[nodiscard]] ibv_wc_status failure() const noexcept { return failure_; }
    [[nodiscard]] const scheduler_counters& counters() const noexcept { return counters_; }
    [[nodiscard]] const scheduler_options& options() const noexcept { return opts_; }
    [[nodiscard]] Port& port() noexcept { return port_; }
    [[nodiscard]] Policy& policy() noexcept { return policy_; }

private:
    using link = boost::intrusive::slist_base_hook<
        boost::intrusive::link_mode<boost::intrusive::normal_link>>;

    struct request : link {
        slice_request wr;            ///< first slice's template: addresses advance per slice
        std::uint64_t length = 0;    ///< bytes in all
        std::uint64_t posted = 0;    ///< bytes posted so far
        std::uint64_t seq = 0;       ///< submission order, for fences
        std::uint64_t wr_id = 0;     ///< the caller's
        std::uint32_t in_flight = 0; ///< slices posted and not retired
        ibv_wc_status result = IBV_WC_SUCCESS;
        std::uint8_t level = 0;
        bool report = true;  ///< hand a completion back on success
        bool queued = false; ///< in its level's queue (not yet posted whole)
        bool first_fenced = false;
    };
    using queue = boost::intrusive::slist<request, boost::intrusive::base_hook<link>,
                                          boost::intrusive::cache_last<true>,
                                          boost::intrusive::constant_time_size<false>>;

    /// A slice posted and not yet known complete.
    struct in_flight_slice {
        request* req = nullptr;
        std::uint32_t bytes = 0;
        bool read = false;
    };

    static scheduler_options clamp(scheduler_options o, const Port& port) noexcept;

    /// The typed calls checked the rights; past them a buffer is its bytes and key.
    using local_view = local_buffer<rights::local_read>;
    using remote_view = remote_buffer<rights::local_read>;

    status submit(priority p, ibv_wr_opcode op, local_view local, std::optional<remote_view> remote,
                  std::uint64_t remote_offset, std::optional<std::uint32_t> imm,
                  std::uint64_t wr_id, request_flags f) noexcept;

    /// A more urgent level than `level` has work, or had some within `hold`.
    [[nodiscard]] bool contended(std::size_t level, clock::time_point now) const noexcept;

    /// The oldest request of `level` may start now (fences; read limits).
    [[nodiscard]] bool startable(const request& r) const noexcept;

    /// Posts slices while the budget allows, one doorbell for all of them;
    /// once an urgent slice is staged, less urgent levels wait for the next
    /// pass unless `every_level`.
    void pump(bool every_level = false) noexcept;

    /// Counts a pass held back by the budget (wqes, slots or bytes) while work waits.
    void note_budget_stall() noexcept;

    /// The levels whose oldest request may take a slice now (the policy picks among them).
    [[nodiscard]] level_mask ready_levels(bool over_budget, clock::time_point now) const noexcept;

    /// Stages the next slice of `r`.
    status post_slice(request& r, std::size_t level, bool small) noexcept;

    /// The most bytes the next slice of a sliced request may carry.
    [[nodiscard]] std::uint64_t slice_cut(bool small) const noexcept;

    /// The next slice of `r`, `len` bytes, signaled or not.
    [[nodiscard]] slice_request next_slice_of(const request& r, std::uint32_t len, bool last,
                                              bool read) const noexcept;

    /// Times the slice about to be staged (a measured budget's sample).
    void start_sample(std::uint32_t len) noexcept;

    /// The books after the port took a slice: in flight, counters, the policy, the queue.
    void note_staged(request& r, std::size_t level, std::uint32_t len, bool read, bool signaled,
                     bool small_slice) noexcept;

    /// Rings the doorbell for the slices staged from id `first` on. False if
    /// the device refused some, which fails the scheduler.
    bool ring(std::uint64_t first) noexcept;

    [[nodiscard]] bool any_queued() const noexcept;

    /// The measured budget (budget_bytes 0): the -inl file says how.
    void measure(typename fine_clock::duration elapsed) noexcept;
    void size_budget(double best_rate) noexcept;

    /// Takes the port's completions in.
    void reap() noexcept;

    /// The oldest slice in flight completed with `st`.
    void retire_oldest(ibv_wc_status st) noexcept { release_slice(tail_slice_++, st); }

    void release_slice(std::uint64_t id, ibv_wc_status st) noexcept;

    void finish_if_done(request& r) noexcept;

    /// The port failed without a completion of this scheduler's saying so
    /// (another request on the queue pair failed, and its owner took the
    /// completion): fail, as after a failed slice.
    void port_failed() noexcept;

    /// Fails every request that has not finished: the queue pair will post
    /// nothing more.
    void fail_all(ibv_wc_status st) noexcept;

    int deliver(std::span<verbs::completion> out) noexcept;

    static ibv_wc_opcode opcode_of(ibv_wr_opcode op) noexcept;

    Port port_;
    Policy policy_;
    scheduler_options opts_;
    std::vector<request> pool_;
    std::vector<in_flight_slice> ring_;
    queue free_;
    queue done_;
    std::array<queue, priority_levels> queues_;
    std::array<std::uint32_t, priority_levels> live_{}; ///< queued or in flight, per level
    std::array<typename clock::time_point, priority_levels> last_active_{};
    std::size_t free_count_ = pool_.size();
    std::uint32_t live_total_ = 0;
    std::uint64_t next_seq_ = 0;
    std::uint64_t next_slice_ = 0; ///< id of the next slice to post
    std::uint64_t tail_slice_ = 0; ///< oldest slice in flight
    std::uint64_t in_flight_bytes_ = 0;
    std::uint64_t unsignaled_bytes_ = 0; ///< posted since the last signaled slice
    std::uint32_t in_flight_wqes_ = 0;
    std::uint32_t reads_in_flight_ = 0;
    bool broken_ = false;
    ibv_wc_status failure_ = IBV_WC_SUCCESS;
    bool deferred_pump_ = false; ///< the last poll() returned requests without posting
    foreign_sink foreign_sink_ = nullptr;
    void* foreign_ctx_ = nullptr;
    scheduler_counters counters_;

    // The budget: fixed (options) or measured (budget_bytes 0).
    static constexpr std::uint64_t adaptive_initial_budget = 16 * 1024;
    static constexpr std::uint64_t adaptive_floor = 4 * 1024;
    static constexpr std::uint64_t probe_bytes = 1024;
    static constexpr std::uint64_t slice_floor = 4 * 1024;
    static constexpr std::uint64_t adaptive_ceiling = 64ULL * 1024 * 1024;
    std::uint64_t budget_;
    std::uint64_t small_slice_ = opts_.small_slice; ///< an eighth of a measured budget
    double post_ns_ = 0;       ///< the host's time per slice posted (average of the samples)
    double host_away_ns_ = 0;  ///< host_away()
    bool sample_rung_ = false; ///< the sample's doorbell was timed
    bool sampling_ = false;    ///< a signaled slice in flight is timed
    std::uint64_t sample_id_ = 0;
    std::uint64_t sample_ahead_ = 0;
    std::uint64_t sample_len_ = 0;
    typename fine_clock::time_point sample_start_{};
    std::array<double, 8> rates_{}; ///< the last rate samples, bytes per ns
    std::uint32_t rate_next_ = 0;
    double base_ns_ = 0;          ///< smallest latency with nothing in flight ahead
    std::uint64_t delivered_ = 0; ///< bytes of slices completed, ever
    std::uint64_t delivered_at_last_end_ = 0;
    typename fine_clock::time_point last_end_{}; ///< the last sample's completion
    bool sampled_before_ = false;
};

} // namespace rdmax::sched

// The member bodies.
#include <rdmax/sched/basic_priority_scheduler-inl.hpp>
