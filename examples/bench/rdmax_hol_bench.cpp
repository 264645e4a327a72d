// rdmax_hol_bench: head-of-line blocking inside one RC queue pair, with and
// without the priority scheduler, all in one run.
//
// Urgent 64-byte RDMA writes arrive at a fixed rate (open loop: each has an
// arrival time, and its latency runs from that time to its completion, so a
// writer held up behind a queue does not hide the wait of the writes that
// would have arrived meanwhile). Three modes, each on a fresh connected pair:
//   idle       urgent writes alone
//   plain      urgent writes and a stream of 64 MiB writes on one queue pair
//   scheduled  the same through priority_scheduler: urgent at sched::urgent,
//              the stream at sched::bulk
// The stream keeps two writes outstanding, and a mode ends when --bulk-count
// of them completed; its throughput is theirs. Both ends are in this process
// (a loopback pair on one device), which is what the scheduler sees anyway:
// one queue pair's send queue.
//
// The three modes run in turn, --rounds times: a machine whose speed drifts
// (an emulated one does, by tens of percent over a minute) then drifts under
// all three alike. Percentiles are over the samples of all rounds, the
// throughput over all their bytes; each round's ratios are printed too.
//
//   rdmax_hol_bench [-d DEV] [-s 64] [--bulk-size 64M] [--bulk-count 2]
//                   [--interval 500] [--idle-samples 2000] [--rounds 5]
//                   [--json FILE] [--plot FILE.png] [-t SECONDS]
//
// The scheduler's options come from RDMAX_SCHED_* (see the README), so a
// sweep over slice sizes and budgets needs no rebuild.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <getopt.h>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

#include "bench_stats.hpp"

namespace {

using namespace rdmax;
using namespace rdmax::bench;
namespace sched = rdmax::sched;

struct hol_options {
    std::string device;
    std::size_t urgent_bytes = 64;
    std::size_t bulk_bytes = 64 * mib;
    std::uint32_t bulk_count = 2;
    double interval_us = 500;
    std::uint32_t idle_samples = 2000;
    std::uint32_t rounds = 5;
    std::string json;
    std::string plot;
    double timeout_s = 600;
};

[[noreturn]] void usage(int code) {
    std::fputs("usage: rdmax_hol_bench [-d DEV] [-s URGENT_BYTES] [--bulk-size N] "
               "[--bulk-count N]\n"
               "                       [--interval US] [--idle-samples N] [--rounds N] "
               "[--json FILE]\n"
               "                       [--plot FILE.png] [-t SECONDS]\n",
               code == 0 ? stdout : stderr);
    std::exit(code);
}

hol_options parse(int argc, char** argv) {
    hol_options o;
    enum { bulk_size = 1000, bulk_count, interval, idle_samples, rounds, json, plot };
    static const ::option longs[] = {{"ib-dev", required_argument, nullptr, 'd'},
                                     {"size", required_argument, nullptr, 's'},
                                     {"timeout", required_argument, nullptr, 't'},
                                     {"bulk-size", required_argument, nullptr, bulk_size},
                                     {"bulk-count", required_argument, nullptr, bulk_count},
                                     {"interval", required_argument, nullptr, interval},
                                     {"idle-samples", required_argument, nullptr, idle_samples},
                                     {"rounds", required_argument, nullptr, rounds},
                                     {"json", required_argument, nullptr, json},
                                     {"plot", required_argument, nullptr, plot},
                                     {"help", no_argument, nullptr, 'h'},
                                     {nullptr, 0, nullptr, 0}};
    int c = 0;
    while ((c = ::getopt_long(argc, argv, "d:s:t:h", longs, nullptr)) != -1) {
        switch (c) {
        case 'd': o.device = optarg; break;
        case 's': o.urgent_bytes = parse_size(optarg, "-s", 4096); break;
        case 't': o.timeout_s = std::atof(optarg); break;
        case bulk_size:
            o.bulk_bytes = parse_size(optarg, "--bulk-size", std::size_t{1} << 31);
            break;
        case bulk_count: o.bulk_count = static_cast<std::uint32_t>(std::atoi(optarg)); break;
        case interval: o.interval_us = std::atof(optarg); break;
        case idle_samples: o.idle_samples = static_cast<std::uint32_t>(std::atoi(optarg)); break;
        case rounds: o.rounds = static_cast<std::uint32_t>(std::atoi(optarg)); break;
        case json: o.json = optarg; break;
        case plot: o.plot = optarg; break;
        case 'h': usage(0);
        default: usage(2);
        }
    }
    if (o.urgent_bytes == 0 || o.bulk_bytes == 0 || o.bulk_count == 0 || o.interval_us <= 0 ||
        o.idle_samples == 0 || o.rounds == 0 || o.timeout_s <= 0)
        usage(2);
    return o;
}

verbs::context open_device(const std::string& name) {
    return name.empty() ? verbs::context::open_first_active() : verbs::context::open(name);
}

/// One connected loopback pair with the memory the modes write.
struct testbed {
    verbs::protection_domain pd;
    verbs::queue_pair<verbs::rc> a;
    verbs::queue_pair<verbs::rc> b;
    std::vector<std::byte> src;
    std::vector<std::byte> dst;
    memory_region<all_rights> src_mr;
    memory_region<all_rights> dst_mr;

