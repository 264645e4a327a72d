#pragma once
// rdmax::sched::rail_group: a basic_striper over a rail_set's rails that keeps
// them connected. It owns each rail's connection and scheduler, and keep()
// does what a rail's failure and return need (issue 31, failover):
//
//   - a rail's PORT_ERR or DEVICE_FATAL (verbs::port_watch) takes it out at
//     once (basic_striper::rail_down), before its work fails; so does a
//     disconnect from the peer (rdma_cm's DISCONNECTED: it closed or went
//     away). A rail whose work failed without either (a link down at the
//     peer's end) the striper takes out by itself;
//   - a rail that is out is dialed again once its port is ready (ACTIVE, its
//     GID back), on a thread of its own: the dial blocks (address and route
//     resolution, the handshake) and the data path must not. A failed dial is
//     tried again after a delay that doubles, from retry_min to retry_max;
//   - once the new connection is made, the port still ready (and not down
//     meanwhile) and none of the rail's old pieces out, keep() makes its
//     scheduler and attaches it: the rail carries pieces again. The old
//     connection and scheduler go then. A rail that goes out again soon
//     after (within retry_max) waits the delay, doubled, before its next
//     dial: a peer that accepts and closes at once is not dialed in a loop.
//
//     verbs::rail_set rails = verbs::rail_set::discover();
//     sched::rail_group<> group(rails, [&](std::size_t k) {
//         return rails.connect(k, peer_address[k], port); // rail k to the peer's rail k
//     });
//     group.striper().write(sched::bulk, src, dst, 0, id);
//     for (;;) { group.striper().poll(done); group.keep(); } // keep(): every ms or so
//
// The passive end accepts on each rail's listener again (a dial is a new
// connection; the old one's queue pair failed with the link). keep() makes
// system calls (a look at each device's event descriptor and each rail's
// connection events; a port query of each rail that is out): call it from
// the loop, or a timer, every millisecond or so. A readable fds() is one
// more reason to call it, not the only one: a dial that ended or a GID that
// came back makes nothing readable. One thread: the group, its striper and
// keep(). The dial runs on another: it must use nothing that thread
// changes. A device's events reach one reader per process: one group (or
// port_watch) per device.
//
// With `urgent_lane`, each rail is dialed twice: the second connection is
// the rail's urgent lane (basic_striper::attach), a queue pair that urgent
// transfers take, which the NIC interleaves with the bulk one. The peer
// accepts two connections per rail then (the dial function is called twice
// for a rail, the main connection first; nothing tells them apart on the
// wire); either one failing or closing takes the rail out, and it comes
// back with two new ones. A rail whose lane's dial fails is dialed again
// whole, after the delay: a peer that takes one connection per rail leaves
// every rail out (the constructor throws, naming the dials' failures).

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/sched/basic_striper.hpp>
#include <rdmax/sched/priority_scheduler.hpp>
#include <rdmax/sched/stripe_options.hpp>
#include <rdmax/verbs/connection.hpp>
#include <rdmax/verbs/port_watch.hpp>
#include <rdmax/verbs/rail_set.hpp>

namespace rdmax::sched {

struct rail_group_options {
    stripe_options stripe = stripe_options{}.with_env();
    scheduler_options sched = scheduler_options{}.with_env(); ///< each rail's scheduler
    /// The delay before a failed dial is tried again (at least 1 ms),
    /// doubled at each failure up to retry_max (a peer whose link is still
    /// down).
    std::chrono::milliseconds retry_min{200};
    std::chrono::milliseconds retry_max{5000};
    /// Each rail dialed twice, the second connection its urgent lane.
    bool urgent_lane = false;
};

/// What keep() has done.
struct rail_group_counters {
    std::uint64_t port_downs = 0;    ///< rails taken out at a port event
    std::uint64_t peer_downs = 0;    ///< rails taken out at the peer's disconnect
    std::uint64_t dials = 0;         ///< dials started by keep()
    std::uint64_t dial_failures = 0; ///< of those, failed or of no use (tried again later)
    std::uint64_t rejoins = 0;       ///< rails attached again after they were out
    std::uint64_t late_joins = 0;    ///< rails whose first dial failed, attached later
};

template <class Scheduler = priority_scheduler<>>
class rail_group {
public:
    /// Rail k's connection to the peer: made on a thread of the group's
    /// (the constructor's own for the first dial); throws on failure.
    using dial_fn = std::function<verbs::connection(std::size_t rail)>;
    using striper_type = basic_striper<Scheduler>;

