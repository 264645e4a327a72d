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

namespace {

/// Why userfaultfd cannot be had, or empty when it can.
std::string why_no_uffd() {
    if (uffd_monitor::available())
        return {};
    try {
        const uffd_monitor probe;
        return "userfaultfd refused";
    } catch (const rdmax::error& e) {
        return e.what();
    }
}

} // namespace

monitor_choice predict_monitor(monitor_kind requested) {
    const bool kmod_loaded = ::access(kmod_device, F_OK) == 0;
    const bool kmod_usable = kmod_monitor::available();
    switch (requested) {
    case monitor_kind::manual: return {requested, "asked for: the application calls invalidate()"};
    case monitor_kind::none: return {requested, "asked for: nothing is cached"};
    case monitor_kind::kmod:
        if (kmod_usable)
            return {requested, fmt::format("asked for, and {} answers", kmod_device)};
        return {monitor_kind::none,
                fmt::format("asked for, but {} {}: caches would throw", kmod_device,
                            kmod_loaded ? "cannot be used (ABI or permission)" : "is missing")};
    case monitor_kind::uffd:
        if (const std::string why = why_no_uffd(); !why.empty())
            return {monitor_kind::none, fmt::format("asked for, but {}: caches would throw", why)};
        return {requested, "asked for, and userfaultfd is available"};
    case monitor_kind::automatic: break;
    }
    if (kmod_usable)
        return {monitor_kind::kmod,
                fmt::format("{} is loaded and speaks this library's ABI", kmod_device)};
    const std::string no_kmod =
        fmt::format("{} {}", kmod_device, kmod_loaded ? "cannot be used" : "is not loaded");
    if (const std::string why = why_no_uffd(); !why.empty())
        return {monitor_kind::none,
                fmt::format("{}, and {}: registrations are not cached", no_kmod, why)};
    return {monitor_kind::uffd, fmt::format("{}; userfaultfd is available", no_kmod)};
}

} // namespace rdmax