    testbed(const verbs::context& ctx, const hol_options& o)
        : pd(ctx)
        , a(pd, config(ctx))
        , b(pd, config(ctx))
        , src(o.bulk_bytes + 4096, std::byte{0x5a})
        , dst(o.bulk_bytes + 4096)
        , src_mr(pd, src.data(), src.size())
        , dst_mr(pd, dst.data(), dst.size()) {
        verbs::connect_pair(a, b);
    }
    static verbs::qp_config config(const verbs::context& ctx) {
        verbs::qp_config c;
        c.send_depth = send_depth(ctx);
        c.recv_depth = 16;
        return c;
    }
    /// Deep enough that, without the scheduler, every urgent write can be
    /// posted when it arrives although it waits seconds behind the stream:
    /// both modes then carry the same urgent load, whose posting and
    /// completion cost the CPU the stream also needs (on soft-RoCE the posting
    /// thread does the device's work). 16384 is soft-RoCE's limit.
    static std::uint32_t send_depth(const verbs::context& ctx) {
        return std::min<std::uint32_t>(16384, ctx.limits().max_qp_wr);
    }
};

constexpr std::uint64_t bulk_tag = std::uint64_t{1} << 63;
/// Room in the send queue for the stream: two writes of up to 8 chained requests each, and slack.
constexpr std::uint32_t stream_room = 64;
constexpr std::size_t warmup_arrivals = 20;

struct mode_result {
    std::string name;
    std::vector<double> latency_us; // sorted once all rounds are in
    // Where each urgent write's latency went: from its arrival until this
    // thread got to post it (it was busy, e.g. in a doorbell), the posting
    // call, and from there until poll() handed back its completion.
    std::vector<double> waited_us;
    std::vector<double> posting_us;
    std::vector<double> completing_us;
    double bulk_bytes = 0;
    double seconds = 0;     // the stream's, all rounds
    std::uint64_t late = 0; // urgent writes posted over an interval after their arrival
    std::uint32_t cap = 0;  // urgent writes outstanding at most
    std::string counters;   // the scheduler's, last round

    [[nodiscard]] double bulk_MBps() const { return seconds > 0 ? bulk_bytes / seconds / 1e6 : 0; }
    void add(mode_result&& r) {
        for (auto [to, from] : {std::pair{&latency_us, &r.latency_us},
                                {&waited_us, &r.waited_us},
                                {&posting_us, &r.posting_us},
                                {&completing_us, &r.completing_us}})
            to->insert(to->end(), from->begin(), from->end());
        bulk_bytes += r.bulk_bytes;
        seconds += r.seconds;
        late += r.late;
        cap = r.cap;
        if (!r.counters.empty())
            counters = std::move(r.counters);
    }
    void sort() {
        for (auto* v : {&latency_us, &waited_us, &posting_us, &completing_us})
            std::sort(v->begin(), v->end());
    }
};

double percentile(const std::vector<double>& sorted, double p) {
    if (sorted.empty())
        return 0;
    const double rank = p / 100.0 * static_cast<double>(sorted.size() - 1);
    const auto lo = static_cast<std::size_t>(std::floor(rank));
    const auto hi = std::min(lo + 1, sorted.size() - 1);
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - static_cast<double>(lo));
}

