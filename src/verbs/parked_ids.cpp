#include "parked_ids.hpp"

#include <mutex>
#include <vector>

#include <infiniband/verbs.h>

namespace rdmax::verbs::detail {
namespace {

struct parked {
    rdma_cm_id* id;
    rdma_event_channel* channel;
};

void destroy(const parked& p) noexcept {
    // Acknowledge whatever is pending: rdma_destroy_id waits for that.
    if (p.channel != nullptr) {
        rdma_cm_event* ev = nullptr;
        while (rdma_get_cm_event(p.channel, &ev) == 0)
            rdma_ack_cm_event(ev);
    }
    rdma_destroy_id(p.id);
    if (p.channel != nullptr)
        rdma_destroy_event_channel(p.channel);
}

/// The parked ids of the process. Ids parked at exit are destroyed then
/// (the kernel would destroy them when the process's rdma_cm file closes).
struct parking {
    std::mutex lock;
    std::vector<parked> ids;
    ~parking() {
        for (const parked& p : ids)
            destroy(p);
    }
};

parking& lot() noexcept {
    static parking p;
    return p;
}

} // namespace

bool port_active(const rdma_cm_id* id) noexcept {
    if (id == nullptr || id->verbs == nullptr || id->port_num == 0)
        return true;
    ibv_port_attr attr{};
    if (ibv_query_port(id->verbs, id->port_num, &attr) != 0)
        return true; // cannot tell: tear down as before
    return attr.state == IBV_PORT_ACTIVE;
}

void park(rdma_cm_id* id, rdma_event_channel* channel) noexcept {
    parking& p = lot();
    {
        const std::lock_guard<std::mutex> hold(p.lock);
        try {
            p.ids.push_back({id, channel});
            return;
        } catch (...) {
            // No memory to keep it: destroyed now, as it would have been.
        }
    }
    destroy({id, channel});
}

void sweep_parked() noexcept {
    parking& p = lot();
    std::vector<parked> due;
    {
        const std::lock_guard<std::mutex> hold(p.lock);
        if (p.ids.empty())
            return;
        for (auto it = p.ids.begin(); it != p.ids.end();) {
            if (!port_active(it->id)) {
                ++it;
                continue;
            }
            try {
                due.push_back(*it);
            } catch (...) {
                break; // the rest wait for the next sweep
            }
            it = p.ids.erase(it);
        }
    }
    for (const parked& d : due)
        destroy(d); // outside the lock: destroying an id may block on its events
}

std::size_t parked_ids() noexcept {
    parking& p = lot();
    const std::lock_guard<std::mutex> hold(p.lock);
    return p.ids.size();
}

} // namespace rdmax::verbs::detail
