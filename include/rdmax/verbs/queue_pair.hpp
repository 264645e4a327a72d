#pragma once
// Queue pairs: queue_pair<rc> (reliable connected: write, read, send, atomics)
// and queue_pair<ud> (unreliable datagram: send and receive).
//
// The data path is noexcept, allocates nothing and makes no system call but
// the doorbell. Every operation is checked before anything is posted: a bad
// request returns a status and posts nothing. Which buffers an operation
// accepts is decided by their access rights at compile time.
//
// Completions: the queue pair owns its send completion queue, so that it can
// account send-queue slots (selective signaling; see detail/verbs/send_slots.hpp). Only
// requests that asked for a completion, and failed ones, are reported, with
// the caller's wr_id. A queue pair is used by one thread at a time.
//
// Once a send completion came back in error (polled by poll_send, wait_send,
// wait_send_for or wait_send_slots), the queue pair is in the error state
// and refuses every later post with status::qp_failed instead of taking work
// that could only complete flushed.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <rdmax/detail/verbs/kept_completions.hpp>
#include <rdmax/detail/verbs/send_slots.hpp>
#include <rdmax/mem/buffer.hpp>
#include <rdmax/status.hpp>
#include <rdmax/verbs/completion.hpp>
#include <rdmax/verbs/completion_queue.hpp>
#include <rdmax/verbs/gid.hpp>
#include <rdmax/verbs/port.hpp>
#include <rdmax/verbs/protection_domain.hpp>
#include <rdmax/verbs/send_batch.hpp>
#include <rdmax/verbs/shared_receive_queue.hpp>

namespace rdmax::verbs {

/// Transport tags.
struct rc {};
struct ud {};

/// What a queue pair is created with. Sizes beyond the device's limits are
/// refused with an error naming the limit; max_inline and max_rd_atomic are
/// clamped to what the device grants.
struct qp_config {
    std::uint32_t send_depth = 256;
    std::uint32_t recv_depth = 256; ///< ignored with an srq
    std::uint32_t max_send_sge = 4;
    std::uint32_t max_recv_sge = 4;
    std::uint32_t max_inline = 64;     ///< bytes sent inline (no lkey, no DMA read)
    std::uint32_t signal_interval = 0; ///< longest unsignaled run; 0: send_depth / 2
    std::uint32_t max_batch = 32;      ///< work requests in one chain (one doorbell)
    std::uint8_t port = 1;
    std::uint8_t max_rd_atomic = 16; ///< outstanding reads/atomics, each direction
    std::uint8_t ack_timeout = 14;   ///< 4.096 us * 2^14 = 67 ms per try
    std::uint8_t retry_count = 7;
    std::uint8_t rnr_retry = 7;          ///< 7: retry for ever on "receiver not ready"
    std::uint32_t qkey = 0x1ee7cafe;     ///< UD only
    completion_queue* recv_cq = nullptr; ///< share one; nullptr: the QP makes its own
    /// The send queue's completion queue raises its events on this channel
    /// (an endpoint that sleeps on one channel for all its queues); nullptr: none.
    /// Whoever owns the channel reads and acknowledges its events: do not
    /// wait_send() on such a queue pair.
    completion_channel* send_channel = nullptr;
    shared_receive_queue* srq = nullptr; ///< receive from a shared queue
};

/// What a peer needs to connect an RC queue pair to this one (or to address a
/// UD one): plain bytes, exchanged out of band or in rdma_cm private data.
struct qp_endpoint {
    gid address;
    std::uint32_t qp_num = 0;
    std::uint32_t psn = 0;
    std::uint32_t qkey = 0;
    std::uint16_t lid = 0;
    std::uint8_t gid_index = 0;
    std::uint8_t mtu = IBV_MTU_1024; ///< ibv_mtu
};

/// A UD destination: an address handle plus the remote QP's number and key.
class address_handle {
public:
    address_handle(const protection_domain& pd, const qp_endpoint& remote, std::uint8_t port,
                   std::uint8_t local_gid_index);
    address_handle(address_handle&& other) noexcept;
    address_handle& operator=(address_handle&& other) noexcept;
    address_handle(const address_handle&) = delete;
    address_handle& operator=(const address_handle&) = delete;
    ~address_handle();

