#pragma once
// rdmax::status as std::error_code: for a refused data-path request that
// must reach an error_code interface (the Asio adapters' completions). ok is
// no error, as a status is. Its conditions: queue_full and batch_full are
// std::errc::resource_unavailable_try_again (poll, then again),
// not_connected and qp_failed std::errc::not_connected, not_permitted
// std::errc::permission_denied; the rest std::errc::invalid_argument (the
// request itself is wrong) but post_failed (the device's refusal: its own).
// Test success with !ec, never ec == status::ok: a success from elsewhere
// (std::error_code{}, what a completed operation carries) is of another
// category, and codes of two categories are never equal.

#include <string>
#include <system_error>

#include <rdmax/status.hpp>

namespace rdmax {

[[nodiscard]] inline const std::error_category& status_category() noexcept {
    struct category final : std::error_category {
        [[nodiscard]] const char* name() const noexcept override { return "rdmax.status"; }
        // A value outside status's 8 bits is no status: converted, it would
        // wrap (256 to ok, whose condition is success).
        static bool is_status(int v) noexcept { return v >= 0 && v <= 0xff; }
        [[nodiscard]] std::string message(int v) const override {
            return is_status(v) ? std::string(to_string(static_cast<status>(v))) : "unknown status";
        }
        [[nodiscard]] std::error_condition default_error_condition(int v) const noexcept override {
            if (!is_status(v))
                return {v, *this};
            switch (static_cast<status>(v)) {
            case status::ok: return {};
            case status::queue_full:
            case status::batch_full: return std::errc::resource_unavailable_try_again;
            case status::not_connected:
            case status::qp_failed: return std::errc::not_connected;
            case status::not_permitted: return std::errc::permission_denied;
            case status::post_failed: return {v, *this};
            default: return std::errc::invalid_argument;
            }
        }
    };
    static const category c;
    return c;
}

[[nodiscard]] inline std::error_code make_error_code(status s) noexcept {
    return {static_cast<int>(s), status_category()};
}

} // namespace rdmax

template <>
struct std::is_error_code_enum<rdmax::status> : std::true_type {};
