#pragma once
// rdmax::rpc::async_client: an rpc::client's calls as Asio asynchronous
// operations, with every completion token Asio has (the async_initiate
// model): a coroutine, a callback, a future, a deferred operation.
//
//     asio::io_context ctx;
//     rpc::client cli(pd);
//     rpc::peer_id p = cli.connect("192.0.2.1", 7471);
//     rpc::async_client acli(ctx, cli);
//     asio::co_spawn(ctx, [&]() -> asio::awaitable<void> {
//         rpc::call_result r = co_await acli.async_call(p, 1, request, {}, asio::use_awaitable);
//         use(r.reply); // valid until this coroutine's next co_await (see below)
//     }, asio::detached);
//     ctx.run();
//
// Progress runs on the io_context's thread: the client's fd() is watched by
// the context's reactor (no thread of its own, no timer thread), and a timer
// of one housekeeping interval runs while calls are out (deadlines,
// keepalive, reconnects). `async_options::spin_polls` / `spin_for` poll that
// many times / that long before sleeping on the descriptor, on the context's
// thread (other handlers wait meanwhile, at most 256 polls): CPU for latency.
//
// The rules:
// - One thread: the client, its async_client and every call and
//   cancellation belong to the thread that runs the io_context (one client
//   per thread; several threads, several clients). While the adapter lives,
//   the client's calls go through it: it polls the client, and results of
//   calls started on the client directly are dropped. The adapter outlives
//   its calls' operations (a deferred one not yet started too).
// - The reply: the result's span is valid until the handler returns; for a
//   coroutine, until it next suspends (its next co_await, on this client or
//   anything else) or release(). A call that passes call_options::reply_into
//   finds its reply there, whatever its size (one that fits a slot is
//   copied): use that where the result leaves the thread (use_future) or must
//   outlive a co_await.
// - Cancellation: a cancellation slot bound to the token (bind_cancellation_
//   slot, a coroutine's, awaitable_operators' `||`) that emits terminal or
//   partial cancellation ends the call at once with call_status::cancelled
//   (rpc::client::cancel: its buffers are fenced from the peer as a
//   timed-out call's; it may have run at the server). A call whose reply came
//   already completes with it: cancellation then does nothing.
// - A call that cannot start (no_credit, bad_peer, too_large...) completes
//   with that status, posted (never inside async_call).
// - No allocation per call in steady state: a call's state is an entry of a
//   table (grown only when every entry is in use), its handler stored inline
//   in the entry (or, when larger than call_handler::inline_bytes, in memory
//   from the handler's associated allocator). The cookie of call_options
//   names the entry on the way (the result gives yours back).

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <system_error>
#include <utility>
#include <vector>

// Asio's own code, inlined here, trips GCC's -Wnull-dereference (its thread call
// stack lookups): not this project's to fix.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference"
#include <asio/associated_cancellation_slot.hpp>
#include <asio/async_result.hpp>
#include <asio/basic_waitable_timer.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/cancellation_type.hpp>
#include <asio/io_context.hpp>
#pragma GCC diagnostic pop

#include <rdmax/asio/call_op.hpp>
#include <rdmax/asio/fd_watch.hpp>
#include <rdmax/rpc/client.hpp>

namespace rdmax::rpc {

struct async_options {
    /// Polls that find nothing before the adapter sleeps on the client's
    /// descriptor (spinning on the context's thread; after 256 polls in a row
    /// the other handlers run, and the spin goes on). 0: sleep at once.
    std::uint32_t spin_polls = 0;
    /// ... or polls for this long (the larger budget of the two wins), counted
    /// from the 256th poll that found nothing (the first 256 read no clock).
    std::chrono::microseconds spin_for{0};
    /// The calls that the handlers of one delivery round start are posted
    /// together once the round's last handler returned: one doorbell per
    /// connection through the device (on soft-RoCE one system call each),
    /// not one per call (rpc::client::hold_doorbells). A round's first call
    /// then waits for the round's other handlers (one that waits in this
    /// thread for the effect of an earlier call of its round would wait for
    /// good); false: each call posts at once.
    bool batch_doorbells = true;
};

namespace detail {

/// An async_client's state, shared with its own waits' handlers (the
/// descriptor's and the timer's memory lives here while they are queued).
class async_state : public std::enable_shared_from_this<async_state> {
public:
    using io_executor = ::asio::io_context::executor_type;