    [[nodiscard]] ibv_ah* get() const noexcept { return ah_; }
    [[nodiscard]] std::uint32_t qp_num() const noexcept { return qp_num_; }
    [[nodiscard]] std::uint32_t qkey() const noexcept { return qkey_; }

private:
    ibv_ah* ah_;
    std::uint32_t qp_num_;
    std::uint32_t qkey_;
};

/// Bytes of room ahead of every UD receive: the global route header.
inline constexpr std::uint32_t ud_grh_bytes = 40;

/// What RC and UD queue pairs share: creation, receives, completions.
class queue_pair_base {
public:
    queue_pair_base(const queue_pair_base&) = delete;
    queue_pair_base& operator=(const queue_pair_base&) = delete;
    queue_pair_base(queue_pair_base&&) noexcept;
    queue_pair_base& operator=(queue_pair_base&&) noexcept;
    ~queue_pair_base();

    [[nodiscard]] ibv_qp* get() const noexcept { return qp_; }
    [[nodiscard]] std::uint32_t qp_num() const noexcept { return qp_->qp_num; }
    [[nodiscard]] std::uint32_t max_inline() const noexcept { return max_inline_; }
    [[nodiscard]] std::uint32_t max_send_sge() const noexcept { return max_send_sge_; }
    [[nodiscard]] std::uint32_t max_recv_sge() const noexcept { return max_recv_sge_; }
    [[nodiscard]] std::uint32_t send_depth() const noexcept { return slots_.depth(); }
    [[nodiscard]] std::uint32_t send_slots_free() const noexcept { return slots_.available(); }
    [[nodiscard]] std::uint32_t max_message() const noexcept { return max_msg_; }
    /// RDMA reads and atomics this end may have outstanding (as granted).
    [[nodiscard]] std::uint32_t max_rd_atomic() const noexcept { return rd_atomic_; }
    /// The errno of the last refused ibv_post_send / ibv_post_recv.
    [[nodiscard]] int last_errno() const noexcept { return last_errno_; }
    /// The state this object moved the QP to (a QP the device put into the error
    /// state shows it in its completions).
    [[nodiscard]] ibv_qp_state state() const noexcept { return state_; }
    /// A send completion came back in error: the device moved the queue pair
    /// to the error state, and every request after it completes flushed.
    /// Every later post is refused with status::qp_failed, nothing posted.
    /// (A queue pair moved there otherwise, by a disconnect, refuses posts
    /// with not_connected.)
    [[nodiscard]] bool failed() const noexcept { return failed_; }
    [[nodiscard]] const qp_config& config() const noexcept { return cfg_; }
    [[nodiscard]] completion_queue& send_cq() noexcept { return send_cq_; }
    [[nodiscard]] completion_queue& recv_cq() noexcept { return *recv_cq_; }

    /// This end's address, for the peer.
    [[nodiscard]] qp_endpoint endpoint() const;

