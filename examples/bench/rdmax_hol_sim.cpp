// rdmax_hol_sim: head-of-line blocking on a modelled ConnectX-class NIC
// (rdmax/sched/sim/nic_model.hpp), in virtual time: no device, seconds to
// run, the same figures on every machine for the same seed.
//
// Urgent 64-byte RDMA writes arrive open loop (Poisson, or a fixed interval
// with --fixed), each timed from its arrival to its completion being seen,
// beside a stream of 64 MiB writes (two outstanding) that starts at once.
// Modes, each on a fresh NIC, the same arrivals:
//   idle             urgent writes alone
//   plain            both on one queue pair, posted whole (FIFO)
//   scheduled        both through the real basic_priority_scheduler (urgent
//                    at sched::urgent, the stream at sched::bulk), its
//                    options from RDMAX_SCHED_* as in production
//   justitia         Justitia-style chunking: the stream in 5 KB chunks while
//                    an urgent write is outstanding, 1 MB chunks otherwise,
//                    --justitia-window chunks in flight; urgent writes posted
//                    at once
//   qp_per_priority  one queue pair each: the NIC takes the two in turn, per
//                    packet (--arbitration wqe: per work request), and pays
//                    qp_switch at each change
// at 25, 100 and 400 Gb/s. Prints p50/p99/p99.9 of the urgent latency, the
// stream's throughput over plain's in the same run, and the scheduler's
// counters; --json FILE writes one record per mode and speed; --sweep adds
// slice/budget (and Justitia chunk/window) variants and --plot FILE.png draws
// p99 against the stream's throughput for them. --cpu times the scheduler
// natively instead (no model): nanoseconds per slice posted and per request.
//
//   rdmax_hol_sim [--gbps 25,100,400] [--interval US] [--fixed] [--seed N]
//                 [--duration MS] [--arbitration packet|wqe] [--sweep]
//                 [--json FILE] [--plot FILE.png] [--cpu]

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <getopt.h>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <rdmax/sched/basic_priority_scheduler.hpp>
#include <rdmax/sched/sim/nic_model.hpp>
#include <rdmax/sched/strict_priority.hpp>

#include "bench_stats.hpp"

