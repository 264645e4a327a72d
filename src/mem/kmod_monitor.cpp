// The user-space side of /dev/rdmax. See kmod_monitor.hpp and
// kmod/uapi/rdmax_kmod.h.
#include <cerrno>
#include <cstddef>
#include <fcntl.h>
#include <mutex>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/fork_policy.hpp>
#include <rdmax/mem/kmod_monitor.hpp>

#include "../notice.hpp"
#include "rdmax_kmod.h"

namespace rdmax {

bool kmod_monitor::available() noexcept {
    static const bool yes = [] {
        const int fd = open(RDMAX_KMOD_DEVICE, O_RDWR | O_CLOEXEC);
        if (fd < 0)
            return false;
        rdmax_query q{};
        const bool ok =
            ioctl(fd, RDMAX_IOC_QUERY, &q) == 0 && q.abi_version == RDMAX_KMOD_ABI_VERSION;
        close(fd);
        return ok;
    }();
    return yes;
}

kmod_monitor::kmod_monitor()
    : fork_generation_(fork_generation()) {
    fd_ = open(RDMAX_KMOD_DEVICE, O_RDWR | O_CLOEXEC | O_NONBLOCK);
    if (fd_ < 0)
        throw_error("open", errno,
                    errno == ENOSPC ? RDMAX_KMOD_DEVICE " (this user's module budget is spent)"
                                    : RDMAX_KMOD_DEVICE " (load kmod/rdmax.ko)");
    if (struct stat st{}; fstat(fd_, &st) == 0)
        rdev_ = st.st_rdev;
    rdmax_query q{};
    if (ioctl(fd_, RDMAX_IOC_QUERY, &q) != 0) {
        const int e = errno;
        close_all();
        throw_error("ioctl(RDMAX_IOC_QUERY)", e);
    }
    if (q.abi_version != RDMAX_KMOD_ABI_VERSION) {
        close_all();
        throw_error("kmod_monitor", EPROTO,
                    fmt::format("/dev/rdmax speaks ABI {}, this library {}", q.abi_version,
                                RDMAX_KMOD_ABI_VERSION));
    }
    map_bytes_ = q.status_bytes;
    void* p = mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) {
        const int e = errno;
        close_all();
        throw_error("mmap", e, "the /dev/rdmax status area");
    }
    map_ = p;
    const auto* status = static_cast<const rdmax_status*>(p);
    generations_ =
        reinterpret_cast<const __u64*>(static_cast<const char*>(p) + RDMAX_STATUS_GENERATIONS);
    pending_ = &status->pending_events;
    publish_figures();
}

namespace {
constexpr stats::field_desc kmod_fields[] = {
    {"live_regions", stats::field_type::gauge},
    {"monitors", stats::field_type::counter},
    {"unmonitors", stats::field_type::counter},
    {"invalidations", stats::field_type::counter},
    {"events_read", stats::field_type::counter},
    {"module_live_regions", stats::field_type::gauge}, // CAP_SYS_ADMIN only, else 0
    {"module_files", stats::field_type::gauge},
};
} // namespace

void kmod_monitor::publish_figures() noexcept {
    // The fd by value: the record goes (stat_ reset) before the fd closes,
    // and a moved monitor keeps both.
    stat_ = stats::pulled("kmod", {}, kmod_fields, [fd = fd_](std::span<std::uint64_t> v) {
        rdmax_query q{};
        if (ioctl(fd, RDMAX_IOC_QUERY, &q) != 0 || v.size() < std::size(kmod_fields))
            return;
        v[0] = q.live_regions;
        v[1] = q.monitors;
        v[2] = q.unmonitors;
        v[3] = q.invalidations;
        v[4] = q.events_read;
        v[5] = q.module_live_regions;
        v[6] = q.module_files;
    });
}

