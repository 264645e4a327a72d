#include <cerrno>
#include <fcntl.h>
#include <utility>

#include <rdmax/error.hpp>
#include <rdmax/verbs/completion_channel.hpp>

namespace rdmax::verbs {

completion_channel::completion_channel(const context& ctx)
    : ch_(ibv_create_comp_channel(ctx.get())) {
    if (ch_ == nullptr)
        throw_error("ibv_create_comp_channel", errno, ctx.name());
    // Non-blocking, so that a wait with a deadline never sleeps in ibv_get_cq_event.
    const int flags = fcntl(ch_->fd, F_GETFL);
    if (flags < 0 || fcntl(ch_->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        const int err = errno;
        ibv_destroy_comp_channel(ch_);
        throw_error("fcntl(O_NONBLOCK)", err, "completion channel");
    }
}

completion_channel::completion_channel(completion_channel&& other) noexcept
    : ch_(std::exchange(other.ch_, nullptr)) {}

completion_channel& completion_channel::operator=(completion_channel&& other) noexcept {
    if (this != &other) {
        if (ch_ != nullptr)
            ibv_destroy_comp_channel(ch_);
        ch_ = std::exchange(other.ch_, nullptr);
    }
    return *this;
}

completion_channel::~completion_channel() {
    if (ch_ != nullptr)
        ibv_destroy_comp_channel(ch_);
}

} // namespace rdmax::verbs
