// rdmax_rail_sim: several rails in the modelled NIC (rdmax/sched/sim/
// striped_host.hpp), in virtual time: sched::basic_striper over one
// basic_priority_scheduler per rail, each on its own modelled ConnectX-class
// NIC, one host thread for all. No device; the same figures on every machine.
//
// Three parts, at 100 and 400 Gb/s:
//   scale     1, 2 and 4 rails: 64 MiB striped writes (two outstanding)
//             beside urgent 64 B writes (Poisson, mean one every 20 us):
//             throughput over the sum of the rails (one rail's striped rate,
//             alone, times the rails), urgent p50/p99 over one rail's
//             (the same load on one rail, one queue pair); each without
//             and with an urgent lane per rail (a second queue pair that
//             the urgent writes take); bulk alone over 2 and 4 rails; and
//             urgent p99 over 1 and 4 rails with the host's costs taken out;
//   failover  the same with rail 1's link down at 10 ms, taken out 100 us
//             later (a port event), up at 20 ms and its new queue pair
//             attached 1 ms later: throughput per 100 us over the rails
//             left, errors seen (none expected); without and with lanes;
//   sweep     RDMAX_STRIPE_CHUNK and _AHEAD against throughput and urgent
//             p99 (4 rails), and one transfer alone, striped over 2 rails or
//             whole on one, from 64 KiB to 4 MiB: where striping pays
//             (what RDMAX_STRIPE_MIN is set from).
//
//   rdmax_rail_sim [--duration MS] [--seed N] [--json FILE]

#include <algorithm>
#include <cstdint>
#include <getopt.h>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <rdmax/sched/sim/striped_host.hpp>

#include "bench_stats.hpp"

