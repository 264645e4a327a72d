#pragma once
// auto_monitor: the monitor chosen at run time from rcache_options::monitor
// (RDMAX_RCACHE_MONITOR), for caches whose users should not have to pick one
// at compile time.
//
//   kmod    the rdmax kernel module (kmod_monitor.hpp); an error if it is missing
//   uffd    userfaultfd (uffd_monitor.hpp); an error if unavailable
//   manual  nothing watched: the application calls invalidate()
//   none    nothing watched, and so nothing cached: every get() registers
//   auto    (the default) kmod if loaded, else uffd, else none; each fallback
//           prints one line on stderr, once per process

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include <rdmax/mem/kmod_monitor.hpp>
#include <rdmax/mem/monitor.hpp>
#include <rdmax/mem/rcache_options.hpp>
#include <rdmax/mem/uffd_monitor.hpp>

namespace rdmax {

class auto_monitor {
public:
    /// Which part is used depends on the kind: kmod's {slot, generation},
    /// or the range for uffd and manual (end 0: not watched).
    struct token {
        uffd_monitor::token range;
        kmod_monitor::token kmod;
    };

    /// Resolves `requested`; throws rdmax::error when a monitor asked for by
    /// name cannot be had, saying why.
    explicit auto_monitor(monitor_kind requested = monitor_kind::automatic);

    /// What was chosen (never automatic).
    [[nodiscard]] monitor_kind kind() const noexcept { return kind_; }
    /// False for none: the cache then registers per use.
    [[nodiscard]] bool caching() const noexcept { return kind_ != monitor_kind::none; }

    [[nodiscard]] token watch(std::uintptr_t start, std::size_t len) {
        if (kmod_)
            return {{}, kmod_->watch(start, len)};
        if (uffd_)
            return {uffd_->watch(start, len), {}};
        return {{start, start + len}, {}};
    }
    void unwatch(token t) noexcept {
        if (kmod_)
            kmod_->unwatch(t.kmod);
        else if (uffd_)
            uffd_->unwatch(t.range);
    }
    [[nodiscard]] bool valid(token t) const noexcept {
        return kind_ == monitor_kind::kmod ? kmod_->valid(t.kmod) : t.range.end != 0;
    }
    void drain(void (*sink)(void*, std::uintptr_t, std::uintptr_t), void* ctx) noexcept {
        if (kmod_)
            kmod_->drain(sink, ctx);
        else if (uffd_)
            uffd_->drain(sink, ctx);
    }
    [[nodiscard]] bool pending() const noexcept {
        return kind_ == monitor_kind::kmod ? kmod_->pending() : uffd_ && uffd_->pending();
    }

    [[nodiscard]] const uffd_monitor* uffd() const noexcept { return uffd_ ? &*uffd_ : nullptr; }
    [[nodiscard]] const kmod_monitor* kmod() const noexcept { return kmod_ ? &*kmod_ : nullptr; }

private:
    monitor_kind kind_ = monitor_kind::none;
    std::optional<uffd_monitor> uffd_;
    std::optional<kmod_monitor> kmod_;
};

/// What auto_monitor(requested) would use, and why (for rdmax-info).
struct monitor_choice {
    monitor_kind kind = monitor_kind::none;
    std::string why;
};
/// Looks without keeping anything open: a kmod or uffd asked for by name that
/// cannot be had is reported as kind none with the reason, not thrown.
[[nodiscard]] monitor_choice predict_monitor(monitor_kind requested = monitor_kind::automatic);

static_assert(monitor<auto_monitor>);
static_assert(monitor<uffd_monitor>);
static_assert(monitor<kmod_monitor>);

} // namespace rdmax
