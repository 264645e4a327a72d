#include <cerrno>
#include <poll.h>
#include <utility>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/verbs/completion_queue.hpp>

namespace rdmax::verbs {

namespace {
ibv_cq* create_cq(const context& ctx, std::uint32_t min_entries, completion_channel* channel) {
    if (min_entries == 0)
        throw_error("ibv_create_cq", EINVAL, "a completion queue needs at least one entry");
    if (min_entries > ctx.limits().max_cqe)
        throw_error("ibv_create_cq", EINVAL,
                    fmt::format("{} entries asked, {} allows at most {}", min_entries, ctx.name(),
                                ctx.limits().max_cqe));
    ibv_cq* cq = ibv_create_cq(ctx.get(), static_cast<int>(min_entries), nullptr,
                               channel != nullptr ? channel->get() : nullptr, 0);
    if (cq == nullptr)
        throw_error("ibv_create_cq", errno,
                    fmt::format("{} entries on {}", min_entries, ctx.name()));
    return cq;
}
} // namespace

completion_queue::completion_queue(const context& ctx, std::uint32_t min_entries,
                                   completion_channel* channel)
    : cq_(create_cq(ctx, min_entries, channel))
    , channel_(channel) {}

completion_queue::completion_queue(completion_queue&& other) noexcept
    : cq_(std::exchange(other.cq_, nullptr))
    , channel_(std::exchange(other.channel_, nullptr))
    , unacked_events_(std::exchange(other.unacked_events_, 0)) {}

completion_queue& completion_queue::operator=(completion_queue&& other) noexcept {
    if (this != &other) {
        release();
        cq_ = std::exchange(other.cq_, nullptr);
        channel_ = std::exchange(other.channel_, nullptr);
        unacked_events_ = std::exchange(other.unacked_events_, 0);
    }
    return *this;
}

completion_queue::~completion_queue() {
    release();
}

void completion_queue::release() noexcept {
    if (cq_ == nullptr)
        return;
    if (unacked_events_ != 0)
        ibv_ack_cq_events(cq_, unacked_events_); // destroy would wait for them forever
    ibv_destroy_cq(cq_);
    cq_ = nullptr;
}

int completion_queue::wait(std::span<ibv_wc> out, std::chrono::microseconds timeout) noexcept {
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + timeout;
    for (;;) {
        if (channel_ == nullptr) {
            // Spin: the lowest latency, and the caller chose no channel. Read
            // the clock only now and then: in a VM it may cost a microsecond
            // (hpet), more than a poll.
            for (unsigned i = 0; i < 1024; ++i)
                if (int n = poll(out); n != 0)
                    return n;
            if (clock::now() >= deadline)
                return 0;
            continue;
        }
        if (int n = poll(out); n != 0)
            return n;
        // Arm, then poll once more: a completion that landed before the arm
        // raises no event.
        if (ibv_req_notify_cq(cq_, 0) != 0)
            return -1;
        if (int n = poll(out); n != 0)
            return n;
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
        if (left.count() <= 0)
            return 0;
        pollfd pfd{channel_->fd(), POLLIN, 0};
        const int ready = ::poll(&pfd, 1, static_cast<int>(left.count()) + 1);
        if (ready < 0 && errno != EINTR)
            return -1;
        if (ready > 0) {
            ibv_cq* ev_cq = nullptr;
            void* ev_ctx = nullptr;
            if (ibv_get_cq_event(channel_->get(), &ev_cq, &ev_ctx) == 0) {
                // Acknowledge in batches: each ack takes a lock in the library.
                if (++unacked_events_ >= 64) {
                    ibv_ack_cq_events(cq_, unacked_events_);
                    unacked_events_ = 0;
                }
            }
        }
    }
}

} // namespace rdmax::verbs
