#pragma once
// Several rails in the NIC model: one host thread drives a basic_striper over
// one modelled NIC per rail (each its own link, all on the host's virtual
// clock) with a stream of large striped writes, small urgent writes that
// arrive at random, and, if asked, a rail whose link fails and comes back.
// What rdmax_rail_sim reports and test_multirail_model asserts.
//
// The failure, in order: rail `fail_rail`'s link goes down (nothing more is
// sent, acknowledgements on the way are lost); `detect_us` later the host
// learns it (a port event) and takes the rail out (basic_striper::rail_down:
// its queue pair fails, its pieces flush and go again on the other rails);
// the link comes back at `restore_at_ms`, and `reconnect_us` later a new
// queue pair is attached (the old one stays failed, as on a NIC).
//
// With `urgent_lane`, each rail has a second queue pair with a scheduler of
// its own, its urgent lane (basic_striper::attach), which the urgent writes
// take; the modelled NIC arbitrates between the two queue pairs.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include <rdmax/mem/rail_buffer.hpp>
#include <rdmax/sched/basic_priority_scheduler.hpp>
#include <rdmax/sched/basic_striper.hpp>
#include <rdmax/sched/sim/nic_model.hpp>
#include <rdmax/sched/strict_priority.hpp>

namespace rdmax::sched::sim {

struct rail_run_options {
    std::uint32_t rails = 2; ///< 1 .. max_rails, each a NIC of `nic`
    nic_params nic = nic_params::cx5_100g();
    scheduler_options sched{}; ///< each rail's scheduler
    stripe_options stripe{};
    std::uint64_t bulk_bytes = 64ULL * 1024 * 1024; ///< each striped write
    std::uint32_t bulk_outstanding = 2;             ///< striped writes kept in flight
    bool with_bulk = true;
    bool with_urgent = true;
    bool urgent_lane = false; ///< each rail with an urgent lane (a second queue pair)
    std::uint32_t urgent_bytes = 64;
    double interval_us = 20; ///< mean gap between urgent writes (Poisson)
    std::uint64_t seed = 1;
    double duration_ms = 20;
    double warmup_ms = 2;
    double fail_at_ms = -1; ///< < 0: no rail fails
    std::uint32_t fail_rail = 1;
    double detect_us = 100;
    double restore_at_ms = -1; ///< < 0: the failed rail stays out
    double reconnect_us = 1000;
    double bin_us = 50;
};

struct rail_run_result {
    double bulk_Bps = 0;          ///< striped payload arrived, all rails, after the warm-up
    std::vector<double> bins_Bps; ///< the same per bin_us, from time 0
    std::vector<std::vector<double>> rail_bins_Bps; ///< each rail's, likewise
    double p50_us = 0;
    double p99_us = 0;
    double p999_us = 0;
    std::size_t urgent_samples = 0;
    std::uint64_t urgent_submitted = 0; ///< urgent writes submitted (the warm-up's too)
    std::uint64_t bulk_done = 0;        ///< striped writes completed
    std::uint64_t failed = 0;           ///< completions in error (any)
    std::uint64_t refused = 0;          ///< submissions the striper refused
    picoseconds attached_at = never;    ///< when the failed rail's new queue pair was attached
    striper_counters counters;
    std::vector<scheduler_counters> rail_counters; ///< each rail's scheduler at the end
    std::vector<scheduler_counters> lane_counters; ///< each rail's urgent lane, if it has one
};

using model_scheduler =
    basic_priority_scheduler<strict_priority, nic_port, virtual_clock, virtual_clock>;

namespace detail {
inline double percentile_of(std::vector<double>& v, double p) {
    if (v.empty())
        return 0;
    const auto k = static_cast<std::size_t>(p / 100.0 * static_cast<double>(v.size() - 1));
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
    return v[k];
}
} // namespace detail

/// One run: the NICs, each rail's scheduler, the striper, the host's loop.
class striped_host {
public:
    explicit striped_host(const rail_run_options& o)
        : o_(o)
        , rails_(std::clamp<std::size_t>(o.rails, 1, max_rails))
        , end_(at_ms(o.duration_ms))
        , warm_(at_ms(o.warmup_ms))
        , bin_(static_cast<picoseconds>(std::max(o.bin_us, 1.0) * 1e6))
        , bins_(rails_, std::vector<std::uint64_t>(static_cast<std::size_t>(end_ / bin_) + 1))
        , st_(o.stripe)
        , rng_(o.seed)
        , gap_(1.0 / o.interval_us) {
        // Queue pairs a NIC: the first, and the one a reconnect makes; with
        // lanes, a lane beside each (qp 2 and 3).
        for (std::size_t k = 0; k < rails_; ++k) {
            nics_.push_back(std::make_unique<nic>(o.nic, o.urgent_lane ? 4 : 2));
            receiver& rx = nics_.back()->rx;
            rx.split_addr = urgent_remote;
            rx.window_start = warm_;
            rx.window_end = end_;
            rx.bins = &bins_[k];
            rx.bin_ps = bin_;
        }
        for (std::size_t k = 0; k < rails_; ++k) {
            sch_.push_back(
                std::make_unique<model_scheduler>(o.sched, strict_priority{}, *nics_[k], 0U));
            lanes_.push_back(o.urgent_lane ? std::make_unique<model_scheduler>(
                                                 o.sched, strict_priority{}, *nics_[k], 2U)
                                           : nullptr);
            (void)st_.attach(k, *sch_[k], o.nic.gbps, lanes_[k].get());
        }
        fail_k_ = std::min<std::size_t>(o.fail_rail, rails_ - 1);
        if (o.fail_at_ms >= 0 && rails_ > 1) {
            t_down_ = at_ms(o.fail_at_ms);
            t_detect_ = t_down_ + static_cast<picoseconds>(o.detect_us * 1e6);
            if (o.restore_at_ms >= 0) {
                t_up_ = at_ms(o.restore_at_ms);
                t_attach_ = t_up_ + static_cast<picoseconds>(o.reconnect_us * 1e6);
            }
        }
        next_arrival_ = o.with_urgent ? next_gap() : never;
    }

