#include "second_rail.hpp"

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <utility>

#include <fmt/format.h>

namespace rdmax::test {

namespace {

namespace fs = std::filesystem;

struct outcome {
    int status = -1; ///< the command's exit status; -1 if it did not exit
    std::string output;
};

/// Runs `cmd` under sh with stdin from /dev/null; its exit status and output.
outcome run(const std::string& cmd) {
    outcome r;
    const std::string full = cmd + " </dev/null 2>&1";
    FILE* p = popen(full.c_str(), "r"); // NOLINT(cert-env33-c): test set-up
    if (p == nullptr)
        return r;
    std::array<char, 512> buf{};
    std::size_t n = 0;
    while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0)
        r.output.append(buf.data(), n);
    const int st = pclose(p);
    if (st != -1 && WIFEXITED(st))
        r.status = WEXITSTATUS(st);
    while (!r.output.empty() && (r.output.back() == '\n' || r.output.back() == ' '))
        r.output.pop_back();
    return r;
}

bool succeeds(const std::string& cmd) {
    return run(cmd).status == 0;
}

/// Runs `cmd`; throws, with its output, if it fails.
void must(const std::string& cmd) {
    outcome r = run(cmd);
    if (r.status != 0)
        throw std::runtime_error(
            fmt::format("second_rail: `{}` failed (exit status {}): {}", cmd, r.status, r.output));
}

/// Names that need no quoting in a shell command: letters, digits, . _ -.
void check_name(const std::string& what, const std::string& name) {
    const bool plain = !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
               c == '.' || c == '_' || c == '-';
    });
    if (!plain)
        throw std::invalid_argument(fmt::format(
            "second_rail: {} '{}': letters, digits, '.', '_' and '-' only", what, name));
}

/// A GID as sysfs shows it: eight groups of four hex digits.
std::string sysfs_form(const verbs::gid& g) {
    std::string out;
    for (std::size_t i = 0; i < g.raw.size(); i += 2)
        out += fmt::format("{}{:02x}{:02x}", i == 0 ? "" : ":", g.raw[i], g.raw[i + 1]);
    return out;
}

std::string first_line(const fs::path& p) {
    std::ifstream f(p);
    std::string line;
    std::getline(f, line);
    return line;
}

} // namespace

second_rail::second_rail(std::string netdev, std::string device, std::string address,
                         unsigned prefix, std::chrono::milliseconds ready_within)
    : netdev_(std::move(netdev))
    , device_(std::move(device))
    , address_(std::move(address)) {
    check_name("netdev", netdev_);
    check_name("device", device_);
    const std::optional<verbs::gid> g = verbs::gid::parse(address_);
    if (!g || !g->is_ipv4_mapped() || address_.find(':') != std::string::npos || prefix > 32)
        throw std::invalid_argument(fmt::format(
            "second_rail: '{}/{}' is not an IPv4 address and prefix", address_, prefix));
    gid_ = *g;
    remove_leftovers();
    const auto deadline = clock::now() + ready_within;
    try {
        must(fmt::format("ip link add {} type dummy", netdev_));
        must(fmt::format("ip addr add {}/{} dev {}", address_, prefix, netdev_));
        must(fmt::format("ip link set {} up", netdev_));
        must(fmt::format("rdma link add {} type rxe netdev {}", device_, netdev_));
        if (!wait_active(deadline))
            throw std::runtime_error(fmt::format(
                "second_rail: {} on {} not ready within {} ms: port state '{}', GID {} {}", device_,
                netdev_, ready_within.count(), port_state(), gid_,
                has_gid() ? "present" : "absent"));
    } catch (...) {
        remove_now();
        throw;
    }
}

second_rail::~second_rail() {
    bool open_here = true;
    try {
        open_here = device_open_here();
    } catch (...) { // unknown: removed once this process has gone, as if open
    }
    if (!open_here) {
        remove_now();
        return;
    }
    (void)run(fmt::format("(while kill -0 {} 2>/dev/null; do sleep 0.1; done; rdma link delete {}; "
                          "ip link del {}) </dev/null >/dev/null 2>&1 &",
                          getpid(), device_, netdev_));
}