namespace {

using namespace rdmax;
using namespace rdmax::bench;
namespace sched = rdmax::sched;
namespace sim = rdmax::sched::sim;
using sim::picoseconds;

constexpr rights rw = rights::local_write | rights::remote_write | rights::remote_read;
// The model never touches the bytes: addresses only.
std::byte* const local_base = sim::nominal_local;
constexpr std::uint64_t remote_base = std::uint64_t{1} << 40;
constexpr std::uint64_t urgent_remote = remote_base + (std::uint64_t{1} << 36);
constexpr std::uint64_t bulk_tag = std::uint64_t{1} << 62;

struct sim_options {
    std::vector<std::uint32_t> gbps{25, 100, 400};
    double interval_us = 20;
    bool fixed = false;
    std::uint64_t seed = 1;
    double duration_ms = 100;
    double warmup_ms = 5;
    std::uint32_t urgent_bytes = 64;
    std::uint64_t bulk_bytes = 64 * mib;
    std::uint32_t bulk_outstanding = 2;
    sim::arbitration arbiter = sim::arbitration::per_packet;
    std::uint32_t justitia_small = 5000;
    std::uint32_t justitia_large = 1000 * 1000;
    std::uint32_t justitia_window = 2;
    bool sweep = false;
    bool cpu = false;
    std::string json;
    std::string plot;
};

[[noreturn]] void usage(int code) {
    std::fputs("usage: rdmax_hol_sim [--gbps 25,100,400] [--interval US] [--fixed] [--seed N]\n"
               "                     [--duration MS] [--arbitration packet|wqe] [--sweep]\n"
               "                     [--json FILE] [--plot FILE.png] [--cpu]\n",
               code == 0 ? stdout : stderr);
    std::exit(code);
}

double number(const char* text, const char* flag) {
    char* end = nullptr;
    const double v = std::strtod(text, &end);
    if (end == text || *end != '\0' || !(v > 0))
        fail(fmt::format("{} wants a positive number, not '{}'", flag, text));
    return v;
}

sim_options parse(int argc, char** argv) {
    sim_options o;
    enum { gbps = 1000, interval, fixed, seed, duration, arbitration, sweep, json, plot, cpu };
    static const ::option longs[] = {{"gbps", required_argument, nullptr, gbps},
                                     {"interval", required_argument, nullptr, interval},
                                     {"fixed", no_argument, nullptr, fixed},
                                     {"seed", required_argument, nullptr, seed},
                                     {"duration", required_argument, nullptr, duration},
                                     {"arbitration", required_argument, nullptr, arbitration},
                                     {"sweep", no_argument, nullptr, sweep},
                                     {"json", required_argument, nullptr, json},
                                     {"plot", required_argument, nullptr, plot},
                                     {"cpu", no_argument, nullptr, cpu},
                                     {"help", no_argument, nullptr, 'h'},
                                     {nullptr, 0, nullptr, 0}};
    for (int c; (c = getopt_long(argc, argv, "h", longs, nullptr)) != -1;) {
        switch (c) {
        case gbps: {
            o.gbps.clear();
            std::string s = optarg;
            for (std::size_t at = 0; at <= s.size();) {
                const std::size_t comma = std::min(s.find(',', at), s.size());
                const auto g =
                    static_cast<std::uint32_t>(number(s.substr(at, comma - at).c_str(), "--gbps"));
                if (8000 % g != 0)
                    fail(fmt::format("--gbps {}: the model wants a divisor of 8000", g));
                o.gbps.push_back(g);
                at = comma + 1;
            }
            break;
        }
        case interval: o.interval_us = number(optarg, "--interval"); break;
        case fixed: o.fixed = true; break;
        case seed: o.seed = static_cast<std::uint64_t>(number(optarg, "--seed")); break;
        case duration: o.duration_ms = number(optarg, "--duration"); break;
        case arbitration:
            if (std::string(optarg) == "packet")
                o.arbiter = sim::arbitration::per_packet;
            else if (std::string(optarg) == "wqe")
                o.arbiter = sim::arbitration::per_wqe;
            else
                fail(fmt::format("--arbitration wants packet or wqe, not '{}'", optarg));
            break;
        case sweep: o.sweep = true; break;
        case json: o.json = optarg; break;
        case plot: o.plot = optarg; break;
        case cpu: o.cpu = true; break;
        case 'h': usage(0);
        default: usage(2);
        }
    }
    if (optind != argc)
        usage(2);
    o.warmup_ms = std::min(o.warmup_ms, o.duration_ms / 4);
    return o;
}

// ---- one mode on one NIC ----------------------------------------------------------------------

struct result {
    std::string mode;
    std::string variant; ///< the sweep's label; empty for the five modes
    double p50 = 0, p99 = 0, p999 = 0;
    std::size_t samples = 0;
    double bulk_Bps = 0;
    std::string counters;
};

double percentile(std::vector<double>& v, double p) {
    if (v.empty())
        return 0;
    std::sort(v.begin(), v.end());
    const auto rank =
        static_cast<std::size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
    return v[std::clamp<std::size_t>(rank, 1, v.size()) - 1];
}

/// A way of posting: urgent(id) and bulk(id) submit, poll() hands back the
/// finished ones' ids.
struct driver {
    std::function<void(std::uint64_t)> urgent;
    std::function<void(std::uint64_t)> bulk;
    std::function<int(std::vector<std::uint64_t>&)> poll;
};

/// The host's loop: urgent arrivals, the stream kept `bulk_outstanding`
/// deep, polling; when a poll finds nothing, time jumps to the next arrival
/// or the next completion the host can see (a busy-polling thread would see
/// it one poll later, at most host_poll).
result run_host(const char* mode, sim::nic& nic, const sim_options& o, driver& d, bool with_bulk) {
    const auto end = static_cast<picoseconds>(o.duration_ms * 1e9);
    const auto warm = static_cast<picoseconds>(o.warmup_ms * 1e9);
    nic.rx.split_addr = urgent_remote;
    nic.rx.window_start = warm;
    nic.rx.window_end = end;
    std::mt19937_64 rng(o.seed);
    std::exponential_distribution<double> gap(1.0 / o.interval_us);
    const auto next_gap = [&] {
        const double g = o.fixed ? o.interval_us : gap(rng);
        return static_cast<picoseconds>(g * 1e6);
    };
    std::vector<picoseconds> arrival;
    arrival.reserve(static_cast<std::size_t>(o.duration_ms * 1000 / o.interval_us * 2) + 16);
    picoseconds next_arrival = next_gap();
    std::vector<double> lat;
    lat.reserve(arrival.capacity());
    std::uint64_t bulk_next = 0;
    if (with_bulk)
        for (std::uint32_t i = 0; i < o.bulk_outstanding; ++i)
            d.bulk(bulk_tag | bulk_next++);
    std::vector<std::uint64_t> done;
    done.reserve(64);
    picoseconds& now = sim::virtual_clock::ps;
    while (now < end) {
        while (next_arrival <= now) {
            arrival.push_back(next_arrival);
            d.urgent(arrival.size() - 1);
            next_arrival += next_gap();
        }
        done.clear();
        const int n = d.poll(done);
        for (const std::uint64_t id : done) {
            if ((id & bulk_tag) != 0) {
                d.bulk(bulk_tag | bulk_next++);
            } else if (arrival[id] >= warm) {
                lat.push_back(static_cast<double>(now - arrival[id]) / 1e6);
            }
        }
        if (n == 0) {
            const picoseconds t = nic.next_completion(std::min(next_arrival, end));
            now = std::max(now, t);
        }
    }
    result r;
    r.mode = mode;
    r.samples = lat.size();
    r.p50 = percentile(lat, 50);
    r.p99 = percentile(lat, 99);
    r.p999 = percentile(lat, 99.9);
    r.bulk_Bps =
        static_cast<double>(nic.rx.window_bytes[0]) / (static_cast<double>(end - warm) / 1e12);
    return r;
}

/// idle (with_bulk false) and plain: everything posted whole on one queue pair.
result run_fifo(const char* mode, const sim::nic_params& p, const sim_options& o, bool with_bulk) {
    sim::nic nic(p, 1);
    sim::nic_port port(nic, 0);
    driver d;
    d.urgent = [&](std::uint64_t id) {
        (void)port.stage(sim::write_request(id, urgent_remote, o.urgent_bytes));
        (void)port.post();
    };
    d.bulk = [&](std::uint64_t id) {
        (void)port.stage(sim::write_request(id, remote_base, o.bulk_bytes));
        (void)port.post();
    };
    d.poll = [&](std::vector<std::uint64_t>& out) {
        verbs::completion c[32];
        const int n = port.poll(c);
        for (int i = 0; i < n; ++i)
            out.push_back(c[i].wr_id);
        return n;
    };
    return run_host(mode, nic, o, d, with_bulk);
}

/// One queue pair per priority: urgent on 0, the stream on 1.
result run_two_qps(const sim::nic_params& p, const sim_options& o) {
    sim::nic_params q = p;
    q.arbiter = o.arbiter;
    sim::nic nic(q, 2);
    sim::nic_port hi(nic, 0);
    sim::nic_port lo(nic, 1);
    driver d;
    d.urgent = [&](std::uint64_t id) {
        (void)hi.stage(sim::write_request(id, urgent_remote, o.urgent_bytes));
        (void)hi.post();
    };
    d.bulk = [&](std::uint64_t id) {
        (void)lo.stage(sim::write_request(id, remote_base, o.bulk_bytes));
        (void)lo.post();
    };
    d.poll = [&](std::vector<std::uint64_t>& out) {
        verbs::completion c[32];
        int n = hi.poll(c);
        for (int i = 0; i < n; ++i)
            out.push_back(c[i].wr_id);
        const int m = lo.poll(c);
        for (int i = 0; i < m; ++i)
            out.push_back(c[i].wr_id);
        return n + m;
    };
    result r = run_host("qp_per_priority", nic, o, d, true);
    r.counters = fmt::format("qp switches {}", nic.qp_switches);
    return r;
}

/// Justitia-style: the stream cut into `small` chunks while an urgent write
/// is outstanding, `large` ones otherwise, `window` chunks in flight.
result run_justitia(const sim::nic_params& p, const sim_options& o, std::uint32_t small,
                    std::uint32_t large, std::uint32_t window) {
    sim::nic nic(p, 1);
    sim::nic_port port(nic, 0);
    struct stream_request {
        std::uint64_t id;
        std::uint64_t posted;
        std::uint64_t chunks_in_flight;
    };
    std::deque<stream_request> stream;
    std::uint64_t urgent_out = 0;
    std::uint32_t in_flight = 0;
    std::uint64_t chunk_id = 0;
    std::deque<std::uint64_t> chunk_owner; // request id of each chunk in flight, in order
    const auto refill = [&] {
        bool staged = false;
        for (auto& r : stream) {
            while (r.posted < o.bulk_bytes && in_flight < window) {
                const std::uint64_t len = std::min<std::uint64_t>(urgent_out != 0 ? small : large,
                                                                  o.bulk_bytes - r.posted);
                (void)port.stage(sim::write_request(
                    bulk_tag | (std::uint64_t{1} << 61) | chunk_id++, remote_base + r.posted, len));
                chunk_owner.push_back(r.id);
                r.posted += len;
                ++r.chunks_in_flight;
                ++in_flight;
                staged = true;
            }
            if (in_flight >= window)
                break;
        }
        if (staged)
            (void)port.post();
    };
    driver d;
    d.urgent = [&](std::uint64_t id) {
        ++urgent_out;
        (void)port.stage(sim::write_request(id, urgent_remote, o.urgent_bytes));
        (void)port.post();
    };
    d.bulk = [&](std::uint64_t id) {
        stream.push_back({id, 0, 0});
        refill();
    };
    d.poll = [&](std::vector<std::uint64_t>& out) {
        verbs::completion c[32];
        const int n = port.poll(c);
        int k = 0;
        for (int i = 0; i < n; ++i) {
            if ((c[i].wr_id & bulk_tag) == 0) {
                --urgent_out;
                out.push_back(c[i].wr_id);
                ++k;
                continue;
            }
            const std::uint64_t owner = chunk_owner.front();
            chunk_owner.pop_front();
            --in_flight;
            for (auto it = stream.begin(); it != stream.end(); ++it)
                if (it->id == owner && --it->chunks_in_flight == 0 && it->posted == o.bulk_bytes) {
                    out.push_back(owner);
                    ++k;
                    stream.erase(it);
                    break;
                }
        }
        refill();
        return k;
    };
    return run_host("justitia", nic, o, d, true);
}

using sim_scheduler = sched::basic_priority_scheduler<sched::strict_priority, sim::nic_port,
                                                      sim::virtual_clock, sim::virtual_clock>;

/// The real scheduler on one queue pair.
result run_scheduled(const sim::nic_params& p, const sim_options& o,
                     const sched::scheduler_options& so) {
    sim::nic nic(p, 1);
    sim_scheduler s(so, {}, nic, 0);
    const local_buffer<rw> urgent_src{local_base, o.urgent_bytes, 1};
    const local_buffer<rw> bulk_src{local_base, static_cast<std::uint32_t>(o.bulk_bytes), 1};
    const remote_buffer<rw> dst{remote_base, std::uint64_t{1} << 37, 2, 0};
    driver d;
    d.urgent = [&](std::uint64_t id) {
        if (s.write(sched::urgent, urgent_src, dst, urgent_remote - remote_base, id) != status::ok)
            fail("the scheduler refused an urgent write");
    };
    d.bulk = [&](std::uint64_t id) {
        if (s.write(sched::bulk, bulk_src, dst, 0, id) != status::ok)
            fail("the scheduler refused a bulk write");
    };
    d.poll = [&](std::vector<std::uint64_t>& out) {
        verbs::completion c[32];
        const int n = s.poll(c);
        for (int i = 0; i < n; ++i) {
            if (!c[i].ok())
                fail(fmt::format("a request failed: {}", ibv_wc_status_str(c[i].status)));
            out.push_back(c[i].wr_id);
        }
        return n;
    };
    result r = run_host("scheduled", nic, o, d, true);
    r.counters = fmt::format("{}", s.counters());
    return r;
}

// ---- the scheduler's own cost, natively ---------------------------------------------------------

/// A port that takes everything and completes it at the next poll: what is
/// left is the scheduler's own work.
class null_port {
public:
    explicit null_port(std::uint32_t depth)
        : done_(depth) {}
    status stage(const sched::slice_request& s) noexcept {
        if (s.signaled)
            done_[(head_ + count_++) % done_.size()] = s.id;
        return status::ok;
    }
    status post() noexcept { return status::ok; }
    [[nodiscard]] std::uint32_t accepted() const noexcept { return 0; }
    void fail() noexcept {}
    int poll(std::span<verbs::completion> out) noexcept {
        int k = 0;
        while (count_ != 0 && static_cast<std::size_t>(k) < out.size()) {
            verbs::completion c;
            c.wr_id = done_[head_];
            c.status = IBV_WC_SUCCESS;
            out[static_cast<std::size_t>(k++)] = c;
            head_ = (head_ + 1) % done_.size();
            --count_;
        }
        return k;
    }
    [[nodiscard]] std::uint32_t slots_free() const noexcept {
        return static_cast<std::uint32_t>(done_.size()) - count_;
    }
    [[nodiscard]] std::uint32_t max_rd_atomic() const noexcept { return 16; }
    [[nodiscard]] std::uint32_t max_message() const noexcept { return 1U << 31; }
    [[nodiscard]] bool ready() const noexcept { return true; }
    [[nodiscard]] bool failed() const noexcept { return false; }

private:
    std::vector<std::uint64_t> done_;
    std::size_t head_ = 0;
    std::uint32_t count_ = 0;
};

void run_cpu(const sim_options& o) {
    using cpu_scheduler = sched::basic_priority_scheduler<sched::strict_priority, null_port>;
    const local_buffer<rw> bulk_src{local_base, static_cast<std::uint32_t>(o.bulk_bytes), 1};
    const local_buffer<rw> urgent_src{local_base, 64, 1};
    const remote_buffer<rw> dst{remote_base, std::uint64_t{1} << 37, 2, 0};
    for (const bool adaptive : {false, true}) {
        sched::scheduler_options so;
        so.small_slice = 16 * 1024;
        so.large_slice = 16 * 1024;
        so.budget_bytes = adaptive ? 0 : 64 * 1024;
        cpu_scheduler s(so, {}, 4096U);
        verbs::completion c[32];
        std::vector<double> per_slice;
        std::vector<double> per_request;
        for (int round = 0; round < 21; ++round) {
            const std::uint64_t slices = s.counters().slices;
            auto t0 = std::chrono::steady_clock::now();
            if (s.write(sched::bulk, bulk_src, dst, 0, 1) != status::ok)
                fail("null port: write refused");
            while (s.outstanding() != 0)
                (void)s.poll(c);
            auto t1 = std::chrono::steady_clock::now();
            per_slice.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() /
                                static_cast<double>(s.counters().slices - slices));
            constexpr int n = 10000;
            t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < n; ++i) {
                if (s.write(sched::urgent, urgent_src, dst, 0, 2) != status::ok)
                    fail("null port: write refused");
                while (s.outstanding() != 0)
                    (void)s.poll(c);
            }
            t1 = std::chrono::steady_clock::now();
            per_request.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / n);
        }
        const summary a = summarize(per_slice);
        const summary b = summarize(per_request);
        fmt::print("cpu  budget {:<8}  per slice posted (16 KiB slices of a {} write, its poll "
                   "included): median {:.1f} ns (min {:.1f}, max {:.1f});  per 64 B request "
                   "(submit + poll): median {:.1f} ns (min {:.1f}, max {:.1f})  [21 rounds]\n",
                   adaptive ? "measured" : "64 KiB", human_bytes(o.bulk_bytes), a.median, a.min,
                   a.max, b.median, b.min, b.max);
    }
}

} // namespace