/// The run loop all modes share: open-loop urgent arrivals, the bulk stream
/// (when bulk_count > 0), and polling, until the stream is done (or, with no
/// stream, until `samples` urgent writes completed).
template <class Post, class Poll>
mode_result run_mode(const char* name, const hol_options& o, double cyc_per_us,
                     std::uint32_t max_urgent_outstanding, std::uint32_t bulk_count,
                     std::uint32_t samples, Post&& post, Poll&& poll) {
    mode_result r;
    r.cap = max_urgent_outstanding;
    r.name = name;
    const auto interval = static_cast<std::uint64_t>(o.interval_us * cyc_per_us);
    const auto deadline_cycles = static_cast<std::uint64_t>(o.timeout_s * 1e6 * cyc_per_us);
    std::vector<double> lat;
    lat.reserve(1 << 20);
    std::vector<std::uint64_t> arrivals;
    arrivals.reserve(1 << 20);
    std::vector<std::uint64_t> posting; // when each urgent write's post() began and ended
    std::vector<std::uint64_t> posted;
    posting.reserve(1 << 20);
    posted.reserve(1 << 20);

    cycle_rate rate;
    rate.start();
    const std::uint64_t start = cycles();
    std::uint64_t bulk_start = 0;
    std::uint64_t next_arrival = start;
    std::uint32_t urgent_out = 0;
    std::uint32_t bulk_posted = 0;
    std::uint32_t bulk_done = 0;
    std::uint64_t bulk_end = 0;
    std::uint64_t urgent_done = 0;
    verbs::completion wcs[32];
    for (;;) {
        const std::uint64_t now = cycles();
        if (now - start > deadline_cycles)
            fail(fmt::format("{}: no end after {} s ({} of {} bulk writes done)", name, o.timeout_s,
                             bulk_done, bulk_count));
        // The stream: two writes outstanding until bulk_count were posted.
        // The stream starts once urgent traffic is under way, so that what
        // is measured is the steady state: the scheduler has seen urgent work
        // and cuts the stream small, as it would all along in a service.
        if (bulk_posted == 0 && bulk_count > 0 && arrivals.size() >= warmup_arrivals)
            bulk_start = now;
        while (bulk_start != 0 && bulk_posted < bulk_count && bulk_posted - bulk_done < 2) {
            if (status s = post(true, bulk_tag | bulk_posted); s != status::ok)
                fail(fmt::format("{}: posting a bulk write: {}", name, to_string(s)));
            ++bulk_posted;
        }
        // Urgent arrivals due by now, while under the outstanding cap.
        const bool more = bulk_count > 0 ? bulk_done < bulk_count : arrivals.size() < samples;
        while (more && now >= next_arrival && urgent_out < max_urgent_outstanding) {
            posting.push_back(cycles());
            if (status s = post(false, arrivals.size()); s != status::ok)
                fail(fmt::format("{}: posting an urgent write: {}", name, to_string(s)));
            posted.push_back(cycles());
            r.late += now - next_arrival > interval ? 1U : 0U;
            arrivals.push_back(next_arrival);
            next_arrival += interval;
            ++urgent_out;
        }
        const int n = poll(std::span<verbs::completion>(wcs));
        if (n < 0)
            fail(fmt::format("{}: polling completions failed", name));
        const std::uint64_t t = cycles();
        for (int i = 0; i < n; ++i) {
            const verbs::completion& c = wcs[i];
            if (!c.ok())
                fail(fmt::format("{}: a write failed: {}", name, c.status_name()));
            if ((c.wr_id & bulk_tag) != 0) {
                ++bulk_done;
                bulk_end = t;
            } else {
                // With a stream, only writes that arrived while it ran count.
                const std::uint64_t id = c.wr_id;
                if (bulk_count == 0 || (bulk_start != 0 && arrivals[id] >= bulk_start)) {
                    lat.push_back(static_cast<double>(t - arrivals[id]));
                    r.waited_us.push_back(static_cast<double>(posting[id] - arrivals[id]));
                    r.posting_us.push_back(static_cast<double>(posted[id] - posting[id]));
                    r.completing_us.push_back(static_cast<double>(t - posted[id]));
                }
                --urgent_out;
                ++urgent_done;
            }
        }
        const bool finished =
            bulk_count > 0 ? bulk_done == bulk_count && urgent_out == 0 : urgent_done >= samples;
        if (finished)
            break;
    }
    rate.stop();
    const double per_us = rate.per_us() > 0 ? rate.per_us() : cyc_per_us;
    r.latency_us = std::move(lat);
    for (auto* v : {&r.latency_us, &r.waited_us, &r.posting_us, &r.completing_us})
        for (double& x : *v)
            x /= per_us;
    if (bulk_count > 0) {
        r.seconds = static_cast<double>(bulk_end - bulk_start) / per_us / 1e6;
        r.bulk_bytes = static_cast<double>(bulk_count) * static_cast<double>(o.bulk_bytes);
    }
    return r;
}