    async_state(::asio::io_context& ctx, client& core, async_options o)
        : core_(core)
        , io_(ctx.get_executor())
        , opts_(o)
        , fd_(ctx, core.fd())
        , timer_(ctx.get_executor()) {
        grow(64);
    }
    async_state(const async_state&) = delete;
    async_state& operator=(const async_state&) = delete;
    ~async_state() = default;

    template <class Handler>
    void start(Handler&& h, peer_id p, std::uint16_t method, std::span<const std::byte> body,
               call_options o) {
        if (free_.empty())
            grow(table_.size()); // only when every entry holds a call: not in steady state
        const std::uint32_t index = free_.back();
        entry& e = *table_[index];
        const std::uint64_t theirs = o.cookie;
        o.cookie = (std::uint64_t{e.generation} << 32) | index;
        // What may throw first (a large handler's memory, the slot's), then the call.
        ::asio::cancellation_slot slot = ::asio::get_associated_cancellation_slot(h);
        e.handler.emplace(std::forward<Handler>(h));
        if (slot.is_connected()) {
            try {
                slot.template emplace<cancel_call>(this, index, e.generation);
            } catch (...) {
                e.handler.reset(); // the entry stays free, and empty
                throw;
            }
        }
        if (const call_status st = start_core(p, method, body, o); st != call_status::ok) {
            if (slot.is_connected())
                slot.clear();
            e.handler.complete(call_result{theirs, p, st, {}}, io_, true);
            return;
        }
        free_.pop_back();
        e.slot = slot;
        e.busy = true;
        e.peer = p;
        e.cookie = theirs;
        e.reply_into = o.reply_into;
        ++outstanding_;
        kick();
    }

    /// The call in entry `index` (of `generation`) ends cancelled, if it has not ended.
    void cancel(std::uint32_t index, std::uint32_t generation) noexcept {
        entry& e = *table_[index];
        if (!e.busy || e.generation != generation)
            return;
        if (core_.cancel(e.peer, (std::uint64_t{generation} << 32) | index))
            post_pump(); // its result is queued in the client
    }

    void release() noexcept {
        if (delivering_)
            release_asked_ = true; // after the handlers of this round ran
        else
            core_.release();
    }
    [[nodiscard]] std::size_t outstanding() const noexcept { return outstanding_; }
    [[nodiscard]] client& core() noexcept { return core_; }
    [[nodiscard]] io_executor executor() const noexcept { return io_; }

    /// The owner goes: calls still out are cancelled, their handlers posted.
    void close() noexcept;

private:
    struct entry {
        call_handler handler;
        ::asio::cancellation_slot slot;
        peer_id peer;
        std::uint64_t cookie = 0; ///< the caller's
        std::span<std::byte> reply_into;
        std::uint32_t generation = 0;
        bool busy = false;
    };
    struct cancel_call {
        async_state* state;
        std::uint32_t index;
        std::uint32_t generation;
        void operator()(::asio::cancellation_type t) const noexcept {
            if ((t & (::asio::cancellation_type::terminal | ::asio::cancellation_type::partial)) !=
                ::asio::cancellation_type::none)
                state->cancel(index, generation);
        }
    };
    using timer =
        ::asio::basic_waitable_timer<std::chrono::steady_clock,
                                     ::asio::wait_traits<std::chrono::steady_clock>, io_executor>;

    /// Results taken per poll (more waiting: another turn of the context).
    static constexpr std::size_t batch = 16;
    /// Results one turn of the pump delivers at most before it lets the other handlers run.
    static constexpr std::size_t turn_results = 4 * batch;
    /// Polls one turn of the pump makes at most before it lets the other
    /// handlers run: each turn through the context costs it a look at the
    /// reactor (epoll_wait, a system call) and a read of the clock.
    static constexpr std::size_t max_rounds = 256;
    /// Empty polls of a spin before spin_for's clock starts.
    static constexpr std::uint32_t unclocked_spins = 256;

