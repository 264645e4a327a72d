// rdmax_cache_bench: what a hit in rdmax's registration cache costs, against
// the baselines that matter, each measured in the same run with the ratio printed.
//
// --lookup (no device): the median cost of a hit, get() + release (handle
//   reset), on registration_cache<counting_registrar> (nothing is really
//   registered), against a naive std::map cache doing the same work (see
//   map_cache below for exactly what it does). Registrations are one page
//   each, one page apart (every other page of one mmap'd area) so that the
//   cache, which merges ranges that overlap or touch, keeps them separate.
//   Patterns: a hot set of 16 registrations visited in turn, and uniformly
//   random visits over 1 Ki, 16 Ki and 256 Ki registrations. The random
//   indices are generated before any timing, and both caches walk the same
//   sequence. Batches of the two caches alternate; a batch's time divided by
//   its lookups is one sample, and the median of the samples is reported.
//
// --reg (a device: -d DEV, or the first with an ACTIVE port): per size, the
//   median of ibv_reg_mr + ibv_dereg_mr of one already touched buffer, fresh
//   each iteration, against the median cost of a cache hit on that buffer
//   (registration_cache<verbs_registrar>, the region registered once before
//   the hits are timed; hits timed in batches as above).
//
// Time is the cycle counter (bench_common.hpp's cycles()), converted with its
// rate measured against steady_clock over each measured phase.
//
//   rdmax_cache_bench --lookup --json lookup.json
//   rdmax_cache_bench --reg -d rxe0 -s 16M
#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <sys/mman.h>
#include <unistd.h>
#include <utility>
#include <vector>

#include <rdmax/mem/registration_cache.hpp>

#include "bench_common.hpp"
#include "bench_stats.hpp"