    /// Send completions the caller asked for (and failures), without blocking.
    int poll_send(std::span<completion> out) noexcept;
    /// Like poll_send, waiting up to `timeout` for the first; 0 on timeout.
    int wait_send(std::span<completion> out, std::chrono::microseconds timeout) noexcept;
    /// Receive completions (from this QP's receive CQ), without blocking.
    int poll_recv(std::span<completion> out) noexcept;
    int wait_recv(std::span<completion> out, std::chrono::microseconds timeout) noexcept;
    /// Waits up to `timeout` for the completion of the request posted with
    /// `wr_id` (signaled); nullopt at the deadline. Every other completion that
    /// arrives meanwhile is kept, in order, for the next poll_send / wait_send:
    /// set-up work (a memory window bind) can wait on a queue pair that also
    /// carries the application's requests without taking their completions.
    /// Set-up path: may allocate (bad_alloc) to keep them.
    std::optional<completion> wait_send_for(std::uint64_t wr_id, std::chrono::microseconds timeout);
    /// After a post returned status::queue_full: waits up to `timeout` until
    /// at least `n` send slots are free, reaping the send CQ, and keeps every
    /// completion the caller would have been handed (its signaled requests'
    /// and every failure), in order, for the next poll_send / wait_send, which
    /// then see each exactly once. Allocates nothing: the keep holds up to
    /// send_depth() completions (made when the QP was). A slot is known free
    /// when a signaled request at or after it completes, so up to
    /// depth - signal interval + 1 slots always come free once the work
    /// completes; more may wait for the unsignaled requests posted after the
    /// last signaled one, until a later signaled request. Returns
    ///  - ok: n slots are free;
    ///  - queue_full: the deadline passed first, or the keep is full of
    ///    completions the caller has not taken (poll_send them, then wait);
    ///  - qp_failed: a kept completion is a failure (or polling the CQ
    ///    failed): the queue pair is broken; poll_send says why;
    ///  - out_of_range: n > send_depth(), which no wait can give.
    status wait_send_slots(std::uint32_t n, std::chrono::microseconds timeout) noexcept;

    /// Posts a receive into `dst`, which must allow local writes. (UD: leave
    /// ud_grh_bytes of room ahead of the payload.)
    template <rights A>
        requires(has(A, rights::local_write))
    status post_recv(local_buffer<A> dst, std::uint64_t wr_id) noexcept {
        if (dst.length == 0)
            return status::zero_length;
        ibv_sge sge{reinterpret_cast<std::uint64_t>(dst.addr), dst.length, dst.lkey};
        return post_recv_sges(&sge, 1, wr_id);
    }
    template <rights A>
        requires(has(A, rights::local_write))
    status post_recv(std::span<const local_buffer<A>> dsts, std::uint64_t wr_id) noexcept {
        if (dsts.size() > max_recv_sge_)
            return status::too_many_sge;
        ibv_sge sges[32];
        if (dsts.size() > std::size(sges))
            return status::too_many_sge;
        std::uint64_t total = 0;
        for (std::size_t i = 0; i < dsts.size(); ++i) {
            sges[i] = {reinterpret_cast<std::uint64_t>(dsts[i].addr), dsts[i].length, dsts[i].lkey};
            total += dsts[i].length;
        }
        if (total == 0)
            return status::zero_length;
        return post_recv_sges(sges, static_cast<std::uint32_t>(dsts.size()), wr_id);
    }

    /// A chain of requests for one doorbell (one batch at a time per QP).
    [[nodiscard]] send_batch batch() noexcept { return send_batch(*this); }

    /// For send ports (sched::queue_pair_port), not applications: moves the
    /// queue pair to the error state after the device refused a post that
    /// the port's scheduler already counted, so that every outstanding
    /// request completes flushed and the scheduler hears of each. An
    /// application that wants to stop disconnects instead.
    void enter_error_for_port() noexcept { enter_error(); }

protected:
    /// One request, staged by `stage` and posted: the single-operation calls.
    template <class Stage>
    status post_one(Stage&& stage) noexcept {
        send_batch b(*this);
        if (status s = stage(b); s != status::ok)
            return s;
        return b.post();
    }

protected:
    queue_pair_base(const protection_domain& pd, const qp_config& cfg, ibv_qp_type type,
                    rdma_cm_id* cm_id);
    void modify(ibv_qp_attr& attr, int mask, ibv_qp_state to, const char* what);
    void to_init();
    void to_rts_from_rtr(std::uint32_t sq_psn);

