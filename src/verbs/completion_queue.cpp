#include <cerrno>
#include <utility>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/verbs/completion_queue.hpp>

namespace rdmax::verbs {

namespace {
ibv_cq* create_cq(const context& ctx, std::uint32_t min_entries) {
    if (min_entries == 0)
        throw_error("ibv_create_cq", EINVAL, "a completion queue needs at least one entry");
    if (min_entries > ctx.limits().max_cqe)
        throw_error("ibv_create_cq", EINVAL,
                    fmt::format("{} entries asked, {} allows at most {}", min_entries, ctx.name(),
                                ctx.limits().max_cqe));
    ibv_cq* cq = ibv_create_cq(ctx.get(), static_cast<int>(min_entries), nullptr, nullptr, 0);
    if (cq == nullptr)
        throw_error("ibv_create_cq", errno,
                    fmt::format("{} entries on {}", min_entries, ctx.name()));
    return cq;
}
} // namespace

completion_queue::completion_queue(const context& ctx, std::uint32_t min_entries)
    : cq_(create_cq(ctx, min_entries)) {}

completion_queue::completion_queue(completion_queue&& other) noexcept
    : cq_(std::exchange(other.cq_, nullptr)) {}

completion_queue& completion_queue::operator=(completion_queue&& other) noexcept {
    if (this != &other) {
        if (cq_ != nullptr)
            ibv_destroy_cq(cq_);
        cq_ = std::exchange(other.cq_, nullptr);
    }
    return *this;
}

completion_queue::~completion_queue() {
    if (cq_ != nullptr)
        ibv_destroy_cq(cq_);
}

} // namespace rdmax::verbs
