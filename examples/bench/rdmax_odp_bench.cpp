// rdmax_odp_bench: what registering without pinning (on-demand paging) costs
// and saves, against pinned registration in the same run (seed 002's table).
//
//   rdmax_odp_bench [-d DEVICE] [-n ITERATIONS] [--max-size BYTES] [--rss-size BYTES]
//                   [--json FILE] [--plot FILE.png]
//
// reg:    ibv_reg_mr of 4 KiB ... --max-size (default 1 GiB), medians: pinned
//         on touched memory (its best case), ODP on untouched memory (what ODP
//         is for: register first, use later) and ODP on the same touched memory;
// fault:  one RDMA read and one RDMA write of 64 bytes at the start of a page
//         of an ODP registration whose page is present, never touched (the
//         device's first touch: a minor fault), or dropped by MADV_DONTNEED
//         after a touch; a pinned page in the same loop is the baseline; with
//         ibv_advise_mr (prefetch) where the device has it;
// rss:    resident anonymous memory after registering --rss-size (default
//         1 GiB) and touching 10 % of it from the CPU, pinned vs ODP.
// The device's ODP is checked first (check_on_demand: capabilities and a
// self-test); a device that fails it is refused, as the cache refuses it.
// --json FILE: {"kind":"odp","bytes":N,"pinned_reg_us":X,"odp_reg_us":Y,"odp_touched_reg_us":Z},
// {"kind":"odp_fault","op":"read"|"write","pinned_us":P,"present_us":X,
//  "first_touch_us":Y,"after_dontneed_us":Z,"prefetched_us":W|null},
// {"kind":"odp_rss","bytes":N,"touched":F,"pinned_mib":X,"odp_mib":Y}.
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fcntl.h>
#include <getopt.h>
#include <optional>
#include <string>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/mem/on_demand_check.hpp>

#include "bench_common.hpp"
#include "bench_stats.hpp"

