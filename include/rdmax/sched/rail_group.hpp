#pragma once
// rdmax::sched::rail_group: a basic_striper over a rail_set's rails that keeps
// them connected. It owns each rail's connection and scheduler, and keep()
// does what a rail's failure and return need (issue 31, failover):
//
//   - a rail's PORT_ERR or DEVICE_FATAL (verbs::port_watch) takes it out at
//     once (basic_striper::rail_down), before its work fails; a rail whose
//     work failed without a port event (a link down at the peer's end, a peer
//     gone) the striper takes out by itself;
//   - a rail that is out is dialed again once its port is ready (ACTIVE, its
//     GID back), on a thread of its own: the dial blocks (address and route
//     resolution, the handshake) and the data path must not. A failed dial is
//     tried again after a delay that doubles, from retry_min to retry_max;
//   - once the new connection is made and none of the rail's old pieces is
//     out, keep() makes its scheduler and attaches it: the rail carries
//     pieces again. The old connection and scheduler go then.
//
//     verbs::rail_set rails = verbs::rail_set::discover();
//     sched::rail_group<> group(rails, [&](std::size_t k) {
//         return rails.connect(k, peer_address[k], port); // rail k to the peer's rail k
//     });
//     group.striper().write(sched::bulk, src, dst, 0, id);
//     for (;;) { group.striper().poll(done); group.keep(); } // keep(): every ms or so
//
// The passive end accepts on each rail's listener again (a dial is a new
// connection; the old one's queue pair failed with the link). keep() reads
// the devices' event descriptors (a system call each): call it from the
// loop now and then (the failed work takes the rail out meanwhile), or when
// fds() is readable. One thread: the group, its striper and keep(). The dial
// runs on another thread: it must use nothing the polling thread changes.

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
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
    /// The delay before a failed dial is tried again, doubled at each
    /// failure up to retry_max (a peer whose link is still down).
    std::chrono::milliseconds retry_min{200};
    std::chrono::milliseconds retry_max{5000};
};

/// What keep() has done.
struct rail_group_counters {
    std::uint64_t port_downs = 0;    ///< rails taken out at a port event
    std::uint64_t dials = 0;         ///< dials started after a rail went out
    std::uint64_t dial_failures = 0; ///< of those, failed (tried again later)
    std::uint64_t rejoins = 0;       ///< rails attached again
};

template <class Scheduler = priority_scheduler<>>
class rail_group {
public:
    /// Rail k's connection to the peer: made on a thread of the group's
    /// (the constructor's own for the first dial); throws on failure.
    using dial_fn = std::function<verbs::connection(std::size_t rail)>;
    using striper_type = basic_striper<Scheduler>;

    /// Dials every rail of `rails` (in this thread) and attaches those that
    /// connect; the others are dialed again by keep(). Throws rdmax::error,
    /// naming each rail's failure, if none connects. `rails` must outlive
    /// the group.
    rail_group(const verbs::rail_set& rails, dial_fn dial, rail_group_options o = {})
        : rails_(rails)
        , dial_(std::move(dial))
        , opts_(o)
        , watch_(rails)
        , slots_(rails.size())
        , striper_(opts_.stripe) {
        std::string why;
        for (std::size_t k = 0; k < slots_.size(); ++k) {
            try {
                bring_up(k, dial_(k));
            } catch (const std::exception& e) {
                why += fmt::format("{}rail {} ({}): {}", why.empty() ? "" : "; ", k,
                                   rails_[k].address, e.what());
                slots_[k].failure = e.what();
                slots_[k].retry_at = clock::now() + opts_.retry_min;
                slots_[k].backoff = opts_.retry_min;
            }
        }
        if (striper_.rails_up() == 0)
            throw error("rail_group: no rail connected", ENOTCONN, why.empty() ? "no rails" : why);
    }
    rail_group(const verbs::rail_set&&, dial_fn, rail_group_options = {}) = delete;
    rail_group(const rail_group&) = delete;
    rail_group& operator=(const rail_group&) = delete;
    /// Waits for a dial under way (at most its own timeout).
    ~rail_group() = default;

