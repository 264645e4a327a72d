// rpc::detail::handoff and group_routes: a server_group's hand-over of new
// connections to its workers (connection set-up only, never a call).

#include <algorithm>
#include <cerrno>
#include <limits>
#include <sys/eventfd.h>
#include <unistd.h>

#include <rdmax/detail/rpc/handoff.hpp>
#include <rdmax/error.hpp>

namespace rdmax::rpc::detail {

handoff::handoff()
    : fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (fd_ < 0)
        throw_error("eventfd", errno, "rpc::server_group worker mailbox");
}

handoff::~handoff() {
    ::close(fd_);
}

void handoff::post(handoff_item item) {
    {
        const std::lock_guard<std::mutex> hold(m_);
        items_.push_back(std::move(item));
        // Counted with the item, under the lock: a take() that finds the
        // item subtracts what was added, never before it.
        pending.fetch_add(1, std::memory_order_release);
    }
    wake();
}

void handoff::wake() noexcept {
    const std::uint64_t one = 1;
    // Cannot fail but by overflowing the counter (2^64 - 1 wakes unread).
    (void)!::write(fd_, &one, sizeof one);
}

std::vector<handoff_item> handoff::take() noexcept {
    std::uint64_t n = 0;
    (void)!::read(fd_, &n, sizeof n); // EAGAIN: nothing posted since the last take
    std::vector<handoff_item> out;
    // The eventfd is readable for other reasons too (a wake for stop or a
    // snapshot): the lock only when something was posted. post() counts an
    // item before it writes the eventfd, so one whose write was read here
    // is counted already; one counted later writes it again.
    if (pending.load(std::memory_order_acquire) == 0)
        return out;
    const std::lock_guard<std::mutex> hold(m_);
    out.swap(items_);
    return out;
}

void handoff::publish(const rpc_counters& c) noexcept {
    {
        const std::lock_guard<std::mutex> hold(m_);
        snapshot_ = c;
        ++snapshots_;
    }
    published_.notify_all();
}

rpc_counters handoff::snapshot(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> hold(m_);
    const std::uint64_t before = snapshots_;
    snapshot_wanted.store(true, std::memory_order_release);
    hold.unlock();
    wake();
    hold.lock();
    (void)published_.wait_for(hold, timeout, [&] { return snapshots_ != before; });
    return snapshot_;
}

group_routes::group_routes(std::size_t workers, std::size_t most_clients)
    : most_(std::max<std::size_t>(most_clients, 1)) {
    boxes_.reserve(workers);
    for (std::size_t i = 0; i < workers; ++i)
        boxes_.push_back(std::make_unique<handoff>());
}

std::size_t group_routes::least_loaded() const noexcept {
    std::size_t best = 0;
    std::size_t best_load = std::numeric_limits<std::size_t>::max();
    for (std::size_t i = 0; i < boxes_.size(); ++i) {
        const handoff& b = *boxes_[i];
        const std::size_t l =
            b.load.load(std::memory_order_acquire) + b.pending.load(std::memory_order_acquire);
        if (l < best_load) {
            best = i;
            best_load = l;
        }
    }
    return best;
}

std::optional<std::size_t> group_routes::owner(std::uint64_t incarnation) {
    const std::lock_guard<std::mutex> hold(m_);
    const auto it = owner_.find(incarnation);
    if (it == owner_.end())
        return std::nullopt;
    return it->second;
}

void group_routes::claim(std::uint64_t incarnation, std::size_t w) {
    const std::lock_guard<std::mutex> hold(m_);
    if (!owner_.insert_or_assign(incarnation, w).second)
        return; // known already: its place in the order stays
    order_.push_back(incarnation);
    while (order_.size() > most_) {
        owner_.erase(order_.front());
        order_.pop_front();
    }
}

} // namespace rdmax::rpc::detail
