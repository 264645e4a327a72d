#pragma once
// The production SendPort: slices go to one RC queue pair through its send
// batches (one doorbell per scheduling pass), and its send completions come
// back through the queue pair's slot accounting.

#include <cstdint>
#include <optional>
#include <span>

#include <rdmax/sched/send_port.hpp>
#include <rdmax/status.hpp>
#include <rdmax/verbs/queue_pair.hpp>

namespace rdmax::sched {

class queue_pair_port {
public:
    explicit queue_pair_port(verbs::queue_pair<verbs::rc>& qp) noexcept
        : qp_(&qp)
        , batch_(qp) {}
    queue_pair_port(const queue_pair_port&) = delete;
    queue_pair_port& operator=(const queue_pair_port&) = delete;

    status stage(const slice_request& s) noexcept {
        const verbs::send_flags f{
            .signaled = s.signaled, .fence = s.fence, .solicited = s.solicited};
        const std::optional<std::uint32_t> imm =
            s.has_imm ? std::optional<std::uint32_t>(s.imm) : std::nullopt;
        return batch_.stage_for_port(s.opcode, s.local, s.length, s.lkey, s.remote_addr, s.rkey,
                                     s.id, f, imm);
    }
    status post() noexcept { return batch_.post(); }
    [[nodiscard]] std::uint32_t accepted() const noexcept { return batch_.accepted(); }
    void fail() noexcept { qp_->enter_error_for_port(); }
    int poll(std::span<verbs::completion> out) noexcept { return qp_->poll_send(out); }
    [[nodiscard]] std::uint32_t slots_free() const noexcept { return qp_->send_slots_free(); }
    [[nodiscard]] std::uint32_t max_rd_atomic() const noexcept { return qp_->max_rd_atomic(); }
    [[nodiscard]] std::uint32_t max_message() const noexcept { return qp_->max_message(); }
    [[nodiscard]] bool ready() const noexcept { return qp_->state() == IBV_QPS_RTS; }
    /// A send came back in error, or the queue pair was moved to the error
    /// state (fail(), a disconnect): either way nothing more is posted, and
    /// the scheduler must fail what it still holds. A queue pair moved there
    /// with nothing in flight brings no completion that would say so.
    [[nodiscard]] bool failed() const noexcept {
        return qp_->failed() || qp_->state() == IBV_QPS_ERR;
    }
    [[nodiscard]] std::uint32_t send_depth() const noexcept { return qp_->send_depth(); }
    [[nodiscard]] verbs::queue_pair<verbs::rc>& queue_pair() const noexcept { return *qp_; }

private:
    verbs::queue_pair<verbs::rc>* qp_;
    verbs::send_batch batch_;
};

static_assert(SendPort<queue_pair_port>);

} // namespace rdmax::sched