int main(int argc, char** argv) try {
    const sim_options o = parse(argc, argv);
    if (o.cpu) {
        run_cpu(o);
        return 0;
    }
    json_list json(o.json);
    const sched::scheduler_options so = sched::scheduler_options{}.with_env();
    fmt::print("# rdmax_hol_sim: urgent {} B writes ({} every {} us) beside {} writes ({} "
               "outstanding), {} ms virtual ({} ms warm-up), seed {}; qp_per_priority arbitrates "
               "per {}\n",
               o.urgent_bytes, o.fixed ? "one" : "Poisson, mean one", o.interval_us,
               human_bytes(o.bulk_bytes), o.bulk_outstanding, o.duration_ms, o.warmup_ms, o.seed,
               o.arbiter == sim::arbitration::per_packet ? "packet" : "work request");
    fmt::print("# scheduler: small slice {}, large slice {}, budget {}, {} WQEs, hold {} us\n",
               human_bytes(so.small_slice), human_bytes(so.large_slice),
               so.budget_bytes == 0 ? std::string("measured") : human_bytes(so.budget_bytes),
               so.budget_wqes, so.hold.count());
    struct sweep_point {
        std::uint32_t gbps;
        std::string family, label;
        double p99_ratio, fraction;
    };
    std::vector<sweep_point> points;
    for (const std::uint32_t g : o.gbps) {
        sim::nic_params p = g == 25    ? sim::nic_params::cx5_25g()
                            : g == 400 ? sim::nic_params::cx7_400g()
                                       : sim::nic_params::cx5_100g();
        p.gbps = g;
        std::vector<result> rs;
        rs.push_back(run_fifo("idle", p, o, false));
        rs.push_back(run_fifo("plain", p, o, true));
        rs.push_back(run_scheduled(p, o, so));
        rs.push_back(run_justitia(p, o, o.justitia_small, o.justitia_large, o.justitia_window));
        rs.push_back(run_two_qps(p, o));
        const double idle99 = rs[0].p99;
        const double plain_Bps = rs[1].bulk_Bps;
        fmt::print("\n{} Gb/s: {}; a lone 64 B write {:.3f} us, line rate {:.0f} MB/s of "
                   "payload at 4 KiB packets\n",
                   g, p.name, static_cast<double>(p.lone_latency(64)) / 1e6,
                   1e6 * 4096.0 / static_cast<double>(p.wire(4096 + p.header_bytes)));
        fmt::print("{:<16} {:>8} {:>10} {:>10} {:>10} {:>11} {:>10} {:>13}\n", "mode", "urgent",
                   "p50 us", "p99 us", "p99.9 us", "p99/idle", "bulk MB/s", "bulk/plain");
        for (const result& r : rs) {
            const double fraction = r.mode == "idle" ? 0 : r.bulk_Bps / plain_Bps;
            fmt::print(
                "{:<16} {:>8} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f}x {:>10.0f} {:>13.3f}\n",
                r.mode, r.samples, r.p50, r.p99, r.p999, r.p99 / idle99, r.bulk_Bps / 1e6,
                fraction);
            json.add(fmt::format("{{\"kind\":\"hol_sim\",\"gbps\":{},\"mode\":\"{}\",\"p50_us\":{:."
                                 "4f},\"p99_us\":{:.4f},\"p999_us\":{:.4f},\"bulk_fraction\":{:."
                                 "4f}}}",
                                 g, r.mode, r.p50, r.p99, r.p999,
                                 r.mode == "plain" ? 1.0 : fraction));
            if (r.mode != "idle" && r.mode != "plain")
                points.push_back({g, r.mode, "default", r.p99 / idle99, fraction});
        }
        for (const result& r : rs)
            if (!r.counters.empty())
                fmt::print("  {} counters: {}\n", r.mode, r.counters);
        if (!o.sweep)
            continue;
        fmt::print("sweep at {} Gb/s (p99 / idle p99, bulk / plain):\n", g);
        for (const std::uint32_t small : {4096U, 8192U, 16384U, 32768U}) {
            for (const std::uint64_t budget :
                 {std::uint64_t{0}, std::uint64_t{16} << 10, std::uint64_t{32} << 10,
                  std::uint64_t{64} << 10, std::uint64_t{128} << 10}) {
                sched::scheduler_options v = so;
                v.small_slice = small;
                v.budget_bytes = budget;
                const result r = run_scheduled(p, o, v);
                const std::string label =
                    fmt::format("slice {} budget {}", human_bytes(small),
                                budget == 0 ? std::string("measured") : human_bytes(budget));
                points.push_back({g, "scheduled", label, r.p99 / idle99, r.bulk_Bps / plain_Bps});
                fmt::print("  scheduled  {:<32} p99 {:>9.2f} us  {:>7.2f}x  bulk {:.3f}\n", label,
                           r.p99, r.p99 / idle99, r.bulk_Bps / plain_Bps);
            }
        }
        // Justitia's own 1 MB chunks when nothing urgent is outstanding, then
        // the small chunk always (large = small): the trade-off curve.
        for (const std::uint32_t large : {o.justitia_large, 0U}) {
            for (const std::uint32_t chunk : {5000U, 16000U, 64000U}) {
                for (const std::uint32_t window : {1U, 2U, 4U, 8U, 16U}) {
                    const std::uint32_t big = large == 0 ? chunk : large;
                    const result r = run_justitia(p, o, chunk, big, window);
                    const std::string label =
                        fmt::format("chunk {} B/{} B window {}", chunk, big, window);
                    points.push_back({g, large == 0 ? "justitia_one_size" : "justitia", label,
                                      r.p99 / idle99, r.bulk_Bps / plain_Bps});
                    fmt::print("  justitia   {:<32} p99 {:>9.2f} us  {:>7.2f}x  bulk {:.3f}\n",
                               label, r.p99, r.p99 / idle99, r.bulk_Bps / plain_Bps);
                }
            }
        }
        {
            sim_options w = o;
            w.arbiter = sim::arbitration::per_wqe;
            const result r = run_two_qps(p, w);
            if (r.samples == 0) {
                // One urgent write per 64 MiB write: the urgent queue grows
                // without end, and none that arrived after the warm-up is done.
                fmt::print("  qp_per_priority  arbitration per work request   no urgent write "
                           "that arrived after the warm-up completed; bulk {:.3f}\n",
                           r.bulk_Bps / plain_Bps);
            } else {
                points.push_back(
                    {g, "qp_per_priority", "per wqe", r.p99 / idle99, r.bulk_Bps / plain_Bps});
                fmt::print("  qp_per_priority  arbitration per work request   p99 {:>9.2f} us  "
                           "{:>7.2f}x  bulk {:.3f}\n",
                           r.p99, r.p99 / idle99, r.bulk_Bps / plain_Bps);
            }
        }
    }
    if (!o.plot.empty() && o.sweep) {
        std::FILE* gp = open_gnuplot(o.plot);
        if (gp != nullptr) {
            fmt::print(gp, "set terminal pngcairo size {},520 noenhanced\nset output \"{}\"\n",
                       420 * o.gbps.size() + 200, gnuplot_quoted(o.plot));
            fmt::print(gp,
                       "set multiplot layout 1,{} title \"Urgent 64 B writes beside 64 MiB "
                       "writes, NIC model: urgent p99 against the stream's throughput "
                       "(sweep)\"\n",
                       o.gbps.size());
            const char* const families[] = {"scheduled", "justitia", "justitia_one_size",
                                            "qp_per_priority"};
            const char* const titles[] = {"scheduled (slice x budget)",
                                          "Justitia-style 5K-64K / 1 MB chunks",
                                          "chunks of one size", "QP per priority"};
            for (const std::uint32_t g : o.gbps) {
                fmt::print(gp,
                           "set title \"{} Gb/s\"\nset xlabel \"stream throughput / plain\"\n"
                           "set ylabel \"urgent p99 / idle p99\"\nset logscale y\nset grid\n"
                           "set key top left\nset format y \"%g\"\nset xrange [0:1.05]\n",
                           g);
                for (std::size_t f = 0; f < std::size(families); ++f) {
                    fmt::print(gp, "$g{}f{} << EOD\n", g, f);
                    for (const auto& pt : points)
                        if (pt.gbps == g && pt.family == families[f])
                            fmt::print(gp, "{} {}\n", pt.fraction, pt.p99_ratio);
                    fmt::print(gp, "EOD\n");
                }
                fmt::print(gp, "plot ");
                for (std::size_t f = 0; f < std::size(families); ++f)
                    fmt::print(gp, "{}$g{}f{} using 1:2 with points pt {} ps 1.4 title \"{}\"",
                               f == 0 ? "" : ", ", g, f, 5 + 2 * static_cast<int>(f), titles[f]);
                fmt::print(gp, "\n");
            }
            fmt::print(gp, "unset multiplot\n");
            close_gnuplot(gp, o.plot);
            fmt::print(stderr, "rdmax_hol_sim: wrote {}\n", o.plot);
        }
    }
    return 0;
} catch (const std::exception& e) {
    fmt::print(stderr, "rdmax_hol_sim: {}\n", e.what());
    return 1;
}
