#pragma once
// Cross-memory attach (Linux CMA): one copy between this process and another
// on the same node, by the kernel (process_vm_readv / process_vm_writev), with
// no mapping and no shared buffer. The kernel allows it only where this
// process could ptrace the other: the same user and, under Yama
// (kernel.yama.ptrace_scope >= 1), only a descendant or a process that
// allowed it (prctl(PR_SET_PTRACER)). A refusal is not_permitted, with
// why_not_permitted() saying which rule; callers fall back to another path.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <sys/types.h>

namespace rdmax::local {

enum class cma_status : std::uint8_t {
    ok = 0,
    not_permitted, ///< EPERM: ptrace rights (Yama's ptrace_scope, another user)
    no_process,    ///< ESRCH: the peer is gone
    bad_address,   ///< EFAULT: the range is not (all) mapped in the peer, or here
    unsupported,   ///< ENOSYS: a kernel without CMA
};

[[nodiscard]] constexpr std::string_view to_string(cma_status s) noexcept {
    switch (s) {
    case cma_status::ok: return "ok";
    case cma_status::not_permitted: return "not permitted (ptrace rights)";
    case cma_status::no_process: return "no such process";
    case cma_status::bad_address: return "address range not mapped";
    case cma_status::unsupported: return "cross-memory attach not supported";
    }
    return "unknown";
}

/// Copies [remote, remote + out.size()) of process `pid` into `out`, whole
/// (partial transfers are continued).
cma_status cma_read(pid_t pid, std::uint64_t remote, std::span<std::byte> out) noexcept;
/// Copies `in` to [remote, remote + in.size()) of process `pid`, whole.
cma_status cma_write(pid_t pid, std::uint64_t remote, std::span<const std::byte> in) noexcept;

/// Why CMA to `pid` would be refused here, in words (the Yama scope, the
/// users), for the one line a fallback prints.
[[nodiscard]] std::string why_not_permitted(pid_t pid);

/// Lets `pid` (or any process, with 0) use CMA on this one under Yama's
/// scope 1 (PR_SET_PTRACER); false if the kernel refused.
bool allow_cma_from(pid_t pid) noexcept;

} // namespace rdmax::local