mode_result plain_mode(const verbs::context& ctx, const hol_options& o, double cyc, bool idle) {
    testbed t(ctx, o);
    auto dst = t.dst_mr.remote();
    const auto bulk_src = *t.src_mr.local().sub(0, o.bulk_bytes);
    const auto urgent_src = *t.src_mr.local().sub(o.bulk_bytes, o.urgent_bytes);
    // A write longer than the port's largest message (8 MiB on soft-RoCE) is
    // posted as plain code would: a chain of the largest messages, one
    // doorbell, the last one signaled.
    const std::uint64_t most = t.a.max_message();
    auto post = [&](bool bulk, std::uint64_t id) {
        if (!bulk)
            return t.a.write(urgent_src, dst, o.bulk_bytes, id);
        verbs::send_batch b = t.a.batch();
        for (std::uint64_t at = 0; at < o.bulk_bytes; at += most) {
            const std::uint64_t len = std::min<std::uint64_t>(most, o.bulk_bytes - at);
            const bool last = at + len == o.bulk_bytes;
            if (status s = b.write(*bulk_src.sub(at, len), dst, at, id, {.signaled = last});
                s != status::ok)
                return s;
        }
        return b.post();
    };
    auto poll = [&](std::span<verbs::completion> out) { return t.a.poll_send(out); };
    return run_mode(idle ? "idle" : "plain", o, cyc, t.a.send_depth() - stream_room,
                    idle ? 0 : o.bulk_count, idle ? o.idle_samples : 0, post, poll);
}

mode_result scheduled_mode(const verbs::context& ctx, const hol_options& o, double cyc) {
    testbed t(ctx, o);
    sched::scheduler_options so = sched::scheduler_options{}.with_env();
    const std::uint32_t max_urgent_outstanding = t.a.send_depth() - stream_room;
    so.max_requests = std::max<std::uint32_t>(so.max_requests, max_urgent_outstanding + 8);
    sched::priority_scheduler<> s(t.a, so);
    auto dst = t.dst_mr.remote();
    const auto bulk_src = *t.src_mr.local().sub(0, o.bulk_bytes);
    const auto urgent_src = *t.src_mr.local().sub(o.bulk_bytes, o.urgent_bytes);
    auto post = [&](bool bulk, std::uint64_t id) {
        return bulk ? s.write(sched::bulk, bulk_src, dst, 0, id)
                    : s.write(sched::urgent, urgent_src, dst, o.bulk_bytes, id);
    };
    auto poll = [&](std::span<verbs::completion> out) { return s.poll(out); };
    mode_result r =
        run_mode("scheduled", o, cyc, max_urgent_outstanding, o.bulk_count, 0, post, poll);
    r.counters = fmt::format("{}", s.counters());
    return r;
}

