// rdmax_kmod_bench: what the rdmax module costs.
//
//   rdmax_kmod_bench [--json FILE] [-n ROUNDS] [--batches N]
//
// check:  the validity check of a cached registration (one acquire load of
//         its generation in the module's read-only status area, and a compare)
//         against a plain load of an ordinary 64-bit variable, same loop;
// munmap: munmap of one present 4 KiB page while 0, 1k and 16k other
//         ranges are watched, against the same with /dev/rdmax not open (no
//         MMU notifier in the process at all), in the same run.
// --json FILE writes {"kind":"check","ns":X,"plain_load_ns":Y} and
// {"kind":"munmap","regions":N,"monitored_us":X,"unmonitored_us":Y} records.
// Needs the module (tests/vm/run loads build/kmod/rdmax.ko).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <getopt.h>
#include <string>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/mem/kmod_monitor.hpp>

#include "bench_common.hpp"
#include "bench_stats.hpp"

namespace {

using namespace rdmax;
using namespace rdmax::bench;

const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));

struct bench_options {
    std::string json;
    std::uint32_t rounds = 2000; ///< munmaps per batch
    std::uint32_t batches = 9;
    std::uint64_t checks = 1 << 24; ///< validity checks per batch
};

/// ns per iteration of `body`, median over batches, measured with the TSC.
template <class Body>
summary time_ns(std::uint32_t batches, std::uint64_t per_batch, Body&& body) {
    std::vector<double> ns;
    cycle_rate rate;
    std::vector<std::uint64_t> c;
    rate.start();
    for (std::uint32_t b = 0; b < batches; ++b) {
        const std::uint64_t t0 = cycles();
        body();
        c.push_back(cycles() - t0);
    }
    rate.stop();
    if (rate.per_us() <= 0)
        fail("the cycle counter did not advance");
    ns.reserve(c.size());
    for (const std::uint64_t x : c)
        ns.push_back(static_cast<double>(x) * 1000.0 / rate.per_us() /
                     static_cast<double>(per_batch));
    return summarize(std::move(ns));
}

void check_cost(const bench_options& o, json_list& json) {
    kmod_monitor mon;
    void* p = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        fail("mmap failed");
    std::memset(p, 1, page);
    const kmod_monitor::token t = mon.watch(reinterpret_cast<std::uintptr_t>(p), page);
    if (!mon.valid(t))
        fail("a fresh watch is not valid");
    std::uint64_t ordinary = t.generation; // the same compare, against process memory
    std::uint64_t hits = 0;
    // The asm keeps each iteration's load in the loop, the same for both.
    const summary check = time_ns(o.batches, o.checks, [&] {
        for (std::uint64_t i = 0; i < o.checks; ++i) {
            hits += mon.valid(t);
            asm volatile("" ::: "memory");
        }
    });
    const summary plain = time_ns(o.batches, o.checks, [&] {
        for (std::uint64_t i = 0; i < o.checks; ++i) {
            hits += __atomic_load_n(&ordinary, __ATOMIC_RELAXED) == t.generation;
            asm volatile("" ::: "memory");
        }
    });
    if (hits != 2ULL * o.batches * o.checks)
        fail("the watch went invalid during the check loop");
    fmt::print(" validity check       {:8.3f} ns   plain 64-bit load {:8.3f} ns   ratio {:.2f}\n",
               check.median, plain.median, check.median / plain.median);
    json.add(fmt::format(R"({{"kind":"check","ns":{:.4f},"plain_load_ns":{:.4f}}})", check.median,
                         plain.median));
    mon.unwatch(t);
    munmap(p, page);
}

/// Median µs of munmap of one present 4 KiB page (the pages are mapped and
/// touched before each batch, untimed).
summary munmap_cost(const bench_options& o) {
    std::vector<double> us;
    std::vector<void*> pages(o.rounds);
    cycle_rate rate;
    std::vector<std::uint64_t> c;
    rate.start();
    for (std::uint32_t b = 0; b < o.batches; ++b) {
        for (void*& p : pages) {
            p = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p == MAP_FAILED)
                fail("mmap failed");
            static_cast<volatile char*>(p)[0] = 1;
        }
        const std::uint64_t t0 = cycles();
        for (void* p : pages)
            munmap(p, page);
        c.push_back(cycles() - t0);
    }
    rate.stop();
    us.reserve(c.size());
    for (const std::uint64_t x : c)
        us.push_back(static_cast<double>(x) / rate.per_us() / static_cast<double>(o.rounds));
    return summarize(std::move(us));
}

