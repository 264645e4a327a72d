// rdmax_reg_bench: what it costs to have registered memory of a given size,
// three ways, measured in one run with the ratios printed.
//
// Device mode (the default; -d DEV, or the first device with an ACTIVE port),
// per size from 4 KiB to 256 MiB (-s caps it):
//   ibv     ibv_reg_mr + ibv_dereg_mr of one already touched buffer, each call
//           timed apart, -n times (fewer above 1 MiB: see reg_iterations());
//   cache   a hit in the registration cache (make_verbs_cache(pd), so the
//           monitor production would pick): get + release of that buffer,
//           registered once by an untimed miss;
//   arena   registered_arena allocate + deallocate of that size from a warm
//           arena: the area serving the size was registered by an untimed
//           allocation first, and the high watermark is raised so that a freed
//           area (a dedicated one, above half an area) stays registered. The
//           arena's counters and the registrar's calls are checked around the
//           timed batches: a steady state that registers, releases or loses a
//           block is reported, and so is a block whose keys are not those of
//           the memory region that ibv_reg_mr returned for the memory under it.
//   Cache hits and arena allocations are timed in batches of --ops; the
//   median of the batches (each divided by --ops) is reported. The arena
//   here is basic_registered_arena over a registrar that wraps
//   verbs_registrar and records the memory regions it makes (for the key
//   check): registered_arena's code, with a log beside it.
//
// --procs N (device): only ibv_reg_mr + ibv_dereg_mr, per size first in one
//   process alone, then in N processes at once (each its own context, PD and
//   buffer, started together by a barrier): what registration costs when N
//   ranks of a job on one machine register at the same time, as the ranks of
//   examples/bench/rdmax_allreduce_bench --mode per-call do. The figure to set beside a
//   per-call allreduce of N ranks on the same machine.
//
// --alloc (no device: counting_registrar registers nothing): the median
//   nanoseconds of an arena allocate + deallocate for 64 B to 1 MiB, on one
//   thread (alone, and beside a live block of the same size, which keeps its
//   span in use), then on two threads at once on the same arena; each against
//   malloc + free of the same size in the same run.
//
// Time is the cycle counter (bench_common.hpp's cycles()), converted with its
// rate measured against steady_clock over each measured phase.
//
//   rdmax_reg_bench --alloc --json alloc.json --plot alloc.png
//   tests/vm/run -- build/examples/bench/rdmax_reg_bench --json /tmp/r.json
//   tests/vm/run -- build/examples/bench/rdmax_reg_bench --procs 4 -s 16M
#include <algorithm>
#include <array>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <pthread.h>
#include <string>
#include <string_view>
#include <sys/mman.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <rdmax/mem/registered_arena.hpp>
#include <rdmax/mem/verbs_cache.hpp>

#include "bench_common.hpp"
#include "bench_stats.hpp"
#include "reg_bench_dmabuf.hpp"

