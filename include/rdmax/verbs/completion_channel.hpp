#pragma once
// Completion channel: lets a thread sleep until a completion queue has work,
// instead of spinning.

#include <infiniband/verbs.h>

#include <rdmax/verbs/context.hpp>

namespace rdmax::verbs {

/// Move-only owner of an ibv_comp_channel; its fd is non-blocking.
class completion_channel {
public:
    explicit completion_channel(const context& ctx);
    completion_channel(completion_channel&& other) noexcept;
    completion_channel& operator=(completion_channel&& other) noexcept;
    completion_channel(const completion_channel&) = delete;
    completion_channel& operator=(const completion_channel&) = delete;
    ~completion_channel();

    [[nodiscard]] ibv_comp_channel* get() const noexcept { return ch_; }
    [[nodiscard]] int fd() const noexcept { return ch_->fd; }

private:
    ibv_comp_channel* ch_;
};

} // namespace rdmax::verbs