namespace {

using namespace rdmax;
using namespace rdmax::bench;

const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
constexpr int pinned_access =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
constexpr int odp_access = pinned_access | IBV_ACCESS_ON_DEMAND;

struct bench_options {
    std::string device;
    std::string json;
    std::string plot;
    std::uint32_t iterations = 25;
    std::size_t max_size = 1024 * mib;
    std::size_t rss_size = 1024 * mib;
};

[[noreturn]] void usage(int status) {
    std::fprintf(status == 0 ? stdout : stderr,
                 "usage: rdmax_odp_bench [-d DEVICE] [-n ITERATIONS] [--max-size BYTES] "
                 "[--rss-size BYTES] [--json FILE] [--plot FILE.png]\n");
    std::exit(status);
}

bench_options parse(int argc, char** argv) {
    bench_options o;
    static const option longs[] = {{"ib-dev", required_argument, nullptr, 'd'},
                                   {"iters", required_argument, nullptr, 'n'},
                                   {"max-size", required_argument, nullptr, 'S'},
                                   {"rss-size", required_argument, nullptr, 'R'},
                                   {"json", required_argument, nullptr, 'j'},
                                   {"plot", required_argument, nullptr, 'p'},
                                   {"help", no_argument, nullptr, 'h'},
                                   {nullptr, 0, nullptr, 0}};
    for (int c; (c = getopt_long(argc, argv, "d:n:h", longs, nullptr)) != -1;) {
        switch (c) {
        case 'd': o.device = optarg; break;
        case 'n':
            o.iterations = static_cast<std::uint32_t>(parse_size(optarg, "-n", 1 << 20));
            break;
        case 'S': o.max_size = parse_size(optarg, "--max-size", std::size_t{64} << 30); break;
        case 'R': o.rss_size = parse_size(optarg, "--rss-size", std::size_t{64} << 30); break;
        case 'j': o.json = optarg; break;
        case 'p': o.plot = optarg; break;
        case 'h': usage(0);
        default: usage(2);
        }
    }
    if (optind != argc)
        usage(2);
    if (o.max_size < 4 * kib)
        fail("--max-size must be at least 4K");
    return o;
}

/// Microseconds of each of `n` calls of `body`, converted with the TSC's rate
/// measured over the whole loop.
template <class Body>
std::vector<double> time_us(std::uint32_t n, Body&& body) {
    std::vector<std::uint64_t> c;
    c.reserve(n);
    cycle_rate rate;
    rate.start();
    for (std::uint32_t i = 0; i < n; ++i)
        c.push_back(body(i));
    rate.stop();
    std::vector<double> us;
    us.reserve(n);
    for (const std::uint64_t x : c)
        us.push_back(static_cast<double>(x) / rate.per_us());
    return us;
}

/// Cycles of one ibv_reg_mr with `access` (dereg untimed), after one warm-up.
std::uint64_t reg_once(const verbs::protection_domain& pd, std::byte* p, std::size_t bytes,
                       int access) {
    const std::uint64_t t0 = cycles();
    ibv_mr* mr = ibv_reg_mr(pd.get(), p, bytes, access);
    const std::uint64_t t1 = cycles();
    if (mr == nullptr)
        fail(fmt::format("ibv_reg_mr of {} ({}) failed: {}", human_bytes(bytes),
                         (access & IBV_ACCESS_ON_DEMAND) != 0 ? "ODP" : "pinned",
                         std::strerror(errno)));
    ibv_dereg_mr(mr);
    return t1 - t0;
}

void registration_costs(const bench_options& o, const verbs::protection_domain& pd,
                        json_list& json) {
    fmt::print("{:>10} {:>7} {:>14} {:>16} {:>16} {:>11}\n", "#bytes", "#iters", "pinned reg us",
               "ODP reg us", "ODP reg us", "pinned/ODP");
    fmt::print("{:>10} {:>7} {:>14} {:>16} {:>16} {:>11}\n", "", "", "(touched)", "(untouched)",
               "(touched)", "(untouched)");
    std::vector<double> x;
    plot_series pinned{"pinned, touched memory", {}}, odp{"on-demand, untouched memory", {}},
        odp_touched{"on-demand, touched memory", {}};
    for (std::size_t bytes = 4 * kib; bytes <= o.max_size; bytes *= 4) {
        const std::uint32_t n = reg_iterations(o.iterations, bytes);
        double p = 0, d = 0, dt = 0;
        {
            const mapping m(bytes, true);
            (void)reg_once(pd, m.data(), bytes, pinned_access);
            auto pinned_us = time_us(
                n, [&](std::uint32_t) { return reg_once(pd, m.data(), bytes, pinned_access); });
            auto touched_us = time_us(
                n, [&](std::uint32_t) { return reg_once(pd, m.data(), bytes, odp_access); });
            p = median(pinned_us);
            dt = median(touched_us);
        }
        {
            // What ODP is for: memory registered before it is used. (Pinning
            // it would fault every page in first.)
            const mapping m(bytes, false);
            auto odp_us = time_us(
                n, [&](std::uint32_t) { return reg_once(pd, m.data(), bytes, odp_access); });
            d = median(odp_us);
        }
        fmt::print("{:>10} {:>7} {:>14.1f} {:>16.1f} {:>16.1f} {:>10.1f}x\n", bytes, n, p, d, dt,
                   p / d);
        json.add(fmt::format(
            R"({{"kind":"odp","bytes":{},"pinned_reg_us":{:.2f},"odp_reg_us":{:.2f},"odp_touched_reg_us":{:.2f}}})",
            bytes, p, d, dt));
        x.push_back(static_cast<double>(bytes));
        pinned.y.push_back(p);
        odp.y.push_back(d);
        odp_touched.y.push_back(dt);
    }
    if (!o.plot.empty() &&
        log_log_plot(o.plot, "ibv_reg_mr: pinned vs on-demand paging (median)", "bytes registered",
                     "microseconds", x, {pinned, odp, odp_touched}))
        fmt::print("plot: {}\n", o.plot);
}

/// Two loopback RC queue pairs and a pinned landing zone for single 64-byte operations.
struct rig {
    verbs::queue_pair<verbs::rc> a, b;
    std::vector<std::byte> local;
    memory_region<all_rights> local_mr;
    double per_us = estimate_cycles_per_us();

