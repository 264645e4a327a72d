#pragma once
// The bodies of rdmax::rpc::detail::async_state (include/rdmax/asio/client.hpp).

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <memory>

// Asio's own code, inlined here, trips GCC's -Wnull-dereference (its thread call
// stack lookups): not this project's to fix.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference"
#include <asio/error.hpp>
#include <asio/post.hpp>
#pragma GCC diagnostic pop

#include <rdmax/asio/client.hpp>

namespace rdmax::rpc::detail {

using rdmax::detail::block_allocator;
using rdmax::detail::in_block;

inline void async_state::grow(std::size_t more) {
    more = std::max<std::size_t>(more, 1);
    const std::size_t from = table_.size();
    table_.reserve(from + more);
    free_.reserve(from + more);
    for (std::size_t i = 0; i < more; ++i)
        table_.push_back(std::make_unique<entry>());
    // Taken from the back: the lowest entries first.
    for (std::size_t i = from + more; i-- > from;)
        free_.push_back(static_cast<std::uint32_t>(i));
}

inline call_status async_state::start_core(peer_id p, std::uint16_t method,
                                           std::span<const std::byte> body,
                                           const call_options& o) noexcept {
    const call_status st = core_.start(p, method, body, o);
    if (st != call_status::no_credit)
        return st;
    if (!delivering_) {
        core_.release(); // every handler of the last round has run
    } else if (round_size_ != 0) {
        // Inside a round: only the replies handed out so far (this
        // handler's among them); the rest of the round's are still to come.
        for (std::size_t i = 0; i < round_size_; ++i)
            core_.release(round_[i]);
        round_size_ = 0;
    } else {
        return st;
    }
    return core_.start(p, method, body, o);
}

inline void async_state::kick() {
    // Inside a round of handlers the pump goes on after it (and polling
    // here would give back the slots of replies not handed out yet).
    if (delivering_ || pump_posted_ || closed_)
        return;
    if (opts_.spin_polls != 0 || opts_.spin_for.count() != 0) {
        spins_ = 0;
        post_pump();
        return;
    }
    if (!timer_waiting_)
        wait_timer();
    // Not asleep on the descriptor: the pump arms and sleeps, after a look.
    // Not here: the look may run other calls' handlers, never inside an
    // initiating function.
    if (!armed_)
        post_pump();
}

inline void async_state::post_pump() {
    if (pump_posted_ || closed_)
        return;
    pump_posted_ = true;
    ::asio::post(io_, in_block<resume>{{shared_from_this(), &async_state::on_post},
                                       block_allocator<void>(post_block_)});
}

inline void async_state::on_post(std::error_code) {
    pump_posted_ = false;
    pump();
}

inline void async_state::pump() {
    if (closed_)
        return;
    const bool spinning = opts_.spin_polls != 0 || opts_.spin_for.count() != 0;
    std::size_t delivered = 0;
    for (std::size_t rounds = 1;; ++rounds) {
        const int n = poll_and_deliver();
        if (closed_)
            return; // a handler destroyed the adapter (and maybe the client)
        if (outstanding_ == 0) {
            idle();
            return;
        }
        if (n > 0)
            spins_ = 0;
        // A turn long enough: the other handlers of the context run before
        // the next. Not after each full batch: a turn through the context
        // costs a look at the reactor (epoll_wait) and a read of the clock.
        delivered += static_cast<std::size_t>(n);
        if (delivered >= turn_results || rounds == max_rounds) {
            post_pump();
            return;
        }
        if (static_cast<std::size_t>(n) == batch)
            continue; // more waiting
        // Spinning: the next reply (often of the call a handler just
        // started) is polled for here, on this thread, within the budget.
        if (spinning && (n > 0 || spin()))
            continue;
        sleep();
        return;
    }
}

inline int async_state::poll_and_deliver() {
    // Results a handler's exception left undelivered go first, unpolled
    // (a poll would give their slots back).
    if (got_at_ == got_n_) {
        got_n_ = static_cast<std::size_t>(core_.poll(got_));
        got_at_ = 0;
        round_size_ = 0;
    }
    const auto n = static_cast<int>(got_n_ - got_at_);
    if (n == 0)
        return 0;
    delivering_ = true;
    // The calls the round's handlers start go with one doorbell per
    // connection, after the last handler (as a poll loop that takes every
    // result first posts them), not one each before the next handler runs.
    if (opts_.batch_doorbells)
        core_.hold_doorbells();
    try {
        while (got_at_ < got_n_) {
            const call_result& r = got_[got_at_++];
            round_[round_size_++] = r.cookie;
            deliver(r);
        }
    } catch (...) {
        // A handler threw: it leaves the context's run() (Asio's rule); the
        // rest of the round goes at the next turn. What the round's handlers
        // started goes now (closed: the client may be gone; the adapter's
        // close polled it, which rang them).
        delivering_ = false;
        release_asked_ = false;
        if (!closed_)
            core_.ring_held();
        post_pump();
        throw;
    }
    delivering_ = false;
    if (!closed_)
        core_.ring_held();
    if (release_asked_ && !closed_) { // closed: the client may be gone
        release_asked_ = false;
        core_.release();
    }
    return n;
}

inline void async_state::deliver(call_result r) {
    const auto index = static_cast<std::uint32_t>(r.cookie);
    const auto generation = static_cast<std::uint32_t>(r.cookie >> 32);
    if (index >= table_.size())
        return; // a call started on the client directly, not through this
    entry& e = *table_[index];
    if (!e.busy || e.generation != generation)
        return;
    if (e.slot.is_connected())
        e.slot.clear();
    e.slot = {};
    e.busy = false;
    ++e.generation; // a cancellation still on its way finds nothing
    free_.push_back(index);
    --outstanding_;
    r.cookie = e.cookie;
    // A reply that fits the slot is copied where the caller asked it to be.
    if (!e.reply_into.empty() && !r.reply.empty() && r.reply.data() != e.reply_into.data() &&
        r.reply.size() <= e.reply_into.size()) {
        std::memcpy(e.reply_into.data(), r.reply.data(), r.reply.size());
        r.reply = {e.reply_into.data(), r.reply.size()};
    }
    e.handler.complete(r, io_);
}

inline bool async_state::spin() {
    if (opts_.spin_polls == 0 && opts_.spin_for.count() == 0)
        return false;
    ++spins_;
    if (spins_ <= opts_.spin_polls)
        return true;
    if (opts_.spin_for.count() == 0)
        return false;
    // spin_for counts from the unclocked_spins-th empty poll, not the first:
    // most replies come before it, and their calls read no clock here
    // (steady_clock is a system call where the clocksource is not the TSC,
    // as under qemu TCG). Then the clock every 16 polls: a poll that finds
    // nothing costs less than a read of it.
    if (spins_ < unclocked_spins)
        return true;
    if (spins_ == unclocked_spins) {
        spin_since_ = std::chrono::steady_clock::now();
        return true;
    }
    return spins_ % 16 != 0 || std::chrono::steady_clock::now() - spin_since_ < opts_.spin_for;
}

inline void async_state::sleep() {
    if (closed_)
        return;
    // The wait first: the reactor reports edges, and one that came before
    // the wait was queued would be lost. Then the arming, then one more
    // look (a completion that came before the arming raises no event).
    if (!fd_.waiting())
        wait_fd();
    if (!timer_waiting_)
        wait_timer();
    armed_ = core_.arm();
    if (!armed_ || poll_and_deliver() > 0)
        post_pump();
}

inline void async_state::wait_fd() {
    fd_.async_wait(resume{shared_from_this(), &async_state::on_fd});
}

inline void async_state::wait_timer() {
    timer_waiting_ = true;
    timer_.expires_after(core_.options().housekeeping);
    timer_.async_wait(in_block<resume>{{shared_from_this(), &async_state::on_timer},
                                       block_allocator<void>(timer_block_)});
}

inline void async_state::idle() noexcept {
    // No call out: nothing here keeps the context running. (A handler that
    // starts the next call from its result does so before this: a
    // coroutine's loop never comes here.)
    armed_ = false;
    if (fd_.waiting())
        fd_.cancel();
    if (timer_waiting_)
        cancel_timer();
}

inline void async_state::cancel_timer() noexcept {
    try {
        (void)timer_.cancel();
    } catch (const std::system_error&) {
        // The reactor refused: the wait ends at its expiry (one interval) instead.
    }
}

inline void async_state::on_fd(std::error_code ec) {
    fd_.done();
    if (closed_)
        return;
    if (ec == ::asio::error::operation_aborted) {
        // A call started since idle() cancelled this wait: armed or not
        // meanwhile, no wait was queued then; sleep again properly.
        armed_ = false;
        if (outstanding_ > 0 && !pump_posted_ && !delivering_)
            sleep();
        return;
    }
    armed_ = false;
    core_.awake();
    spins_ = 0;
    if (!pump_posted_)
        pump();
}

inline void async_state::on_timer(std::error_code ec) {
    timer_waiting_ = false;
    if (closed_ || outstanding_ == 0)
        return;
    if (ec == ::asio::error::operation_aborted) {
        wait_timer(); // a call started since idle() cancelled this one
        return;
    }
    // Deadlines, keepalive and reconnects are looked at in the client's
    // housekeeping, which a poll runs when it is due.
    wait_timer();
    if (!pump_posted_)
        pump();
}

inline void async_state::close() noexcept {
    closed_ = true;
    fd_.cancel();
    cancel_timer();
    for (std::size_t i = 0; i < table_.size(); ++i) {
        entry& e = *table_[i];
        if (e.busy)
            (void)core_.cancel(e.peer, (std::uint64_t{e.generation} << 32) | i);
    }
    // Their results (cancelled, or the outcome that came first) go to their
    // handlers, posted: none runs inside a destructor.
    const auto orphan = [this](call_result r) noexcept {
        const auto index = static_cast<std::uint32_t>(r.cookie);
        if (index >= table_.size() || !table_[index]->busy)
            return;
        entry& e = *table_[index];
        if (e.slot.is_connected())
            e.slot.clear();
        e.busy = false;
        --outstanding_;
        r.cookie = e.cookie;
        r.reply = {}; // its slot goes back with the next poll
        try {
            e.handler.complete(r, io_, true);
        } catch (...) {
            // No memory to post it: the handler is dropped, as a closed context drops it.
        }
    };
    for (; got_at_ < got_n_; ++got_at_) // left by a handler that threw
        orphan(got_[got_at_]);
    std::array<call_result, batch> got;
    for (int n; outstanding_ > 0 && (n = core_.poll(got)) > 0;)
        for (int k = 0; k < n; ++k)
            orphan(got[static_cast<std::size_t>(k)]);
    // Calls the client could not cancel yet (answered, their windows still
    // being invalidated): their handlers end cancelled too, and their slots
    // stay fenced in the client, whose late results nothing here takes.
    for (std::size_t i = 0; i < table_.size() && outstanding_ > 0; ++i)
        if (const entry& e = *table_[i]; e.busy)
            orphan({(std::uint64_t{e.generation} << 32) | i, e.peer, call_status::cancelled, {}});
}

} // namespace rdmax::rpc::detail
