// cache_demo: what the registration cache saves, and that it never serves a
// registration over memory that was unmapped.
//
//   cache_demo [-d DEVICE] [-n COUNT] [-s SIZE]
//
// 1. Registers the same buffer COUNT times with ibv_reg_mr + ibv_dereg_mr, as
//    code without a cache does before every transfer.
// 2. Asks the cache for it COUNT times: one registration, COUNT - 1 hits.
// 3. Unmaps the buffer and maps new memory at the same address: the cache's
//    monitor sees it, and the next request registers the new pages.
// The cache's options come from RDMAX_RCACHE_* (see the README).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <getopt.h>
#include <string>
#include <sys/mman.h>

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

namespace {

using namespace rdmax;
using steady = std::chrono::steady_clock;

double micros(steady::duration d) {
    return std::chrono::duration<double, std::micro>(d).count();
}

std::byte* map_buffer(void* where, std::size_t size) {
    void* p = mmap(where, size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | (where != nullptr ? MAP_FIXED : 0), -1, 0);
    if (p == MAP_FAILED)
        throw_error("mmap", errno, fmt::format("{} bytes", size));
    std::memset(p, 0x5a, size); // touch it: registration pins present pages
    return static_cast<std::byte*>(p);
}

int run(const char* device, std::size_t count, std::size_t size) {
    auto ctx =
        device != nullptr ? verbs::context::open(device) : verbs::context::open_first_active();
    verbs::protection_domain pd(ctx);
    std::byte* buf = map_buffer(nullptr, size);
    fmt::print("device {}, buffer of {} bytes, {} requests each\n\n", ctx.name(), size, count);

    const auto t0 = steady::now();
    for (std::size_t i = 0; i < count; ++i) {
        // An int, as ibv_reg_mr's macro tests it against another enum's flag.
        ibv_mr* mr = ibv_reg_mr(pd.get(), buf, size, static_cast<int>(IBV_ACCESS_LOCAL_WRITE));
        if (mr == nullptr)
            throw_error("ibv_reg_mr", errno);
        ibv_dereg_mr(mr);
    }
    const auto without = steady::now() - t0;

    auto cache = make_verbs_cache(pd);
    const auto t1 = steady::now();
    cache.local<rights::local_write>(buf, size).registration.reset(); // the one miss
    const auto t2 = steady::now();
    for (std::size_t i = 1; i < count; ++i) {
        auto src = cache.local<rights::local_write>(buf, size);
        static_cast<void>(src); // a real program posts src.buffer here
    }
    const auto t3 = steady::now();
    const double per_hit = count > 1 ? micros(t3 - t2) / static_cast<double>(count - 1) : 0.0;

    fmt::print("without the cache  {:>12.1f} us total  {:>10.3f} us per request\n", micros(without),
               micros(without) / static_cast<double>(count));
    fmt::print("with the cache     {:>12.1f} us total  (the first request registers: {:.1f} us;\n"
               "                   the other {} hit: {:.3f} us each, {:.0f}x cheaper)\n",
               micros(t3 - t1), micros(t2 - t1), count - 1, per_hit,
               per_hit > 0 ? micros(without) / static_cast<double>(count) / per_hit : 0.0);
    fmt::print("counters: {}\n\n", cache.counters());

    fmt::print("monitor {}: munmap the buffer, mmap new pages at the same address\n",
               to_string(cache.monitor_ref().kind()));
    if (munmap(buf, size) != 0)
        throw_error("munmap", errno);
    if (cache.monitor_ref().kind() == monitor_kind::manual)
        cache.invalidate(buf, size); // this monitor relies on the application
    map_buffer(buf, size);
    {
        auto again = cache.local<rights::local_write>(buf, size);
        fmt::print("counters: {}\n", cache.counters());
    }
    const auto c = cache.counters();
    const bool caching = cache.options().enable;
    const bool ok = !caching || (c.invalidations == 1 && c.registrations == 2);
    fmt::print("{}\n", ok ? "the stale registration was dropped and the new pages registered"
                          : "ERROR: the cache did not see the unmap");
    munmap(buf, size);
    return ok ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
    const char* device = nullptr;
    std::size_t count = 1000, size = 1 << 20;
    for (int opt; (opt = getopt(argc, argv, "d:n:s:h")) != -1;) {
        switch (opt) {
        case 'd': device = optarg; break;
        case 'n': count = std::strtoull(optarg, nullptr, 10); break;
        case 's': size = std::strtoull(optarg, nullptr, 10); break;
        default:
            std::fprintf(stderr, "usage: cache_demo [-d DEVICE] [-n COUNT] [-s SIZE]\n");
            return opt == 'h' ? 0 : 2;
        }
    }
    if (count == 0 || size == 0) {
        std::fprintf(stderr, "cache_demo: -n and -s must be positive\n");
        return 2;
    }
    try {
        return run(device, count, size);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "cache_demo: %s\n", e.what());
        return 1;
    }
}