namespace {

using namespace rdmax;
using namespace rdmax::bench;
using rdmax::rights;

constexpr std::string_view tool = "rdmax_reg_bench";
/// What the ibv_reg_mr baseline and the cache ask for (a typical RDMA buffer's).
constexpr rights reg_rights = rights::local_write | rights::remote_write | rights::remote_read;

/// Device-mode sizes; -s cuts the list.
constexpr std::array<std::size_t, 9> device_sizes = {
    4 * kib, 16 * kib, 64 * kib, 256 * kib, 1 * mib, 4 * mib, 16 * mib, 64 * mib, 256 * mib};
/// --alloc sizes: 64 B to 1 MiB in powers of two; -s cuts the list.
constexpr std::size_t alloc_smallest = 64;
constexpr std::size_t alloc_largest = mib;

constexpr std::uint32_t default_reg_iterations = 1000;
constexpr std::uint32_t default_ops = 10000;
/// What the issue asks of the arena on the host.
constexpr double alloc_target_ns = 50;
/// What the issue asks of a cache hit and an arena allocation against ibv_reg_mr.
constexpr double ratio_target = 100;

struct reg_options {
    bool alloc = false;              ///< --alloc
    bool dmabuf = false;             ///< --dmabuf
    std::string device;              ///< -d
    std::size_t max_size = 0;        ///< -s; 0: the mode's largest
    std::uint32_t iterations = 0;    ///< -n; 0: default_reg_iterations
    std::uint32_t ops = default_ops; ///< --ops
    std::uint32_t batches = 9;       ///< --batches
    std::uint32_t procs = 0;         ///< --procs; 0: not that mode
    std::chrono::microseconds nap{}; ///< --nap
    std::string json_path;           ///< --json
    std::string plot_path;           ///< --plot
    [[nodiscard]] std::uint32_t registrations() const noexcept {
        return iterations != 0 ? iterations : default_reg_iterations;
    }
};

void print_usage() {
    fmt::print(
        "usage: {0} [options]            ibv_reg_mr vs a cache hit vs an arena allocation\n"
        "       {0} --alloc [options]    arena allocate + deallocate on the host (no device)\n\n"
        "  -d, --ib-dev DEV        device (default: the first with an ACTIVE port)\n"
        "  -s, --max-size BYTES    largest size (K/M/G suffixes; default 256M, --alloc 1M)\n"
        "  -n, --iters N           ibv_reg_mr + ibv_dereg_mr per size up to 1 MiB (default {1}),\n"
        "                          scaled down by size above it (at least min(N, 9))\n"
        "      --ops N             cache hits / arena allocations per timed batch (default {2})\n"
        "      --batches N         timed batches per measurement, median reported (default 9)\n"
        "      --procs N           ibv_reg_mr + ibv_dereg_mr only: one process alone, then N\n"
        "                          processes at once (as N ranks on one machine register)\n"
        "      --nap US            sleep US before each ibv_reg_mr (untimed): registration\n"
        "                          after a wakeup, as between a program's messages\n"
        "      --alloc             the host-only arena allocation benchmark\n"
        "      --dmabuf            dma-buf (udmabuf) registration vs a dmabuf_cache hit, beside\n"
        "                          host memory (a device with dma-buf MRs, /dev/udmabuf)\n"
        "      --json FILE         a JSON list of the results\n"
        "      --plot FILE.png     cost against size, log-log, with gnuplot\n"
        "  -h, --help              this text\n",
        tool, default_reg_iterations, default_ops);
}

reg_options parse_options(int argc, char** argv) {
    reg_options o;
    enum : int {
        opt_json = 1000,
        opt_plot,
        opt_alloc,
        opt_dmabuf,
        opt_ops,
        opt_batches,
        opt_procs,
        opt_nap
    };
    const option longs[] = {
        {"alloc", no_argument, nullptr, opt_alloc},
        {"dmabuf", no_argument, nullptr, opt_dmabuf},
        {"ib-dev", required_argument, nullptr, 'd'},
        {"max-size", required_argument, nullptr, 's'},
        {"iters", required_argument, nullptr, 'n'},
        {"ops", required_argument, nullptr, opt_ops},
        {"batches", required_argument, nullptr, opt_batches},
        {"procs", required_argument, nullptr, opt_procs},
        {"nap", required_argument, nullptr, opt_nap},
        {"json", required_argument, nullptr, opt_json},
        {"plot", required_argument, nullptr, opt_plot},
        {"help", no_argument, nullptr, 'h'},
        {nullptr, 0, nullptr, 0},
    };
    using bench::detail::parse_number;
    try {
        for (;;) {
            const int c = getopt_long(argc, argv, "d:s:n:h", longs, nullptr);
            if (c == -1)
                break;
            switch (c) {
            case opt_alloc: o.alloc = true; break;
            case opt_dmabuf: o.dmabuf = true; break;
            case 'd': o.device = optarg; break;
            case 's': o.max_size = parse_size(optarg, "-s", device_sizes.back()); break;
            case 'n':
                o.iterations =
                    parse_number<std::uint32_t>(optarg, "-n", fewest_iterations, 100'000'000);
                break;
            case opt_ops:
                o.ops = parse_number<std::uint32_t>(optarg, "--ops", 1, 1'000'000'000);
                break;
            case opt_batches:
                o.batches = parse_number<std::uint32_t>(optarg, "--batches", 1, 1000);
                break;
            case opt_procs: o.procs = parse_number<std::uint32_t>(optarg, "--procs", 1, 64); break;
            case opt_nap:
                o.nap = std::chrono::microseconds(
                    parse_number<std::uint32_t>(optarg, "--nap", 0, 1'000'000));
                break;
            case opt_json: o.json_path = optarg; break;
            case opt_plot: o.plot_path = optarg; break;
            case 'h': print_usage(); std::exit(0);
            default: fmt::print(stderr, "{}: try --help\n", tool); std::exit(2);
            }
        }
        if (optind < argc)
            fail(fmt::format("unexpected argument '{}'", argv[optind]));
        if (o.alloc && (!o.device.empty() || o.iterations != 0))
            fail("-d and -n are for the device mode, not --alloc");
        if (o.alloc && o.procs != 0)
            fail("--procs and --alloc: one or the other");
        if (o.dmabuf && (o.alloc || o.procs != 0 || o.nap.count() != 0 || !o.plot_path.empty()))
            fail("--dmabuf takes -d, -s, -n, --ops, --batches and --json only");
        const std::size_t smallest = o.alloc ? alloc_smallest : device_sizes.front();
        if (o.max_size == 0)
            o.max_size = o.alloc ? alloc_largest : device_sizes.back();
        if (o.max_size < smallest)
            fail(fmt::format("-s {} is below the smallest size, {}", o.max_size, smallest));
        if (o.alloc && o.max_size > alloc_largest)
            fail(fmt::format("--alloc goes up to {}", human_bytes(alloc_largest)));
    } catch (const bench_failure& e) {
        fmt::print(stderr, "{}: {}\n", tool, e.what());
        std::exit(2);
    }
    return o;
}

/// Keeps the compiler from dropping an allocation it can see is unused.
inline void escape(void* p) noexcept {
    asm volatile("" : : "r"(p) : "memory");
}

/// Per-operation nanoseconds of each batch, from cycles at `per_us`.
summary per_op_ns(const std::vector<std::uint64_t>& batch_cycles, double per_us,
                  std::uint32_t ops) {
    if (per_us <= 0)
        fail("the cycle counter did not advance");
    std::vector<double> ns;
    ns.reserve(batch_cycles.size());
    for (const std::uint64_t c : batch_cycles)
        ns.push_back(static_cast<double>(c) * 1000.0 / per_us / ops);
    return summarize(std::move(ns));
}

/// Something that makes a measurement wrong: printed after the table, and the
/// run exits 1.
std::vector<std::string> anomalies;

void anomaly(std::string what) {
    fmt::print(stderr, "{}: ANOMALY: {}\n", tool, what);
    anomalies.push_back(std::move(what));
}

// ---- device mode --------------------------------------------------------------------------

/// The memory regions registrations made and not yet dropped, with counts.
struct mr_log {
    std::mutex mutex;
    std::vector<ibv_mr*> live;
    std::uint64_t regs = 0, deregs = 0;
};

/// verbs_registrar, writing down what it registers (the arena registers
/// outside its lock, and deregisters from its trimming thread: hence the mutex).
class recording_registrar {
public:
    using handle = ibv_mr*;

    recording_registrar(const verbs::protection_domain& pd, mr_log& log) noexcept
        : inner_(pd)
        , log_(&log) {}

    [[nodiscard]] handle reg(void* addr, std::size_t len, rights r) {
        ibv_mr* mr = inner_.reg(addr, len, r);
        try {
            std::lock_guard g(log_->mutex);
            log_->live.push_back(mr);
            ++log_->regs;
        } catch (...) {
            inner_.dereg(mr);
            throw;
        }
        return mr;
    }
    void dereg(handle mr) noexcept {
        {
            std::lock_guard g(log_->mutex);
            std::erase(log_->live, mr);
            ++log_->deregs;
        }
        inner_.dereg(mr);
    }
    [[nodiscard]] static mr_keys keys(handle mr) noexcept { return verbs_registrar::keys(mr); }

private:
    verbs_registrar inner_;
    mr_log* log_;
};
static_assert(registrar<recording_registrar>);

using checked_arena = basic_registered_arena<recording_registrar>;

/// Whether the block's keys are those of a live memory region covering it;
/// if not, what is wrong.
std::string check_block(mr_log& log, const checked_arena::block& b, std::size_t bytes) {
    if (b.data == nullptr || b.size != bytes)
        return fmt::format("allocate({}) gave {{data {}, size {}}}", bytes,
                           static_cast<void*>(b.data), b.size);
    const auto at = reinterpret_cast<std::uintptr_t>(b.data);
    std::lock_guard g(log.mutex);
    for (const ibv_mr* mr : log.live) {
        const auto start = reinterpret_cast<std::uintptr_t>(mr->addr);
        if (at >= start && at + bytes <= start + mr->length) {
            if (mr->lkey == b.lkey && mr->rkey == b.rkey)
                return {};
            return fmt::format("block {} + {} has lkey {:#x} rkey {:#x}, its memory region "
                               "[{:#x}, +{}) lkey {:#x} rkey {:#x}",
                               static_cast<void*>(b.data), bytes, b.lkey, b.rkey, start, mr->length,
                               mr->lkey, mr->rkey);
        }
    }
    return fmt::format("block {} + {} (lkey {:#x}) lies in no memory region the arena registered "
                       "({} live)",
                       static_cast<void*>(b.data), bytes, b.lkey, log.live.size());
}

struct device_result {
    std::size_t bytes = 0;
    std::uint32_t iterations = 0;
    double reg_us = 0, dereg_us = 0, both_us = 0, hit_us = 0, arena_us = 0;
    bool arena_ok = true;
};

/// The cache hit: batches of get + release on one cached registration.
std::vector<std::uint64_t> time_cache_hits(const reg_options& opt,
                                           const verbs::protection_domain& pd, std::byte* buffer,
                                           std::size_t bytes, std::string& monitor) {
    auto cache = make_verbs_cache(pd);
    monitor = std::string(to_string(cache.monitor_ref().kind()));
    std::uint32_t lkey = 0;
    {
        auto first = cache.get<reg_rights>(buffer, bytes); // the miss: registers once
        lkey = first.lkey();
    }
    std::vector<std::uint64_t> hit_cycles;
    std::uint64_t keys = 0;
    for (std::uint32_t b = 0; b < opt.batches; ++b) {
        const std::uint64_t t0 = cycles();
        for (std::uint32_t i = 0; i < opt.ops; ++i) {
            auto h = cache.get<reg_rights>(buffer, bytes);
            keys += h.lkey();
            h.reset();
        }
        hit_cycles.push_back(cycles() - t0);
    }
    const rcache_counters c = cache.counters();
    const std::uint64_t gets = std::uint64_t{opt.batches} * opt.ops;
    if (c.registrations != 1 || c.hits != gets || keys != std::uint64_t{lkey} * gets)
        fail(fmt::format("{}: the cache did not serve every get from one registration: {}",
                         human_bytes(bytes), c));
    return hit_cycles;
}

/// The arena: batches of allocate + deallocate of `bytes`, the area already
/// registered. Checks keys and counters; anomalies are recorded, not fatal.
std::vector<std::uint64_t> time_arena(const reg_options& opt, const verbs::protection_domain& pd,
                                      std::size_t bytes, bool& ok) {
    mr_log log;
    arena_options ao = arena_options{}.with_env();
    // A freed area (a dedicated one, or the shared one when its last block
    // goes) must stay registered: the watermark holds twice the largest area.
    const std::size_t two_mib = 2 * mib;
    const std::size_t area = std::max(ao.area_bytes, (bytes + two_mib - 1) / two_mib * two_mib);
    ao.high_watermark = std::max(ao.high_watermark, 2 * area);
    checked_arena arena(recording_registrar(pd, log), ao);
    const auto where = [&] { return fmt::format("arena, {}", human_bytes(bytes)); };

    // Warm: the first allocation registers the area; a few more settle it.
    const std::uint32_t warm = std::max<std::uint32_t>(opt.ops / 8, 1);
    for (std::uint32_t i = 0; i < warm; ++i) {
        const checked_arena::block b = arena.allocate(bytes);
        if (i == 0 || i + 1 == warm)
            if (std::string bad = check_block(log, b, bytes); !bad.empty()) {
                anomaly(fmt::format("{}: wrong keys after warming: {}", where(), bad));
                ok = false;
            }
        arena.deallocate(b.data, bytes);
    }
    const arena_counters before = arena.counters();
    std::uint64_t regs_before = 0;
    {
        std::lock_guard g(log.mutex);
        regs_before = log.regs;
    }

    std::vector<std::uint64_t> arena_cycles;
    std::uint64_t keys = 0, expected_keys = 0;
    for (std::uint32_t b = 0; b < opt.batches; ++b) {
        const std::uint64_t t0 = cycles();
        for (std::uint32_t i = 0; i < opt.ops; ++i) {
            const checked_arena::block blk = arena.allocate(bytes);
            keys += blk.lkey;
            arena.deallocate(blk.data, bytes);
        }
        arena_cycles.push_back(cycles() - t0);
        // Outside the timing: one more block, checked against the registrations.
        const checked_arena::block blk = arena.allocate(bytes);
        expected_keys += std::uint64_t{blk.lkey} * opt.ops;
        if (std::string bad = check_block(log, blk, bytes); !bad.empty()) {
            anomaly(fmt::format("{}: wrong keys in batch {}: {}", where(), b + 1, bad));
            ok = false;
        }
        arena.deallocate(blk.data, bytes);
    }

    const arena_counters after = arena.counters();
    std::uint64_t regs_after = 0;
    {
        std::lock_guard g(log.mutex);
        regs_after = log.regs;
    }
    const std::uint64_t pairs = std::uint64_t{opt.batches} * (opt.ops + 1);
    if (after.areas_registered != before.areas_registered || regs_after != regs_before ||
        after.areas_released != 0 || after.allocations - before.allocations != pairs ||
        after.frees - before.frees != pairs || after.allocated_bytes != 0) {
        anomaly(fmt::format("{}: not a steady state: {} registrations during the timed batches; "
                            "before: {}; after: {}",
                            where(), regs_after - regs_before, before, after));
        ok = false;
    }
    if (keys != expected_keys) {
        anomaly(fmt::format("{}: lkeys of the timed allocations sum to {}, {} expected (keys "
                            "changed between allocations)",
                            where(), keys, expected_keys));
        ok = false;
    }
    fmt::print(stderr, "[arena] {}: {}\n", human_bytes(bytes), after);
    return arena_cycles;
}

device_result measure_device(const reg_options& opt, const verbs::protection_domain& pd,
                             std::byte* buffer, std::size_t bytes, std::string& monitor) {
    device_result r;
    r.bytes = bytes;
    r.iterations = reg_iterations(opt.registrations(), bytes);
    cycle_rate rate;
    rate.start();

    fmt::print(stderr, "[{}] {} x ibv_reg_mr + ibv_dereg_mr\n", human_bytes(bytes), r.iterations);
    const reg_cycles reg = time_registration(pd, buffer, bytes, reg_rights, r.iterations, opt.nap);

    fmt::print(stderr, "[{}] {} x {} cache hits\n", human_bytes(bytes), opt.batches, opt.ops);
    const std::vector<std::uint64_t> hit_cycles = time_cache_hits(opt, pd, buffer, bytes, monitor);

    fmt::print(stderr, "[{}] {} x {} arena allocations\n", human_bytes(bytes), opt.batches,
               opt.ops);
    const std::vector<std::uint64_t> arena_cycles = time_arena(opt, pd, bytes, r.arena_ok);
    rate.stop();

    const double per_us = rate.per_us();
    if (per_us <= 0)
        fail("the cycle counter did not advance");
    std::vector<double> reg_us, dereg_us, both_us;
    for (std::size_t i = 0; i < reg.reg.size(); ++i) {
        reg_us.push_back(static_cast<double>(reg.reg[i]) / per_us);
        dereg_us.push_back(static_cast<double>(reg.dereg[i]) / per_us);
        both_us.push_back(static_cast<double>(reg.reg[i] + reg.dereg[i]) / per_us);
    }
    r.reg_us = median(reg_us);
    r.dereg_us = median(dereg_us);
    r.both_us = median(both_us);
    const summary hit = per_op_ns(hit_cycles, per_us, opt.ops);
    const summary arena = per_op_ns(arena_cycles, per_us, opt.ops);
    r.hit_us = hit.median / 1000.0;
    r.arena_us = arena.median / 1000.0;
    fmt::print(stderr,
               "[{}] ns per op, median (min-max): cache hit {:.1f} ({:.1f}-{:.1f}), arena "
               "{:.1f} ({:.1f}-{:.1f})\n",
               human_bytes(bytes), hit.median, hit.min, hit.max, arena.median, arena.min,
               arena.max);
    return r;
}

void run_device(const reg_options& opt, json_list& json) {
    const verbs::context ctx =
        opt.device.empty() ? verbs::context::open_first_active() : verbs::context::open(opt.device);
    const verbs::protection_domain pd(ctx);
    std::vector<std::size_t> sizes;
    for (const std::size_t s : device_sizes)
        if (s <= opt.max_size)
            sizes.push_back(s);
    fmt::print(stderr, "[setup] mapping and touching {}\n", human_bytes(sizes.back()));
    const mapping buffer(sizes.back(), true);
    const arena_options ao = arena_options{}.with_env();

    fmt::print(
        "{}"
        "     Registered memory: ibv_reg_mr + ibv_dereg_mr vs a cache hit vs an arena block\n"
        " Device         : {}\n"
        " ibv            : reg and dereg of a touched buffer, timed apart; median\n"
        "                  ({} us nap before each reg, untimed)\n"
        " Cache hit      : get + release, make_verbs_cache(pd); {} batches of {}; median\n"
        " Arena          : allocate + deallocate, area registered before; {} batches of {}; "
        "median\n"
        "                  areas of {}, above {} a dedicated area; huge pages {}\n"
        "{}",
        result_line, ctx.name(), opt.nap.count(), opt.batches, opt.ops, opt.batches, opt.ops,
        human_bytes(ao.area_bytes), human_bytes(ao.area_bytes / 2), ao.huge_pages ? "asked" : "off",
        result_line);
    fmt::print(" {:>10} {:>6} {:>10} {:>11} {:>16} {:>15} {:>15} {:>10} {:>10}\n", "#bytes",
               "#iters", "reg[usec]", "dereg[usec]", "reg+dereg[usec]", "cache_hit[usec]",
               "arena[usec]", "ibv/cache", "ibv/arena");
    std::fflush(stdout);

    std::vector<device_result> results;
    std::string monitor;
    for (const std::size_t bytes : sizes) {
        const device_result r = measure_device(opt, pd, buffer.data(), bytes, monitor);
        results.push_back(r);
        fmt::print(" {:>10} {:>6} {:>10.2f} {:>11.2f} {:>16.2f} {:>15.4f} {:>15.4f} {:>10.0f} "
                   "{:>10.0f}{}\n",
                   r.bytes, r.iterations, r.reg_us, r.dereg_us, r.both_us, r.hit_us, r.arena_us,
                   r.both_us / r.hit_us, r.both_us / r.arena_us, r.arena_ok ? "" : "  !");
        std::fflush(stdout);
        json.add(fmt::format(R"({{"bytes":{},"ibv_reg_mr_us":{:.3f},"cache_hit_us":{:.4f},)"
                             R"("arena_alloc_us":{:.4f}}})",
                             r.bytes, r.both_us, r.hit_us, r.arena_us));
    }
    fmt::print("{}", result_line);
    fmt::print(" cache monitor: {}\n", monitor);

    const auto worst = [&](auto ratio) {
        const auto it =
            std::min_element(results.begin(), results.end(),
                             [&](const auto& a, const auto& b) { return ratio(a) < ratio(b); });
        return std::pair{ratio(*it), it->bytes};
    };
    const auto [cache_min, cache_at] =
        worst([](const device_result& r) { return r.both_us / r.hit_us; });
    const auto [arena_min, arena_at] =
        worst([](const device_result& r) { return r.both_us / r.arena_us; });
    fmt::print(" target: cache hit >= {:.0f}x cheaper than ibv_reg_mr + ibv_dereg_mr at every "
               "size: {} (least {:.0f}x, at {})\n",
               ratio_target, cache_min >= ratio_target ? "met" : "NOT met", cache_min,
               human_bytes(cache_at));
    fmt::print(" target: arena allocation >= {:.0f}x cheaper than ibv_reg_mr + ibv_dereg_mr at "
               "every size: {} (least {:.0f}x, at {})\n",
               ratio_target, arena_min >= ratio_target ? "met" : "NOT met", arena_min,
               human_bytes(arena_at));

    if (!opt.plot_path.empty()) {
        std::vector<double> x;
        std::vector<plot_series> series{{"ibv_reg_mr + ibv_dereg_mr", {}},
                                        {"registration cache hit (get + release)", {}},
                                        {"registered_arena allocate + deallocate", {}}};
        for (const device_result& r : results) {
            x.push_back(static_cast<double>(r.bytes));
            series[0].y.push_back(r.both_us);
            series[1].y.push_back(r.hit_us);
            series[2].y.push_back(r.arena_us);
        }
        if (log_log_plot(
                opt.plot_path,
                fmt::format("Registered memory on {}: cost against size (median)", ctx.name()),
                "bytes", "microseconds", x, series))
            fmt::print(stderr, "[plot] wrote {}\n", opt.plot_path);
    }
}

// ---- --procs ------------------------------------------------------------------------------

/// What the processes of --procs share: a barrier and their medians.
struct procs_shared {
    pthread_barrier_t barrier;
    /// [phase][size][process]: reg + dereg, reg, dereg in microseconds (median);
    /// phase 0: process 0 alone; phase 1: all at once.
    double both[2][device_sizes.size()][64];
    double reg[2][device_sizes.size()][64];
    double dereg[2][device_sizes.size()][64];
    int failed;
};

/// One process of --procs: its own context, PD and buffer; the barrier
/// starts every measurement at once.
void procs_child(const reg_options& opt, procs_shared& sh, std::uint32_t me,
                 const std::vector<std::size_t>& sizes) {
    const auto sync = [&] { pthread_barrier_wait(&sh.barrier); };
    try {
        const verbs::context ctx = opt.device.empty() ? verbs::context::open_first_active()
                                                      : verbs::context::open(opt.device);
        const verbs::protection_domain pd(ctx);
        const mapping buffer(sizes.back(), true);
        for (std::size_t k = 0; k < sizes.size(); ++k) {
            const std::uint32_t iters = reg_iterations(opt.registrations(), sizes[k]);
            for (int phase = 0; phase < 2; ++phase) {
                sync();
                if (phase == 0 && me != 0)
                    continue; // process 0 alone
                cycle_rate rate;
                rate.start();
                const reg_cycles c =
                    time_registration(pd, buffer.data(), sizes[k], reg_rights, iters, opt.nap);
                rate.stop();
                const double per_us = rate.per_us();
                std::vector<double> both, reg, dereg;
                for (std::size_t i = 0; i < c.reg.size(); ++i) {
                    reg.push_back(static_cast<double>(c.reg[i]) / per_us);
                    dereg.push_back(static_cast<double>(c.dereg[i]) / per_us);
                    both.push_back(static_cast<double>(c.reg[i] + c.dereg[i]) / per_us);
                }
                sh.both[phase][k][me] = median(both);
                sh.reg[phase][k][me] = median(reg);
                sh.dereg[phase][k][me] = median(dereg);
            }
        }
        sync();
    } catch (const std::exception& e) {
        fmt::print(stderr, "{}: process {}: {}\n", tool, me, e.what());
        sh.failed = 1;
        std::_Exit(1); // the others then wait at the barrier: the parent kills them
    }
}

void run_procs(const reg_options& opt, json_list& json) {
    std::vector<std::size_t> sizes;
    for (const std::size_t s : device_sizes)
        if (s <= opt.max_size)
            sizes.push_back(s);
    const std::uint32_t n = opt.procs;
    void* mem = mmap(nullptr, sizeof(procs_shared), PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED)
        fail("cannot map the shared results");
    auto& sh = *new (mem) procs_shared{};
    pthread_barrierattr_t attr;
    pthread_barrierattr_init(&attr);
    pthread_barrierattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_barrier_init(&sh.barrier, &attr, n);

    fmt::print("{}"
               "     ibv_reg_mr + ibv_dereg_mr: one process alone vs {} processes at once\n"
               " Each process   : its own context, PD and touched buffer; per size, process 0\n"
               "                  alone, then all {} started together by a barrier\n"
               " Figures        : median per process; 'at once' is the median of the {} "
               "processes' medians (min-max)\n"
               " Processors     : {} online\n"
               " Nap            : {} us before each ibv_reg_mr, untimed\n"
               "{}",
               result_line, n, n, n, sysconf(_SC_NPROCESSORS_ONLN), opt.nap.count(), result_line);
    fmt::print(" {:>10} {:>6} {:>16} {:>16} {:>26} {:>12} {:>12} {:>8}\n", "#bytes", "#iters",
               "alone reg+dereg", "alone reg/dereg", fmt::format("{} at once reg+dereg", n), "reg",
               "dereg", "ratio");
    std::fflush(stdout);
    std::vector<pid_t> kids;
    for (std::uint32_t me = 0; me < n; ++me) {
        const pid_t pid = fork();
        if (pid < 0)
            fail(fmt::format("fork: {}", std::strerror(errno)));
        if (pid == 0) {
            procs_child(opt, sh, me, sizes);
            std::_Exit(0);
        }
        kids.push_back(pid);
    }
    int bad = 0;
    for (std::size_t left = kids.size(); left > 0;) {
        int st = 0;
        const pid_t pid = waitpid(-1, &st, 0);
        if (pid < 0)
            break;
        --left;
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            bad = 1;
            for (const pid_t k : kids)
                kill(k, SIGKILL); // the others would wait at the barrier for ever
        }
    }
    if (bad != 0 || sh.failed != 0)
        fail("a process failed");
    for (std::size_t k = 0; k < sizes.size(); ++k) {
        std::vector<double> all(sh.both[1][k], sh.both[1][k] + n);
        std::vector<double> regs(sh.reg[1][k], sh.reg[1][k] + n);
        std::vector<double> deregs(sh.dereg[1][k], sh.dereg[1][k] + n);
        const double alone = sh.both[0][k][0], together = median(all);
        fmt::print(" {:>10} {:>6} {:>16.2f} {:>16} {:>26} {:>12.2f} {:>12.2f} {:>8.2f}\n", sizes[k],
                   reg_iterations(opt.registrations(), sizes[k]), alone,
                   fmt::format("{:.1f}/{:.1f}", sh.reg[0][k][0], sh.dereg[0][k][0]),
                   fmt::format("{:.2f} ({:.1f}-{:.1f})", together,
                               *std::min_element(all.begin(), all.end()),
                               *std::max_element(all.begin(), all.end())),
                   median(regs), median(deregs), together / alone);
        json.add(fmt::format(R"({{"bytes":{},"procs":{},"alone_us":{:.3f},"at_once_us":{:.3f}}})",
                             sizes[k], n, alone, together));
    }
    fmt::print("{}", result_line);
    pthread_barrier_destroy(&sh.barrier);
    munmap(mem, sizeof(procs_shared));
}

// ---- --alloc ------------------------------------------------------------------------------

using counting_arena = basic_registered_arena<counting_registrar>;

/// One batch of allocate + deallocate pairs on the arena; cycles.
std::uint64_t arena_batch(counting_arena& arena, std::size_t bytes, std::uint32_t ops) {
    const std::uint64_t t0 = cycles();
    for (std::uint32_t i = 0; i < ops; ++i) {
        const counting_arena::block b = arena.allocate(bytes);
        escape(b.data);
        arena.deallocate(b.data, bytes);
    }
    return cycles() - t0;
}

/// The same with malloc + free.
std::uint64_t malloc_batch(std::size_t bytes, std::uint32_t ops) {
    const std::uint64_t t0 = cycles();
    for (std::uint32_t i = 0; i < ops; ++i) {
        void* p = std::malloc(bytes);
        if (p == nullptr)
            fail(fmt::format("malloc({}) failed", bytes));
        escape(p);
        std::free(p);
    }
    return cycles() - t0;
}

struct alloc_result {
    std::size_t bytes = 0;
    summary arena, arena_live, malloc1, arena2, malloc2;
};

/// Two threads at once, each its own batches, started together per batch.
/// Both threads' batches are the samples.
template <class Batch>
std::vector<std::uint64_t> two_threads(std::uint32_t batches, Batch batch) {
    std::vector<std::uint64_t> samples[2];
    std::barrier sync(2);
    const auto body = [&](int t) {
        for (std::uint32_t b = 0; b < batches; ++b) {
            sync.arrive_and_wait();
            samples[t].push_back(batch());
        }
    };
    std::thread other(body, 1);
    body(0);
    other.join();
    samples[0].insert(samples[0].end(), samples[1].begin(), samples[1].end());
    return samples[0];
}

alloc_result measure_alloc(const reg_options& opt, counting_arena& arena, std::size_t bytes) {
    alloc_result r;
    r.bytes = bytes;
    const std::string where = fmt::format("--alloc, {}", human_bytes(bytes));
    fmt::print(stderr, "[alloc] {}: warming\n", human_bytes(bytes));
    // Two blocks at once, so that the two-thread run finds its memory too.
    {
        const counting_arena::block a = arena.allocate(bytes), b = arena.allocate(bytes);
        arena.deallocate(a.data, bytes);
        arena.deallocate(b.data, bytes);
    }
    const std::uint32_t warm = std::max<std::uint32_t>(opt.ops / 8, 1);
    (void)arena_batch(arena, bytes, warm);
    (void)malloc_batch(bytes, warm);
    const arena_counters before = arena.counters();
    const std::size_t regs_before = arena.registrar_ref().regs;

    std::vector<std::uint64_t> arena_c, live_c, malloc_c;
    cycle_rate rate;
    rate.start();
    fmt::print(stderr, "[alloc] {}: one thread, {} x {}\n", human_bytes(bytes), opt.batches,
               opt.ops);
    for (std::uint32_t b = 0; b < opt.batches; ++b) {
        if (b % 2 == 0) { // alternate which goes first
            arena_c.push_back(arena_batch(arena, bytes, opt.ops));
            malloc_c.push_back(malloc_batch(bytes, opt.ops));
        } else {
            malloc_c.push_back(malloc_batch(bytes, opt.ops));
            arena_c.push_back(arena_batch(arena, bytes, opt.ops));
        }
        const counting_arena::block keep = arena.allocate(bytes);
        live_c.push_back(arena_batch(arena, bytes, opt.ops));
        arena.deallocate(keep.data, bytes);
    }
    fmt::print(stderr, "[alloc] {}: two threads, {} x {} each\n", human_bytes(bytes), opt.batches,
               opt.ops);
    const std::vector<std::uint64_t> arena2_c =
        two_threads(opt.batches, [&] { return arena_batch(arena, bytes, opt.ops); });
    const std::vector<std::uint64_t> malloc2_c =
        two_threads(opt.batches, [&] { return malloc_batch(bytes, opt.ops); });
    rate.stop();

    const arena_counters after = arena.counters();
    const std::uint64_t pairs = std::uint64_t{opt.batches} * (4 * std::uint64_t{opt.ops} + 1);
    if (after.areas_registered != before.areas_registered ||
        arena.registrar_ref().regs != regs_before ||
        after.areas_released != before.areas_released ||
        after.allocations - before.allocations != pairs || after.frees - before.frees != pairs ||
        after.allocated_bytes != 0)
        anomaly(fmt::format("{}: not a steady state: before: {}; after: {}", where, before, after));

    const double per_us = rate.per_us();
    r.arena = per_op_ns(arena_c, per_us, opt.ops);
    r.arena_live = per_op_ns(live_c, per_us, opt.ops);
    r.malloc1 = per_op_ns(malloc_c, per_us, opt.ops);
    r.arena2 = per_op_ns(arena2_c, per_us, opt.ops);
    r.malloc2 = per_op_ns(malloc2_c, per_us, opt.ops);
    return r;
}

void run_alloc(const reg_options& opt, json_list& json) {
    counting_arena arena(counting_registrar{}, arena_options{}.with_env());
    const arena_options& ao = arena.options();
    fmt::print("{}"
               "     registered_arena allocate + deallocate vs malloc + free (no device)\n"
               " Registrar      : counting_registrar (registers nothing)\n"
               " Arena          : areas of {}, huge pages {}; one arena, warm; {} batches of {}; "
               "median (min-max)\n"
               " live           : the same beside one live block of the size (its span stays "
               "in use)\n"
               " 2 threads      : both at once on the same arena (malloc: the same, its own "
               "arenas);\n"
               "                  the median of both threads' batches\n"
               "{}",
               result_line, human_bytes(ao.area_bytes), ao.huge_pages ? "asked" : "off",
               opt.batches, opt.ops, result_line);
    fmt::print(" {:>8}   {:>22} {:>9} {:>10} {:>12}   {:>22} {:>12} {:>12}\n", "#bytes",
               "arena[ns]", "live[ns]", "malloc[ns]", "malloc/arena", "arena 2thr[ns]",
               "malloc 2thr[ns]", "malloc/arena");
    std::fflush(stdout);
    const auto cell = [](const summary& s) {
        return fmt::format("{:.1f} ({:.1f}-{:.1f})", s.median, s.min, s.max);
    };
    std::vector<alloc_result> results;
    for (std::size_t bytes = alloc_smallest; bytes <= opt.max_size; bytes *= 2) {
        const alloc_result r = measure_alloc(opt, arena, bytes);
        results.push_back(r);
        fmt::print(" {:>8}   {:>22} {:>9.1f} {:>10.1f} {:>12.2f}   {:>22} {:>12.1f} {:>12.2f}\n",
                   human_bytes(bytes), cell(r.arena), r.arena_live.median, r.malloc1.median,
                   r.malloc1.median / r.arena.median, cell(r.arena2), r.malloc2.median,
                   r.malloc2.median / r.arena2.median);
        std::fflush(stdout);
        json.add(
            fmt::format(R"({{"bytes":{},"arena_ns":{:.2f},"arena_live_ns":{:.2f},)"
                        R"("malloc_ns":{:.2f},"arena_2thr_ns":{:.2f},"malloc_2thr_ns":{:.2f}}})",
                        bytes, r.arena.median, r.arena_live.median, r.malloc1.median,
                        r.arena2.median, r.malloc2.median));
    }
    fmt::print("{}", result_line);
    const auto slowest = std::max_element(results.begin(), results.end(),
                                          [](const alloc_result& a, const alloc_result& b) {
                                              return a.arena.median < b.arena.median;
                                          });
    const auto over = std::count_if(results.begin(), results.end(), [](const alloc_result& r) {
        return r.arena.median > alloc_target_ns;
    });
    fmt::print(" target: arena allocate + deallocate <= {:.0f} ns median on one thread: {} "
               "(slowest {:.1f} ns at {}; {} of {} sizes over)\n",
               alloc_target_ns, over == 0 ? "met" : "NOT met", slowest->arena.median,
               human_bytes(slowest->bytes), over, results.size());
    fmt::print(" arena counters: {}\n", arena.counters());

    if (!opt.plot_path.empty()) {
        std::vector<double> x;
        std::vector<plot_series> series{{"arena, 1 thread", {}},
                                        {"arena, beside a live block", {}},
                                        {"malloc + free, 1 thread", {}},
                                        {"arena, 2 threads", {}},
                                        {"malloc + free, 2 threads", {}}};
        for (const alloc_result& r : results) {
            x.push_back(static_cast<double>(r.bytes));
            series[0].y.push_back(r.arena.median);
            series[1].y.push_back(r.arena_live.median);
            series[2].y.push_back(r.malloc1.median);
            series[3].y.push_back(r.arena2.median);
            series[4].y.push_back(r.malloc2.median);
        }
        if (log_log_plot(opt.plot_path, "registered_arena allocate + deallocate (median)", "bytes",
                         "nanoseconds", x, series))
            fmt::print(stderr, "[plot] wrote {}\n", opt.plot_path);
    }
}

// ---- --dmabuf (reg_bench_dmabuf.cpp) ------------------------------------------------------

void run_dmabuf(const reg_options& opt, json_list& json) {
    const verbs::context ctx =
        opt.device.empty() ? verbs::context::open_first_active() : verbs::context::open(opt.device);
    const verbs::protection_domain pd(ctx);
    dmabuf_bench_options d;
    for (const std::size_t s : device_sizes)
        if (s <= opt.max_size)
            d.sizes.push_back(s);
    d.iterations = opt.registrations();
    d.ops = opt.ops;
    d.batches = opt.batches;
    if (!run_dmabuf_bench(pd, ctx.name(), d, json))
        fail("a dmabuf_cache hit is not 100x cheaper than registering at every size");
}

void run(int argc, char** argv) {
    const reg_options opt = parse_options(argc, argv);
    json_list json(opt.json_path);
    if (opt.alloc)
        run_alloc(opt, json);
    else if (opt.dmabuf)
        run_dmabuf(opt, json);
    else if (opt.procs != 0)
        run_procs(opt, json);
    else
        run_device(opt, json);
    if (!anomalies.empty()) {
        fmt::print("\n{} anomal{} (figures of those sizes are not the steady state):\n",
                   anomalies.size(), anomalies.size() == 1 ? "y" : "ies");
        for (const std::string& a : anomalies)
            fmt::print("  {}\n", a);
        fail("the arena did not behave");
    }
}

} // namespace

int main(int argc, char** argv) {
    try {
        run(argc, argv);
        return 0;
    } catch (const std::exception& e) {
        std::fflush(stdout);
        fmt::print(stderr, "{}: {}\n", tool, e.what());
        return 1;
    }
}
