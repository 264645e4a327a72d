#include <algorithm>
#include <arpa/inet.h>
#include <cerrno>
#include <memory>
#include <netinet/in.h>
#include <span>
#include <sys/socket.h>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <rdma/rdma_cma.h>

#include <rdmax/error.hpp>
#include <rdmax/verbs/context.hpp>

namespace rdmax::verbs {

namespace {

/// The device list, freed on every path out.
struct device_list {
    int count = 0;
    using owner = std::unique_ptr<ibv_device*[], decltype(&ibv_free_device_list)>;
    owner devices{nullptr, &ibv_free_device_list};

    device_list() {
        devices.reset(ibv_get_device_list(&count));
        if (!devices) {
            // ENOSYS: no kernel RDMA support at all; that is "no devices", not a failure.
            if (errno == ENOSYS)
                count = 0;
            else
                throw_error("ibv_get_device_list", errno);
        }
    }
    [[nodiscard]] std::span<ibv_device*> all() const noexcept {
        return {devices.get(), static_cast<std::size_t>(devices ? count : 0)};
    }
};

device_limits query_limits(ibv_context* ctx) {
    ibv_device_attr_ex attr{};
    if (int rc = ibv_query_device_ex(ctx, nullptr, &attr); rc != 0)
        throw_error("ibv_query_device_ex", rc, ibv_get_device_name(ctx->device));
    const ibv_device_attr& a = attr.orig_attr;
    device_limits l;
    l.name = ibv_get_device_name(ctx->device);
    l.firmware = a.fw_ver;
    l.max_mr_size = a.max_mr_size;
    l.page_size_cap = a.page_size_cap;
    l.max_qp = static_cast<std::uint32_t>(a.max_qp);
    l.max_qp_wr = static_cast<std::uint32_t>(a.max_qp_wr);
    l.max_sge = static_cast<std::uint32_t>(a.max_sge);
    l.max_sge_rd = static_cast<std::uint32_t>(a.max_sge_rd);
    l.max_cq = static_cast<std::uint32_t>(a.max_cq);
    l.max_cqe = static_cast<std::uint32_t>(a.max_cqe);
    l.max_mr = static_cast<std::uint32_t>(a.max_mr);
    l.max_pd = static_cast<std::uint32_t>(a.max_pd);
    l.max_mw = static_cast<std::uint32_t>(a.max_mw);
    l.max_srq = static_cast<std::uint32_t>(a.max_srq);
    l.max_srq_wr = static_cast<std::uint32_t>(a.max_srq_wr);
    l.max_qp_rd_atom = static_cast<std::uint32_t>(a.max_qp_rd_atom);
    l.max_qp_init_rd_atom = static_cast<std::uint32_t>(a.max_qp_init_rd_atom);
    l.phys_port_cnt = a.phys_port_cnt;
    l.atomics = a.atomic_cap != IBV_ATOMIC_NONE;
    l.mw_type_2a = (a.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2A) != 0;
    l.mw_type_2b = (a.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B) != 0;
    l.memory_windows = l.mw_type_2a || l.mw_type_2b;
    l.on_demand_paging = (attr.odp_caps.general_caps & IBV_ODP_SUPPORT) != 0;
    l.odp_rc_caps = attr.odp_caps.per_transport_caps.rc_odp_caps;
    l.odp_ud_caps = attr.odp_caps.per_transport_caps.ud_odp_caps;
    return l;
}

gid_type from_ibv(unsigned t) noexcept {
    switch (t) {
    case IBV_GID_TYPE_ROCE_V1: return gid_type::roce_v1;
    case IBV_GID_TYPE_ROCE_V2: return gid_type::roce_v2;
    default: return gid_type::ib;
    }
}

} // namespace

std::vector<std::string> device_names() {
    std::vector<std::string> names;
    const device_list list; // named: a temporary would be freed before the loop runs
    for (ibv_device* dev : list.all())
        names.emplace_back(ibv_get_device_name(dev));
    return names;
}

context::context(ibv_context* ctx, bool owned)
    : ctx_(ctx)
    , owned_(owned) {
    try {
        limits_ = query_limits(ctx_);
    } catch (...) {
        if (owned_)
            ibv_close_device(ctx_);
        throw;
    }
}

namespace {
/// librdmacm's device contexts, or an empty span where rdma_cm is unavailable
/// (no rdma_ucm module, no /dev/infiniband/rdma_cm).
struct cm_devices {
    int count = 0;
    ibv_context** list = rdma_get_devices(&count);
    cm_devices() = default;
    cm_devices(const cm_devices&) = delete;
    cm_devices& operator=(const cm_devices&) = delete;
    ~cm_devices() {
        if (list != nullptr)
            rdma_free_devices(list);
    }
    [[nodiscard]] std::span<ibv_context*> all() const noexcept {
        return {list, list != nullptr ? static_cast<std::size_t>(count) : 0};
    }
};
} // namespace

context context::borrow(ibv_context* cm_context) {
    return context(cm_context, false);
}

context context::open_by_address(std::string_view ip, std::uint8_t* port) {
    const std::string text(ip);
    sockaddr_storage ss{};
    auto* v4 = reinterpret_cast<sockaddr_in*>(&ss);
    auto* v6 = reinterpret_cast<sockaddr_in6*>(&ss);
    if (inet_pton(AF_INET, text.c_str(), &v4->sin_addr) == 1)
        v4->sin_family = AF_INET;
    else if (inet_pton(AF_INET6, text.c_str(), &v6->sin6_addr) == 1)
        v6->sin6_family = AF_INET6;
    else
        throw_error("rdma_bind_addr", EINVAL, fmt::format("'{}' is not an IP address", ip));
    rdma_event_channel* ch = rdma_create_event_channel();
    if (ch == nullptr)
        throw_error("rdma_create_event_channel", errno,
                    "rdma_cm is unavailable (rdma_ucm module?)");
    rdma_cm_id* id = nullptr;
    if (rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) != 0) {
        const int err = errno;
        rdma_destroy_event_channel(ch);
        throw_error("rdma_create_id", err);
    }
    // Binding to a local address ties the id to the device that carries it.
    const int rc = rdma_bind_addr(id, reinterpret_cast<sockaddr*>(&ss));
    const int err = errno;
    ibv_context* verbs = rc == 0 ? id->verbs : nullptr;
    const std::uint8_t p = rc == 0 ? id->port_num : 0;
    rdma_destroy_id(id);
    rdma_destroy_event_channel(ch);
    if (rc != 0)
        throw_error("rdma_bind_addr", err, fmt::format("{} is not an address of this machine", ip));
    if (verbs == nullptr)
        throw_error("rdma_bind_addr", ENODEV, fmt::format("no RDMA device carries {}", ip));
    if (port != nullptr)
        *port = p;
    return context(verbs, false);
}

