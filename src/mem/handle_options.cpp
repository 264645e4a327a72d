#include <rdmax/mem/handle_options.hpp>

#include "../env_knobs.hpp"

namespace rdmax {

handle_options handle_options::with_env() const {
    using namespace detail;
    constexpr const char* who = "handle_options::with_env";
    handle_options o = *this;
    if (auto v = env("RDMAX_HANDLE_REVOKE"); !v.empty())
        o.revoke = parse_choice<revoke_by>(who, "RDMAX_HANDLE_REVOKE", v,
                                           {{"auto", revoke_by::automatic},
                                            {"mw", revoke_by::memory_window},
                                            {"mr", revoke_by::memory_region}});
    return o;
}

} // namespace rdmax
