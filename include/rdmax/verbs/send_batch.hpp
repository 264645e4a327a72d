#pragma once
// send_batch: a chain of work requests a queue pair posts with one
// ibv_post_send (queue_pair::batch()), and send_flags, the per-request
// options every post takes. Each call checks its request against the queue
// pair (state, slots, SGEs, sizes, rights at compile time) and stages it, or
// returns why not, with nothing staged.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include <infiniband/verbs.h>

#include <rdmax/detail/verbs/send_slots.hpp>
#include <rdmax/mem/buffer.hpp>
#include <rdmax/mem/rights.hpp>
#include <rdmax/status.hpp>

namespace rdmax::verbs {

class address_handle;
class queue_pair_base;

/// Per-request options. Defaults: signaled, not fenced, inline when it fits.
struct send_flags {
    bool signaled = true;      ///< report a completion (failures are always reported)
    bool fence = false;        ///< wait for earlier reads/atomics before this one starts
    bool solicited = false;    ///< wake a peer that sleeps for solicited events
    bool force_inline = false; ///< refuse rather than fall back when data exceeds max_inline
};

/// A chain of work requests posted with one ibv_post_send. Obtained from a
/// queue pair's batch(); each call checks its request and stages it, or
/// returns why not; post() rings the doorbell once for all of them.
class send_batch {
public:
    explicit send_batch(queue_pair_base& qp) noexcept;
    send_batch(const send_batch&) = delete;
    send_batch& operator=(const send_batch&) = delete;
    ~send_batch(); ///< an unposted batch is dropped, its slots returned

    [[nodiscard]] std::uint32_t size() const noexcept { return count_; }

    template <rights L, rights R>
        requires(has(R, rights::remote_write))
    status write(local_buffer<L> src, remote_buffer<R> dst, std::uint64_t dst_offset,
                 std::uint64_t wr_id, send_flags f = {}) noexcept {
        return rdma(IBV_WR_RDMA_WRITE, std::span<const local_buffer<L>>(&src, 1), dst, dst_offset,
                    wr_id, f, std::nullopt);
    }
    template <rights L, rights R>
        requires(has(R, rights::remote_write))
    status write(std::span<const local_buffer<L>> srcs, remote_buffer<R> dst,
                 std::uint64_t dst_offset, std::uint64_t wr_id, send_flags f = {}) noexcept {
        return rdma(IBV_WR_RDMA_WRITE, srcs, dst, dst_offset, wr_id, f, std::nullopt);
    }
    /// RDMA write whose immediate arrives with a receive completion at the peer.
    template <rights L, rights R>
        requires(has(R, rights::remote_write))
    status write_imm(local_buffer<L> src, remote_buffer<R> dst, std::uint64_t dst_offset,
                     std::uint32_t imm, std::uint64_t wr_id, send_flags f = {}) noexcept {
        return rdma(IBV_WR_RDMA_WRITE_WITH_IMM, std::span<const local_buffer<L>>(&src, 1), dst,
                    dst_offset, wr_id, f, imm);
    }
    /// RDMA read into local memory, which must allow local writes.
    template <rights L, rights R>
        requires(has(L, rights::local_write) && has(R, rights::remote_read))
    status read(local_buffer<L> dst, remote_buffer<R> src, std::uint64_t src_offset,
                std::uint64_t wr_id, send_flags f = {}) noexcept {
        f.force_inline = false;
        return rdma(IBV_WR_RDMA_READ, std::span<const local_buffer<L>>(&dst, 1), src, src_offset,
                    wr_id, f, std::nullopt);
    }
    template <rights L, rights R>
        requires(has(L, rights::local_write) && has(R, rights::remote_read))
    status read(std::span<const local_buffer<L>> dsts, remote_buffer<R> src,
                std::uint64_t src_offset, std::uint64_t wr_id, send_flags f = {}) noexcept {
        f.force_inline = false;
        return rdma(IBV_WR_RDMA_READ, dsts, src, src_offset, wr_id, f, std::nullopt);
    }
    template <rights L>
    status send(local_buffer<L> src, std::uint64_t wr_id, send_flags f = {}) noexcept {
        return message(std::span<const local_buffer<L>>(&src, 1), wr_id, f, std::nullopt, nullptr);
    }
    template <rights L>
    status send(std::span<const local_buffer<L>> srcs, std::uint64_t wr_id,
                send_flags f = {}) noexcept {
        return message(srcs, wr_id, f, std::nullopt, nullptr);
    }
    template <rights L>
    status send_imm(local_buffer<L> src, std::uint32_t imm, std::uint64_t wr_id,
                    send_flags f = {}) noexcept {
        return message(std::span<const local_buffer<L>>(&src, 1), wr_id, f, imm, nullptr);
    }
    /// UD send to `to`.
    template <rights L>
    status send_to(local_buffer<L> src, const address_handle& to, std::uint64_t wr_id,
                   send_flags f = {}) noexcept {
        return message(std::span<const local_buffer<L>>(&src, 1), wr_id, f, std::nullopt, &to);
    }
    /// If the 8 bytes at dst + offset equal `expected`, store `desired`; the old
    /// value lands in `result` (8 bytes) either way.
    template <rights L, rights R>
        requires(has(L, rights::local_write) && has(R, rights::remote_atomic))
    status compare_swap(local_buffer<L> result, remote_buffer<R> dst, std::uint64_t dst_offset,
                        std::uint64_t expected, std::uint64_t desired, std::uint64_t wr_id,
                        send_flags f = {}) noexcept {
        return atomic(IBV_WR_ATOMIC_CMP_AND_SWP, as_sge(result), dst.addr, dst.length, dst.rkey,
                      dst_offset, expected, desired, wr_id, f);
    }
    /// Adds `add` to the 8 bytes at dst + offset; the old value lands in `result`.
    template <rights L, rights R>
        requires(has(L, rights::local_write) && has(R, rights::remote_atomic))
    status fetch_add(local_buffer<L> result, remote_buffer<R> dst, std::uint64_t dst_offset,
                     std::uint64_t add, std::uint64_t wr_id, send_flags f = {}) noexcept {
        return atomic(IBV_WR_ATOMIC_FETCH_AND_ADD, as_sge(result), dst.addr, dst.length, dst.rkey,
                      dst_offset, add, 0, wr_id, f);
    }

