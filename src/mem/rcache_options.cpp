#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/resource.h>

#include <rdmax/mem/rcache_options.hpp>

namespace rdmax {

rcache_options rcache_options::with_env() const {
    return config::apply_env(*this, rcache_knobs, "rcache_options::with_env");
}

namespace {

/// Whether this process may pin without limit: CAP_IPC_LOCK in its effective
/// set (the kernel then ignores RLIMIT_MEMLOCK for registrations).
bool may_lock_any() {
    std::FILE* f = std::fopen("/proc/self/status", "r");
    if (f == nullptr)
        return false;
    char line[256];
    unsigned long long caps = 0;
    while (std::fgets(line, sizeof line, f) != nullptr)
        if (std::strncmp(line, "CapEff:", 7) == 0)
            caps = std::strtoull(line + 7, nullptr, 16);
    std::fclose(f);
    constexpr unsigned cap_ipc_lock = 14;
    return ((caps >> cap_ipc_lock) & 1) != 0;
}

} // namespace

rcache_options rcache_options::with_device_limits(const verbs::device_limits& dev) const {
    rcache_options o = *this;
    if (o.max_count == 0 && dev.max_mr != 0)
        o.max_count = std::max<std::size_t>(dev.max_mr / 2, 1);
    if (o.max_bytes == 0 && !o.on_demand) {
        rlimit lim{};
        if (getrlimit(RLIMIT_MEMLOCK, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY &&
            !may_lock_any())
            o.max_bytes = std::max<std::size_t>(static_cast<std::size_t>(lim.rlim_cur) / 2, 1);
    }
    return o;
}

} // namespace rdmax
