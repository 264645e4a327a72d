#pragma once
// Access rights of a memory registration, usable as a template argument so
// that what a buffer may be used for is checked by the compiler.

#include <infiniband/verbs.h>

namespace rdmax {

enum class rights : int {
    local_read = 0, ///< always granted
    local_write = IBV_ACCESS_LOCAL_WRITE,
    remote_write = IBV_ACCESS_REMOTE_WRITE,
    remote_read = IBV_ACCESS_REMOTE_READ,
    remote_atomic = IBV_ACCESS_REMOTE_ATOMIC,
    /// Memory windows may be bound to the registration (IBV_ACCESS_MW_BIND).
    /// With it and no remote right, the registration's own rkey opens nothing
    /// to a peer: only windows bound to it do (see handle_issuer.hpp).
    mw_bind = IBV_ACCESS_MW_BIND,
};

[[nodiscard]] constexpr rights operator|(rights a, rights b) noexcept {
    return static_cast<rights>(static_cast<int>(a) | static_cast<int>(b));
}

/// True when `set` includes every right in `wanted`.
[[nodiscard]] constexpr bool has(rights set, rights wanted) noexcept {
    return (static_cast<int>(set) & static_cast<int>(wanted)) == static_cast<int>(wanted);
}

/// The verbs flags for ibv_reg_mr.
[[nodiscard]] constexpr int to_ibv(rights a) noexcept {
    return static_cast<int>(a);
}

/// Rights the verbs specification forbids alone: remote write and remote
/// atomic need local write too (ibv_reg_mr fails with EINVAL otherwise).
[[nodiscard]] constexpr bool valid(rights a) noexcept {
    return has(a, rights::local_write) ||
           (!has(a, rights::remote_write) && !has(a, rights::remote_atomic));
}

inline constexpr rights all_rights =
    rights::local_write | rights::remote_write | rights::remote_read | rights::remote_atomic;

/// The rights a peer can be granted (a remote_handle's, a memory window's).
inline constexpr rights remote_rights =
    rights::remote_write | rights::remote_read | rights::remote_atomic;

} // namespace rdmax
