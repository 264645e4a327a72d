// The parsers' non-template parts (knob.hpp) and the registry of every table (knobs.hpp).
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include <rdmax/config/knob.hpp>
#include <rdmax/config/knobs.hpp>
#include <rdmax/error.hpp>
#include <rdmax/local/mapping_options.hpp>
#include <rdmax/local/team_options.hpp>
#include <rdmax/mem/arena_options.hpp>
#include <rdmax/mem/handle_options.hpp>
#include <rdmax/mem/rcache_options.hpp>
#include <rdmax/rpc/rpc_options.hpp>
#include <rdmax/sched/scheduler_options.hpp>
#include <rdmax/sched/stripe_options.hpp>
#include <rdmax/stats/stat_options.hpp>
#include <rdmax/verbs/rail_options.hpp>

namespace rdmax::config {

namespace {
constexpr std::string_view suffixes = "KMGT";
} // namespace

bool parse_number(std::string_view text, std::uint64_t& out) noexcept {
    std::uint64_t value = 0;
    const char* end = text.data() + text.size();
    const auto [ptr, ec] = std::from_chars(text.data(), end, value);
    if (ec != std::errc{} || ptr == text.data())
        return false;
    unsigned shift = 0;
    if (ptr != end) {
        if (end - ptr != 1)
            return false;
        const auto at = suffixes.find(static_cast<char>(*ptr & ~0x20)); // K or k
        if (at == std::string_view::npos)
            return false;
        shift = 10 * static_cast<unsigned>(at + 1);
    }
    if (shift != 0 && value > (UINT64_MAX >> shift))
        return false;
    out = value << shift;
    return true;
}

std::string format_size(std::uint64_t n) {
    unsigned step = 0;
    while (step < suffixes.size() && n != 0 && n % 1024 == 0) {
        n /= 1024;
        ++step;
    }
    return step == 0 ? fmt::format("{}", n) : fmt::format("{}{}", n, suffixes[step - 1]);
}

void refuse(const char* who, std::string_view name, std::string_view value,
            std::string_view range) {
    throw_error(who, EINVAL, fmt::format("{}='{}': expected {}", name, value, range));
}

bool number::accepts(std::uint64_t n, std::uint64_t type_max) const noexcept {
    if (n < lo || n > std::min(hi, type_max))
        return false;
    if (multiple_of > 1 && n % multiple_of != 0)
        return false;
    return !power_of_two || (n != 0 && (n & (n - 1)) == 0);
}

std::string number::describe_range(std::uint64_t type_max) const {
    const std::uint64_t most = std::min(hi, type_max);
    const auto show = [this](std::uint64_t n) {
        return bytes ? format_size(n) : fmt::format("{}", n);
    };
    std::string what = power_of_two      ? "a power of two"
                       : multiple_of > 1 ? fmt::format("a multiple of {}", multiple_of)
                       : bytes           ? "a size"
                                         : "a number";
    if (most != type_max)
        what += fmt::format(" from {} to {}", show(lo), show(most));
    else if (lo != 0)
        what += fmt::format(" of at least {}", show(lo));
    else
        what = bytes ? "any size" : "any number";
    if (bytes)
        what += " (K, M, G, T allowed)";
    if (!zero_word.empty())
        what += fmt::format(", or {}", zero_word);
    return what;
}

std::vector<knob_row> knobs_from_env() {
    std::vector<knob_row> rows;
    describe_env(rcache_knobs, rows);
    describe_env(arena_knobs, rows);
    describe_env(handle_knobs, rows);
    describe_env(sched::scheduler_knobs, rows);
    describe_env(sched::stripe_knobs, rows);
    describe_env(verbs::rail_knobs, rows);
    describe_env(rpc::rpc_knobs, rows);
    describe_env(local::mapping_knobs, rows);
    describe_env(local::team_knobs, rows);
    describe_env(stats::stat_knobs, rows);
    return rows;
}

} // namespace rdmax::config
