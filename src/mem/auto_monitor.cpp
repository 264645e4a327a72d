#include <cerrno>
#include <mutex>
#include <string>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/auto_monitor.hpp>

#include "../notice.hpp"

namespace rdmax {

namespace {

using detail::notice_once;

constexpr const char* kmod_device = "/dev/rdmax";

std::once_flag no_kmod_notice, no_monitor_notice;

} // namespace

auto_monitor::auto_monitor(monitor_kind requested) {
    switch (requested) {
    case monitor_kind::manual: kind_ = monitor_kind::manual; return;
    case monitor_kind::none: kind_ = monitor_kind::none; return;
    case monitor_kind::uffd:
        uffd_.emplace(); // throws, saying why, if userfaultfd is unavailable
        kind_ = monitor_kind::uffd;
        return;
    case monitor_kind::kmod:
        if (::access(kmod_device, F_OK) != 0)
            throw_error("registration cache monitor", ENODEV,
                        fmt::format("RDMAX_RCACHE_MONITOR=kmod, but {} is missing (load "
                                    "kmod/rdmax.ko)",
                                    kmod_device));
        kmod_.emplace(); // throws, saying why, if the module cannot be used
        kind_ = monitor_kind::kmod;
        return;
    case monitor_kind::automatic: break;
    }
    std::string why_not_kmod = ::access(kmod_device, F_OK) == 0
                                   ? fmt::format("{} cannot be used", kmod_device)
                                   : fmt::format("{} is not loaded", kmod_device);
    if (kmod_monitor::available()) {
        try {
            kmod_.emplace();
            kind_ = monitor_kind::kmod;
            return;
        } catch (const rdmax::error& e) {
            // The module is there but refused this open (past this user's
            // budget: ENOSPC): watch with userfaultfd instead.
            why_not_kmod = e.what();
        }
    }
    if (uffd_monitor::available()) {
        notice_once(no_kmod_notice,
                    fmt::format("{}: the registration cache watches memory with userfaultfd",
                                why_not_kmod));
        uffd_.emplace();
        kind_ = monitor_kind::uffd;
        return;
    }
    notice_once(no_monitor_notice,
                "no memory monitor (neither /dev/rdmax nor userfaultfd): registrations are not "
                "cached; RDMAX_RCACHE_MONITOR=manual caches them if you call invalidate()");
    kind_ = monitor_kind::none;
}

} // namespace rdmax