    [[nodiscard]] striper_type& striper() noexcept { return striper_; }
    [[nodiscard]] const verbs::rail_set& rails() const noexcept { return rails_; }
    /// Rail k's connection now (nullptr while it has none).
    [[nodiscard]] verbs::connection* connection(std::size_t k) noexcept {
        return k < slots_.size() && slots_[k].conn ? slots_[k].conn.get() : nullptr;
    }
    [[nodiscard]] const rail_group_counters& counters() const noexcept { return counters_; }
    /// Why rail k's last dial failed ("" if it did not).
    [[nodiscard]] const std::string& last_failure(std::size_t k) const {
        return slots_.at(k).failure;
    }
    /// The devices' event descriptors: keep() has work when one is readable.
    [[nodiscard]] const std::vector<int>& fds() const noexcept { return watch_.fds(); }

    /// Port events, dials and returns (see the top of this header); never
    /// blocks. Returns how many rails it took out or brought back. Throws
    /// what making a rail's scheduler throws (the rail stays out, and is
    /// dialed again at the next call).
    std::size_t keep() {
        std::size_t changed = 0;
        (void)watch_.poll([&](const verbs::port_watch::change& c) {
            if (!c.up && striper_.rail_up(c.rail)) {
                striper_.rail_down(c.rail);
                ++counters_.port_downs;
                ++changed;
            }
        });
        const auto now = clock::now();
        for (std::size_t k = 0; k < slots_.size(); ++k) {
            slot& s = slots_[k];
            if (striper_.rail_up(k))
                continue;
            if (s.pending) {
                if (attach_pending(k))
                    ++changed;
            } else if (s.dialing.valid()) {
                if (s.dialing.wait_for(std::chrono::seconds(0)) != std::future_status::ready)
                    continue;
                if (finish_dial(k, now))
                    ++changed;
            } else if (now >= s.retry_at && watch_.ready(k)) {
                ++counters_.dials;
                s.dialing = std::async(std::launch::async, [this, k] { return dial_(k); });
            }
        }
        return changed;
    }

private:
    using clock = std::chrono::steady_clock;
    struct slot {
        std::unique_ptr<verbs::connection> conn;
        std::unique_ptr<Scheduler> sched;
        std::future<verbs::connection> dialing;
        /// A dial made while the rail's old pieces were still out: attached
        /// once they are back.
        std::unique_ptr<verbs::connection> pending;
        clock::time_point retry_at{};
        std::chrono::milliseconds backoff{};
        std::string failure;
    };

    /// The dial of rail k ended: its connection attached (or kept until the
    /// rail is idle), or the failure noted and the next try set.
    bool finish_dial(std::size_t k, clock::time_point now) {
        slot& s = slots_[k];
        try {
            s.pending = std::make_unique<verbs::connection>(s.dialing.get());
        } catch (const std::exception& e) {
            s.failure = e.what();
            ++counters_.dial_failures;
            s.backoff = s.backoff.count() == 0
                            ? opts_.retry_min
                            : std::min<std::chrono::milliseconds>(s.backoff * 2, opts_.retry_max);
            s.retry_at = now + s.backoff;
            return false;
        }
        if (!watch_.ready(k)) {
            s.pending.reset(); // the port went down again while it dialed: once it is back
            return false;
        }
        return attach_pending(k);
    }
    bool attach_pending(std::size_t k) {
        slot& s = slots_[k];
        if (!striper_.rail_idle(k))
            return false; // keep() comes back: the dial is not redone
        const std::unique_ptr<verbs::connection> c = std::move(s.pending);
        bring_up(k, std::move(*c));
        ++counters_.rejoins;
        return true;
    }
    /// Rail k on connection c: a scheduler on it, attached; the old
    /// connection and scheduler go once the striper no longer names them.
    void bring_up(std::size_t k, verbs::connection c) {
        slot& s = slots_[k];
        auto conn = std::make_unique<verbs::connection>(std::move(c));
        auto sched = std::make_unique<Scheduler>(conn->qp(), opts_.sched);
        if (!striper_.attach(k, *sched, rails_[k].gbps))
            throw error("rail_group: attach", EBUSY, fmt::format("rail {} has pieces out", k));
        s.sched = std::move(sched);
        s.conn = std::move(conn);
        s.failure.clear();
        s.backoff = {};
    }

    const verbs::rail_set& rails_;
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