    rail_run_result run() {
        if (o_.with_bulk)
            for (std::uint32_t i = 0; i < o_.bulk_outstanding; ++i)
                submit_bulk();
        picoseconds& now = virtual_clock::ps;
        while (now < end_) {
            events(now);
            arrivals(now);
            if (poll() == 0) {
                // Nothing for the host: on to the next arrival, event or
                // completion it can see (a spinning host sees it one poll later).
                const picoseconds t =
                    std::min({next_arrival_, end_, t_down_, t_detect_, t_up_, t_attach_});
                picoseconds seen = t;
                for (auto& x : nics_)
                    seen = std::min(seen, x->next_completion(t));
                now = std::max(now, seen);
            }
        }
        return finish();
    }

private:
    static constexpr rights rw = rights::local_write | rights::remote_write | rights::remote_read;
    static constexpr std::uint64_t remote_base = std::uint64_t{1} << 40;
    static constexpr std::uint64_t urgent_remote = remote_base + (std::uint64_t{1} << 36);
    static constexpr std::uint64_t bulk_tag = std::uint64_t{1} << 62;
    static picoseconds at_ms(double ms) { return static_cast<picoseconds>(ms * 1e9); }
    picoseconds next_gap() { return static_cast<picoseconds>(gap_(rng_) * 1e6); }

    void submit_bulk() {
        const rail_local<rw> src{nominal_local, o_.bulk_bytes, {1, 1, 1, 1}, max_rails};
        if (st_.write(bulk, src, dst_, 0, bulk_tag | bulk_next_++) != status::ok)
            ++r_.refused;
    }

    /// The failing rail's link and host, at their times.
    void events(picoseconds now) {
        if (now >= t_down_) {
            nics_[fail_k_]->link_down();
            t_down_ = never;
        }
        if (now >= t_detect_) {
            st_.rail_down(fail_k_);
            t_detect_ = never;
        }
        if (now >= t_up_) {
            nics_[fail_k_]->link_up();
            t_up_ = never;
        }
        if (now >= t_attach_ && !st_.rail_idle(fail_k_)) {
            t_attach_ = now + us; // its old queue pair still has pieces out
        } else if (now >= t_attach_) {
            retired_.push_back(std::move(sch_[fail_k_]));
            sch_[fail_k_] =
                std::make_unique<model_scheduler>(o_.sched, strict_priority{}, *nics_[fail_k_], 1U);
            if (lanes_[fail_k_] != nullptr) {
                retired_.push_back(std::move(lanes_[fail_k_]));
                lanes_[fail_k_] = std::make_unique<model_scheduler>(o_.sched, strict_priority{},
                                                                    *nics_[fail_k_], 3U);
            }
            (void)st_.attach(fail_k_, *sch_[fail_k_], o_.nic.gbps, lanes_[fail_k_].get());
            r_.attached_at = now;
            t_attach_ = never;
        }
    }

