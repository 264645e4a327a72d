#pragma once
// The bodies of basic_striper's members (basic_striper.hpp holds the class,
// what it promises and its API; this file, how it keeps that). Included at
// the end of basic_striper.hpp; including it alone includes that first.

#include <algorithm>

#include <rdmax/sched/basic_striper.hpp>

namespace rdmax::sched {

template <class Scheduler>
basic_striper<Scheduler>::basic_striper(stripe_options opts)
    : opts_(opts)
    , transfers_(std::max<std::uint32_t>(opts.max_requests, 1))
    // A whole transfer has one piece; a striped one, chunks_ahead per rail,
    // as many again coming back from a failed rail while the others take theirs.
    , pieces_(transfers_.size() + 2 * max_rails * (std::size_t{opts.chunks_ahead} + 1)) {
    opts_.chunks_ahead = std::max<std::uint32_t>(opts_.chunks_ahead, 1);
    opts_.chunk = std::clamp<std::uint64_t>(opts_.chunk, 4096, std::uint64_t{1} << 30);
    opts_.stripe_min = std::clamp<std::uint64_t>(opts_.stripe_min, 1, UINT32_MAX);
    for (transfer& t : transfers_)
        free_transfers_.push_front(t);
    for (piece& p : pieces_)
        free_pieces_.push_front(p);
}

template <class Scheduler>
basic_striper<Scheduler>::~basic_striper() {
    // The lists link into the pools; unhook before the pools go.
    for (transfer& t : transfers_)
        t.again.clear();
    free_transfers_.clear();
    free_pieces_.clear();
    for (level_queue& q : queues_)
        q.clear();
    order_.clear();
    done_.clear();
}

// ---- rails ----------------------------------------------------------------------------------

template <class Scheduler>
bool basic_striper<Scheduler>::attach(std::size_t k, Scheduler& s, double gbps,
                                      Scheduler* lane) noexcept {
    if (k >= max_rails || rails_[k].pieces != 0 || lane == &s)
        return false;
    // A scheduler is one queue pair's: shared with another rail (or its
    // lane), its completions would be taken for that rail's and lost.
    for (std::size_t j = 0; j < max_rails; ++j) {
        const rail& o = rails_[j];
        if (j != k &&
            (o.s == &s || o.lane == &s || (lane != nullptr && (o.s == lane || o.lane == lane))))
            return false;
    }
    rail& r = rails_[k];
    const bool was_out = r.s != nullptr && !r.up;
    r.s = &s;
    r.lane = lane;
    r.lane_bytes = 0;
    r.gbps = std::clamp(gbps, 1e-3, 1e6); // a weight: finite, positive (not NaN: clamp keeps it)
    if (!(r.gbps > 0))
        r.gbps = 1;
    r.bytes_out = 0;
    r.up = true;
    each_queue_pair(r, [&](Scheduler& x) {
        r.up = r.up && x.port().ready() && !x.failed();
        x.host_away(std::chrono::nanoseconds(0)); // until a round over the rails is timed
    });
    if (was_out && r.up)
        ++counters_.rejoins;
    return true;
}

template <class Scheduler>
void basic_striper<Scheduler>::rail_down(std::size_t k) noexcept {
    if (k >= max_rails || rails_[k].s == nullptr)
        return;
    if (rails_[k].up)
        take_out(k, IBV_WC_WR_FLUSH_ERR);
    // Its queue pairs to the error state: what they hold comes back
    // flushed now, not after the transport's retries.
    each_queue_pair(rails_[k], [](Scheduler& x) { x.port().fail(); });
}

template <class Scheduler>
void basic_striper<Scheduler>::take_out(std::size_t k, ibv_wc_status why) noexcept {
    // A transfer's own failure (a key the peer refused) broke this rail's
    // queue pair too; others that find no rail left are told of a flush.
    if (!rail_status(why))
        why = IBV_WC_WR_FLUSH_ERR;
    rails_[k].up = false;
    ++counters_.failovers;
    // A rail with a lane is out as a whole: its other queue pair fails too,
    // so that its pieces come back flushed now, not after its transport's
    // retries against a peer that may be gone.
    if (rails_[k].lane != nullptr)
        each_queue_pair(rails_[k], [](Scheduler& x) { x.port().fail(); });
    if (why != IBV_WC_WR_FLUSH_ERR || last_rail_failure_ == IBV_WC_SUCCESS)
        last_rail_failure_ = why;
}

template <class Scheduler>
std::uint8_t basic_striper<Scheduler>::live_mask() const noexcept {
    std::uint8_t m = 0;
    for (std::size_t k = 0; k < max_rails; ++k)
        if (rails_[k].up)
            m = static_cast<std::uint8_t>(m | (1U << k));
    return m;
}

template <class Scheduler>
std::uint8_t basic_striper<Scheduler>::attached_mask() const noexcept {
    std::uint8_t m = 0;
    for (std::size_t k = 0; k < max_rails; ++k)
        if (rails_[k].s != nullptr)
            m = static_cast<std::uint8_t>(m | (1U << k));
    return m;
}

template <class Scheduler>
double basic_striper<Scheduler>::weight(std::size_t k) const noexcept {
    const rail& r = rails_[k];
    if (r.s != nullptr) {
        const auto measured = r.s->counters().rate_mb_per_s;
        if (measured > 0)
            return static_cast<double>(measured);
    }
    return r.gbps * 125.0; // Gb/s in MB/s
}

template <class Scheduler>
std::size_t basic_striper<Scheduler>::least_loaded(priority p, std::uint8_t mask) const noexcept {
    std::size_t best = max_rails;
    double best_load = 0;
    for (std::size_t k = 0; k < max_rails; ++k) {
        if (!rails_[k].up || ((mask >> k) & 1U) == 0)
            continue;
        // What a request of priority p waits for there: the bytes on the
        // wire, and the pieces of its level or more urgent ones (its
        // scheduler lets it overtake the others). In a rail's urgent lane,
        // the lane's bytes alone: the NIC interleaves the two queue pairs.
        const rail& r = rails_[k];
        std::uint64_t ahead = 0;
        if (r.lane != nullptr && p.level < opts_.lane_levels) {
            ahead = r.lane->counters().in_flight_bytes + r.lane_bytes;
        } else {
            ahead = r.s->counters().in_flight_bytes;
            for (std::size_t l = 0; l <= p.level && l < priority_levels; ++l)
                ahead += r.bytes_at[l];
        }
        const double load = static_cast<double>(ahead) / weight(k);
        if (best == max_rails || load < best_load) {
            best = k;
            best_load = load;
        }
    }
    return best;
}

// ---- submission -----------------------------------------------------------------------------

template <class Scheduler>
status basic_striper<Scheduler>::submit(priority p, ibv_wr_opcode op, std::byte* local,
                                        std::uint64_t local_length,
                                        const std::array<std::uint32_t, max_rails>& lkey,
                                        std::uint64_t remote_addr, std::uint64_t remote_length,
                                        const std::array<std::uint32_t, max_rails>& rkey,
                                        std::uint32_t keyed_rails, std::uint64_t remote_offset,
                                        std::uint64_t wr_id, request_flags f) noexcept {
    if (p.level >= priority_levels)
        return status::out_of_range;
    if (local_length == 0)
        return status::zero_length;
    if (remote_offset > remote_length || local_length > remote_length - remote_offset ||
        remote_addr + remote_length < remote_addr)
        return status::out_of_range;
    const auto mask =
        static_cast<std::uint8_t>((1U << std::min<std::uint32_t>(keyed_rails, max_rails)) - 1U);
    if (mask == 0)
        return status::not_permitted; // keys for no rail
    if ((mask & live_mask()) == 0)
        return status::qp_failed;
    if (free_transfers_.empty())
        return status::queue_full;
    transfer& t = free_transfers_.front();
    free_transfers_.pop_front();
    t.op = op;
    t.local = local;
    t.length = local_length;
    t.lkey = lkey;
    t.remote_addr = remote_addr;
    t.remote_length = remote_length;
    t.remote_offset = remote_offset;
    t.rkey = rkey;
    t.wr_id = wr_id;
    t.cut = 0;
    t.confirmed = 0;
    t.tail_from = 0;
    t.tail_weight = 0;
    t.out = 0;
    t.result = IBV_WC_SUCCESS;
    t.mask = mask;
    t.loc_qp_rails = 0;
    t.prio = p;
    t.flags = f;
    t.whole = local_length < opts_.stripe_min;
    t.fed = false;
    t.queued = true;
    queues_[p.level].push_back(t);
    order_.push_back(t);
    ++live_;
    ++counters_.requests;
    feed();
    return status::ok;
}

template <class Scheduler>
bool basic_striper<Scheduler>::cancel(std::uint64_t wr_id) noexcept {
    for (transfer& t : order_) {
        if (t.wr_id != wr_id || t.fed)
            continue;
        drop_unsent(t); // pieces cut and refused by a scheduler wait in `again`
        order_.erase(order_.iterator_to(t));
        --live_;
        release(t);
        return true;
    }
    return false;
}

// ---- handing out pieces ---------------------------------------------------------------------

template <class Scheduler>
bool basic_striper<Scheduler>::startable(const transfer& t) const noexcept {
    return !t.flags.fence || &order_.front() == &t;
}

template <class Scheduler>
void basic_striper<Scheduler>::unqueue(transfer& t) noexcept {
    if (!t.queued)
        return;
    level_queue& q = queues_[t.prio.level];
    q.remove_if([&](const transfer& x) { return &x == &t; });
    t.queued = false;
}

template <class Scheduler>
std::uint64_t basic_striper<Scheduler>::cut_length(transfer& t, std::size_t k) noexcept {
    const std::uint64_t left = t.length - t.cut;
    if (t.whole)
        return left;
    if (t.tail_from == 0) {
        // Once what is left fits one chunk per live rail, the last pieces are
        // sized by the rails' rates so that they end together.
        double sum = 0;
        std::uint64_t live = 0;
        for (std::size_t j = 0; j < max_rails; ++j)
            if (rails_[j].up) {
                sum += weight(j);
                ++live;
            }
        if (left <= opts_.chunk * live) {
            t.tail_from = left;
            t.tail_weight = sum;
        }
    }
    std::uint64_t len = opts_.chunk;
    if (t.tail_from != 0 && t.tail_weight > 0) {
        const auto share = static_cast<std::uint64_t>(static_cast<double>(t.tail_from) * weight(k) /
                                                      t.tail_weight);
        len = std::max<std::uint64_t>((share + 4095) / 4096 * 4096, 4096);
    }
    return std::min({len, left, opts_.chunk});
}

template <class Scheduler>
typename basic_striper<Scheduler>::transfer*
basic_striper<Scheduler>::next_transfer(bool whole, std::size_t k) noexcept {
    for (level_queue& q : queues_)
        for (transfer& t : q)
            if (t.whole == whole && startable(t) && (k == max_rails || ((t.mask >> k) & 1U) != 0))
                return &t;
    return nullptr;
}

template <class Scheduler>
typename basic_striper<Scheduler>::piece*
basic_striper<Scheduler>::take_piece(transfer& t, std::size_t k) noexcept {
    piece* pc = nullptr;
    if (!t.again.empty()) {
        pc = &t.again.front();
        t.again.pop_front();
    } else {
        if (free_pieces_.empty())
            return nullptr;
        pc = &free_pieces_.front();
        free_pieces_.pop_front();
        pc->owner = &t;
        pc->offset = t.cut;
        pc->length = static_cast<std::uint32_t>(cut_length(t, k));
        pc->retry = false;
        t.cut += pc->length;
    }
    if (t.again.empty() && t.cut == t.length)
        unqueue(t);
    return pc;
}

template <class Scheduler>
bool basic_striper<Scheduler>::send_piece(piece& pc, std::size_t k) noexcept {
    transfer& t = *pc.owner;
    rail& r = rails_[k];
    const std::uint64_t id = id_of(pc);
    request_flags f = t.flags;
    f.fence = false;   // the striper orders fenced transfers itself
    f.signaled = true; // it needs every piece's completion
    const bool lane = r.lane != nullptr && lane_transfer(t);
    Scheduler& s = lane ? *r.lane : *r.s;
    status st = status::ok;
    if (t.op == IBV_WR_RDMA_WRITE)
        st = s.write(
            t.prio, local_buffer<rights::local_read>{t.local + pc.offset, pc.length, t.lkey[k]},
            remote_buffer<rights::remote_write>{t.remote_addr, t.remote_length, t.rkey[k], 0},
            t.remote_offset + pc.offset, id, f);
    else
        st = s.read(
            t.prio, local_buffer<rights::local_write>{t.local + pc.offset, pc.length, t.lkey[k]},
            remote_buffer<rights::remote_read>{t.remote_addr, t.remote_length, t.rkey[k], 0},
            t.remote_offset + pc.offset, id, f);
    if (st == status::ok) {
        pc.rail = static_cast<std::uint8_t>(k);
        pc.in_rail = true;
        pc.in_lane = lane;
        if (lane) {
            r.lane_bytes += pc.length;
            ++counters_.lane_pieces;
        }
        pc.fed = ++fed_;
        ++t.out;
        t.fed = true;
        ++r.pieces;
        r.striped += t.whole ? 0U : 1U;
        r.bytes_out += pc.length;
        r.bytes_at[t.prio.level] += pc.length;
        ++counters_.chunks;
        if (pc.retry)
            ++counters_.reposts;
        pc.retry = false;
        return true;
    }
    // Not taken: the piece waits in its transfer for the next pass.
    send_again(pc);
    if (st == status::qp_failed || st == status::not_connected) {
        take_out(k, IBV_WC_WR_FLUSH_ERR);
    } else if (st != status::queue_full) {
        // The striper checked the range; a scheduler that refuses it for
        // another reason would refuse it on every rail.
        t.result = IBV_WC_LOC_PROT_ERR;
        drop_unsent(t);
        finish_if_done(t);
    }
    return false;
}

template <class Scheduler>
void basic_striper<Scheduler>::feed() noexcept {
    if (live_mask() != attached_mask())
        fail_unsendable();
    // Whole transfers: each to the rail where it waits least, whatever it holds.
    while (transfer* t = next_transfer(true, max_rails)) {
        const std::size_t k = least_loaded(t->prio, t->mask);
        if (k == max_rails)
            break;
        piece* pc = take_piece(*t, k);
        if (pc == nullptr || !send_piece(*pc, k))
            break;
    }
    // Striped ones: a piece to each rail with room, in turn.
    for (bool more = true; more;) {
        more = false;
        for (std::size_t k = 0; k < max_rails; ++k) {
            if (!rails_[k].up || rails_[k].striped >= opts_.chunks_ahead)
                continue;
            transfer* t = next_transfer(false, k);
            piece* pc = t != nullptr ? take_piece(*t, k) : nullptr;
            if (pc == nullptr) {
                steal();
                return;
            }
            if (send_piece(*pc, k))
                more = true;
        }
    }
    if (live_mask() != attached_mask()) // a rail refused its piece: failed
        fail_unsendable();
}

template <class Scheduler>
void basic_striper<Scheduler>::steal() noexcept {
    // Nothing is left to hand out, so the rails end the transfers with what
    // they hold: a rail that ran dry while another holds two pieces would
    // idle for a piece's time (a chunk: 168 us at 100 Gb/s) at every
    // transfer's end. Only a piece its scheduler has not started can move
    // (cancel() says so), and only to a rail where it ends sooner.
    for (std::size_t k = 0; k < max_rails; ++k) {
        rail& to = rails_[k];
        if (!to.up || to.striped >= opts_.chunks_ahead)
            continue;
        std::size_t from = max_rails;
        double latest = 0;
        for (std::size_t j = 0; j < max_rails; ++j) {
            const rail& r = rails_[j];
            if (j == k || !r.up || r.striped < 2)
                continue;
            const double finish = static_cast<double>(r.bytes_out) / weight(j);
            if (from == max_rails || finish > latest) {
                from = j;
                latest = finish;
            }
        }
        if (from == max_rails)
            continue;
        piece* last = nullptr;
        for (piece& pc : pieces_)
            if (pc.in_rail && !pc.in_lane && pc.rail == from && !pc.owner->whole &&
                ((pc.owner->mask >> k) & 1U) != 0 && pc.owner->result == IBV_WC_SUCCESS &&
                (last == nullptr || pc.fed > last->fed))
                last = &pc;
        if (last == nullptr)
            continue;
        const double here = static_cast<double>(to.bytes_out + last->length) / weight(k);
        if (here >= latest)
            continue;
        if (!scheduler_of(*last).cancel(id_of(*last)))
            continue; // under way: it ends where it is
        unbook(*last);
        --last->owner->out;
        ++counters_.steals;
        // Refused: back in its transfer's `again` (which then has bytes to
        // send: it is not done), or its transfer failed and finished there.
        (void)send_piece(*last, k);
    }
}

template <class Scheduler>
void basic_striper<Scheduler>::send_again(piece& pc) noexcept {
    transfer& t = *pc.owner;
    t.again.push_front(pc);
    if (!t.queued) {
        queues_[t.prio.level].push_back(t);
        t.queued = true;
    }
}

template <class Scheduler>
void basic_striper<Scheduler>::drop_unsent(transfer& t) noexcept {
    while (!t.again.empty()) {
        piece& pc = t.again.front();
        t.again.pop_front();
        free_pieces_.push_front(pc);
    }
    t.cut = t.length;
    unqueue(t);
}

template <class Scheduler>
void basic_striper<Scheduler>::fail_unsendable() noexcept {
    const ibv_wc_status why =
        last_rail_failure_ == IBV_WC_SUCCESS ? IBV_WC_WR_FLUSH_ERR : last_rail_failure_;
    const std::uint8_t live = live_mask();
    for (level_queue& q : queues_) {
        for (auto it = q.begin(); it != q.end();) {
            transfer& t = *it++; // unqueued below: the iterator is past it
            if ((t.mask & live) != 0)
                continue;
            if (t.result == IBV_WC_SUCCESS)
                t.result = why;
            drop_unsent(t);
            finish_if_done(t);
        }
    }
}

// ---- completions ----------------------------------------------------------------------------

template <class Scheduler>
void basic_striper<Scheduler>::unbook(piece& pc) noexcept {
    rail& r = rails_[pc.rail];
    const transfer& t = *pc.owner;
    pc.in_rail = false;
    if (pc.in_lane)
        r.lane_bytes -= pc.length;
    pc.in_lane = false;
    --r.pieces;
    r.striped -= t.whole ? 0U : 1U;
    r.bytes_out -= pc.length;
    r.bytes_at[t.prio.level] -= pc.length;
}

template <class Scheduler>
void basic_striper<Scheduler>::withdraw(transfer& t) noexcept {
    for (piece& pc : pieces_) {
        if (!pc.in_rail || pc.owner != &t)
            continue;
        if (!scheduler_of(pc).cancel(id_of(pc)))
            continue; // under way: it completes, in error or not
        unbook(pc);
        --t.out;
        free_pieces_.push_front(pc);
    }
}

template <class Scheduler>
bool basic_striper<Scheduler>::piece_done(std::size_t k, bool lane, std::uint64_t wr_id,
                                          ibv_wc_status st) noexcept {
    const std::uint64_t index = wr_id & ~tag_mask;
    if (index >= pieces_.size() || !pieces_[index].in_rail || pieces_[index].rail != k ||
        pieces_[index].in_lane != lane)
        return false; // the caller's wr_id with our tag: theirs
    piece& pc = pieces_[index];
    transfer& t = *pc.owner;
    unbook(pc);
    --t.out;
    if (st == IBV_WC_LOC_QP_OP_ERR)
        t.loc_qp_rails = static_cast<std::uint8_t>(t.loc_qp_rails | (1U << k));
    if (st == IBV_WC_SUCCESS) {
        t.confirmed += pc.length;
        counters_.rail_bytes[k] += pc.length;
        free_pieces_.push_front(pc);
    } else if (rail_failure(st, t, k) && t.result == IBV_WC_SUCCESS) {
        // Its rail failed under it: the same bytes go again on another.
        if (rails_[k].up)
            take_out(k, st);
        pc.retry = true;
        send_again(pc);
    } else {
        if (t.result == IBV_WC_SUCCESS)
            t.result = st;
        free_pieces_.push_front(pc);
        drop_unsent(t);
        withdraw(t);
    }
    finish_if_done(t);
    return true;
}

template <class Scheduler>
void basic_striper<Scheduler>::finish_if_done(transfer& t) noexcept {
    if (t.out != 0)
        return;
    if (t.result == IBV_WC_SUCCESS && t.confirmed != t.length)
        return;
    drop_unsent(t);
    order_.erase(order_.iterator_to(t));
    --live_;
    if (t.result == IBV_WC_SUCCESS)
        ++counters_.completed;
    else
        ++counters_.failed;
    if (t.result != IBV_WC_SUCCESS || t.flags.signaled)
        done_.push_back(t);
    else
        release(t);
}

template <class Scheduler>
void basic_striper<Scheduler>::release(transfer& t) noexcept {
    free_transfers_.push_front(t);
}

template <class Scheduler>
std::size_t basic_striper<Scheduler>::first_to_poll() const noexcept {
    // The rail of the most urgent piece out first (its completion is the
    // one a caller waits for most), then the others in turn.
    std::size_t first = next_rail_;
    std::size_t most_urgent = priority_levels;
    for (std::size_t j = 0; j < max_rails; ++j)
        for (std::size_t l = 0; l < most_urgent; ++l)
            if (rails_[j].bytes_at[l] != 0) {
                most_urgent = l;
                first = j;
                break;
            }
    return first;
}

template <class Scheduler>
std::size_t basic_striper<Scheduler>::poll_rail(std::size_t j, std::span<verbs::completion> out,
                                                std::size_t k) noexcept {
    rail& r = rails_[j];
    take_out_if_failed(j);
    // The lane first: its completions are the ones callers wait for most.
    // An idle one is not polled: an empty poll costs the host as much as
    // a completion, and this thread's round is what the rails wait for.
    if (r.lane != nullptr && r.lane->outstanding() != 0)
        k = poll_part(j, true, out, k);
    k = poll_part(j, false, out, k);
    take_out_if_failed(j);
    return k;
}

template <class Scheduler>
void basic_striper<Scheduler>::take_out_if_failed(std::size_t j) noexcept {
    rail& r = rails_[j];
    const Scheduler* f = failed_part(j);
    if (!r.up || f == nullptr)
        return;
    take_out(j, f->failure());
}

template <class Scheduler>
std::size_t basic_striper<Scheduler>::poll_part(std::size_t j, bool lane,
                                                std::span<verbs::completion> out,
                                                std::size_t k) noexcept {
    Scheduler& s = lane ? *rails_[j].lane : *rails_[j].s;
    // Until the scheduler has nothing to hand back: a call that hands back
    // finished requests posts nothing (basic_priority_scheduler::poll), and
    // a finished piece is no reason to leave its rail's link idle. No more
    // at a time than the caller has room for: a completion that is not ours
    // goes straight to it.
    for (int round = 0; round < 8 && k < out.size(); ++round) {
        std::array<verbs::completion, 16> wc;
        const std::size_t room = std::min(wc.size(), out.size() - k);
        const int n = s.poll(std::span(wc.data(), room));
        for (int x = 0; x < n; ++x) {
            const verbs::completion& c = wc[static_cast<std::size_t>(x)];
            const bool ours =
                (c.wr_id & tag_mask) == piece_tag && piece_done(j, lane, c.wr_id, c.status);
            if (!ours) {
                out[k++] = c;
                ++counters_.foreign;
            }
        }
        if (n == 0)
            break;
    }
    return k;
}

template <class Scheduler>
void basic_striper<Scheduler>::note_round(std::chrono::nanoseconds round) noexcept {
    // One rail: a thread of its own, as far as its scheduler is concerned.
    const auto ns = attached() > 1 ? static_cast<double>(round.count()) : 0.0;
    away_ns_ = away_ns_ == 0 || ns == 0 ? ns : (7 * away_ns_ + ns) / 8;
    const auto away = std::chrono::nanoseconds(static_cast<std::int64_t>(away_ns_));
    for (rail& r : rails_)
        each_queue_pair(r, [&](Scheduler& x) { x.host_away(away); });
}

template <class Scheduler>
int basic_striper<Scheduler>::poll(std::span<verbs::completion> out) noexcept {
    using fine_clock = typename Scheduler::fine_clock;
    // Every 16th call, with two rails or more, times one round over the
    // rails: how long a rail's scheduler waits for the host to come back
    // (host_away()).
    const bool timed = ++polls_ % 16 == 0;
    const auto began = timed ? fine_clock::now() : typename fine_clock::time_point{};
    std::size_t k = 0;
    const std::size_t first = first_to_poll();
    for (std::size_t i = 0; i < max_rails && k < out.size(); ++i) {
        const std::size_t j = (first + i) % max_rails;
        if (rails_[j].s != nullptr)
            k = poll_rail(j, out, k);
    }
    if (timed)
        note_round(std::chrono::duration_cast<std::chrono::nanoseconds>(fine_clock::now() - began));
    next_rail_ = (next_rail_ + 1) % max_rails;
    feed();
    while (!done_.empty() && k < out.size()) {
        transfer& t = done_.front();
        done_.pop_front();
        verbs::completion c;
        c.wr_id = t.wr_id;
        c.status = t.result;
        c.opcode = t.op == IBV_WR_RDMA_WRITE ? IBV_WC_RDMA_WRITE : IBV_WC_RDMA_READ;
        out[k++] = c;
        release(t);
    }
    return static_cast<int>(k);
}

template <class Scheduler>
int basic_striper<Scheduler>::wait(std::span<verbs::completion> out,
                                   std::chrono::microseconds timeout) noexcept {
    using clock = typename Scheduler::clock;
    const auto deadline = clock::now() + timeout;
    for (std::uint32_t spins = 1;; ++spins) {
        const int n = poll(out);
        if (n != 0)
            return n;
        bool busy = live_ != 0 || !done_.empty();
        for (const rail& r : rails_)
            each_queue_pair(r, [&](Scheduler& x) { busy = busy || x.outstanding() != 0; });
        if (!busy)
            return 0;
        if (spins % 64 == 0 && clock::now() >= deadline)
            return 0;
    }
}

template <class Scheduler>
void basic_striper<Scheduler>::flush() noexcept {
    for (rail& r : rails_)
        if (r.up)
            each_queue_pair(r, [](Scheduler& x) { x.flush(); });
}

} // namespace rdmax::sched