std::optional<std::string> second_rail::unavailable() {
    if (geteuid() != 0)
        return "makes its own netdev and soft-RoCE device: needs root";
    if (!succeeds("ip -V") || !succeeds("rdma -V"))
        return "needs the ip and rdma tools (iproute2)";
    if (!fs::exists("/sys/module/rdma_rxe") && !succeeds("modprobe rdma_rxe"))
        return "needs the rdma_rxe module (soft-RoCE)";
    // numdummies=0: loaded here, the module makes no dummy0 of its own.
    if (!fs::exists("/sys/module/dummy") && !succeeds("modprobe dummy numdummies=0"))
        return "needs the dummy module (dummy netdevs)";
    return std::nullopt;
}

void second_rail::down() const {
    must(fmt::format("ip link set {} down", netdev_));
}

void second_rail::up() const {
    must(fmt::format("ip link set {} up", netdev_));
}

std::string second_rail::port_state() const {
    // "4: ACTIVE"
    const std::string line =
        first_line(fs::path("/sys/class/infiniband") / device_ / "ports/1/state");
    const std::size_t colon = line.find(": ");
    return colon == std::string::npos ? line : line.substr(colon + 2);
}

bool second_rail::has_gid() const {
    const std::string want = sysfs_form(gid_);
    std::error_code ec;
    for (const auto& e :
         fs::directory_iterator(fs::path("/sys/class/infiniband") / device_ / "ports/1/gids", ec))
        if (first_line(e.path()) == want)
            return true;
    return false;
}

bool second_rail::wait_active(clock::time_point deadline) const {
    while (!active()) {
        if (clock::now() > deadline)
            return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
}

bool second_rail::wait_not_active(clock::time_point deadline) const {
    while (port_state() == "ACTIVE") {
        if (clock::now() > deadline)
            return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
}

void second_rail::remove_leftovers() const {
    if (fs::exists(fs::path("/sys/class/infiniband") / device_)) {
        if (device_open_here())
            throw std::runtime_error(fmt::format(
                "second_rail: {} exists and this process has it open (librdmacm keeps it until "
                "exit): one second_rail of a name a process",
                device_));
        // "link rxe1/1 state ACTIVE physical_state LINK_UP netdev dummy1"
        const outcome link = run(fmt::format("rdma link show {}/1", device_));
        if (link.output.find(" netdev " + netdev_) == std::string::npos)
            throw std::runtime_error(
                fmt::format("second_rail: an RDMA device {} exists and is not on {}: {}", device_,
                            netdev_, link.output));
        // A leftover some living process still holds would never go: bounded.
        must(fmt::format("timeout 10 rdma link delete {}", device_));
    }
    if (fs::exists(fs::path("/sys/class/net") / netdev_)) {
        const outcome link = run(fmt::format("ip -d -o link show {}", netdev_));
        if (link.output.find(" dummy ") == std::string::npos)
            throw std::runtime_error(
                fmt::format("second_rail: a netdev {0} exists and is not a dummy (`ip -d link "
                            "show {0}` says what it is)",
                            netdev_));
        must(fmt::format("ip link del {}", netdev_));
    }
}

void second_rail::remove_now() const noexcept {
    try {
        if (fs::exists(fs::path("/sys/class/infiniband") / device_))
            (void)run(fmt::format("timeout 10 rdma link delete {}", device_));
        (void)run(fmt::format("ip link del {}", netdev_));
    } catch (...) { // best effort: a leftover is removed by the next run
    }
}

bool second_rail::device_open_here() const {
    // /sys/class/infiniband_verbs/uverbsN/ibdev names the device of /dev/infiniband/uverbsN.
    // No such class (ib_uverbs not loaded): nothing can have the device open.
    std::string uverbs;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/sys/class/infiniband_verbs", ec))
        if (first_line(e.path() / "ibdev") == device_)
            uverbs = "/dev/infiniband/" + e.path().filename().string();
    if (uverbs.empty())
        return false;
    for (const auto& e : fs::directory_iterator("/proc/self/fd")) {
        if (fs::read_symlink(e.path(), ec).string() == uverbs)
            return true;
    }
    return false;
}

} // namespace rdmax::test