    /// client::start; with no credit left, the slots of the replies that
    /// handlers have had are given back first (the caller of a new call is
    /// done with its last reply).
    call_status start_core(peer_id p, std::uint16_t method, std::span<const std::byte> body,
                           const call_options& o) noexcept;
    void grow(std::size_t more);
    void kick();
    void post_pump();
    void on_post(std::error_code);
    void pump();
    /// No call out: the waits are cancelled.
    void idle() noexcept;
    void cancel_timer() noexcept;
    /// Polls the client once and runs the handlers of what ended; how many.
    /// A handler that throws: the exception goes on, the rest wait for the next turn.
    int poll_and_deliver();
    void deliver(call_result r);
    /// Nothing came: spin (post another pump) while the budget lasts.
    [[nodiscard]] bool spin();
    /// Sleeps on the descriptor (and the housekeeping timer), armed.
    void sleep();
    void wait_fd();
    void wait_timer();
    void on_fd(std::error_code ec);
    void on_timer(std::error_code ec);
    /// A handler of this state's own: keeps it alive while queued.
    struct resume {
        std::shared_ptr<async_state> state;
        void (async_state::*what)(std::error_code);
        void operator()(std::error_code ec = {}) const { (state.get()->*what)(ec); }
    };

    client& core_;
    io_executor io_;
    async_options opts_;
    rdmax::detail::fd_watch fd_;
    timer timer_;
    rdmax::detail::handler_block timer_block_, post_block_;
    std::vector<std::unique_ptr<entry>> table_;
    std::vector<std::uint32_t> free_;
    std::size_t outstanding_ = 0;
    std::uint32_t spins_ = 0;
    std::chrono::steady_clock::time_point spin_since_{};
    bool pump_posted_ = false;
    bool armed_ = false; ///< arm() said true since the descriptor last woke this
    bool timer_waiting_ = false;
    bool delivering_ = false;
    /// The round's results handed to their handlers so far (the client's cookies).
    std::array<std::uint64_t, batch> round_{};
    std::size_t round_size_ = 0;
    /// The last poll's results, and the next to deliver.
    std::array<call_result, batch> got_{};
    std::size_t got_at_ = 0, got_n_ = 0;
    bool release_asked_ = false;
    bool closed_ = false;
};

} // namespace detail

/// An rpc::client's calls on an io_context (include/rdmax/asio/client.hpp).
class async_client {
public:
    using executor_type = ::asio::io_context::executor_type;

    /// `core` must outlive this; both are used on the thread that runs `ctx`.
    /// Throws rdmax::error (the reactor refused the client's descriptor).
    async_client(::asio::io_context& ctx, client& core, async_options o = {})
        : state_(std::make_shared<detail::async_state>(ctx, core, o)) {}
    async_client(const async_client&) = delete;
    async_client& operator=(const async_client&) = delete;
    /// Calls still out end cancelled, or with the outcome that came first
    /// (its reply dropped); their handlers are posted to run.
    ~async_client() { state_->close(); }

    /// Starts a call of `method` to `p` with `request` (kept unchanged until
    /// the call ends when it is over a slot), completing with call_signature
    /// as `token` asks (asio::use_awaitable, a callback, asio::use_future,
    /// asio::experimental::deferred...). `o` as for client::start.
    template <class Token>
    auto async_call(peer_id p, std::uint16_t method, std::span<const std::byte> request,
                    call_options o, Token&& token) {
        return ::asio::async_initiate<Token, call_signature>(initiate{state_.get()}, token, p,
                                                             method, request, o);
    }
    /// Gives back now the reply slots of the results handed to handlers so
    /// far (inside a handler: once the handlers of its round have run).
    void release() noexcept { state_->release(); }

    /// Calls started and not yet completed.
    [[nodiscard]] std::size_t outstanding() const noexcept { return state_->outstanding(); }
    [[nodiscard]] client& core() noexcept { return state_->core(); }
    [[nodiscard]] executor_type get_executor() const noexcept { return state_->executor(); }

private:
    struct initiate {
        detail::async_state* state;
        template <class Handler>
        void operator()(Handler&& h, peer_id p, std::uint16_t method,
                        std::span<const std::byte> request, const call_options& o) const {
            state->start(std::forward<Handler>(h), p, method, request, o);
        }
    };
    std::shared_ptr<detail::async_state> state_;
};

} // namespace rdmax::rpc

#include <rdmax/asio/client-inl.hpp>
