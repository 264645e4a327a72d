#include <rdmax/mem/handle_options.hpp>

#include "../env_knobs.hpp"

namespace rdmax {

handle_options handle_options::with_env() const {
    using namespace detail;
    constexpr const char* who = "handle_options::with_env";
    handle_options o = *this;
    if (auto v = env("RDMAX_HANDLE_REVOKE"); !v.empty()) {
        if (v == "auto")
            o.revoke = revoke_by::automatic;
        else if (v == "mw")
            o.revoke = revoke_by::memory_window;
        else if (v == "mr")
            o.revoke = revoke_by::memory_region;
        else
            malformed(who, "RDMAX_HANDLE_REVOKE", v, "auto, mw or mr");
    }
    return o;
}

} // namespace rdmax