    friend class send_batch;
    friend class connection;
    status post_recv_sges(ibv_sge* sges, std::uint32_t n, std::uint64_t wr_id) noexcept;
    /// ok, or why nothing may be posted: qp_failed (error state), not_connected.
    [[nodiscard]] status can_post() const noexcept {
        if (failed_) [[unlikely]]
            return status::qp_failed;
        return state_ == IBV_QPS_RTS ? status::ok : status::not_connected;
    }
    void destroy() noexcept;
    /// Moves the QP to the error state: outstanding work completes flushed.
    void enter_error() noexcept;
    int translate_send(const ibv_wc* wcs, int n, std::span<completion> out) noexcept;
    /// Creates qp_ (through cm_id where given), halving inline data until
    /// the device takes it; throws naming the verb.
    void create(ibv_qp_init_attr& attr, rdma_cm_id* cm_id);
    /// The port's MTU, LID, preferred GID and atomic depth; a random PSN.
    void learn_port();

    const protection_domain* pd_;
    qp_config cfg_;
    completion_queue send_cq_;
    std::unique_ptr<completion_queue> own_recv_cq_;
    completion_queue* recv_cq_;
    ibv_qp* qp_ = nullptr;
    rdma_cm_id* cm_id_ = nullptr; ///< set when rdma_cm created (and will destroy) the QP
    ibv_qp_type type_;
    ibv_qp_state state_ = IBV_QPS_RESET;
    std::uint32_t max_inline_ = 0;
    std::uint32_t max_send_sge_ = 0;
    std::uint32_t max_recv_sge_ = 0;
    std::uint32_t max_msg_ = 0;
    std::uint32_t psn_ = 0;
    std::uint16_t lid_ = 0;
    std::uint8_t gid_index_ = 0;
    std::uint8_t rd_atomic_ = 1;
    ibv_mtu mtu_ = IBV_MTU_1024;
    gid gid_;
    int last_errno_ = 0;
    bool failed_ = false; ///< a send completion came back in error
    send_slots slots_;
    // Staging area for batches: allocated once, reused by every post.
    std::vector<ibv_send_wr> wrs_;
    std::vector<ibv_sge> sges_;
    // Send completions wait_send_for and wait_send_slots took for the
    // caller; the next poll_send / wait_send hands them out first. Room for
    // send_depth() of them is made with the QP.
    kept_completions kept_;
};

template <class Transport>
class queue_pair;

/// Reliable connected queue pair.
template <>
class queue_pair<rc> : public queue_pair_base {
public:
    /// A QP in the RESET state; connect() it to a peer's endpoint.
    queue_pair(const protection_domain& pd, const qp_config& cfg = {});

    /// INIT -> RTR -> RTS against the peer's endpoint (exchanged out of band).
    void connect(const qp_endpoint& remote);

    /// The incarnation of the peer's handle_issuer (its epoch()), as the peer
    /// told it on this connection; 0 (the start) means unknown. read() and
    /// write() of remote_handle.hpp post a handle only if its epoch is this
    /// one (stale_handle, unknown_epoch otherwise). Set it on every new
    /// connection from what the peer sent on it (a handle's epoch in the
    /// connect payload, say), never from a handle kept from before: that may
    /// be of an earlier incarnation. Setting it again replaces it.
    void set_peer_epoch(std::uint64_t epoch) noexcept { peer_epoch_ = epoch; }
    [[nodiscard]] std::uint64_t peer_epoch() const noexcept { return peer_epoch_; }

