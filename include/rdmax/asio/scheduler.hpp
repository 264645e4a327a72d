#pragma once
// rdmax::sched::async_scheduler: a priority scheduler's requests as Asio
// asynchronous operations (the async_initiate model: a coroutine, a
// callback, a future, a deferred operation), each completing when its
// request's completion arrives:
//
//     asio::io_context io;
//     sched::priority_scheduler<> s(qp);
//     sched::async_scheduler a(io, s);
//     asio::co_spawn(io, [&]() -> asio::awaitable<void> {
//         verbs::completion c = co_await a.async_write(sched::urgent, src, peer, 0,
//                                                      asio::use_awaitable);
//     }, asio::detached);
//     io.run();
//
// Completion signature: void(std::error_code, verbs::completion). The error
// is the completion's status (verbs::wc_category(); empty on success): a
// coroutine sees a failed request as asio::system_error unless it asks for
// a tuple (asio::experimental::as_tuple).
//
// Progress: the scheduler has no descriptor of its own, so the adapter
// polls it on the io_context's thread while requests are out: a turn of
// the context per poll for `spin_polls` empty polls, then a timer from
// `idle_wait` doubling up to `max_idle_wait` (a large transfer does not keep
// a core busy), back to polling at the first completion. Nothing runs while
// no request is out. One thread: the scheduler, this adapter and every
// request belong to the thread that runs the io_context; while the adapter
// lives, the scheduler's completions go through it (one submitted directly,
// with a wr_id of its own, is dropped: the adapter's wr_ids have 0xA5 as their
// top byte, which no small number and no user-space pointer has; a direct
// wr_id must not have it).
//
// No allocation per request in steady state: a request's state is an entry
// of a table (grown only when every entry is in use), its handler inline
// (rpc::detail::op_handler). Requests refused at submission (status is not
// ok: queue full, out of range...) complete posted, never inside the
// initiating function, with a completion whose status is IBV_WC_GENERAL_ERR
// and the refusal as the error (rdmax::status_category(): "queue_full" is
// resource_unavailable_try_again, as from any status).
//
// No per-operation cancellation: a request handed to the scheduler may
// already be on the wire, and RDMA has no way to take a posted work request
// back short of failing the whole queue pair (which would fail every other
// request on it). A cancellation slot bound to the token is not used; bound
// a wait with a timer of your own and keep the buffers until the operation
// completes.
//
// A handler that throws leaves the context's run() (Asio's rule); the other
// completions of that poll are delivered at the next turn, none is lost.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include <rdmax/asio/call_op.hpp>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference"
#include <asio/async_result.hpp>
#include <asio/error.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#pragma GCC diagnostic pop

#include <rdmax/mem/buffer.hpp>
#include <rdmax/sched/priority.hpp>
#include <rdmax/sched/request_flags.hpp>
#include <rdmax/status.hpp>
#include <rdmax/status_error.hpp>
#include <rdmax/verbs/completion.hpp>

namespace rdmax::verbs {

/// Work-completion statuses (ibv_wc_status) as error codes.
inline const std::error_category& wc_category() noexcept {
    struct category final : std::error_category {
        [[nodiscard]] const char* name() const noexcept override { return "ibv_wc_status"; }
        [[nodiscard]] std::string message(int v) const override {
            return ibv_wc_status_str(static_cast<ibv_wc_status>(v));
        }
    };
    static const category c;
    return c;
}

/// The error of a completion (empty on success); found by the Asio adapters.
[[nodiscard]] inline std::error_code error_of(const completion& c) noexcept {
    return c.ok() ? std::error_code{} : std::error_code(static_cast<int>(c.status), wc_category());
}

} // namespace rdmax::verbs

namespace rdmax::sched {

struct async_scheduler_options {
    std::uint32_t spin_polls = 64;                 ///< empty polls, a turn each, before the timer
    std::chrono::microseconds idle_wait{50};       ///< the timer's first wait
    std::chrono::microseconds max_idle_wait{1000}; ///< ... doubling up to this
};

template <class Scheduler>
class async_scheduler {
public:
    using signature = void(std::error_code, verbs::completion);

    async_scheduler(::asio::io_context& io, Scheduler& s, async_scheduler_options o = {})
        : state_(std::make_shared<state>(io, s, o)) {}
    async_scheduler(const async_scheduler&) = delete;
    async_scheduler& operator=(const async_scheduler&) = delete;
    /// Requests whose completion it already polled complete with it; those
    /// still out complete with operation_aborted (both posted). Those
    /// none of which was posted are withdrawn from the scheduler (cancel());
    /// one posted in part or whole runs its course there, its buffers in use
    /// until then (poll the scheduler, or destroy it, to know it is over).
    ~async_scheduler() { state_->close(); }