    explicit rig(const verbs::protection_domain& pd)
        : a(pd, config())
        , b(pd, config())
        , local(page)
        , local_mr(pd, local.data(), local.size()) {
        verbs::connect_pair(a, b);
    }
    static verbs::qp_config config() {
        verbs::qp_config c;
        c.send_depth = c.recv_depth = 16;
        c.max_batch = 16;
        c.max_inline = 0;
        return c;
    }
    /// Cycles of one 64-byte read from / write to `addr` under `rkey`, posted to completed.
    std::uint64_t op(bool read, std::byte* addr, std::uint32_t rkey) {
        const remote_buffer<rights::remote_read | rights::remote_write | rights::local_write> r{
            reinterpret_cast<std::uintptr_t>(addr), 64, rkey};
        const std::uint64_t t0 = cycles();
        const status s =
            read ? a.read(local_mr.local(0, 64), r, 0, 1) : a.write(local_mr.local(0, 64), r, 0, 1);
        if (s != status::ok)
            fail(fmt::format("posting an RDMA {} failed: {}", read ? "read" : "write",
                             to_string(s)));
        verbs::completion c[1];
        int got = 0;
        if (!spin_until([&] { return (got = a.poll_send(c)) != 0; },
                        static_cast<std::uint64_t>(per_us * 5e6)))
            fail("an RDMA operation did not complete within 5 s");
        const std::uint64_t t1 = cycles();
        if (!c[0].ok())
            fail(fmt::format("an RDMA {} failed: {}", read ? "read" : "write", c[0].status_name()));
        return t1 - t0;
    }
};

/// An ODP (or pinned) registration of fresh anonymous pages, undone at the end.
struct region {
    std::byte* p;
    std::size_t len;
    ibv_mr* mr = nullptr;
    region(const verbs::protection_domain& pd, std::size_t pages, int access, bool touch)
        : p(static_cast<std::byte*>(mmap(nullptr, pages * page, PROT_READ | PROT_WRITE,
                                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)))
        , len(pages * page) {
        if (p == MAP_FAILED)
            fail("mmap failed");
        if (touch)
            std::memset(p, 0x33, len);
        mr = ibv_reg_mr(pd.get(), p, len, access);
        if (mr == nullptr)
            fail(fmt::format("ibv_reg_mr failed: {}", std::strerror(errno)));
    }
    region(const region&) = delete;
    region& operator=(const region&) = delete;
    ~region() {
        ibv_dereg_mr(mr);
        munmap(p, len);
    }
    [[nodiscard]] std::byte* at(std::uint32_t i) const { return p + std::size_t{i} * page; }
};

void fault_costs(const bench_options& o, const verbs::protection_domain& pd, json_list& json) {
    rig r(pd);
    const std::uint32_t n = std::max<std::uint32_t>(o.iterations * 8, 100);
    // Prefetch where the device has it (soft-RoCE answers EOPNOTSUPP).
    bool can_prefetch = false;
    {
        const region probe(pd, 1, odp_access, false);
        ibv_sge sge{reinterpret_cast<std::uintptr_t>(probe.p), static_cast<std::uint32_t>(page),
                    probe.mr->lkey};
        can_prefetch = ibv_advise_mr(pd.get(), IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE,
                                     IBV_ADVISE_MR_FLAG_FLUSH, &sge, 1) == 0;
    }
    fmt::print("\n{:>6} {:>8} {:>11} {:>11} {:>13} {:>15} {:>13}\n", "op", "#iters", "pinned us",
               "present us", "first touch us", "after DONTNEED us", "prefetched us");
    for (const bool read : {true, false}) {
        const char* name = read ? "read" : "write";
        const region pinned(pd, 1, pinned_access, true);
        // present: every page touched before the registration and once through
        // the device; fresh: each operation is the first access to its page;
        // dropped: present, then MADV_DONTNEED, then accessed again; ahead:
        // fresh, prefetched with ibv_advise_mr before the loop.
        const region present(pd, n, odp_access, true);
        const region fresh(pd, n, odp_access, false);
        const region dropped(pd, n, odp_access, true);
        for (std::uint32_t i = 0; i < n; ++i) {
            (void)r.op(read, present.at(i), present.mr->rkey);
            (void)r.op(read, dropped.at(i), dropped.mr->rkey);
        }
        if (madvise(dropped.p, dropped.len, MADV_DONTNEED) != 0)
            fail(fmt::format("madvise(MADV_DONTNEED) failed: {}", std::strerror(errno)));
        std::optional<region> ahead;
        if (can_prefetch) {
            ahead.emplace(pd, n, odp_access, false);
            ibv_sge sge{reinterpret_cast<std::uintptr_t>(ahead->p),
                        static_cast<std::uint32_t>(ahead->len), ahead->mr->lkey};
            if (ibv_advise_mr(pd.get(), IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE,
                              IBV_ADVISE_MR_FLAG_FLUSH, &sge, 1) != 0)
                fail(fmt::format("ibv_advise_mr failed: {}", std::strerror(errno)));
        }
        // Interleaved, one of each per round, so that the emulator's stalls
        // fall on every kind alike and the medians compare like with like.
        std::vector<std::uint64_t> pin, pres, first, again, pre;
        cycle_rate rate;
        rate.start();
        for (std::uint32_t i = 0; i < n; ++i) {
            pin.push_back(r.op(read, pinned.p, pinned.mr->rkey));
            pres.push_back(r.op(read, present.at(i), present.mr->rkey));
            first.push_back(r.op(read, fresh.at(i), fresh.mr->rkey));
            again.push_back(r.op(read, dropped.at(i), dropped.mr->rkey));
            if (ahead)
                pre.push_back(r.op(read, ahead->at(i), ahead->mr->rkey));
        }
        rate.stop();
        const auto med = [&](std::vector<std::uint64_t>& c) {
            std::vector<double> us;
            us.reserve(c.size());
            for (const std::uint64_t x : c)
                us.push_back(static_cast<double>(x) / rate.per_us());
            return median(us);
        };
        const double p = med(pin), x = med(pres), f = med(first), d = med(again);
        const std::optional<double> a = ahead ? std::optional<double>(med(pre)) : std::nullopt;
        fmt::print("{:>6} {:>8} {:>11.1f} {:>11.1f} {:>13.1f} {:>17.1f} {:>13}\n", name, n, p, x, f,
                   d, a ? fmt::format("{:.1f}", *a) : std::string("unsupported"));
        json.add(fmt::format(
            R"({{"kind":"odp_fault","op":"{}","pinned_us":{:.2f},"present_us":{:.2f},"first_touch_us":{:.2f},"after_dontneed_us":{:.2f},"prefetched_us":{}}})",
            name, p, x, f, d, a ? fmt::format("{:.2f}", *a) : std::string("null")));
    }
}

/// Resident anonymous memory of this process, bytes.
std::size_t rss_anon() {
    std::FILE* f = std::fopen("/proc/self/status", "r");
    if (f == nullptr)
        fail("cannot read /proc/self/status");
    char line[256];
    std::size_t kb = 0;
    while (std::fgets(line, sizeof line, f) != nullptr)
        if (std::strncmp(line, "RssAnon:", 8) == 0)
            kb = std::strtoull(line + 8, nullptr, 10);
    std::fclose(f);
    return kb * 1024;
}

void resident_memory(const bench_options& o, const verbs::protection_domain& pd, json_list& json) {
    const std::size_t bytes = o.rss_size;
    const std::size_t touched = bytes / 10;
    auto grown = [&](int access) {
        const std::size_t before = rss_anon();
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            fail("mmap failed");
        ibv_mr* mr = ibv_reg_mr(pd.get(), p, bytes, access);
        if (mr == nullptr)
            fail(fmt::format("ibv_reg_mr of {} failed: {}", human_bytes(bytes),
                             std::strerror(errno)));
        for (std::size_t off = 0; off < touched; off += page)
            static_cast<volatile std::byte*>(p)[off] = std::byte{1};
        const std::size_t after = rss_anon();
        ibv_dereg_mr(mr);
        munmap(p, bytes);
        return static_cast<double>(after - before) / static_cast<double>(mib);
    };
    const double pinned = grown(pinned_access);
    const double odp = grown(odp_access);
    fmt::print("\nresident after registering {} and touching 10 %: pinned {:.1f} MiB, ODP {:.1f} "
               "MiB ({:.3f}x)\n",
               human_bytes(bytes), pinned, odp, odp / pinned);
    json.add(fmt::format(
        R"({{"kind":"odp_rss","bytes":{},"touched":0.1,"pinned_mib":{:.1f},"odp_mib":{:.1f}}})",
        bytes, pinned, odp));
}

} // namespace

int main(int argc, char** argv) {
    try {
        const bench_options o = parse(argc, argv);
        const verbs::context ctx =
            o.device.empty() ? verbs::context::open_first_active() : verbs::context::open(o.device);
        const verbs::protection_domain pd(ctx);
        const on_demand_verdict v = check_on_demand(pd);
        if (!v.usable())
            fail(v.problem);
        fmt::print(
            "{}     rdmax_odp_bench: pinned vs on-demand paging on {} (self-test passed)\n{}",
            result_line, ctx.name(), result_line);
        json_list json(o.json);
        registration_costs(o, pd, json);
        fault_costs(o, pd, json);
        resident_memory(o, pd, json);
        fmt::print("{}", result_line);
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "rdmax_odp_bench: %s\n", e.what());
        return 1;
    }
}