    void arrivals(picoseconds now) {
        const rail_local<rw> src{nominal_local, o_.urgent_bytes, {1, 1, 1, 1}, max_rails};
        while (next_arrival_ <= now) {
            arrival_.push_back(next_arrival_);
            if (st_.write(urgent, src, dst_, urgent_remote - remote_base, arrival_.size() - 1) !=
                status::ok)
                ++r_.refused;
            next_arrival_ += next_gap();
        }
    }

    int poll() {
        std::array<verbs::completion, 32> c;
        const int n = st_.poll(c);
        const picoseconds now = virtual_clock::ps; // the caller has it once poll() returned
        for (int i = 0; i < n; ++i) {
            const verbs::completion& d = c[static_cast<std::size_t>(i)];
            if (!d.ok())
                ++r_.failed;
            if ((d.wr_id & bulk_tag) != 0) {
                ++r_.bulk_done;
                if (o_.with_bulk)
                    submit_bulk();
            } else if (arrival_[d.wr_id] >= warm_) {
                lat_.push_back(static_cast<double>(now - arrival_[d.wr_id]) / 1e6);
            }
        }
        return n;
    }

    rail_run_result finish() {
        std::uint64_t window = 0;
        for (auto& x : nics_)
            window += x->rx.window_bytes[0];
        r_.bulk_Bps = static_cast<double>(window) / (static_cast<double>(end_ - warm_) / 1e12);
        const auto rate = [&](std::uint64_t b) {
            return static_cast<double>(b) / (static_cast<double>(bin_) / 1e12);
        };
        r_.bins_Bps.assign(bins_[0].size(), 0);
        for (const auto& per_rail : bins_) {
            r_.rail_bins_Bps.emplace_back();
            for (std::size_t i = 0; i < per_rail.size(); ++i) {
                r_.rail_bins_Bps.back().push_back(rate(per_rail[i]));
                r_.bins_Bps[i] += rate(per_rail[i]);
            }
        }
        r_.urgent_samples = lat_.size();
        r_.urgent_submitted = arrival_.size();
        r_.p50_us = detail::percentile_of(lat_, 50);
        r_.p99_us = detail::percentile_of(lat_, 99);
        r_.p999_us = detail::percentile_of(lat_, 99.9);
        r_.counters = st_.counters();
        for (const auto& x : sch_)
            r_.rail_counters.push_back(x->counters());
        for (const auto& x : lanes_)
            if (x != nullptr)
                r_.lane_counters.push_back(x->counters());
        return r_;
    }

    rail_run_options o_;
    std::size_t rails_;
    picoseconds end_;
    picoseconds warm_;
    picoseconds bin_;
    std::vector<std::vector<std::uint64_t>> bins_;
    std::vector<std::unique_ptr<nic>> nics_;
    std::vector<std::unique_ptr<model_scheduler>> sch_;
    std::vector<std::unique_ptr<model_scheduler>> lanes_;   ///< each rail's urgent lane, or null
    std::vector<std::unique_ptr<model_scheduler>> retired_; ///< failed, kept while referenced
    basic_striper<model_scheduler> st_;
    rail_remote<rw> dst_{remote_base, std::uint64_t{1} << 37, {2, 2, 2, 2}, max_rails, 0};
    std::mt19937_64 rng_;
    std::exponential_distribution<double> gap_;
    picoseconds next_arrival_ = never;
    std::vector<picoseconds> arrival_;
    std::vector<double> lat_;
    std::uint64_t bulk_next_ = 0;
    std::size_t fail_k_ = 0;
    picoseconds t_down_ = never;
    picoseconds t_detect_ = never;
    picoseconds t_up_ = never;
    picoseconds t_attach_ = never;
    rail_run_result r_;
};

[[nodiscard]] inline rail_run_result run_rails(const rail_run_options& o) {
    return striped_host(o).run();
}

} // namespace rdmax::sched::sim
