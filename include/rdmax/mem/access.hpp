#pragma once
// Access rights of a memory registration, usable as a template argument so
// that what a buffer may be used for is checked by the compiler.

#include <infiniband/verbs.h>

namespace rdmax {

enum class access : int {
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

[[nodiscard]] constexpr access operator|(access a, access b) noexcept {
    return static_cast<access>(static_cast<int>(a) | static_cast<int>(b));
}

/// True when `set` includes every right in `wanted`.
[[nodiscard]] constexpr bool has(access set, access wanted) noexcept {
    return (static_cast<int>(set) & static_cast<int>(wanted)) == static_cast<int>(wanted);
}

/// The verbs flags for ibv_reg_mr.
[[nodiscard]] constexpr int to_ibv(access a) noexcept {
    return static_cast<int>(a);
}

/// Rights the verbs specification forbids alone: remote write and remote
/// atomic need local write too (ibv_reg_mr fails with EINVAL otherwise).
[[nodiscard]] constexpr bool valid(access a) noexcept {
    return has(a, access::local_write) ||
           (!has(a, access::remote_write) && !has(a, access::remote_atomic));
}

inline constexpr access access_all =
    access::local_write | access::remote_write | access::remote_read | access::remote_atomic;

/// The rights a peer can be granted (a remote_handle's, a memory window's).
inline constexpr access remote_rights =
    access::remote_write | access::remote_read | access::remote_atomic;

} // namespace rdmax