namespace {

using namespace rdmax;
using namespace rdmax::bench;
using rdmax::rights;

constexpr std::string_view tool = "rdmax_cache_bench";
/// The rights every registration here asks for (a typical RDMA buffer's).
constexpr rights reg_rights = rights::local_write | rights::remote_write | rights::remote_read;

/// --reg sizes; -s cuts the list.
constexpr std::array<std::size_t, 5> reg_sizes = {4 * kib, 64 * kib, 1 * mib, 16 * mib, 256 * mib};
/// --lookup: the random pattern's cache populations.
constexpr std::array<std::uint32_t, 3> random_regions = {1024, 16384, 262144};
constexpr std::uint32_t hot_regions = 16;
/// --reg: cache hits per timed batch.
constexpr std::uint32_t hits_per_batch = 10000;

struct cache_options {
    bool lookup = false;
    bool reg = false;
    std::string device;                      ///< -d
    std::size_t max_size = reg_sizes.back(); ///< -s
    std::uint32_t iterations = 0;            ///< -n; 0: the mode's default
    std::uint32_t batches = 9;               ///< --batches
    std::string json_path;                   ///< --json
};

constexpr std::uint32_t default_lookups = 1u << 20;
constexpr std::uint32_t default_reg_iterations = 1000;

void print_usage() {
    fmt::print(
        "usage: {0} --lookup [--reg] [options]\n"
        "What a registration-cache hit costs, against a std::map cache (--lookup, no device)\n"
        "and against ibv_reg_mr + ibv_dereg_mr (--reg, needs an RDMA device).\n\n"
        "      --lookup            hit cost vs std::map: hot set of 16, random over "
        "1Ki/16Ki/256Ki\n"
        "      --reg               ibv_reg_mr + ibv_dereg_mr vs a cache hit, 4 KiB to 256 MiB\n"
        "  -d, --ib-dev DEV        device for --reg (default: the first with an ACTIVE port)\n"
        "  -s, --max-size BYTES    largest --reg size (K/M/G suffixes; default 256M)\n"
        "  -n, --iters N           --lookup: lookups per batch (default {1});\n"
        "                          --reg: registrations per size up to 1 MiB (default {2}),\n"
        "                          scaled down by size above it (at least {3})\n"
        "      --batches N         timed batches per measurement, median reported (default 9)\n"
        "      --json FILE         a JSON list of the results\n"
        "  -h, --help              this text\n",
        tool, default_lookups, default_reg_iterations, fewest_iterations);
}

cache_options parse_options(int argc, char** argv) {
    cache_options o;
    enum : int { opt_json = 1000, opt_lookup, opt_reg, opt_batches };
    const option longs[] = {
        {"lookup", no_argument, nullptr, opt_lookup},
        {"reg", no_argument, nullptr, opt_reg},
        {"ib-dev", required_argument, nullptr, 'd'},
        {"max-size", required_argument, nullptr, 's'},
        {"iters", required_argument, nullptr, 'n'},
        {"batches", required_argument, nullptr, opt_batches},
        {"json", required_argument, nullptr, opt_json},
        {"help", no_argument, nullptr, 'h'},
        {nullptr, 0, nullptr, 0},
    };
    try {
        for (;;) {
            const int c = getopt_long(argc, argv, "d:s:n:h", longs, nullptr);
            if (c == -1)
                break;
            switch (c) {
            case opt_lookup: o.lookup = true; break;
            case opt_reg: o.reg = true; break;
            case 'd': o.device = optarg; break;
            case 's': o.max_size = parse_size(optarg, "-s", reg_sizes.back()); break;
            case 'n':
                o.iterations = bench::detail::parse_number<std::uint32_t>(
                    optarg, "-n", fewest_iterations, 1'000'000'000);
                break;
            case opt_batches:
                o.batches =
                    bench::detail::parse_number<std::uint32_t>(optarg, "--batches", 1, 1000);
                break;
            case opt_json: o.json_path = optarg; break;
            case 'h': print_usage(); std::exit(0);
            default: fmt::print(stderr, "{}: try --help\n", tool); std::exit(2);
            }
        }
        if (optind < argc)
            fail(fmt::format("unexpected argument '{}'", argv[optind]));
        if (!o.lookup && !o.reg)
            fail("say what to measure: --lookup, --reg, or both");
        if (o.max_size < reg_sizes.front() && o.reg)
            fail(
                fmt::format("-s {} is below the smallest size, {}", o.max_size, reg_sizes.front()));
    } catch (const bench_failure& e) {
        fmt::print(stderr, "{}: {}\n", tool, e.what());
        std::exit(2);
    }
    return o;
}

// ---- helpers ------------------------------------------------------------------------------

// ---- the baseline -------------------------------------------------------------------------

/// The baseline for --lookup: what a naive registration cache does on a hit.
///
/// Registrations live in a std::map from start address to {end, rights, key,
/// reference count}, guarded by one std::shared_mutex. get<A>(addr, len):
///   1. rounds [addr, addr + len) out to pages (as rdmax does);
///   2. takes the mutex shared;
///   3. map.upper_bound(start), then the element before it: the last
///      registration starting at or before `start`;
///   4. checks that it reaches `end` and has rights A;
///   5. increments its atomic reference count (relaxed, as rdmax does);
///   6. drops the mutex, returns a handle.
/// Release (handle reset) decrements the count (acq_rel, as rdmax does),
/// without the mutex. A miss returns an empty handle: this baseline never
/// registers, merges, evicts, counts lookups or marks entries referenced;
/// those are part of rdmax's cost that the comparison shows.
class map_cache {
    struct region {
        region(std::uintptr_t e, rights r, std::uint32_t k) noexcept
            : end(e)
            , granted(r)
            , lkey(k) {}
        std::uintptr_t end;
        rights granted;
        std::uint32_t lkey;
        std::atomic<std::uint32_t> refs{0};
    };

public:
    class handle {
    public:
        handle() noexcept = default;
        explicit handle(region* r) noexcept
            : r_(r) {}
        handle(handle&& o) noexcept
            : r_(std::exchange(o.r_, nullptr)) {}
        handle& operator=(handle&& o) noexcept {
            if (this != &o) {
                reset();
                r_ = std::exchange(o.r_, nullptr);
            }
            return *this;
        }
        handle(const handle&) = delete;
        handle& operator=(const handle&) = delete;
        ~handle() { reset(); }

        [[nodiscard]] explicit operator bool() const noexcept { return r_ != nullptr; }
        [[nodiscard]] std::uint32_t lkey() const noexcept { return r_->lkey; }
        void reset() noexcept {
            if (r_ != nullptr)
                r_->refs.fetch_sub(1, std::memory_order_acq_rel);
            r_ = nullptr;
        }

    private:
        region* r_ = nullptr;
    };

    map_cache()
        : page_(static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE))) {}

    void insert(const void* addr, std::size_t len, rights r, std::uint32_t key) {
        const auto a = reinterpret_cast<std::uintptr_t>(addr);
        std::unique_lock lock(mutex_);
        map_.try_emplace(a & ~(page_ - 1), (a + len + page_ - 1) & ~(page_ - 1), r, key);
    }