    /// RDMA write of `src` to dst + dst_offset (sliced, by priority).
    template <rights L, rights R, class Token>
        requires(has(R, rights::remote_write))
    auto async_write(priority p, local_buffer<L> src, remote_buffer<R> dst,
                     std::uint64_t dst_offset, Token&& token, request_flags f = {}) {
        return submit(std::forward<Token>(token), [=](Scheduler& s, std::uint64_t wr_id) {
            return s.write(p, src, dst, dst_offset, wr_id, signaled(f));
        });
    }
    /// RDMA read of src + src_offset into `dst`.
    template <rights L, rights R, class Token>
        requires(has(L, rights::local_write) && has(R, rights::remote_read))
    auto async_read(priority p, local_buffer<L> dst, remote_buffer<R> src, std::uint64_t src_offset,
                    Token&& token, request_flags f = {}) {
        return submit(std::forward<Token>(token), [=](Scheduler& s, std::uint64_t wr_id) {
            return s.read(p, dst, src, src_offset, wr_id, signaled(f));
        });
    }
    /// A send (the peer's receive must hold all of it).
    template <rights L, class Token>
    auto async_send(priority p, local_buffer<L> src, Token&& token, request_flags f = {}) {
        return submit(std::forward<Token>(token), [=](Scheduler& s, std::uint64_t wr_id) {
            return s.send(p, src, wr_id, signaled(f));
        });
    }

    [[nodiscard]] std::size_t outstanding() const noexcept { return state_->outstanding; }

private:
    static request_flags signaled(request_flags f) noexcept {
        f.signaled = true; // the operation completes with its completion
        return f;
    }

    struct entry {
        rpc::detail::op_handler<verbs::completion> handler;
        std::uint32_t generation = 0; ///< its low 24 bits are in the wr_id
        bool busy = false;
    };

    // A wr_id: tag (8 bits), the entry's generation (24), its index (32).
    // The tag keeps a direct submission's wr_id (0, 1, 2..., a pointer) from
    // naming a live entry.
    static constexpr std::uint64_t wr_tag = std::uint64_t{0xA5} << 56;
    static constexpr std::uint64_t generation_mask = (std::uint64_t{1} << 24) - 1;
    static std::uint64_t wr_id_of(std::uint32_t index, std::uint32_t generation) noexcept {
        return wr_tag | ((generation & generation_mask) << 32) | index;
    }

    /// Adapters made so far (any thread): each starts its entries'
    /// generations apart from the one before.
    static inline std::atomic<std::uint32_t> adapters{0};