namespace {

using namespace rdmax;
using namespace rdmax::bench;
namespace sched = rdmax::sched;
namespace sim = rdmax::sched::sim;

struct bench_options {
    double duration_ms = 30;
    std::uint64_t seed = 1;
    std::string json;
};

bench_options parse(int argc, char** argv) {
    bench_options o;
    enum { duration = 1000, seed, json };
    const option longs[] = {{"duration", required_argument, nullptr, duration},
                            {"seed", required_argument, nullptr, seed},
                            {"json", required_argument, nullptr, json},
                            {"help", no_argument, nullptr, 'h'},
                            {nullptr, 0, nullptr, 0}};
    for (int c; (c = getopt_long(argc, argv, "h", longs, nullptr)) != -1;) {
        switch (c) {
        case duration: o.duration_ms = std::stod(optarg); break;
        case seed: o.seed = std::stoull(optarg); break;
        case json: o.json = optarg; break;
        default:
            fmt::print(stderr, "usage: rdmax_rail_sim [--duration MS] [--seed N] [--json FILE]\n");
            std::exit(c == 'h' ? 0 : 2);
        }
    }
    if (o.duration_ms < 5)
        fail("--duration: at least 5 ms (2 ms of warm-up)");
    return o;
}

sim::rail_run_options base(const bench_options& b, const sim::nic_params& p, std::uint32_t n) {
    sim::rail_run_options o;
    o.nic = p;
    o.rails = n;
    o.duration_ms = b.duration_ms;
    o.warmup_ms = 2;
    o.seed = b.seed;
    o.stripe = sched::stripe_options{}.with_env();
    o.sched = sched::scheduler_options{}.with_env();
    return o;
}

/// One rail's striped rate with nothing else on it: the unit of "the sum of the rails".
double one_rail_Bps(const bench_options& b, const sim::nic_params& p) {
    sim::rail_run_options alone = base(b, p, 1);
    alone.with_urgent = false;
    return sim::run_rails(alone).bulk_Bps;
}

void scale(const bench_options& b, const sim::nic_params& p, double one, json_list& json) {
    // The baseline: one rail as a user without rdmax's rails has it, one
    // queue pair under the priority scheduler.
    const sim::rail_run_result single = sim::run_rails(base(b, p, 1));
    fmt::print("rails  lane  bulk GB/s  /sum   urgent p50 us  p99 us  p99/one rail  reposts "
               "steals\n");
    for (const bool lane : {false, true}) {
        for (const std::uint32_t n : {1U, 2U, 4U}) {
            sim::rail_run_options o = base(b, p, n);
            o.urgent_lane = lane;
            const sim::rail_run_result r = sim::run_rails(o);
            const double of_sum = r.bulk_Bps / (n * one);
            const double p99x = r.p99_us / single.p99_us;
            fmt::print("{:>5}  {:>4}  {:>9.2f}  {:>5.3f}  {:>13.2f}  {:>6.2f}  {:>11.2f}x  {:>7} "
                       "{:>6}\n",
                       n, lane ? "yes" : "no", r.bulk_Bps / 1e9, of_sum, r.p50_us, r.p99_us, p99x,
                       r.counters.reposts, r.counters.steals);
            json.add(fmt::format(
                "{{\"kind\":\"rail_sim_scale\",\"gbps\":{},\"rails\":{},\"lane\":{},\"bulk_GBps\":"
                "{:.3f},\"of_sum\":{:.4f},\"p50_us\":{:.3f},\"p99_us\":{:.3f},"
                "\"p99_over_one_rail\":{:.3f},\"failed\":{}}}",
                p.gbps, n, lane, r.bulk_Bps / 1e9, of_sum, r.p50_us, r.p99_us, p99x, r.failed));
        }
    }
    // Bulk alone over several rails: the budget must outgrow the host's round.
    for (const std::uint32_t n : {2U, 4U}) {
        sim::rail_run_options o = base(b, p, n);
        o.with_urgent = false;
        const double of_sum = sim::run_rails(o).bulk_Bps / (n * one);
        fmt::print("bulk alone, {} rails: {:.3f} of the sum\n", n, of_sum);
        json.add(fmt::format("{{\"kind\":\"rail_sim_bulk_alone\",\"gbps\":{},\"rails\":{},"
                             "\"of_sum\":{:.4f}}}",
                             p.gbps, n, of_sum));
    }
    // The same load with the host's costs taken out: what the rails add to
    // an urgent write's wait when no thread is busy for them.
    sim::nic_params free_host = p;
    free_host.host_wqe = free_host.host_doorbell = free_host.host_poll = free_host.host_cqe = 1;
    for (const bool lane : {false, true}) {
        double p99[2] = {0, 0};
        for (const std::uint32_t n : {1U, 4U}) {
            sim::rail_run_options o = base(b, free_host, n);
            o.urgent_lane = lane;
            p99[n == 1 ? 0 : 1] = sim::run_rails(o).p99_us;
        }
        fmt::print("no host costs{}: urgent p99 {:.2f} us over 1 rail, {:.2f} us over 4\n",
                   lane ? ", lanes" : "", p99[0], p99[1]);
        json.add(fmt::format("{{\"kind\":\"rail_sim_free_host\",\"gbps\":{},\"lane\":{},"
                             "\"p99_one_us\":{:.3f},\"p99_four_us\":{:.3f}}}",
                             p.gbps, lane, p99[0], p99[1]));
    }
}

void failover(const bench_options& b, const sim::nic_params& p, double one, json_list& json) {
    for (const auto& [n, lane] :
         {std::pair{2U, false}, std::pair{4U, false}, std::pair{2U, true}, std::pair{4U, true}}) {
        sim::rail_run_options o = base(b, p, n);
        o.urgent_lane = lane;
        o.duration_ms = std::max(b.duration_ms, 30.0);
        o.fail_at_ms = 10;
        o.restore_at_ms = 20;
        o.bin_us = 100;
        const sim::rail_run_result r = sim::run_rails(o);
        const auto bin = [&](double ms) { return static_cast<std::size_t>(ms * 1000 / o.bin_us); };
        // The worst 100 us from 1 ms after the failure to the rail's return,
        // and from 1 ms after its new queue pair was attached to the end.
        double worst_out = 1e30;
        for (std::size_t i = bin(11); i < bin(20); ++i)
            worst_out = std::min(worst_out, r.bins_Bps[i]);
        const double back = static_cast<double>(r.attached_at) / 1e9 + 1;
        double worst_back = 1e30;
        for (std::size_t i = bin(back); i + 1 < bin(o.duration_ms); ++i)
            worst_back = std::min(worst_back, r.bins_Bps[i]);
        const double out_x = worst_out / ((n - 1) * one);
        const double back_x = worst_back / (n * one);
        fmt::print(
            "{} rails{}, rail 1 down 10-20 ms: worst 100 us from 11 ms {:.2f} GB/s = {:.3f} of "
            "the {} left; from {:.1f} ms (back + 1 ms) {:.3f} of all; errors {}; pieces "
            "sent again {}; urgent p99 {:.2f} us\n",
            n, lane ? " with lanes" : "", worst_out / 1e9, out_x, n - 1, back, back_x, r.failed,
            r.counters.reposts, r.p99_us);
        json.add(
            fmt::format("{{\"kind\":\"rail_sim_failover\",\"gbps\":{},\"rails\":{},"
                        "\"lane\":{},\"worst_out_of_left\":{:.4f},\"worst_back_of_all\":{:.4f},"
                        "\"failed\":{},\"reposts\":{},\"p99_us\":{:.3f}}}",
                        p.gbps, n, lane, out_x, back_x, r.failed, r.counters.reposts, r.p99_us));
    }
}

void sweep(const bench_options& b, const sim::nic_params& p, json_list& json) {
    fmt::print("4 rails: chunk  ahead  bulk GB/s  urgent p99 us\n");
    for (const std::uint64_t chunk : {512ULL << 10, 1ULL << 20, 2ULL << 20, 4ULL << 20}) {
        for (const std::uint32_t ahead : {1U, 2U, 4U}) {
            sim::rail_run_options o = base(b, p, 4);
            o.stripe.chunk = chunk;
            o.stripe.chunks_ahead = ahead;
            const sim::rail_run_result r = sim::run_rails(o);
            fmt::print("        {:>5}  {:>5}  {:>9.2f}  {:>13.2f}\n", human_bytes(chunk), ahead,
                       r.bulk_Bps / 1e9, r.p99_us);
            json.add(fmt::format("{{\"kind\":\"rail_sim_sweep\",\"gbps\":{},\"chunk\":{},"
                                 "\"ahead\":{},\"bulk_GBps\":{:.3f},\"p99_us\":{:.3f}}}",
                                 p.gbps, chunk, ahead, r.bulk_Bps / 1e9, r.p99_us));
        }
    }
    fmt::print("one transfer alone: bytes  whole p50 us  striped over 2 p50 us  ratio\n");
    for (std::uint64_t bytes = 64 << 10; bytes <= (4 << 20); bytes *= 2) {
        sim::rail_run_options o = base(b, p, 2);
        o.with_bulk = false;
        // Arrivals far apart (5 transfers' wire time): each one alone.
        const double wire_us = static_cast<double>(bytes) * 8 / (p.gbps * 1000.0);
        o.interval_us = 5 * wire_us + 20;
        o.duration_ms = std::max(b.duration_ms, o.interval_us * 200 / 1000);
        o.urgent_bytes = static_cast<std::uint32_t>(bytes);
        o.stripe.stripe_min = UINT32_MAX; // whole
        const double whole = sim::run_rails(o).p50_us;
        o.stripe.stripe_min = 1; // always striped
        o.stripe.chunk = std::max<std::uint64_t>(bytes / 2, 4096);
        const double striped = sim::run_rails(o).p50_us;
        fmt::print("                    {:>6}  {:>12.2f}  {:>21.2f}  {:>5.2f}\n",
                   human_bytes(bytes), whole, striped, striped / whole);
        json.add(fmt::format("{{\"kind\":\"rail_sim_alone\",\"gbps\":{},\"bytes\":{},"
                             "\"whole_p50_us\":{:.3f},\"striped_p50_us\":{:.3f}}}",
                             p.gbps, bytes, whole, striped));
    }
}

} // namespace

int main(int argc, char** argv) try {
    const bench_options b = parse(argc, argv);
    json_list json(b.json);
    const sched::stripe_options so = sched::stripe_options{}.with_env();
    fmt::print("# rdmax_rail_sim: {} ms virtual (2 ms warm-up), seed {}; stripe min {}, chunk {}, "
               "{} ahead; schedulers' options from RDMAX_SCHED_*\n",
               b.duration_ms, b.seed, human_bytes(so.stripe_min), human_bytes(so.chunk),
               so.chunks_ahead);
    for (const sim::nic_params& p : {sim::nic_params::cx5_100g(), sim::nic_params::cx7_400g()}) {
        fmt::print("\n== {}\n", p.name);
        const double one = one_rail_Bps(b, p);
        scale(b, p, one, json);
        failover(b, p, one, json);
        sweep(b, p, json);
    }
    return 0;
} catch (const std::exception& e) {
    fmt::print(stderr, "rdmax_rail_sim: {}\n", e.what());
    return 1;
}
