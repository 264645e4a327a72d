#pragma once
// Shared receive queue: one pool of receive buffers for many queue pairs.

#include <cerrno>
#include <cstdint>
#include <iterator>
#include <span>

#include <infiniband/verbs.h>

#include <rdmax/mem/buffer.hpp>
#include <rdmax/status.hpp>
#include <rdmax/verbs/protection_domain.hpp>

namespace rdmax::verbs {

/// Move-only owner of an ibv_srq.
class shared_receive_queue {
public:
    /// `depth` receives outstanding at most; beyond the device's max_srq_wr, or
    /// `max_sge` beyond max_sge, is refused with an error naming the limit.
    shared_receive_queue(const protection_domain& pd, std::uint32_t depth,
                         std::uint32_t max_sge = 1);
    shared_receive_queue(shared_receive_queue&& other) noexcept;
    shared_receive_queue& operator=(shared_receive_queue&& other) noexcept;
    shared_receive_queue(const shared_receive_queue&) = delete;
    shared_receive_queue& operator=(const shared_receive_queue&) = delete;
    ~shared_receive_queue();

    [[nodiscard]] ibv_srq* get() const noexcept { return srq_; }
    [[nodiscard]] std::uint32_t max_sge() const noexcept { return max_sge_; }
    [[nodiscard]] int last_errno() const noexcept { return last_errno_; }

    /// Posts one receive into `dst` (which must allow local writes).
    template <rights A>
        requires(has(A, rights::local_write))
    status post_recv(local_buffer<A> dst, std::uint64_t wr_id) noexcept {
        if (dst.length == 0)
            return status::zero_length;
        ibv_sge sge{reinterpret_cast<std::uint64_t>(dst.addr), dst.length, dst.lkey};
        ibv_recv_wr wr{};
        wr.wr_id = wr_id;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        ibv_recv_wr* bad = nullptr;
        if (int rc = ibv_post_srq_recv(srq_, &wr, &bad); rc != 0) {
            last_errno_ = rc;
            return status::post_failed;
        }
        return status::ok;
    }

    /// Posts `count` receives with no buffer (at most 64 per call, one
    /// chain): what a write-with-immediate consumes, for its immediate alone.
    /// A send that lands on one fails there (local length error).
    status post_empty(std::uint32_t count, std::uint64_t wr_id) noexcept {
        if (count == 0)
            return status::zero_length;
        ibv_recv_wr wrs[64];
        if (count > std::size(wrs))
            return status::batch_full;
        for (std::uint32_t i = 0; i < count; ++i) {
            wrs[i] = ibv_recv_wr{};
            wrs[i].wr_id = wr_id;
            wrs[i].next = i + 1 < count ? &wrs[i + 1] : nullptr;
        }
        ibv_recv_wr* bad = nullptr;
        if (int rc = ibv_post_srq_recv(srq_, wrs, &bad); rc != 0) {
            last_errno_ = rc;
            return status::post_failed;
        }
        return status::ok;
    }

private:
    ibv_srq* srq_;
    std::uint32_t max_sge_;
    int last_errno_ = 0;
};

} // namespace rdmax::verbs