void munmap_costs(const bench_options& o, json_list& json) {
    // Without the module in the process first: no MMU notifier anywhere.
    std::vector<std::pair<std::uint32_t, summary>> plain;
    const std::uint32_t counts[] = {0, 1024, 16384};
    for (const std::uint32_t n : counts) {
        fmt::print(stderr, "[munmap] unmonitored, for {} regions\n", n);
        plain.emplace_back(n, munmap_cost(o));
    }
    // The watched ranges live in one mapping, one page each, away from the
    // page that is mapped and unmapped.
    const std::size_t span = std::size_t{16384} * page;
    auto* area = static_cast<std::byte*>(
        mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (area == MAP_FAILED)
        fail("mmap failed");
    std::memset(area, 1, span);
    kmod_monitor mon;
    std::vector<kmod_monitor::token> watched;
    fmt::print(" {:>9}   {:>26}   {:>26}   {:>7}\n", "#regions", "monitored munmap[us]",
               "unmonitored munmap[us]", "ratio");
    for (std::size_t k = 0; k < std::size(counts); ++k) {
        const std::uint32_t n = counts[k];
        while (watched.size() < n) {
            const auto t =
                mon.watch(reinterpret_cast<std::uintptr_t>(area) + watched.size() * page, page);
            if (!mon.valid(t))
                fail(fmt::format("could not watch region {}", watched.size()));
            watched.push_back(t);
        }
        fmt::print(stderr, "[munmap] monitored, {} regions\n", n);
        const summary m = munmap_cost(o);
        const summary& u = plain[k].second;
        fmt::print(" {:>9}   {:>10.3f} ({:.3f}-{:.3f})   {:>10.3f} ({:.3f}-{:.3f})   {:>7.2f}\n", n,
                   m.median, m.min, m.max, u.median, u.min, u.max, m.median / u.median);
        json.add(fmt::format(
            R"({{"kind":"munmap","regions":{},"monitored_us":{:.3f},"unmonitored_us":{:.3f}}})", n,
            m.median, u.median));
    }
    for (const auto& t : watched)
        mon.unwatch(t);
    munmap(area, span);
}

bench_options parse(int argc, char** argv) {
    bench_options o;
    enum : int { opt_json = 1000, opt_batches };
    const option longs[] = {
        {"json", required_argument, nullptr, opt_json},
        {"batches", required_argument, nullptr, opt_batches},
        {"iters", required_argument, nullptr, 'n'},
        {"help", no_argument, nullptr, 'h'},
        {nullptr, 0, nullptr, 0},
    };
    for (int c; (c = getopt_long(argc, argv, "n:h", longs, nullptr)) != -1;) {
        switch (c) {
        case opt_json: o.json = optarg; break;
        case opt_batches:
            o.batches = bench::detail::parse_number<std::uint32_t>(optarg, "--batches", 1, 1000);
            break;
        case 'n':
            o.rounds = bench::detail::parse_number<std::uint32_t>(optarg, "-n", 10, 10000000);
            break;
        default:
            std::fprintf(stderr,
                         "usage: rdmax_kmod_bench [--json FILE] [-n ROUNDS] [--batches N]\n");
            std::exit(c == 'h' ? 0 : 2);
        }
    }
    return o;
}

} // namespace

int main(int argc, char** argv) {
    try {
        const bench_options o = parse(argc, argv);
        if (!kmod_monitor::available())
            fail("/dev/rdmax is absent: load the module (kmod/build; tests/vm/run loads it)");
        json_list json(o.json);
        fmt::print("{}          rdmax module: validity check and munmap cost\n{}", result_line,
                   result_line);
        check_cost(o, json);
        munmap_costs(o, json);
        fmt::print("{}", result_line);
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "rdmax_kmod_bench: %s\n", e.what());
        return 1;
    }
}