    /// Dials every rail of `rails` (in this thread) and attaches those that
    /// connect; keep() dials the others again. Throws rdmax::error, naming
    /// each rail's failure, if none connects. The rails' devices must
    /// outlive the group (the set may be moved).
    rail_group(const verbs::rail_set& rails, dial_fn dial, rail_group_options o = {})
        : dial_(std::move(dial))
        , opts_(o)
        , watch_(rails)
        , slots_(rails.size())
        , striper_(opts_.stripe) {
        opts_.retry_min = std::max(opts_.retry_min, std::chrono::milliseconds(1));
        opts_.retry_max = std::max(opts_.retry_max, opts_.retry_min);
        std::string why;
        for (std::size_t k = 0; k < slots_.size(); ++k) {
            slot& s = slots_[k];
            s.address = rails[k].address;
            s.gbps = rails[k].gbps;
            try {
                bring_up(k, dial_both(k));
                s.joined_before = joined(k, clock::now());
            } catch (const std::exception& e) {
                failed(k, e.what(), clock::now());
            }
            if (!s.joined_before)
                why += fmt::format("{}rail {} ({}): {}", why.empty() ? "" : "; ", k, s.address,
                                   s.failure);
        }
        if (striper_.rails_up() == 0)
            throw error("rail_group: no rail connected", ENOTCONN, why.empty() ? "no rails" : why);
    }
    rail_group(const verbs::rail_set&&, dial_fn, rail_group_options = {}) = delete;
    rail_group(const rail_group&) = delete;
    rail_group& operator=(const rail_group&) = delete;
    /// Waits for a dial under way (at most its timeout, twice with lanes).
    ~rail_group() = default;

    [[nodiscard]] striper_type& striper() noexcept { return striper_; }
    [[nodiscard]] std::size_t size() const noexcept { return slots_.size(); }
    /// Rail k's connection now (nullptr while it has none).
    [[nodiscard]] verbs::connection* connection(std::size_t k) noexcept {
        return k < slots_.size() && slots_[k].conn ? slots_[k].conn.get() : nullptr;
    }
    /// Rail k's urgent lane's connection now (nullptr without lanes, or
    /// while it has none).
    [[nodiscard]] verbs::connection* lane_connection(std::size_t k) noexcept {
        return k < slots_.size() && slots_[k].lane_conn ? slots_[k].lane_conn.get() : nullptr;
    }
    [[nodiscard]] const rail_group_counters& counters() const noexcept { return counters_; }
    /// Why rail k's last dial failed ("" if it did not).
    [[nodiscard]] const std::string& last_failure(std::size_t k) const {
        return slots_.at(k).failure;
    }
    /// The devices' event descriptors: readable, keep() has work (see the top).
    [[nodiscard]] const std::vector<int>& fds() const noexcept { return watch_.fds(); }

    /// Port events, peers' disconnects, dials and returns (see the top of
    /// this header); never blocks. Returns how many rails it took out or
    /// brought back. Throws what making a rail's scheduler throws (that
    /// rail stays out and is dialed again after the delay).
    std::size_t keep() {
        std::size_t changed = 0;
        (void)watch_.poll([&](const verbs::port_watch::change& c) {
            if (c.up)
                return;
            slot& s = slots_.at(c.rail);
            ++s.epoch; // a dial under way or waiting is from before: dropped
            if (s.pending)
                dropped(c.rail, clock::now());
            if (striper_.rail_up(c.rail)) {
                striper_.rail_down(c.rail);
                ++counters_.port_downs;
                ++changed;
            }
        });
        const auto now = clock::now();
        for (std::size_t k = 0; k < slots_.size(); ++k) {
            slot& s = slots_[k];
            if (striper_.rail_up(k)) {
                const bool gone = (s.conn && s.conn->peer_disconnected()) ||
                                  (s.lane_conn && s.lane_conn->peer_disconnected());
                if (!gone)
                    continue;
                striper_.rail_down(k);
                ++counters_.peer_downs;
                ++changed;
            }
            if (s.up)
                went_out(k, now);
            if (s.pending) {
                if (attach_pending(k, now))
                    ++changed;
            } else if (s.dialing.valid()) {
                if (s.dialing.wait_for(std::chrono::seconds(0)) == std::future_status::ready &&
                    finish_dial(k, now))
                    ++changed;
            } else if (now >= s.retry_at && ready(k)) {
                s.dial_epoch = s.epoch;
                s.dialing = std::async(std::launch::async, [this, k] { return dial_both(k); });
                ++counters_.dials;
            }
        }
        return changed;
    }

private:
    using clock = std::chrono::steady_clock;
    /// What a dial of a rail makes: its connection, and its lane's.
    struct dialed {
        verbs::connection main;
        std::optional<verbs::connection> lane;
    };
    /// Rail k dialed (twice, with lanes). On the dial's thread.
    dialed dial_both(std::size_t k) {
        dialed d{dial_(k), std::nullopt};
        if (opts_.urgent_lane)
            d.lane.emplace(dial_(k));
        return d;
    }
    struct slot {
        std::string address; ///< the rail's (for errors)
        double gbps = 0;     ///< its weight until the striper measured one
        std::unique_ptr<verbs::connection> conn;
        std::unique_ptr<Scheduler> sched;
        std::unique_ptr<verbs::connection> lane_conn; ///< with urgent_lane
        std::unique_ptr<Scheduler> lane_sched;
        std::future<dialed> dialing;
        /// A dial made while the rail's old pieces were still out: attached
        /// once they are back.
        std::unique_ptr<dialed> pending;
        clock::time_point retry_at{};
        std::chrono::milliseconds backoff{};
        std::string failure;
        unsigned epoch = 0;      ///< the rail's port went down this many times
        unsigned dial_epoch = 0; ///< epoch when the dial under way began
        bool up = false;         ///< attached and up, as keep() last saw it
        bool joined_before = false;
        clock::time_point up_since{};
    };

