// rdmax showcase: what the library sees of this machine's RDMA devices.
// examples/demo builds and runs it on the best device available.
#include <cstdio>
#include <exception>

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

namespace {

void print_devices() {
    using namespace rdmax::verbs;
    const auto names = device_names();
    if (names.empty())
        throw rdmax::error("ibv_get_device_list", ENODEV, "this machine has no RDMA device");

    fmt::print("{:<10} {:>4}  {:<8} {:<10} {:>5} {:>5}  {:>3}  {:<26} {}\n", "device", "port",
               "state", "link", "mtu", "lid", "idx", "preferred gid", "type");
    for (const auto& name : names) {
        context ctx = context::open(name);
        for (std::uint8_t p = 1; p <= ctx.limits().phys_port_cnt; ++p) {
            const port_info port = ctx.port(p);
            const auto g = ctx.preferred_gid(p);
            fmt::print("{:<10} {:>4}  {:<8} {:<10} {:>5} {:>5}  {:>3}  {:<26} {}\n", name, p,
                       to_string(port.state), port.layer, mtu_bytes(port.active_mtu), port.lid,
                       g ? fmt::format("{}", g->index) : "-", g ? g->value.to_string() : "-",
                       g ? to_string(g->type) : "-");
        }
    }
    for (const auto& name : names) {
        context ctx = context::open(name);
        fmt::print("\nlimits of {}:\n{}", name, ctx.limits());
        for (std::uint8_t p = 1; p <= ctx.limits().phys_port_cnt; ++p)
            for (const gid_entry& e : ctx.gids(p))
                fmt::print("  gid[{}] port {}  {:<26} {}\n", e.index, p, e.value, e.type);
    }
}

} // namespace

int main() {
    try {
        fmt::print("rdmax showcase: RDMA devices\n\n");
        print_devices();
        return 0;
    } catch (const std::exception& e) {
        fmt::print(stderr, "showcase: {}\n", e.what());
        return 1;
    }
}