kmod_monitor::kmod_monitor(kmod_monitor&& o) noexcept
    : fd_(std::exchange(o.fd_, -1))
    , map_(std::exchange(o.map_, nullptr))
    , map_bytes_(std::exchange(o.map_bytes_, 0))
    , generations_(std::exchange(o.generations_, nullptr))
    , pending_(std::exchange(o.pending_, nullptr))
    , fork_generation_(o.fork_generation_)
    , rdev_(o.rdev_)
    , stat_(std::move(o.stat_)) {}

kmod_monitor& kmod_monitor::operator=(kmod_monitor&& o) noexcept {
    if (this != &o) {
        close_all();
        fd_ = std::exchange(o.fd_, -1);
        map_ = std::exchange(o.map_, nullptr);
        map_bytes_ = std::exchange(o.map_bytes_, 0);
        generations_ = std::exchange(o.generations_, nullptr);
        pending_ = std::exchange(o.pending_, nullptr);
        fork_generation_ = o.fork_generation_;
        rdev_ = o.rdev_;
        stat_ = std::move(o.stat_);
    }
    return *this;
}

kmod_monitor::~kmod_monitor() {
    close_all();
}

void kmod_monitor::close_all() noexcept {
    stat_ = {}; // the stat thread queries fd_ no more
    if (fork_generation() != fork_generation_) {
        // A forked child: the status area was never mapped here
        // (VM_DONTCOPY), so whatever the child has at map_ now is its own
        // and stays. The descriptor is the child's copy, closed so that the
        // parent's watches end with the parent's file -- unless the child
        // closed it and the number is now something else.
        struct stat st {};
        if (fd_ >= 0 && fstat(fd_, &st) == 0 && S_ISCHR(st.st_mode) && st.st_rdev == rdev_)
            close(fd_);
        map_ = nullptr;
        fd_ = -1;
        return;
    }
    if (map_ != nullptr)
        munmap(const_cast<void*>(map_), map_bytes_);
    if (fd_ >= 0)
        close(fd_); // the module stops watching every range of this file
    map_ = nullptr;
    fd_ = -1;
}

kmod_monitor::token kmod_monitor::watch(std::uintptr_t start, std::size_t len) {
    if (fork_generation() != fork_generation_)
        throw_error("kmod_monitor::watch", EPERM, "the monitor belongs to the parent process");
    rdmax_monitor req{};
    req.addr = start;
    req.len = len;
    req.cookie = start;
    for (int attempt = 0; attempt < 8; ++attempt) {
        if (ioctl(fd_, RDMAX_IOC_MONITOR, &req) == 0)
            return {generations_ + req.slot, req.generation};
        if (errno == EAGAIN) // the range changed while the module set up its watch
            continue;
        if (errno == ENOSPC) {
            // The file's table, the user's budget or the module's is full:
            // such memory is registered per use.
            static std::once_flag told;
            detail::notice_once(told, "/dev/rdmax watches no more ranges for this user "
                                      "(ENOSPC: its module limits); memory beyond them is "
                                      "registered per use, not cached");
            return {};
        }
        if (errno == EFAULT)
            return {}; // not mapped: the registration will say so
        throw_error("ioctl(RDMAX_IOC_MONITOR)", errno,
                    fmt::format("{} bytes at {:#x}", len, start));
    }
    return {};
}

void kmod_monitor::unwatch(token t) noexcept {
    if (t.generation == 0 || fd_ < 0 || fork_generation() != fork_generation_)
        return;
    rdmax_unmonitor req{};
    req.slot = static_cast<std::uint32_t>(t.where - generations_);
    req.generation = t.generation;
    ioctl(fd_, RDMAX_IOC_UNMONITOR, &req);
}

void kmod_monitor::drain(void (*sink)(void*, std::uintptr_t, std::uintptr_t), void* ctx) noexcept {
    if (fd_ < 0 || fork_generation() != fork_generation_)
        return;
    rdmax_event events[16];
    for (;;) {
        const ssize_t n = read(fd_, events, sizeof events);
        if (n <= 0)
            return; // EAGAIN: nothing more
        for (std::size_t i = 0; i < static_cast<std::size_t>(n) / sizeof(rdmax_event); ++i)
            sink(ctx, events[i].start, events[i].end);
    }
}

} // namespace rdmax
