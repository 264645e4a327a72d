#include <cerrno>
#include <utility>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/verbs/shared_receive_queue.hpp>

namespace rdmax::verbs {

namespace {
ibv_srq* create_srq(const protection_domain& pd, std::uint32_t depth, std::uint32_t max_sge) {
    const device_limits& lim = pd.device().limits();
    if (depth == 0 || depth > lim.max_srq_wr)
        throw_error(
            "ibv_create_srq", EINVAL,
            fmt::format("depth {} asked, {} allows 1..{}", depth, lim.name, lim.max_srq_wr));
    if (max_sge == 0 || max_sge > lim.max_sge)
        throw_error("ibv_create_srq", EINVAL,
                    fmt::format("{} SGEs asked, {} allows 1..{}", max_sge, lim.name, lim.max_sge));
    ibv_srq_init_attr attr{};
    attr.attr.max_wr = depth;
    attr.attr.max_sge = max_sge;
    ibv_srq* srq = ibv_create_srq(pd.get(), &attr);
    if (srq == nullptr)
        throw_error("ibv_create_srq", errno, fmt::format("depth {} on {}", depth, lim.name));
    return srq;
}
} // namespace

shared_receive_queue::shared_receive_queue(const protection_domain& pd, std::uint32_t depth,
                                           std::uint32_t max_sge)
    : srq_(create_srq(pd, depth, max_sge))
    , max_sge_(max_sge) {}

shared_receive_queue::shared_receive_queue(shared_receive_queue&& other) noexcept
    : srq_(std::exchange(other.srq_, nullptr))
    , max_sge_(other.max_sge_)
    , last_errno_(other.last_errno_) {}

shared_receive_queue& shared_receive_queue::operator=(shared_receive_queue&& other) noexcept {
    if (this != &other) {
        if (srq_ != nullptr)
            ibv_destroy_srq(srq_);
        srq_ = std::exchange(other.srq_, nullptr);
        max_sge_ = other.max_sge_;
        last_errno_ = other.last_errno_;
    }
    return *this;
}

shared_receive_queue::~shared_receive_queue() {
    if (srq_ != nullptr)
        ibv_destroy_srq(srq_);
}

} // namespace rdmax::verbs
