#pragma once
// The SendPort concept: what the scheduler posts slices through. In
// production a queue_pair_port over one RC queue pair; in unit tests a
// simulated send queue that drains at a set rate.
//
// A slice is one work request. The port reports the completions of signaled
// slices, and of every failed one, with the slice's id, in posting order
// (an RC send queue completes in order, which is what lets one signaled
// slice retire every unsignaled one before it).

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include <infiniband/verbs.h>

#include <rdmax/status.hpp>
#include <rdmax/verbs/completion.hpp>

namespace rdmax::sched {

/// One work request, rights already checked by the scheduler's typed calls.
struct slice_request {
    std::uint64_t id = 0; ///< the port reports completions with it
    std::byte* local = nullptr;
    std::uint32_t length = 0;
    std::uint32_t lkey = 0;
    std::uint64_t remote_addr = 0; ///< RDMA operations only
    std::uint32_t rkey = 0;
    std::uint32_t imm = 0; ///< host order, when has_imm
    ibv_wr_opcode opcode = IBV_WR_RDMA_WRITE;
    bool has_imm = false;
    bool signaled = false;
    bool fence = false;
    bool solicited = false;
};

template <class P>
concept SendPort =
    requires(P& p, const P& cp, const slice_request& s, std::span<verbs::completion> out) {
        /// Adds the slice to the chain the next post() rings in.
        { p.stage(s) } noexcept -> std::same_as<status>;
        /// Posts the chain; on failure, accepted() tells how many of it the device took.
        { p.post() } noexcept -> std::same_as<status>;
        { cp.accepted() } noexcept -> std::convertible_to<std::uint32_t>;
        /// Moves the queue to the error state: everything posted completes, flushed.
        { p.fail() } noexcept;
        /// Completions of signaled and failed slices, without blocking.
        { p.poll(out) } noexcept -> std::same_as<int>;
        { cp.slots_free() } noexcept -> std::convertible_to<std::uint32_t>;
        { cp.max_rd_atomic() } noexcept -> std::convertible_to<std::uint32_t>;
        { cp.max_message() } noexcept -> std::convertible_to<std::uint32_t>;
        { cp.ready() } noexcept -> std::convertible_to<bool>;
        /// The queue failed (a completion in error, whoever posted the
        /// request): stage() refuses with qp_failed, and what was posted
        /// completes flushed.
        { cp.failed() } noexcept -> std::convertible_to<bool>;
    };

} // namespace rdmax::sched
