#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/rcache_options.hpp>

namespace rdmax {

namespace {

std::string_view env(const char* name) noexcept {
    const char* v = std::getenv(name);
    return v != nullptr ? std::string_view(v) : std::string_view();
}

[[noreturn]] void malformed(const char* name, std::string_view value, std::string_view expected) {
    throw_error("rcache_options::with_env", EINVAL,
                fmt::format("{}='{}': expected {}", name, value, expected));
}

/// "4096", "64K", "16G": a count or size with an optional binary suffix.
std::size_t parse_size(const char* name, std::string_view text) {
    std::size_t value = 0;
    const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc{} || ptr == text.data())
        malformed(name, text, "a number, optionally with K, M, G or T");
    std::string_view suffix(ptr, static_cast<std::size_t>(text.data() + text.size() - ptr));
    unsigned shift = 0;
    if (suffix == "K" || suffix == "k")
        shift = 10;
    else if (suffix == "M" || suffix == "m")
        shift = 20;
    else if (suffix == "G" || suffix == "g")
        shift = 30;
    else if (suffix == "T" || suffix == "t")
        shift = 40;
    else if (!suffix.empty())
        malformed(name, text, "a number, optionally with K, M, G or T");
    if (shift != 0 && value > (SIZE_MAX >> shift))
        malformed(name, text, "a size that fits in 64 bits");
    return value << shift;
}

/// "1", "yes", "true" or "0", "no", "false".
bool parse_flag(const char* name, std::string_view v) {
    if (v == "1" || v == "yes" || v == "true")
        return true;
    if (v == "0" || v == "no" || v == "false")
        return false;
    malformed(name, v, "0 or 1");
}

} // namespace

rcache_options rcache_options::with_env() const {
    rcache_options o = *this;
    if (auto v = env("RDMAX_RCACHE_ENABLE"); !v.empty())
        o.enable = parse_flag("RDMAX_RCACHE_ENABLE", v);
    if (auto v = env("RDMAX_RCACHE_ODP"); !v.empty())
        o.on_demand = parse_flag("RDMAX_RCACHE_ODP", v);
    if (auto v = env("RDMAX_RCACHE_MAX_COUNT"); !v.empty())
        o.max_count = parse_size("RDMAX_RCACHE_MAX_COUNT", v);
    if (auto v = env("RDMAX_RCACHE_MAX_BYTES"); !v.empty())
        o.max_bytes = parse_size("RDMAX_RCACHE_MAX_BYTES", v);
    if (auto v = env("RDMAX_RCACHE_MONITOR"); !v.empty()) {
        if (v == "auto")
            o.monitor = monitor_kind::automatic;
        else if (v == "kmod")
            o.monitor = monitor_kind::kmod;
        else if (v == "uffd")
            o.monitor = monitor_kind::uffd;
        else if (v == "manual")
            o.monitor = monitor_kind::manual;
        else if (v == "none")
            o.monitor = monitor_kind::none;
        else
            malformed("RDMAX_RCACHE_MONITOR", v, "auto, kmod, uffd, manual or none");
    }
    return o;
}

} // namespace rdmax