void write_cdf_plot(const std::string& png, const std::vector<mode_result>& modes) {
    std::FILE* gp = open_gnuplot(png);
    if (gp == nullptr)
        return;
    fmt::print(gp, "set title \"Latency of urgent 64-byte writes beside a bulk stream on one RC "
                   "queue pair\"\n"
                   "set xlabel \"latency (us, log scale)\"\nset ylabel \"fraction of writes\"\n"
                   "set logscale x\nset grid\nset key bottom right\nset yrange [0:1]\n");
    for (std::size_t m = 0; m < modes.size(); ++m) {
        fmt::print(gp, "$d{} << EOD\n", m);
        const auto& v = modes[m].latency_us;
        // At most ~2000 points per curve: enough for the eye.
        const std::size_t step = std::max<std::size_t>(1, v.size() / 2000);
        for (std::size_t i = 0; i < v.size(); i += step)
            fmt::print(gp, "{} {}\n", v[i],
                       static_cast<double>(i + 1) / static_cast<double>(v.size()));
        if (!v.empty())
            fmt::print(gp, "{} 1\n", v.back());
        fmt::print(gp, "EOD\n");
    }
    fmt::print(gp, "plot ");
    for (std::size_t m = 0; m < modes.size(); ++m)
        fmt::print(gp, "{}$d{} using 1:2 with lines lw 2 title \"{}\"", m == 0 ? "" : ", ", m,
                   modes[m].name);
    fmt::print(gp, "\n");
    close_gnuplot(gp, png);
}

} // namespace