    template <rights A>
    [[nodiscard]] handle get(const void* addr, std::size_t len) {
        const auto a = reinterpret_cast<std::uintptr_t>(addr);
        const std::uintptr_t start = a & ~(page_ - 1);
        const std::uintptr_t end = (a + len + page_ - 1) & ~(page_ - 1);
        std::shared_lock lock(mutex_);
        auto it = map_.upper_bound(start);
        if (it == map_.begin())
            return {};
        --it;
        region& r = it->second;
        if (r.end < end || !has(r.granted, A))
            return {};
        r.refs.fetch_add(1, std::memory_order_relaxed);
        return handle(&r);
    }

    [[nodiscard]] std::size_t size() const noexcept { return map_.size(); }

private:
    std::uintptr_t page_;
    std::shared_mutex mutex_;
    std::map<std::uintptr_t, region> map_;
};

// ---- --lookup -----------------------------------------------------------------------------

using counting_cache = registration_cache<counting_registrar, manual_monitor>;

/// One batch: get + release at each index's registration. Returns cycles;
/// counts lookups that did not hit (there must be none) into `missed`.
template <class Cache>
std::uint64_t lookup_batch(Cache& cache, std::span<const std::uint32_t> indices,
                           const std::byte* base, std::size_t stride, std::size_t len,
                           std::uint64_t& key_sum, std::uint64_t& missed) {
    std::uint64_t keys = 0, misses = 0;
    const std::uint64_t start = cycles();
    for (const std::uint32_t i : indices) {
        auto h = cache.template get<reg_rights>(base + std::size_t{i} * stride, len);
        if (h)
            keys += h.lkey();
        else
            ++misses;
        h.reset();
    }
    const std::uint64_t elapsed = cycles() - start;
    key_sum += keys;
    missed += misses;
    return elapsed;
}

struct lookup_result {
    std::string_view pattern;
    std::uint32_t regions = 0;
    summary rdmax_ns, map_ns, session_ns;
    std::uint64_t misses = 0; ///< rdmax's misses after it was populated
};

lookup_result measure_lookup(const cache_options& opt, const mapping& area, std::size_t page,
                             std::string_view pattern, std::uint32_t regions,
                             std::span<const std::uint32_t> indices) {
    const std::size_t stride = 2 * page; // every other page: never touching, never merged
    const std::byte* base = area.data();

    fmt::print(stderr, "[lookup] {} over {} registrations: populating\n", pattern, regions);
    rcache_options ro; // default limits: a working set of 256 k must hit
    ro.monitor = monitor_kind::manual;
    counting_cache cache(counting_registrar{}, manual_monitor{}, ro);
    map_cache baseline;
    for (std::uint32_t i = 0; i < regions; ++i) {
        const std::byte* p = base + std::size_t{i} * stride;
        auto h = cache.get<reg_rights>(p, page);
        baseline.insert(p, page, reg_rights, h.lkey());
    }
    const rcache_counters filled = cache.counters();
    if (filled.registered_count != regions || filled.merges != 0 || filled.evictions != 0 ||
        baseline.size() != regions)
        fail(fmt::format("the caches do not hold {} separate registrations: rdmax {}; std::map {}",
                         regions, filled, baseline.size()));

    // The per-thread front end: its hits cost no atomic read-modify-write.
    counting_cache::session session(cache);
    std::uint64_t rdmax_keys = 0, map_keys = 0, session_keys = 0, missed = 0;
    // Warm-up, untimed: an eighth of a batch each.
    const auto warm = indices.first(std::max<std::size_t>(indices.size() / 8, 1));
    (void)lookup_batch(cache, warm, base, stride, page, rdmax_keys, missed);
    (void)lookup_batch(baseline, warm, base, stride, page, map_keys, missed);
    (void)lookup_batch(session, warm, base, stride, page, session_keys, missed);

    std::vector<std::uint64_t> rdmax_cycles, map_cycles, session_cycles;
    cycle_rate rate;
    rate.start();
    for (std::uint32_t b = 0; b < opt.batches; ++b) {
        fmt::print(stderr, "[lookup] {} over {} registrations: batch {}/{}\n", pattern, regions,
                   b + 1, opt.batches);
        // Alternate which goes first, so that neither always follows the other.
        if (b % 2 == 0) {
            rdmax_cycles.push_back(
                lookup_batch(cache, indices, base, stride, page, rdmax_keys, missed));
            map_cycles.push_back(
                lookup_batch(baseline, indices, base, stride, page, map_keys, missed));
        } else {
            map_cycles.push_back(
                lookup_batch(baseline, indices, base, stride, page, map_keys, missed));
            rdmax_cycles.push_back(
                lookup_batch(cache, indices, base, stride, page, rdmax_keys, missed));
        }
        session_cycles.push_back(
            lookup_batch(session, indices, base, stride, page, session_keys, missed));
    }
    rate.stop();

    const rcache_counters after = cache.counters();
    if (missed != 0 || after.misses != regions || rdmax_keys != map_keys ||
        session_keys != map_keys || after.registrations != regions)
        fail(fmt::format("{} over {}: lookups that did not hit (baseline misses {}, keys {} vs "
                         "{}); rdmax {}",
                         pattern, regions, missed, rdmax_keys, map_keys, after));

    const double per_us = rate.per_us();
    if (per_us <= 0)
        fail("the cycle counter did not advance");
    const auto to_ns = [&](const std::vector<std::uint64_t>& c) {
        std::vector<double> ns;
        ns.reserve(c.size());
        for (const std::uint64_t x : c)
            ns.push_back(static_cast<double>(x) * 1000.0 / per_us /
                         static_cast<double>(indices.size()));
        return summarize(std::move(ns));
    };
    return {pattern,
            regions,
            to_ns(rdmax_cycles),
            to_ns(map_cycles),
            to_ns(session_cycles),
            after.misses - regions};
}