context context::open(std::string_view name) {
    {
        const cm_devices cm;
        for (ibv_context* c : cm.all())
            if (name == ibv_get_device_name(c->device))
                return context(c, false);
    }
    device_list list;
    std::vector<std::string> present;
    for (ibv_device* dev : list.all()) {
        if (name == ibv_get_device_name(dev)) {
            ibv_context* ctx = ibv_open_device(dev);
            if (ctx == nullptr)
                throw_error("ibv_open_device", errno, name);
            return context(ctx, true);
        }
        present.emplace_back(ibv_get_device_name(dev));
    }
    throw_error(
        "ibv_open_device", ENODEV,
        present.empty()
            ? fmt::format("no device named '{}': this machine has no RDMA device", name)
            : fmt::format("no device named '{}'; present: {}", name, fmt::join(present, ", ")));
}

context context::open_first_active() {
    {
        const cm_devices cm;
        for (ibv_context* c : cm.all()) {
            context ctx(c, false);
            for (std::uint8_t p = 1; p <= ctx.limits().phys_port_cnt; ++p)
                if (ctx.port(p).active())
                    return ctx;
        }
    }
    device_list list;
    for (ibv_device* dev : list.all()) {
        ibv_context* raw = ibv_open_device(dev);
        if (raw == nullptr)
            continue;
        context ctx(raw, true);
        for (std::uint8_t p = 1; p <= ctx.limits().phys_port_cnt; ++p)
            if (ctx.port(p).active())
                return ctx;
    }
    throw_error("ibv_open_device", ENODEV,
                list.all().empty() ? "this machine has no RDMA device"
                                   : "no RDMA device has an ACTIVE port");
}

context::context(context&& other) noexcept
    : ctx_(std::exchange(other.ctx_, nullptr))
    , owned_(std::exchange(other.owned_, false))
    , limits_(std::move(other.limits_)) {}

context& context::operator=(context&& other) noexcept {
    if (this != &other) {
        if (ctx_ != nullptr && owned_)
            ibv_close_device(ctx_);
        ctx_ = std::exchange(other.ctx_, nullptr);
        owned_ = std::exchange(other.owned_, false);
        limits_ = std::move(other.limits_);
    }
    return *this;
}

