#include <algorithm>
#include <cerrno>
#include <fcntl.h>
#include <poll.h>

#include <rdmax/error.hpp>
#include <rdmax/verbs/port_watch.hpp>

namespace rdmax::verbs {

port_watch::port_watch(const rail_set& rails)
    : rails_(&rails) {
    for (std::size_t d = 0; d < rails.domains(); ++d) {
        ibv_context* c = rails.domain(d).device().get();
        const int flags = fcntl(c->async_fd, F_GETFL);
        if (flags < 0 || fcntl(c->async_fd, F_SETFL, flags | O_NONBLOCK) != 0)
            throw_error("fcntl", errno, "port_watch: a device's async descriptor");
        ctxs_.push_back(c);
        fds_.push_back(c->async_fd);
        // Events queued before the watch (the device was open before: a
        // link that went down and came back) are stale: the ports' states
        // read below are where it starts.
        ibv_async_event e{};
        while (ibv_get_async_event(c, &e) == 0)
            ibv_ack_async_event(&e);
    }
    for (std::size_t k = 0; k < rails.size(); ++k)
        up_.at(k) = rails.port_now(k).active();
}

std::size_t port_watch::poll(const std::function<void(const change&)>& on_change) {
    std::size_t changes = 0;
    for (std::size_t d = 0; d < ctxs_.size(); ++d) {
        ibv_async_event e{};
        while (ibv_get_async_event(ctxs_[d], &e) == 0) {
            const ibv_event_type type = e.event_type;
            const bool port_event = type == IBV_EVENT_PORT_ERR || type == IBV_EVENT_PORT_ACTIVE;
            const std::uint8_t port =
                port_event ? static_cast<std::uint8_t>(e.element.port_num) : 0;
            ibv_ack_async_event(&e); // before the callback: it may block or throw
            bool ours = false;
            for (std::size_t k = 0; port_event && k < rails_->size(); ++k) {
                const rail& r = (*rails_)[k];
                if (r.domain != d || r.port != port)
                    continue;
                ours = true;
                const change c{k, type == IBV_EVENT_PORT_ACTIVE};
                up_.at(k) = c.up;
                ++(c.up ? counters_.ups : counters_.downs);
                ++changes;
                on_change(c);
            }
            if (!ours)
                ++counters_.others;
        }
    }
    return changes;
}

std::size_t port_watch::wait(std::chrono::steady_clock::time_point deadline,
                             const std::function<void(const change&)>& on_change) {
    using namespace std::chrono;
    std::vector<pollfd> pfds;
    pfds.reserve(fds_.size());
    for (const int fd : fds_)
        pfds.push_back({fd, POLLIN, 0});
    for (;;) {
        if (const std::size_t n = poll(on_change); n != 0)
            return n;
        const auto left = duration_cast<milliseconds>(deadline - steady_clock::now()).count();
        if (left <= 0)
            return 0;
        // A bounded sleep: an event read by someone else leaves no wake-up.
        (void)::poll(pfds.data(), pfds.size(), static_cast<int>(std::min<long>(left, 100)));
    }
}

bool port_watch::ready(std::size_t k) const {
    const rail& r = (*rails_)[k];
    return rails_->port_now(k).active() &&
           rails_->device(k).find_gid(r.port, r.gid.value, r.gid.type).has_value();
}

} // namespace rdmax::verbs