void run_lookup(const cache_options& opt, json_list& json) {
    const std::uint32_t lookups = opt.iterations != 0 ? opt.iterations : default_lookups;
    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    const std::uint32_t most = *std::max_element(random_regions.begin(), random_regions.end());
    // Address space only: the counting registrar reads nothing, so nothing is touched.
    const mapping area(std::size_t{most} * 2 * page, false);

    fmt::print("{}"
               "          Registration cache hit: get + release, rdmax vs std::map\n"
               " Registrations  : 1 page each, 1 page apart (counting registrar: no device)\n"
               " Lookups        : {} per batch, {} batches per cell, median (min-max)\n"
               " Baseline       : std::map + std::shared_mutex, upper_bound/prev, atomic refcount\n"
               " session        : the same gets through one registration_cache::session\n"
               "{}",
               result_line, lookups, opt.batches, result_line);
    fmt::print(" {:<8} {:>9}   {:>24}   {:>24}   {:>9}   {:>24}   {:>7}\n", "pattern", "#regions",
               "rdmax[ns/op]", "std::map[ns/op]", "map/rdmax", "session[ns/op]", "misses");
    std::fflush(stdout);

    std::vector<std::uint32_t> indices(lookups);
    const auto report = [&](const lookup_result& r) {
        const auto cell = [](const summary& s) {
            return fmt::format("{:8.1f} ({:.1f}-{:.1f})", s.median, s.min, s.max);
        };
        fmt::print(" {:<8} {:>9}   {:>24}   {:>24}   {:>9.2f}   {:>24}   {:>7}\n", r.pattern,
                   r.regions, cell(r.rdmax_ns), cell(r.map_ns), r.map_ns.median / r.rdmax_ns.median,
                   cell(r.session_ns), r.misses);
        std::fflush(stdout);
        json.add(fmt::format(
            R"({{"kind":"lookup","pattern":"{}","regions":{},"rdmax_ns":{:.3f},"std_map_ns":{:.3f},"rdmax_session_ns":{:.3f},"misses":{}}})",
            r.pattern, r.regions, r.rdmax_ns.median, r.map_ns.median, r.session_ns.median,
            r.misses));
    };

    for (std::uint32_t i = 0; i < lookups; ++i)
        indices[i] = i % hot_regions;
    report(measure_lookup(opt, area, page, "hot16", hot_regions, indices));

    std::mt19937_64 rng(20240611);
    for (const std::uint32_t regions : random_regions) {
        std::uniform_int_distribution<std::uint32_t> pick(0, regions - 1);
        for (auto& i : indices)
            i = pick(rng);
        report(measure_lookup(opt, area, page, "random", regions, indices));
    }
    fmt::print("{}", result_line);
}

// ---- --reg --------------------------------------------------------------------------------

using verbs_cache = registration_cache<verbs_registrar, manual_monitor>;

struct reg_result {
    std::size_t bytes = 0;
    std::uint32_t iterations = 0;
    double reg_us = 0, dereg_us = 0, both_us = 0, hit_us = 0;
};

