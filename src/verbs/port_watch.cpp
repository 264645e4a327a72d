#include <algorithm>
#include <cerrno>
#include <fcntl.h>
#include <poll.h>

#include <rdmax/error.hpp>
#include <rdmax/verbs/port_watch.hpp>

namespace rdmax::verbs {

port_watch::port_watch(const rail_set& rails) {
    for (std::size_t d = 0; d < rails.domains(); ++d) {
        const context& c = rails.domain(d).device();
        const int fd = c.get()->async_fd;
        const int flags = fcntl(fd, F_GETFL);
        if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
            const int err = errno;
            restore_flags(); // the descriptors done so far
            throw_error("fcntl", err, "port_watch: a device's async descriptor");
        }
        devices_.push_back({&c, flags});
        fds_.push_back(fd);
        // Events queued before the watch (the device was open before: a
        // link that went down and came back) are stale: the ports' states
        // read below are where it starts.
        ibv_async_event e{};
        while (ibv_get_async_event(c.get(), &e) == 0)
            ibv_ack_async_event(&e);
    }
    for (std::size_t k = 0; k < rails.size(); ++k) {
        rails_.push_back({rails[k].domain, rails[k].port, rails[k].gid});
        up_.at(k) = rails.port_now(k).active();
    }
}

port_watch::~port_watch() {
    restore_flags();
}

void port_watch::restore_flags() noexcept {
    for (const watched_device& d : devices_)
        (void)fcntl(d.ctx->get()->async_fd, F_SETFL, d.flags);
}

void port_watch::pass(std::size_t device, ibv_event_type type, std::uint8_t port,
                      const std::function<void(const change&)>& on_change, std::size_t& changes) {
    // A dead device takes every rail on it down; a port event, that port's.
    const bool fatal = type == IBV_EVENT_DEVICE_FATAL;
    bool ours = false;
    for (std::size_t k = 0; k < rails_.size(); ++k) {
        if (rails_[k].domain != device || (!fatal && rails_[k].port != port))
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

std::size_t port_watch::poll(const std::function<void(const change&)>& on_change) {
    std::size_t changes = 0;
    for (std::size_t d = 0; d < devices_.size(); ++d) {
        // Readable first, whatever the descriptor's flags: another watch of
        // the device that went (against the one-watch rule) gave them back
        // blocking, and a read would then wait for the next event.
        const auto readable = [&] {
            pollfd p{fds_[d], POLLIN, 0};
            return ::poll(&p, 1, 0) == 1 && (p.revents & POLLIN) != 0;
        };
        ibv_async_event e{};
        while (readable() && ibv_get_async_event(devices_[d].ctx->get(), &e) == 0) {
            const ibv_event_type type = e.event_type;
            const bool port_event = type == IBV_EVENT_PORT_ERR || type == IBV_EVENT_PORT_ACTIVE;
            const bool ours = port_event || type == IBV_EVENT_DEVICE_FATAL;
            const std::uint8_t port =
                port_event ? static_cast<std::uint8_t>(e.element.port_num) : std::uint8_t{0};
            ibv_ack_async_event(&e); // before the callback: it may block or throw
            if (ours)
                pass(d, type, port, on_change, changes);
            else
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
    const watched_rail& r = rails_.at(k);
    const context& c = *devices_.at(r.domain).ctx;
    return c.port(r.port).active() && c.find_gid(r.port, r.gid.value, r.gid.type).has_value();
}

} // namespace rdmax::verbs
