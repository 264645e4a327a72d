// rdmax-info: what rdmax would use on this machine, as ucx_info shows UCX's.
// Every knob with its value and where it came from, the RDMA devices and
// their limits, the kernel module, and the monitor `auto` would pick.
//
//   rdmax-info              all of it
//   rdmax-info --markdown   the knobs as rows of the README's table
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fcntl.h>
#include <string>
#include <string_view>
#include <sys/ioctl.h>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/config/knobs.hpp>
#include <rdmax/mem/auto_monitor.hpp>
#include <rdmax/mem/rcache_options.hpp>
#include <rdmax/verbs/context.hpp>
#include <rdmax/version.hpp>

#include "rdmax_kmod.h"

namespace {

using rdmax::config::knob_row;

void print_knobs(const std::vector<knob_row>& rows) {
    fmt::print("# Knobs (value, where it came from; options passed in code override these)\n");
    for (const knob_row& r : rows) {
        fmt::print("{:<30} = {:<10} {:<11} {}\n", r.name, r.value, to_string(r.from), r.doc);
        fmt::print("{:<30}   accepts {}{}\n", "", r.range,
                   r.value == r.default_value ? "" : fmt::format("; default {}", r.default_value));
        if (!r.problem.empty())
            fmt::print("{:<30}   REFUSED: {}\n", "", r.problem);
    }
}

void print_markdown(const std::vector<knob_row>& rows) {
    fmt::print("| variable | default | meaning |\n|---|---|---|\n");
    for (const knob_row& r : rows)
        fmt::print("| `{}` | `{}` | {} |\n", r.name, r.default_value, r.doc);
}

void print_devices() {
    fmt::print("\n# RDMA devices\n");
    std::vector<std::string> names;
    try {
        names = rdmax::verbs::device_names();
    } catch (const std::exception& e) {
        fmt::print("none: {}\n", e.what());
        return;
    }
    if (names.empty()) {
        fmt::print("none: this machine has no RDMA device (ibv_get_device_list found none)\n");
        return;
    }
    for (const std::string& name : names) {
        try {
            const rdmax::verbs::context ctx = rdmax::verbs::context::open(name);
            fmt::print("{}", ctx.limits());
        } catch (const std::exception& e) {
            fmt::print("{}: cannot be opened: {}\n", name, e.what());
        }
    }
}

void print_module() {
    fmt::print("\n# Kernel module\n");
    if (::access(RDMAX_KMOD_DEVICE, F_OK) != 0) {
        fmt::print("{}: absent (the rdmax module is not loaded; kmod/build, then insmod)\n",
                   RDMAX_KMOD_DEVICE);
        return;
    }
    const int fd = ::open(RDMAX_KMOD_DEVICE, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        fmt::print("{}: present, cannot be opened: {}\n", RDMAX_KMOD_DEVICE, std::strerror(errno));
        return;
    }
    rdmax_query q{};
    const bool ok = ::ioctl(fd, RDMAX_IOC_QUERY, &q) == 0;
    const int err = errno;
    ::close(fd);
    if (!ok) {
        fmt::print("{}: present, RDMAX_IOC_QUERY failed: {}\n", RDMAX_KMOD_DEVICE,
                   std::strerror(err));
        return;
    }
    // Set where the module declares a version (MODULE_VERSION) or the kernel records its source's.
    std::string version;
    for (const char* file : {"/sys/module/rdmax/version", "/sys/module/rdmax/srcversion"}) {
        std::FILE* f = std::fopen(file, "r");
        if (f == nullptr)
            continue;
        char line[64] = {};
        if (std::fgets(line, sizeof line, f) != nullptr && version.empty())
            version = fmt::format(", {} {}", std::strrchr(file, '/') + 1,
                                  std::string_view(line, std::strcspn(line, "\n")));
        std::fclose(f);
    }
    fmt::print("{}: present, ABI {} ({}){}, {} slots per open file\n", RDMAX_KMOD_DEVICE,
               q.abi_version,
               q.abi_version == RDMAX_KMOD_ABI_VERSION
                   ? "this library's"
                   : fmt::format("this library speaks {}", RDMAX_KMOD_ABI_VERSION),
               version, q.max_regions);
}

void print_monitor() {
    fmt::print("\n# Registration cache monitor\n");
    rdmax::rcache_options o;
    try {
        o = rdmax::rcache_options{}.with_env();
    } catch (const std::exception& e) {
        fmt::print("RDMAX_RCACHE_MONITOR cannot be read: {}\n", e.what());
        return;
    }
    const rdmax::monitor_choice auto_pick = rdmax::predict_monitor(rdmax::monitor_kind::automatic);
    fmt::print("auto would pick: {} ({})\n", to_string(auto_pick.kind), auto_pick.why);
    if (o.monitor != rdmax::monitor_kind::automatic) {
        const rdmax::monitor_choice c = rdmax::predict_monitor(o.monitor);
        fmt::print("RDMAX_RCACHE_MONITOR={}: {} ({})\n", to_string(o.monitor), to_string(c.kind),
                   c.why);
    }
    if (o.on_demand)
        fmt::print("with RDMAX_RCACHE_ODP=1 a verbs cache watches nothing where the device "
                   "passes the ODP check\n");
}

} // namespace

int main(int argc, char** argv) {
    try {
        const std::vector<knob_row> rows = rdmax::config::knobs_from_env();
        if (argc > 1 && std::string_view(argv[1]) == "--markdown") {
            print_markdown(rows);
            return 0;
        }
        if (argc > 1) {
            fmt::print(stderr, "usage: rdmax-info [--markdown]\n");
            return 2;
        }
        fmt::print("# rdmax {}\n\n", rdmax::version_string);
        print_knobs(rows);
        print_devices();
        print_module();
        print_monitor();
        return 0;
    } catch (const std::exception& e) {
        fmt::print(stderr, "rdmax-info: {}\n", e.what());
        return 1;
    }
}