    /// Binds the type-2 memory window `mw` to [addr, addr + length) of `mr`
    /// (IBV_WR_BIND_MW), granting `rights` (remote ones only) under `rkey`:
    /// the window's key with a new low byte, ibv_inc_rkey(mw->rkey), so that
    /// no handle of an earlier binding matches. The window then answers only
    /// to requests that arrive on this queue pair (type 2 is tied to the QP it
    /// was bound through). `mr` must have been registered with
    /// rights::mw_bind, and with local_write when `rights` include remote
    /// write or atomic: ibv_mr does not say, and the device fails such a bind
    /// (IBV_WC_MW_BIND_ERR), which takes the queue pair to the error state.
    /// Once the bind has completed, set mw->rkey = rkey: the provider names
    /// the window by mw->rkey in the next bind.
    status bind_mw(ibv_mw* mw, std::uint32_t rkey, ibv_mr* mr, std::uint64_t addr,
                   std::uint64_t length, rights window_rights, std::uint64_t wr_id,
                   send_flags f = {}) noexcept;
    /// Invalidates the memory window whose key is `rkey` (IBV_WR_LOCAL_INV):
    /// once this completes the device refuses the key, and a type-2 window
    /// may be bound again (with a new key).
    status local_invalidate(std::uint32_t rkey, std::uint64_t wr_id, send_flags f = {}) noexcept;

    /// Posts every staged request with one ibv_post_send.
    status post() noexcept;
    /// How many requests of the last post()ed chain the device took: all of
    /// them after a success, those before the refused one after a failure.
    [[nodiscard]] std::uint32_t accepted() const noexcept { return accepted_; }

    // ---- for schedulers and send ports (sched::queue_pair_port), not applications ----