reg_result measure_reg(const cache_options& opt, const verbs::protection_domain& pd,
                       std::byte* buffer, std::size_t bytes) {
    reg_result r;
    r.bytes = bytes;
    r.iterations =
        reg_iterations(opt.iterations != 0 ? opt.iterations : default_reg_iterations, bytes);
    fmt::print(stderr, "[reg] {}: {} x ibv_reg_mr + ibv_dereg_mr\n", human_bytes(bytes),
               r.iterations);

    cycle_rate rate;
    rate.start();
    const reg_cycles reg = time_registration(pd, buffer, bytes, reg_rights, r.iterations);

    fmt::print(stderr, "[reg] {}: {} x {} cache hits\n", human_bytes(bytes), opt.batches,
               hits_per_batch);
    std::vector<std::uint64_t> hit_cycles;
    std::uint64_t keys = 0;
    {
        verbs_cache cache(verbs_registrar(pd), manual_monitor{});
        std::uint32_t lkey = 0;
        {
            auto first = cache.get<reg_rights>(buffer, bytes); // the miss: registers once
            lkey = first.lkey();
        }
        for (std::uint32_t b = 0; b < opt.batches; ++b) {
            const std::uint64_t t0 = cycles();
            for (std::uint32_t i = 0; i < hits_per_batch; ++i) {
                auto h = cache.get<reg_rights>(buffer, bytes);
                keys += h.lkey();
                h.reset();
            }
            hit_cycles.push_back(cycles() - t0);
        }
        const rcache_counters c = cache.counters();
        if (c.registrations != 1 || c.hits != std::uint64_t{opt.batches} * hits_per_batch ||
            keys != std::uint64_t{lkey} * opt.batches * hits_per_batch)
            fail(fmt::format("{} bytes: the cache did not serve every get from one "
                             "registration: {}",
                             bytes, c));
    }
    rate.stop();

    const double per_us = rate.per_us();
    if (per_us <= 0)
        fail("the cycle counter did not advance");
    std::vector<double> reg_us, dereg_us, both_us, hit_us;
    for (std::size_t i = 0; i < reg.reg.size(); ++i) {
        reg_us.push_back(static_cast<double>(reg.reg[i]) / per_us);
        dereg_us.push_back(static_cast<double>(reg.dereg[i]) / per_us);
        both_us.push_back(static_cast<double>(reg.reg[i] + reg.dereg[i]) / per_us);
    }
    for (const std::uint64_t c : hit_cycles)
        hit_us.push_back(static_cast<double>(c) / per_us / hits_per_batch);
    r.reg_us = median(reg_us);
    r.dereg_us = median(dereg_us);
    r.both_us = median(both_us);
    r.hit_us = median(hit_us);
    return r;
}

void run_reg(const cache_options& opt, json_list& json) {
    const verbs::context ctx =
        opt.device.empty() ? verbs::context::open_first_active() : verbs::context::open(opt.device);
    const verbs::protection_domain pd(ctx);
    std::size_t largest = 0;
    for (const std::size_t s : reg_sizes)
        if (s <= opt.max_size)
            largest = s;
    fmt::print(stderr, "[reg] mapping and touching {}\n", human_bytes(largest));
    const mapping area(largest, true);

    fmt::print("{}"
               "          Registration: ibv_reg_mr + ibv_dereg_mr vs a cache hit\n"
               " Device         : {}\n"
               " Registration   : fresh each iteration, memory touched before; median\n"
               " Cache hit      : get + release of the cached region, {} batches of {}; median\n"
               "{}",
               result_line, ctx.name(), opt.batches, hits_per_batch, result_line);
    fmt::print(" {:>10} {:>7} {:>11} {:>13} {:>17} {:>16} {:>17}\n", "#bytes", "#iters",
               "reg[usec]", "dereg[usec]", "reg+dereg[usec]", "cache_hit[usec]", "(reg+dereg)/hit");
    std::fflush(stdout);
    for (const std::size_t bytes : reg_sizes) {
        if (bytes > largest)
            break;
        const reg_result r = measure_reg(opt, pd, area.data(), bytes);
        fmt::print(" {:>10} {:>7} {:>11.2f} {:>13.2f} {:>17.2f} {:>16.4f} {:>17.0f}\n", r.bytes,
                   r.iterations, r.reg_us, r.dereg_us, r.both_us, r.hit_us, r.both_us / r.hit_us);
        std::fflush(stdout);
        json.add(fmt::format(R"({{"kind":"reg","bytes":{},"ibv_reg_mr_us":{:.3f},)"
                             R"("cache_hit_us":{:.4f}}})",
                             r.bytes, r.both_us, r.hit_us));
    }
    fmt::print("{}", result_line);
}

void run(int argc, char** argv) {
    const cache_options opt = parse_options(argc, argv);
    json_list json(opt.json_path);
    if (opt.lookup)
        run_lookup(opt, json);
    if (opt.reg)
        run_reg(opt, json);
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