    /// The port of rail k ready for a connection; a device that fails the
    /// query (gone, fatal) is not.
    [[nodiscard]] bool ready(std::size_t k) const noexcept {
        try {
            return watch_.ready(k);
        } catch (...) {
            return false;
        }
    }
    /// A dial of rail k failed (or what it made could not be used): why,
    /// and the next try after the delay, doubled.
    void failed(std::size_t k, std::string_view why, clock::time_point now) {
        slot& s = slots_[k];
        s.failure = why;
        s.backoff =
            s.backoff.count() == 0 ? opts_.retry_min : std::min(s.backoff * 2, opts_.retry_max);
        s.retry_at = now + s.backoff;
    }
    /// What rail k's dial made is of no use: its port went down meanwhile.
    void dropped(std::size_t k, clock::time_point now) {
        slots_[k].pending.reset();
        ++counters_.dial_failures;
        failed(k, "its port went down while it was dialed", now);
    }
    /// Rail k was seen out, after it was up: dialed at once once its port is
    /// ready if it had stayed up a while (retry_max), else after the delay,
    /// doubled (a peer that accepts and closes at once is not dialed in a loop).
    void went_out(std::size_t k, clock::time_point now) {
        slot& s = slots_[k];
        s.up = false;
        if (now - s.up_since >= opts_.retry_max) {
            s.backoff = {};
            s.retry_at = now;
        } else {
            failed(k, "it went out soon after it was attached", now);
        }
    }
    /// The dial of rail k ended: its connection attached (or kept until the
    /// rail is idle), or the failure noted and the next try set.
    bool finish_dial(std::size_t k, clock::time_point now) {
        slot& s = slots_[k];
        try {
            s.pending = std::make_unique<dialed>(s.dialing.get());
        } catch (const std::exception& e) {
            ++counters_.dial_failures;
            failed(k, e.what(), now);
            return false;
        } catch (...) {
            ++counters_.dial_failures;
            failed(k, "the dial threw something other than an exception", now);
            return false;
        }
        if (s.dial_epoch != s.epoch) {
            dropped(k, now); // the port went down and up while it dialed
            return false;
        }
        return attach_pending(k, now);
    }
    bool attach_pending(std::size_t k, clock::time_point now) {
        slot& s = slots_[k];
        if (!ready(k)) {
            dropped(k, now);
            return false;
        }
        if (!striper_.rail_idle(k))
            return false; // keep() comes back: the dial is not redone
        const std::unique_ptr<dialed> c = std::move(s.pending);
        try {
            bring_up(k, std::move(*c));
        } catch (const std::exception& e) {
            ++counters_.dial_failures;
            failed(k, e.what(), now);
            throw;
        }
        if (!joined(k, now)) {
            ++counters_.dial_failures;
            return false;
        }
        ++(s.joined_before ? counters_.rejoins : counters_.late_joins);
        s.joined_before = true;
        return true;
    }
    /// Rail k on the connections of `d`: a scheduler on each, attached;
    /// the old connections and schedulers go once the striper no longer
    /// names them.
    void bring_up(std::size_t k, dialed d) {
        slot& s = slots_[k];
        auto conn = std::make_unique<verbs::connection>(std::move(d.main));
        auto sched = std::make_unique<Scheduler>(conn->qp(), opts_.sched);
        std::unique_ptr<verbs::connection> lane_conn;
        std::unique_ptr<Scheduler> lane_sched;
        if (d.lane) {
            lane_conn = std::make_unique<verbs::connection>(std::move(*d.lane));
            lane_sched = std::make_unique<Scheduler>(lane_conn->qp(), opts_.sched);
        }
        if (!striper_.attach(k, *sched, s.gbps, lane_sched.get()))
            throw error("rail_group: attach", EBUSY, fmt::format("rail {} has pieces out", k));
        s.sched = std::move(sched);
        s.conn = std::move(conn);
        s.lane_sched = std::move(lane_sched);
        s.lane_conn = std::move(lane_conn);
    }
    /// After bring_up: rail k up (the striper uses it), or noted as a
    /// failure (attached, its queue pair not ready to send): dialed again
    /// after the delay.
    bool joined(std::size_t k, clock::time_point now) {
        slot& s = slots_[k];
        if (!striper_.rail_up(k)) {
            failed(k, "attached, but its queue pair was not ready to send", now);
            return false;
        }
        s.up = true;
        s.up_since = now;
        s.failure.clear();
        return true;
    }

    dial_fn dial_;
    rail_group_options opts_;
    verbs::port_watch watch_;
    /// Before the striper: it goes first, while the schedulers it names are
    /// still there; a dial under way is waited for after it (it uses dial_).
    std::vector<slot> slots_;
    striper_type striper_;
    rail_group_counters counters_;
};

} // namespace rdmax::sched