    /// Stages one work request over the single local range [addr, addr + length)
    /// under `lkey` whose rights the caller has already checked against typed
    /// buffers (a scheduler's slice of a request it took as local_buffer and
    /// remote_buffer): the typed calls above are what checks rights, so an
    /// application uses those. `op` is IBV_WR_SEND or IBV_WR_SEND_WITH_IMM, or
    /// an RDMA write or read of [remote_addr, remote_addr + length) under
    /// `rkey`. Everything else is checked as for the typed calls (state, slots,
    /// SGEs, message size, inline data), with the same statuses; any other
    /// opcode (atomics, binds, invalidations) is not_permitted here.
    status stage_for_port(ibv_wr_opcode op, const void* addr, std::uint32_t length,
                          std::uint32_t lkey, std::uint64_t remote_addr, std::uint32_t rkey,
                          std::uint64_t wr_id, send_flags f,
                          std::optional<std::uint32_t> imm) noexcept {
        if (op != IBV_WR_SEND && op != IBV_WR_SEND_WITH_IMM && op != IBV_WR_RDMA_WRITE &&
            op != IBV_WR_RDMA_WRITE_WITH_IMM && op != IBV_WR_RDMA_READ)
            return status::not_permitted;
        ibv_sge* sges = nullptr;
        if (status s = reserve(1, sges); s != status::ok)
            return s;
        sges[0] = {reinterpret_cast<std::uint64_t>(addr), length, lkey};
        if (op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM)
            return stage_message(1, length, wr_id, f, imm, nullptr);
        // A slice is its own remote range: the scheduler checked the request's.
        return stage_rdma(op, 1, length, remote_addr, length, rkey, 0, wr_id, f, imm);
    }

private:
    template <rights L>
    static ibv_sge as_sge(const local_buffer<L>& b) noexcept {
        return {reinterpret_cast<std::uint64_t>(b.addr), b.length, b.lkey};
    }
    template <rights L>
    status rdma(ibv_wr_opcode op, std::span<const local_buffer<L>> locals, const auto& remote,
                std::uint64_t offset, std::uint64_t wr_id, send_flags f,
                std::optional<std::uint32_t> imm) noexcept {
        ibv_sge* sges = nullptr;
        std::uint64_t total = 0;
        if (status s = gather(locals, sges, total); s != status::ok)
            return s;
        return stage_rdma(op, locals.size(), total, remote.addr, remote.length, remote.rkey, offset,
                          wr_id, f, imm);
    }
    template <rights L>
    status message(std::span<const local_buffer<L>> locals, std::uint64_t wr_id, send_flags f,
                   std::optional<std::uint32_t> imm, const address_handle* to) noexcept {
        ibv_sge* sges = nullptr;
        std::uint64_t total = 0;
        if (status s = gather(locals, sges, total); s != status::ok)
            return s;
        return stage_message(locals.size(), total, wr_id, f, imm, to);
    }
    /// Copies the buffers into the next staging slot's SGEs.
    template <rights L>
    status gather(std::span<const local_buffer<L>> locals, ibv_sge*& sges,
                  std::uint64_t& total) noexcept {
        if (status s = reserve(locals.size(), sges); s != status::ok)
            return s;
        for (std::size_t i = 0; i < locals.size(); ++i) {
            sges[i] = as_sge(locals[i]);
            total += locals[i].length;
        }
        return status::ok;
    }

    status reserve(std::size_t nsge, ibv_sge*& sges) noexcept;
    status stage_rdma(ibv_wr_opcode op, std::size_t nsge, std::uint64_t total, std::uint64_t raddr,
                      std::uint64_t rlen, std::uint32_t rkey, std::uint64_t offset,
                      std::uint64_t wr_id, send_flags f, std::optional<std::uint32_t> imm) noexcept;
    status stage_message(std::size_t nsge, std::uint64_t total, std::uint64_t wr_id, send_flags f,
                         std::optional<std::uint32_t> imm, const address_handle* to) noexcept;
    status atomic(ibv_wr_opcode op, ibv_sge result, std::uint64_t raddr, std::uint64_t rlen,
                  std::uint32_t rkey, std::uint64_t offset, std::uint64_t operand,
                  std::uint64_t swap, std::uint64_t wr_id, send_flags f) noexcept;
    status commit(ibv_send_wr& wr, std::uint64_t wr_id, send_flags f, bool inline_ok,
                  std::uint64_t total) noexcept;

    queue_pair_base& qp_;
    send_slots::checkpoint start_;
    std::uint32_t count_ = 0;
    std::uint32_t accepted_ = 0;
};

} // namespace rdmax::verbs