    struct state : std::enable_shared_from_this<state> {
        state(::asio::io_context& io, Scheduler& s, async_scheduler_options o)
            : io_(io.get_executor())
            , sched(s)
            , opts(o)
            , timer(io)
            // Spread (an odd multiplier: consecutive adapters differ in the
            // wr_id's 24 bits), so that a successor on the same scheduler
            // does not take the completion of a request its forerunner left
            // running for one of its own.
            , first_generation(adapters.fetch_add(1, std::memory_order_relaxed) * 0x9E3779B1U) {
            grow(16);
        }
        void grow(std::size_t more) {
            const std::size_t from = table.size();
            for (std::size_t i = 0; i < more; ++i) {
                table.push_back(std::make_unique<entry>());
                table.back()->generation = first_generation;
            }
            for (std::size_t i = from + more; i-- > from;)
                free.push_back(static_cast<std::uint32_t>(i));
        }
        void kick() {
            spins = 0;
            wait = opts.idle_wait;
            if (closed || posted)
                return;
            if (timing) {
                // Asleep on the idle timer (up to max_idle_wait): the new
                // request's completion is looked for now; the cancelled
                // wait's handler runs the pump.
                try {
                    (void)timer.cancel();
                } catch (const std::system_error&) {
                    // The wait ends at its expiry instead.
                }
                return;
            }
            post_pump();
        }
        void post_pump() {
            if (posted)
                return; // one pump queued at a time (a handler's new request kicks too)
            // The flag only once queued: a post that throws (out of memory)
            // must not leave the adapter believing a pump is on its way.
            ::asio::post(io_, [self = this->shared_from_this()] {
                self->posted = false;
                self->pump();
            });
            posted = true;
        }
        void pump() {
            if (closed)
                return;
            // Completions a throwing handler left undelivered go first, unpolled.
            if (got_at == got_n) {
                got_n = static_cast<std::size_t>(std::max(sched.poll(got), 0));
                got_at = 0;
            }
            const auto n = static_cast<int>(got_n - got_at);
            try {
                while (got_at < got_n && !closed)
                    deliver(got[got_at++]);
            } catch (...) {
                if (!closed && !posted)
                    post_pump(); // the rest of this poll's, at the next turn
                throw;
            }
            if (closed || outstanding == 0)
                return;
            if (n > 0) {
                spins = 0;
                wait = opts.idle_wait;
            }
            // At most one of a queued pump and a timer wait: a handler that
            // turned the context itself may have run this pump's successor
            // (which queued one or went to sleep). Two would cancel each
            // other's waits and spin without end.
            if (posted || timing)
                return;
            if (n > 0 || ++spins <= opts.spin_polls) {
                post_pump();
                return;
            }
            try {
                timer.expires_after(wait);
                timer.async_wait([self = this->shared_from_this()](std::error_code) {
                    self->timing = false;
                    self->pump();
                });
            } catch (...) {
                post_pump(); // no wait to be had: poll again at the next turn instead
                return;
            }
            timing = true; // once the wait is on (as posted)
            wait = std::min(2 * wait, opts.max_idle_wait);
        }
        /// The entry whose request `c` completes, if that request is out;
        /// null for a completion of a request not submitted through this
        /// adapter (or of an earlier generation of the entry).
        entry* live(const verbs::completion& c) noexcept {
            const auto index = static_cast<std::uint32_t>(c.wr_id);
            if (index >= table.size())
                return nullptr;
            entry& e = *table[index];
            return e.busy && c.wr_id == wr_id_of(index, e.generation) ? &e : nullptr;
        }
        void deliver(const verbs::completion& c) {
            entry* const e = live(c);
            if (e == nullptr)
                return;
            e->busy = false;
            ++e->generation;
            free.push_back(static_cast<std::uint32_t>(c.wr_id)); // its index
            --outstanding;
            e->handler.complete(c, io_);
        }
        void close() noexcept {
            closed = true;
            try {
                (void)timer.cancel();
            } catch (const std::system_error&) {
                // The wait ends at its expiry and finds the adapter closed.
            }
            // Completions already polled (a handler of this poll closed the
            // adapter, or threw): those requests finished, and say how.
            for (; got_at < got_n; ++got_at) {
                const verbs::completion& c = got[got_at];
                entry* const e = live(c);
                if (e == nullptr)
                    continue;
                e->busy = false;
                try {
                    e->handler.complete(c, io_, true);
                } catch (...) {
                    // No memory to post it: dropped, as a closed context drops it.
                }
            }
            for (std::size_t i = 0; i < table.size(); ++i) {
                entry& e = *table[i];
                if (!e.busy)
                    continue;
                e.busy = false;
                verbs::completion c;
                c.wr_id = wr_id_of(static_cast<std::uint32_t>(i), e.generation);
                c.status = IBV_WC_WR_FLUSH_ERR;
                // None of it posted: withdrawn, it never reaches the device
                // (its buffers are its owner's again when the abort runs).
                // Else it runs its course in the scheduler.
                (void)sched.cancel(c.wr_id);
                try {
                    e.handler.complete_with(::asio::error::operation_aborted, c, io_);
                } catch (...) {
                    // No memory to post it: dropped, as a closed context drops it.
                }
            }
            outstanding = 0;
        }

        ::asio::io_context::executor_type io_;
        Scheduler& sched;
        async_scheduler_options opts;
        ::asio::steady_timer timer;
        std::uint32_t first_generation; ///< of every entry
        std::vector<std::unique_ptr<entry>> table;
        std::vector<std::uint32_t> free;
        std::size_t outstanding = 0;
        verbs::completion got[16]; ///< the last poll's completions ...
        std::size_t got_n = 0;     ///< ... how many
        std::size_t got_at = 0;    ///< ... delivered so far
        std::uint32_t spins = 0;
        std::chrono::microseconds wait{};
        bool posted = false;
        bool timing = false;
        bool closed = false;
    };

    template <class Token, class Submit>
    auto submit(Token&& token, Submit s) {
        return ::asio::async_initiate<Token, signature>(
            [st = state_.get()](auto handler, Submit submit_it) {
                if (st->free.empty())
                    st->grow(st->table.size()); // only when every entry holds a request
                const std::uint32_t index = st->free.back();
                entry& e = *st->table[index];
                e.handler.emplace(std::move(handler));
                // The pump is queued before the request goes to the
                // scheduler: when queuing it throws, nothing is out and the
                // handler goes, as an initiating function that throws must
                // leave it (an extra pump after a refusal finds nothing).
                try {
                    st->kick();
                } catch (...) {
                    e.handler.reset();
                    throw;
                }
                const std::uint64_t wr_id = wr_id_of(index, e.generation);
                if (const status r = submit_it(st->sched, wr_id); r != status::ok) {
                    verbs::completion c;
                    c.wr_id = wr_id;
                    c.status = IBV_WC_GENERAL_ERR;
                    e.handler.complete_with(make_error_code(r), c, st->io_);
                    return;
                }
                st->free.pop_back();
                e.busy = true;
                ++st->outstanding;
            },
            token, std::move(s));
    }

    std::shared_ptr<state> state_;
};

} // namespace rdmax::sched
