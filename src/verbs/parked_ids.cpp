#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <vector>

#include <infiniband/verbs.h>

#include <rdmax/detail/verbs/parked_ids.hpp>

namespace rdmax::verbs::detail {
namespace {

/// rxe's vendor id (rdma_rxe reports 0xffffff).
constexpr std::uint32_t soft_roce_vendor = 0xffffff;

struct parked {
    rdma_cm_id* id;
    rdma_event_channel* channel;
};

void destroy(const parked& p) noexcept {
    destroy_id(p.id, p.channel);
}

/// The process's parked ids, and which devices are soft-RoCE. Never
/// destroyed: connections owned by static objects are torn down during
/// exit, possibly after any static here would be gone; ids still parked at
/// exit go with the process's rdma_cm file, as they would have anyway.
struct parking {
    std::mutex lock;
    std::vector<parked> ids;
    std::array<std::pair<const ibv_context*, bool>, 16> soft{}; ///< device: is soft-RoCE
};

parking& lot() noexcept {
    // Made once, before any connection can need it (a failed allocation here
    // ends the process, as noexcept says); never freed: see parking.
    static auto* const p =
        new parking; // NOLINT(cppcoreguidelines-owning-memory,bugprone-unhandled-exception-at-new)
    return *p;
}

bool is_soft_roce(ibv_context* ctx) noexcept {
    parking& p = lot();
    {
        const std::lock_guard<std::mutex> hold(p.lock);
        for (const auto& [c, soft] : p.soft)
            if (c == ctx)
                return soft;
    }
    ibv_device_attr attr{};
    const bool soft = ibv_query_device(ctx, &attr) == 0 && attr.vendor_id == soft_roce_vendor;
    const std::lock_guard<std::mutex> hold(p.lock);
    for (auto& entry : p.soft)
        if (entry.first == nullptr || entry.first == ctx) {
            entry = {ctx, soft};
            break;
        }
    return soft;
}

bool gid_present(ibv_context* ctx, std::uint8_t port, const ibv_gid& gid, int table_len) noexcept {
    try {
        std::vector<ibv_gid_entry> table(static_cast<std::size_t>(std::max(table_len, 1)));
        const ssize_t n = ibv_query_gid_table(ctx, table.data(), table.size(), 0);
        if (n < 0)
            return true; // cannot tell: tear down as before
        return std::any_of(table.begin(), table.begin() + n, [&](const ibv_gid_entry& e) {
            return e.port_num == port && std::memcmp(&e.gid, &gid, sizeof gid) == 0;
        });
    } catch (...) {
        return true;
    }
}

} // namespace

void destroy_id(rdma_cm_id* id, rdma_event_channel* channel) noexcept {
    // The channel never blocks (make_channel in connection.cpp): the loop
    // ends when nothing is pending.
    if (channel != nullptr) {
        rdma_cm_event* ev = nullptr;
        while (rdma_get_cm_event(channel, &ev) == 0)
            rdma_ack_cm_event(ev);
    }
    rdma_destroy_id(id);
    if (channel != nullptr)
        rdma_destroy_event_channel(channel);
}

bool may_send_mads(const rdma_cm_id* id) noexcept {
    if (id == nullptr || id->verbs == nullptr || id->port_num == 0 || !is_soft_roce(id->verbs))
        return true;
    ibv_port_attr attr{};
    if (ibv_query_port(id->verbs, id->port_num, &attr) != 0)
        return true; // cannot tell: tear down as before
    if (attr.state != IBV_PORT_ACTIVE && attr.state != IBV_PORT_ACTIVE_DEFER)
        return false;
    return gid_present(id->verbs, id->port_num, id->route.addr.addr.ibaddr.sgid, attr.gid_tbl_len);
}

void park(rdma_cm_id* id, rdma_event_channel* channel) noexcept {
    parking& p = lot();
    {
        const std::lock_guard<std::mutex> hold(p.lock);
        if (p.ids.size() < max_parked) {
            try {
                p.ids.push_back({id, channel});
                return;
            } catch (...) {
                // No memory to keep it: destroyed now, as it would have been.
            }
        }
    }
    destroy({id, channel});
}

void sweep_parked() noexcept {
    parking& p = lot();
    std::vector<parked> check;
    {
        const std::lock_guard<std::mutex> hold(p.lock);
        if (p.ids.empty())
            return;
        check.swap(p.ids); // looked at outside the lock: each look is a system call
    }
    std::vector<parked> still;
    for (const parked& d : check) {
        if (may_send_mads(d.id)) {
            destroy(d);
            continue;
        }
        try {
            still.push_back(d);
        } catch (...) {
            destroy(d); // no memory to keep it: as before the parking
        }
    }
    if (still.empty())
        return;
    const std::lock_guard<std::mutex> hold(p.lock);
    for (const parked& d : still) {
        try {
            p.ids.push_back(d);
        } catch (...) {
            destroy(d);
        }
    }
}

std::size_t parked_ids() noexcept {
    parking& p = lot();
    const std::lock_guard<std::mutex> hold(p.lock);
    return p.ids.size();
}

} // namespace rdmax::verbs::detail