int main(int argc, char** argv) try {
    const hol_options o = parse(argc, argv);
    verbs::context ctx = open_device(o.device);
    const double cyc = estimate_cycles_per_us();
    json_list json(o.json);
    const sched::scheduler_options so = sched::scheduler_options{}.with_env();
    fmt::print("head-of-line bench on {}: urgent {} B writes every {} us; bulk {} x {} writes; "
               "{} rounds\n",
               ctx.name(), o.urgent_bytes, o.interval_us, o.bulk_count, human_bytes(o.bulk_bytes),
               o.rounds);
    fmt::print("scheduler: small slice {}, large slice {}, budget {} / {} WQEs, hold {} us\n",
               human_bytes(so.small_slice), human_bytes(so.large_slice),
               so.budget_bytes == 0 ? std::string("measured (see the counters)")
                                    : fmt::format("{} bytes", so.budget_bytes),
               so.budget_wqes, so.hold.count());

    std::vector<mode_result> modes(3);
    modes[0].name = "idle";
    modes[1].name = "plain";
    modes[2].name = "scheduled";
    std::vector<double> round_latency_ratio;
    std::vector<double> round_bulk_ratio;
    for (std::uint32_t round = 1; round <= o.rounds; ++round) {
        fmt::print(stderr, "round {}/{}: idle ...\n", round, o.rounds);
        mode_result idle = plain_mode(ctx, o, cyc, true);
        fmt::print(stderr, "round {}/{}: plain ...\n", round, o.rounds);
        mode_result plain = plain_mode(ctx, o, cyc, false);
        fmt::print(stderr, "round {}/{}: scheduled ...\n", round, o.rounds);
        mode_result scheduled = scheduled_mode(ctx, o, cyc);
        for (auto* m : {&idle, &plain, &scheduled})
            std::sort(m->latency_us.begin(), m->latency_us.end());
        const double idle99 = percentile(idle.latency_us, 99);
        const double sched99 = percentile(scheduled.latency_us, 99);
        round_latency_ratio.push_back(sched99 / idle99);
        round_bulk_ratio.push_back(scheduled.bulk_MBps() / plain.bulk_MBps());
        fmt::print("round {}: idle p99 {:.1f} us, scheduled p99 {:.1f} us ({:.2f}x); stream "
                   "{:.1f} MB/s plain, {:.1f} scheduled ({:.3f})\n",
                   round, idle99, sched99, round_latency_ratio.back(), plain.bulk_MBps(),
                   scheduled.bulk_MBps(), round_bulk_ratio.back());
        modes[0].add(std::move(idle));
        modes[1].add(std::move(plain));
        modes[2].add(std::move(scheduled));
    }
    for (auto& m : modes)
        m.sort();

    fmt::print("\nall rounds:\n{:<10} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10}\n", "mode",
               "samples", "p50 us", "p99 us", "p99.9 us", "max us", "bulk MB/s");
    for (const auto& m : modes) {
        const double p50 = percentile(m.latency_us, 50);
        const double p99 = percentile(m.latency_us, 99);
        const double p999 = percentile(m.latency_us, 99.9);
        fmt::print("{:<10} {:>8} {:>10.1f} {:>10.1f} {:>10.1f} {:>10.1f} {:>10}\n", m.name,
                   m.latency_us.size(), p50, p99, p999,
                   m.latency_us.empty() ? 0.0 : m.latency_us.back(),
                   m.name == "idle" ? std::string("-") : fmt::format("{:.1f}", m.bulk_MBps()));
        json.add(fmt::format(R"({{"mode":"{}","p50_us":{:.2f},"p99_us":{:.2f},"p999_us":{:.2f}}})",
                             m.name, p50, p99, p999));
    }
    for (const auto& m : modes)
        if (m.name != "idle")
            json.add(fmt::format(R"({{"mode":"{}","bulk_MBps":{:.3f}}})", m.name, m.bulk_MBps()));
    fmt::print("\nwhere urgent latency goes, p50 / p99 us: waiting for the thread, posting, "
               "completing\n");
    for (const auto& m : modes)
        fmt::print("{:<10} {:>8.1f} / {:<8.1f} {:>8.1f} / {:<8.1f} {:>10.1f} / {:.1f}\n", m.name,
                   percentile(m.waited_us, 50), percentile(m.waited_us, 99),
                   percentile(m.posting_us, 50), percentile(m.posting_us, 99),
                   percentile(m.completing_us, 50), percentile(m.completing_us, 99));

    const double idle99 = percentile(modes[0].latency_us, 99);
    const double plain99 = percentile(modes[1].latency_us, 99);
    const double sched99 = percentile(modes[2].latency_us, 99);
    fmt::print("\nurgent p99 / idle p99: plain {:.1f}x, scheduled {:.2f}x (target <= 3x; "
               "median of the rounds {:.2f}x)\n",
               plain99 / idle99, sched99 / idle99, median(round_latency_ratio));
    fmt::print("bulk throughput scheduled / plain: {:.3f} (target >= 0.95; median of the rounds "
               "{:.3f})\n",
               modes[2].bulk_MBps() / modes[1].bulk_MBps(), median(round_bulk_ratio));
    // The budget should cover the bandwidth-delay product: the stream's rate
    // times an idle round trip, both measured here.
    const double bdp = modes[1].bulk_MBps() * percentile(modes[0].latency_us, 50);
    fmt::print("measured bandwidth-delay product: {:.1f} MB/s x {:.1f} us = {:.0f} bytes "
               "(budget {})\n",
               modes[1].bulk_MBps(), percentile(modes[0].latency_us, 50), bdp,
               so.budget_bytes == 0 ? std::string("measured: see the counters")
                                    : fmt::format("{} bytes", so.budget_bytes));
    for (const auto& m : modes)
        if (m.late > 0)
            fmt::print("{}: {} urgent writes were posted over an interval after their arrival "
                       "(at most {} are outstanding; latency counts from arrival)\n",
                       m.name, m.late, m.cap);
    fmt::print("scheduler counters (last round): {}\n", modes[2].counters);
    if (!o.plot.empty()) {
        write_cdf_plot(o.plot, modes);
        fmt::print("latency CDF written to {}\n", o.plot);
    }
    return 0;
} catch (const std::exception& e) {
    fmt::print(stderr, "rdmax_hol_bench: {}\n", e.what());
    return 1;
}