    template <rights L, rights R>
        requires(has(R, rights::remote_write))
    status write(local_buffer<L> src, remote_buffer<R> dst, std::uint64_t dst_offset,
                 std::uint64_t wr_id, send_flags f = {}) noexcept {
        return post_one([&](send_batch& b) { return b.write(src, dst, dst_offset, wr_id, f); });
    }
    template <rights L, rights R>
        requires(has(R, rights::remote_write))
    status write_imm(local_buffer<L> src, remote_buffer<R> dst, std::uint64_t dst_offset,
                     std::uint32_t imm, std::uint64_t wr_id, send_flags f = {}) noexcept {
        return post_one(
            [&](send_batch& b) { return b.write_imm(src, dst, dst_offset, imm, wr_id, f); });
    }
    template <rights L, rights R>
        requires(has(L, rights::local_write) && has(R, rights::remote_read))
    status read(local_buffer<L> dst, remote_buffer<R> src, std::uint64_t src_offset,
                std::uint64_t wr_id, send_flags f = {}) noexcept {
        return post_one([&](send_batch& b) { return b.read(dst, src, src_offset, wr_id, f); });
    }
    template <rights L>
    status send(local_buffer<L> src, std::uint64_t wr_id, send_flags f = {}) noexcept {
        return post_one([&](send_batch& b) { return b.send(src, wr_id, f); });
    }
    template <rights L>
    status send_imm(local_buffer<L> src, std::uint32_t imm, std::uint64_t wr_id,
                    send_flags f = {}) noexcept {
        return post_one([&](send_batch& b) { return b.send_imm(src, imm, wr_id, f); });
    }
    template <rights L, rights R>
        requires(has(L, rights::local_write) && has(R, rights::remote_atomic))
    status compare_swap(local_buffer<L> result, remote_buffer<R> dst, std::uint64_t dst_offset,
                        std::uint64_t expected, std::uint64_t desired, std::uint64_t wr_id,
                        send_flags f = {}) noexcept {
        return post_one([&](send_batch& b) {
            return b.compare_swap(result, dst, dst_offset, expected, desired, wr_id, f);
        });
    }
    template <rights L, rights R>
        requires(has(L, rights::local_write) && has(R, rights::remote_atomic))
    status fetch_add(local_buffer<L> result, remote_buffer<R> dst, std::uint64_t dst_offset,
                     std::uint64_t add, std::uint64_t wr_id, send_flags f = {}) noexcept {
        return post_one(
            [&](send_batch& b) { return b.fetch_add(result, dst, dst_offset, add, wr_id, f); });
    }
    /// See send_batch::bind_mw.
    status bind_mw(ibv_mw* mw, std::uint32_t rkey, ibv_mr* mr, std::uint64_t addr,
                   std::uint64_t length, rights window_rights, std::uint64_t wr_id,
                   send_flags f = {}) noexcept {
        return post_one([&](send_batch& b) {
            return b.bind_mw(mw, rkey, mr, addr, length, window_rights, wr_id, f);
        });
    }
    /// See send_batch::local_invalidate.
    status local_invalidate(std::uint32_t rkey, std::uint64_t wr_id, send_flags f = {}) noexcept {
        return post_one([&](send_batch& b) { return b.local_invalidate(rkey, wr_id, f); });
    }

private:
    friend class connection;
    queue_pair(const protection_domain& pd, const qp_config& cfg, rdma_cm_id* id);
    void mark_connected() noexcept;

    std::uint64_t peer_epoch_ = 0; ///< the peer issuer's incarnation; 0: unknown
};

/// Unreliable datagram queue pair: ready (RTS) once constructed.
template <>
class queue_pair<ud> : public queue_pair_base {
public:
    queue_pair(const protection_domain& pd, const qp_config& cfg = {});

    template <rights L>
    status send_to(local_buffer<L> src, const address_handle& to, std::uint64_t wr_id,
                   send_flags f = {}) noexcept {
        return post_one([&](send_batch& b) { return b.send_to(src, to, wr_id, f); });
    }
};

/// Connects two RC queue pairs of this process to each other (both ends on
/// one device, or two devices of one machine): the loopback pair of tests.
void connect_pair(queue_pair<rc>& a, queue_pair<rc>& b);

} // namespace rdmax::verbs
