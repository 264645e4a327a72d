#include <algorithm>
#include <cerrno>
#include <fstream>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/local/cma.hpp>

namespace rdmax::local {

namespace {
cma_status from_errno(int err) noexcept {
    switch (err) {
    case EPERM: return cma_status::not_permitted;
    case ESRCH: return cma_status::no_process;
    case ENOSYS: return cma_status::unsupported;
    default: return cma_status::bad_address;
    }
}

template <class Call>
cma_status whole(std::byte* local, std::size_t n, std::uint64_t remote, Call call) noexcept {
    std::size_t done = 0;
    while (done < n) {
        iovec l{local + done, n - done};
        iovec r{reinterpret_cast<void*>(remote + done), n - done};
        const ssize_t got = call(&l, &r);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return from_errno(errno);
        }
        if (got == 0)
            return cma_status::bad_address;
        done += static_cast<std::size_t>(got);
    }
    return cma_status::ok;
}
} // namespace

cma_status cma_read(pid_t pid, std::uint64_t remote, std::span<std::byte> out) noexcept {
    return whole(out.data(), out.size(), remote,
                 [pid](iovec* l, iovec* r) { return process_vm_readv(pid, l, 1, r, 1, 0); });
}

cma_status cma_write(pid_t pid, std::uint64_t remote, std::span<const std::byte> in) noexcept {
    return whole(const_cast<std::byte*>(in.data()), in.size(), remote,
                 [pid](iovec* l, iovec* r) { return process_vm_writev(pid, l, 1, r, 1, 0); });
}

std::string why_not_permitted(pid_t pid) {
    int scope = -1;
    std::ifstream("/proc/sys/kernel/yama/ptrace_scope") >> scope;
    std::string owner = "unknown";
    std::ifstream status(fmt::format("/proc/{}/status", pid));
    for (std::string line; std::getline(status, line);)
        if (line.rfind("Uid:", 0) == 0)
            owner = line.substr(4);
    if (scope >= 2)
        return fmt::format("kernel.yama.ptrace_scope is {}: only an administrator may attach",
                           scope);
    if (scope == 1)
        return fmt::format("kernel.yama.ptrace_scope is 1: process {} must be a descendant of this "
                           "one or allow it (prctl PR_SET_PTRACER)",
                           pid);
    return fmt::format("process {} (uid{}) is not this user's, or is not dumpable", pid, owner);
}

bool allow_cma_from(pid_t pid) noexcept {
    const unsigned long who = pid == 0 ? PR_SET_PTRACER_ANY : static_cast<unsigned long>(pid);
    return prctl(PR_SET_PTRACER, who, 0, 0, 0) == 0 || errno == EINVAL; // EINVAL: no Yama
}

} // namespace rdmax::local