context::~context() {
    if (ctx_ != nullptr && owned_)
        ibv_close_device(ctx_);
}

port_info context::port(std::uint8_t number) const {
    if (number == 0 || number > limits_.phys_port_cnt)
        throw_error(
            "ibv_query_port", EINVAL,
            fmt::format("{} has ports 1..{}, not {}", name(), limits_.phys_port_cnt, number));
    ibv_port_attr attr{};
    if (int rc = ibv_query_port(ctx_, number, &attr); rc != 0)
        throw_error("ibv_query_port", rc, fmt::format("{} port {}", name(), number));
    port_info p;
    p.number = number;
    p.state = attr.state;
    p.layer = attr.link_layer == IBV_LINK_LAYER_ETHERNET     ? link_layer::ethernet
              : attr.link_layer == IBV_LINK_LAYER_INFINIBAND ? link_layer::infiniband
                                                             : link_layer::unspecified;
    p.active_mtu = attr.active_mtu;
    p.max_mtu = attr.max_mtu;
    p.lid = attr.lid;
    p.gid_table_len = static_cast<std::uint32_t>(attr.gid_tbl_len);
    p.max_msg_size = attr.max_msg_sz;
    p.active_speed = attr.active_speed;
    p.active_width = attr.active_width;
    return p;
}

double port_info::gbps() const noexcept {
    // ibv_port_attr's codes (verbs.h, ibv_query_port(3)).
    double lane = 0;
    switch (active_speed) {
    case 1: lane = 2.5; break;       // SDR
    case 2: lane = 5.0; break;       // DDR
    case 4: lane = 10.0; break;      // QDR
    case 8: lane = 10.3125; break;   // FDR10
    case 16: lane = 14.0625; break;  // FDR
    case 32: lane = 25.78125; break; // EDR
    case 64: lane = 50.0; break;     // HDR
    case 128: lane = 100.0; break;   // NDR
    default: return 0;
    }
    unsigned lanes = 0;
    switch (active_width) {
    case 1: lanes = 1; break;
    case 2: lanes = 4; break;
    case 4: lanes = 8; break;
    case 8: lanes = 12; break;
    case 16: lanes = 2; break;
    default: return 0;
    }
    return lane * lanes;
}

std::vector<gid_entry> context::gids(std::uint8_t port_number) const {
    const port_info p = port(port_number);
    std::vector<gid_entry> out;
    for (std::uint32_t i = 0; i < p.gid_table_len; ++i) {
        ibv_gid_entry e{};
        // ENODATA marks an empty slot; the table may have holes.
        if (int rc = ibv_query_gid_ex(ctx_, port_number, i, &e, 0); rc != 0) {
            if (rc == ENODATA || rc == EINVAL)
                continue;
            throw_error("ibv_query_gid_ex", rc,
                        fmt::format("{} port {} index {}", name(), port_number, i));
        }
        gid_entry g{gid::from(e.gid), e.gid_index, port_number, from_ibv(e.gid_type),
                    e.ndev_ifindex};
        if (!g.value.is_zero())
            out.push_back(g);
    }
    return out;
}

std::optional<gid_entry> context::find_gid(std::uint8_t port_number, const gid& value,
                                           gid_type type) const {
    for (const gid_entry& e : gids(port_number))
        if (e.value == value && e.type == type)
            return e;
    return std::nullopt;
}

std::optional<gid_entry> context::preferred_gid(std::uint8_t port_number) const {
    const std::vector<gid_entry> table = gids(port_number);
    if (table.empty())
        return std::nullopt;
    auto rank = [](const gid_entry& e) {
        if (e.type == gid_type::roce_v2)
            return e.value.is_ipv4_mapped() ? 0 : 1;
        return e.type == gid_type::ib ? 2 : 3;
    };
    return *std::min_element(
        table.begin(), table.end(),
        [&](const gid_entry& a, const gid_entry& b) { return rank(a) < rank(b); });
}

std::string_view to_string(ibv_port_state s) noexcept {
    switch (s) {
    case IBV_PORT_NOP: return "NOP";
    case IBV_PORT_DOWN: return "DOWN";
    case IBV_PORT_INIT: return "INIT";
    case IBV_PORT_ARMED: return "ARMED";
    case IBV_PORT_ACTIVE: return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER: return "ACTIVE_DEFER";
    }
    return "unknown";
}

} // namespace rdmax::verbs
