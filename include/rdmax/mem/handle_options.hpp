#pragma once
// Options and counters of handle_issuer (handle_issuer.hpp), with their knob
// (handle_knobs), and the rule that picks how a handle is revoked.

#include <chrono>
#include <cstdint>
#include <string_view>
#include <tuple>

#include <fmt/format.h>

#include <rdmax/config/knob.hpp>

namespace rdmax {

/// How a handle is backed, which decides how it is revoked.
enum class revoke_by : std::uint8_t {
    /// Memory windows where they can be had (the device has type 2, the
    /// issuer has the queue pair, the memory's registration allows binding),
    /// else a registration of the handle's own.
    automatic,
    /// A type-2 memory window bound over the memory's registration through the
    /// queue pair the peer's requests arrive on; revoked by a local
    /// invalidation (IBV_WR_LOCAL_INV). Nothing is registered per handle.
    memory_window,
    /// A registration (ibv_reg_mr) of the handle's bytes alone; revoked by
    /// deregistering it. Works on every device, costs a registration per handle.
    memory_region,
};

[[nodiscard]] constexpr std::string_view to_string(revoke_by r) noexcept {
    switch (r) {
    case revoke_by::automatic: return "auto";
    case revoke_by::memory_window: return "mw";
    case revoke_by::memory_region: return "mr";
    }
    return "?";
}

struct handle_options {
    revoke_by revoke = revoke_by::automatic;
    /// How long issue() and revoke() wait for a bind or local invalidation to
    /// complete. issue() throws at the deadline; revoke() deallocates the
    /// window instead, which revokes it just as surely.
    std::chrono::milliseconds deadline{5000};

    /// These options with the variables of handle_knobs that are set applied;
    /// a malformed value throws rdmax::error naming the variable.
    [[nodiscard]] handle_options with_env() const;
};

/// RDMAX_HANDLE_*: read by with_env() only (handle_issuer's default options).
inline constexpr std::tuple handle_knobs{
    config::knob{"RDMAX_HANDLE_REVOKE", &handle_options::revoke,
                 config::one_of<revoke_by>({{"auto", revoke_by::automatic},
                                            {"mw", revoke_by::memory_window},
                                            {"mr", revoke_by::memory_region}}),
                 "`mw` (type-2 windows), `mr` (a registration per handle), `auto`"},
};

/// Why a handle cannot be backed by a memory window, or nullptr when it can.
/// device: the device has type-2 windows; queue_pair: the issuer was given the
/// queue pair the peer uses; bindable: the memory's registration has
/// rights::mw_bind; local_write: it has local write, which windows granting
/// remote write or atomic need (the verbs rule, C10-74); writes: such rights are asked.
[[nodiscard]] constexpr const char* why_no_window(bool device, bool queue_pair, bool bindable,
                                                  bool local_write, bool writes) noexcept {
    if (!device)
        return "the device has no type-2 memory windows";
    if (!queue_pair)
        return "no queue pair was given to bind windows through (the one the peer's "
               "requests arrive on)";
    if (!bindable)
        return "the memory's registration lacks rights::mw_bind (IBV_ACCESS_MW_BIND)";
    if (writes && !local_write)
        return "a window granting remote write or atomic needs a registration with local write";
    return nullptr;
}

/// The mechanism for one handle, given what the options ask and why_no_window().
/// `refused`: the options insist on a window and there can be none.
struct mechanism_choice {
    revoke_by by = revoke_by::memory_region;
    bool refused = false;
};
[[nodiscard]] constexpr mechanism_choice choose_mechanism(revoke_by asked,
                                                          const char* why_not) noexcept {
    switch (asked) {
    case revoke_by::memory_region: return {revoke_by::memory_region, false};
    case revoke_by::memory_window: return {revoke_by::memory_window, why_not != nullptr};
    case revoke_by::automatic:
        return {why_not == nullptr ? revoke_by::memory_window : revoke_by::memory_region, false};
    }
    return {};
}

struct handle_counters {
    std::uint64_t issued_mw = 0;  ///< handles backed by a memory window
    std::uint64_t issued_mr = 0;  ///< handles backed by a registration of their own
    std::uint64_t fallbacks = 0;  ///< of issued_mr: automatic, where a window could not be had
    std::uint64_t revoked_mw = 0; ///< by local invalidation
    std::uint64_t revoked_mw_dealloc = 0; ///< windows deallocated instead (invalidation impossible)
    std::uint64_t revoked_mr = 0;         ///< by deregistration
    std::uint64_t windows_allocated = 0;  ///< ibv_alloc_mw calls
    std::uint64_t windows_reused = 0;     ///< binds of a window freed by an earlier revocation
    std::uint64_t live = 0;               ///< handles issued and not revoked, now
};

} // namespace rdmax

template <>
struct fmt::formatter<rdmax::revoke_by> : fmt::formatter<std::string_view> {
    auto format(rdmax::revoke_by r, fmt::format_context& ctx) const {
        return fmt::formatter<std::string_view>::format(rdmax::to_string(r), ctx);
    }
};

template <>
struct fmt::formatter<rdmax::handle_counters> {
    constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
    auto format(const rdmax::handle_counters& c, fmt::format_context& ctx) const {
        return fmt::format_to(ctx.out(),
                              "handles issued {} by mw, {} by mr ({} fallbacks); revoked {} by "
                              "mw (+{} by deallocation), {} by mr; live {}; windows allocated {} "
                              "reused {}",
                              c.issued_mw, c.issued_mr, c.fallbacks, c.revoked_mw,
                              c.revoked_mw_dealloc, c.revoked_mr, c.live, c.windows_allocated,
                              c.windows_reused);
    }
};
