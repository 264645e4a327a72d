#include <algorithm>
#include <cerrno>
#include <sys/epoll.h>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/detail/rpc/inbox.hpp>
#include <rdmax/error.hpp>

namespace rdmax::rpc {

namespace {
std::uint32_t clamp_depth(const verbs::protection_domain& pd, std::uint32_t depth) {
    const verbs::device_limits& lim = pd.device().limits();
    return std::max<std::uint32_t>(
        64,
        std::min<std::uint32_t>({depth, lim.max_srq_wr, static_cast<std::uint32_t>(lim.max_cqe)}));
}
/// Receives given back in one chain.
constexpr std::uint32_t refill_batch = 32;
} // namespace

inbox::inbox(const verbs::protection_domain& pd, std::uint32_t depth)
    : channel_(std::in_place, pd.device())
    , cq_(std::in_place, pd.device(), clamp_depth(pd, depth), &*channel_)
    , srq_(std::in_place, pd, clamp_depth(pd, depth), 1)
    , depth_(clamp_depth(pd, depth)) {
    for (std::uint32_t posted = 0; posted < depth_;) {
        const std::uint32_t n = std::min(64U, depth_ - posted);
        if (srq_->post_empty(n, 0) != status::ok)
            throw_error("ibv_post_srq_recv", srq_->last_errno(),
                        fmt::format("{} zero-length receives", depth_));
        posted += n;
    }
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    if (epoll_fd_ < 0)
        throw_error("epoll_create1", errno, "rpc inbox");
    try {
        watch(channel_->fd());
    } catch (...) {
        ::close(epoll_fd_);
        throw;
    }
}

inbox::inbox(detail::no_device_t) {
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    if (epoll_fd_ < 0)
        throw_error("epoll_create1", errno, "rpc inbox");
}

inbox::~inbox() {
    if (epoll_fd_ >= 0)
        ::close(epoll_fd_);
}

void inbox::replenish(std::uint32_t n) noexcept {
    if (!srq_)
        return;
    owed_ += n;
    // In batches: one chain per refill_batch receives, while enough stay
    // posted (a peer that finds none waits for "receiver not ready" retries).
    while (owed_ >= refill_batch || (owed_ > 0 && owed_ * 4 >= depth_)) {
        const std::uint32_t k = std::min(owed_, 64U);
        if (srq_->post_empty(k, 0) != status::ok)
            return; // retried at the next call: the queue keeps what it had
        owed_ -= k;
    }
}

void inbox::watch(int fd) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0)
        throw_error("epoll_ctl(ADD)", errno, fmt::format("descriptor {}", fd));
}

void inbox::forget(int fd) noexcept {
    (void)epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
}

bool inbox::arm() noexcept {
    return !cq_ || ibv_req_notify_cq(cq_->get(), 0) == 0;
}

bool inbox::events_pending() noexcept {
    epoll_event evs[8];
    const int n = epoll_wait(epoll_fd_, evs, 8, 0);
    bool cm = false;
    for (int i = 0; i < n; ++i) {
        if (channel_ && evs[i].data.fd == channel_->fd())
            take_events(); // else it stays readable, level-triggered
        else
            cm = true;
    }
    return cm;
}

void inbox::sleep(std::chrono::microseconds timeout) noexcept {
    epoll_event evs[8];
    const int ms =
        static_cast<int>(std::clamp<std::int64_t>((timeout.count() + 999) / 1000, 0, 60'000));
    (void)epoll_wait(epoll_fd_, evs, 8, ms);
    take_events();
}

void inbox::take_events() noexcept {
    if (!channel_)
        return;
    ibv_cq* cq = nullptr;
    void* ctx = nullptr;
    unsigned n = 0;
    // Each event is acknowledged on its own queue: the receive queue's, or a
    // connection's send queue's (whose destruction waits for its events to be
    // acknowledged). The receive queue's are batched; a send queue raises one
    // only when its scheduler armed it before a sleep.
    while (ibv_get_cq_event(channel_->get(), &cq, &ctx) == 0) {
        if (cq == cq_->get())
            ++n;
        else
            ibv_ack_cq_events(cq, 1);
    }
    if (n != 0)
        ibv_ack_cq_events(cq_->get(), n);
}

} // namespace rdmax::rpc
