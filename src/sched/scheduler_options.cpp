#include <rdmax/sched/scheduler_options.hpp>

#include "../env_knobs.hpp"

namespace rdmax::sched {

scheduler_options scheduler_options::with_env() const {
    using namespace rdmax::detail;
    constexpr const char* who = "scheduler_options::with_env";
    scheduler_options o = *this;
    const auto size32 = [&](const char* name, std::string_view v, std::uint32_t least) {
        const std::size_t n = parse_size(who, name, v);
        if (n < least || n > UINT32_MAX)
            malformed(who, name, v, fmt::format("a size from {} to 4G - 1", least));
        return static_cast<std::uint32_t>(n);
    };
    if (auto v = env("RDMAX_SCHED_SMALL_SLICE"); !v.empty())
        o.small_slice = size32("RDMAX_SCHED_SMALL_SLICE", v, 1);
    if (auto v = env("RDMAX_SCHED_LARGE_SLICE"); !v.empty())
        o.large_slice = size32("RDMAX_SCHED_LARGE_SLICE", v, 1);
    if (auto v = env("RDMAX_SCHED_BUDGET_BYTES"); v == "auto")
        o.budget_bytes = 0;
    else if (!v.empty())
        o.budget_bytes = size32("RDMAX_SCHED_BUDGET_BYTES", v, 1);
    if (auto v = env("RDMAX_SCHED_BUDGET_WQES"); !v.empty())
        o.budget_wqes = size32("RDMAX_SCHED_BUDGET_WQES", v, 1);
    if (auto v = env("RDMAX_SCHED_HOLD_US"); !v.empty())
        o.hold = std::chrono::microseconds(parse_size(who, "RDMAX_SCHED_HOLD_US", v));
    if (auto v = env("RDMAX_SCHED_MAX_REQUESTS"); !v.empty())
        o.max_requests = size32("RDMAX_SCHED_MAX_REQUESTS", v, 1);
    return o;
}

} // namespace rdmax::sched
