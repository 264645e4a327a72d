// rpc::async_client (include/rdmax/asio/client.hpp) on the fake link: every
// completion token (a coroutine, a callback, a future, a deferred
// operation), cancellation at every phase of a call, timeouts, many calls
// in flight, and no allocation per call through the awaitable path. A real
// rpc::client and rpc::server talk through fake links; the "network" is a
// handler on the same io_context that lands what each side sent and, as a
// device's completion channel would, makes the client's descriptor readable
// (the adapter sleeps on it unless it spins). Time is virtual for the
// calls' deadlines; the adapter's own housekeeping timer is real.

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <future>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unistd.h>
#include <vector>

// First: its Asio includes quiet a GCC warning in Asio's own code (see there).
#include <rdmax/asio/client.hpp>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference"
#include <asio/bind_cancellation_slot.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/experimental/awaitable_operators.hpp>
#include <asio/experimental/deferred.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>
#pragma GCC diagnostic pop

#include "../support/catch.hpp"
#include "../support/counting_new.hpp"
#include "../support/redialing_pair.hpp"

using namespace rdmax;
using namespace rdmax::test::rpc_unit;

namespace {

constexpr std::uint16_t echo = 1;
constexpr std::uint16_t deferring = 2; ///< answered only when the test says

rpc::rpc_options options(std::uint16_t slots = 4) {
    rpc::rpc_options o;
    o.slots = slots;
    o.slot_bytes = 256;
    o.max_message = 64 << 10;
    o.local = false;
    o.call_timeout = 30s;
    o.housekeeping = 2ms;
    o.keepalive = 100s; // nothing here is about keepalive
    o.keepalive_timeout = 1000s;
    o.reconnect_backoff = 1ms;
    o.reconnect_backoff_max = 1ms;
    return o;
}

/// A client, a server, the fake network between them, on one io_context.
struct world : test::redialing_pair {
    bool flowing = true; ///< the network moves messages
    std::vector<rpc::deferred_call> deferred;
    int runs = 0;
    asio::io_context ctx;
    std::optional<rpc::async_client> acli;
    bool net_on = false;
    std::chrono::nanoseconds clock_step{0}; ///< virtual time per turn of the network

    explicit world(rpc::rpc_options opts = options(), rpc::async_options ao = {})
        : redialing_pair(opts) {
        make_server();
        srv->on(echo, [this](rpc::request_context& x) {
            ++runs;
            x.reply(x.body());
        });
        srv->on(deferring, [this](rpc::request_context& x) {
            ++runs;
            deferred.push_back(x.defer());
        });
        connect();
        acli.emplace(ctx, *cli, ao);
    }
    /// Moves what both sides sent; true when something reached the client.
    bool move() {
        const test::not_counted scaffolding;
        return land_both_ways();
    }
    /// Makes the client's descriptor readable, as a completion event would.
    void ring() const { c->wake(); }
    /// The network, a handler that runs again each turn while net_on.
    void net() {
        if (!net_on)
            return;
        const test::not_counted scaffolding;
        virtual_now += clock_step;
        if (flowing && move())
            ring();
        asio::post(ctx, [this] { net(); });
    }
    /// Runs the context until `done` (or 10 s: a hang fails, never waits for ever).
    template <class Done>
    void run_until(Done&& done) {
        net_on = true;
        net();
        const auto deadline = std::chrono::steady_clock::now() + 10s;
        while (!done() && std::chrono::steady_clock::now() < deadline)
            ctx.run_one_for(10ms);
        net_on = false;
        ctx.restart();
        ctx.poll(); // the network's last turn
        ctx.restart();
        INFO("client: " << fmt::format("{}", cli->counters()) << "; outstanding "
                        << (acli ? acli->outstanding() : 0)); // a test may close it
        REQUIRE(done());
    }
};

using awaitable = asio::awaitable<void>;

} // namespace

TEST_CASE("asio: a coroutine's calls (use_awaitable)", "[asio][tokens]") {
    world w;
    int ok = 0;
    bool done = false;
    asio::co_spawn(
        w.ctx,
        [&]() -> awaitable {
            for (int i = 0; i < 100; ++i) {
                const std::string body = "call " + std::to_string(i);
                const call_result r =
                    co_await w.acli->async_call(w.p, echo, bytes_of(body), {}, asio::use_awaitable);
                CHECK(r.status == call_status::ok);
                CHECK(text(r.reply) == body);
                ok += text(r.reply) == body ? 1 : 0;
            }
            done = true;
        },
        asio::detached);
    w.run_until([&] { return done; });
    CHECK(ok == 100);
    CHECK(w.acli->outstanding() == 0);
    // Nothing out: the adapter's waits are cancelled, and the context runs out of work.
    const auto t0 = std::chrono::steady_clock::now();
    w.ctx.run_for(2s);
    CHECK(std::chrono::steady_clock::now() - t0 < 1s);
}

TEST_CASE("asio: a callback, a future and a deferred operation", "[asio][tokens]") {
    world w;
    std::optional<call_result> by_callback;
    std::error_code ec_callback = make_error_code(call_status::bad_reply);
    rpc::call_options co;
    co.cookie = 77;
    w.acli->async_call(w.p, echo, bytes_of("cb"), co, [&](std::error_code ec, call_result r) {
        ec_callback = ec;
        by_callback = r;
    });
    w.run_until([&] { return by_callback.has_value(); });
    CHECK(!ec_callback);
    CHECK(by_callback->cookie == 77); // the caller's cookie comes back
    CHECK(text(by_callback->reply) == "cb");

    // A future: the result leaves the handler, so the reply goes where asked.
    std::array<std::byte, 64> keep{};
    co.reply_into = keep;
    std::future<call_result> f =
        w.acli->async_call(w.p, echo, bytes_of("future"), co, asio::use_future);
    w.run_until([&] { return f.wait_for(0s) == std::future_status::ready; });
    const call_result fr = f.get();
    CHECK(fr.status == call_status::ok);
    CHECK(fr.reply.data() == keep.data());
    CHECK(text(fr.reply) == "future");

    auto op = w.acli->async_call(w.p, echo, bytes_of("later"), {}, asio::experimental::deferred);
    CHECK(w.srv->counters().calls == 2); // deferred: nothing started yet
    std::optional<std::string> by_deferred;
    std::move(op)([&](std::error_code, call_result r) { by_deferred = text(r.reply); });
    w.run_until([&] { return by_deferred.has_value(); });
    CHECK(*by_deferred == "later");
}

TEST_CASE("asio: a call that cannot start completes at once, posted, with why", "[asio][tokens]") {
    world w;
    int ran = 0;
    std::error_code last;
    for (int i = 0; i < 5; ++i) // 4 slots: the fifth finds no credit
        w.acli->async_call(w.p, deferring, bytes_of("x"), {}, [&](std::error_code ec, call_result) {
            ++ran;
            last = ec;
        });
    CHECK(ran == 0); // never inside async_call
    w.run_until([&] { return ran == 1; });
    CHECK(last == call_status::no_credit);
    CHECK(last == std::errc::resource_unavailable_try_again);
    w.acli->async_call(w.p, 0, {}, {}, [&](std::error_code ec, call_result) {
        ++ran;
        last = ec;
    });
    w.run_until([&] { return ran == 2; });
    CHECK(last == call_status::invalid_method);
    for (rpc::deferred_call& d : w.deferred)
        (void)w.srv->reply(d, bytes_of("late"));
    w.run_until([&] { return ran == 6; });
}

TEST_CASE("asio: a coroutine sees errors as exceptions, or as a tuple", "[asio][tokens]") {
    world w;
    bool done = false;
    asio::co_spawn(
        w.ctx,
        [&]() -> awaitable {
            rpc::call_options quick;
            quick.timeout = 1ms;
            try {
                (void)co_await w.acli->async_call(w.p, deferring, bytes_of("x"), quick,
                                                  asio::use_awaitable);
                FAIL("no exception");
            } catch (const std::system_error& e) {
                CHECK(e.code() == call_status::timed_out);
                CHECK(e.code() == std::errc::timed_out);
            }
            auto [ec, r] =
                co_await w.acli->async_call(w.p, deferring, bytes_of("y"), quick,
                                            asio::experimental::as_tuple(asio::use_awaitable));
            CHECK(ec == call_status::timed_out);
            CHECK(r.status == call_status::timed_out);
            done = true;
        },
        asio::detached);
    w.clock_step = 100us; // virtual time passes; the adapter's timer has the client look
    w.run_until([&] { return done; });
    CHECK(w.cli->counters().timed_out == 2);
}

TEST_CASE("asio: 64 coroutines, 64 calls in flight, 3 200 calls", "[asio][many]") {
    world w(options(64));
    int finished = 0, good = 0;
    for (int k = 0; k < 64; ++k) {
        asio::co_spawn(
            w.ctx,
            [&, k]() -> awaitable {
                for (int i = 0; i < 50; ++i) {
                    const std::string body = std::to_string(k) + "/" + std::to_string(i);
                    const call_result r = co_await w.acli->async_call(w.p, echo, bytes_of(body), {},
                                                                      asio::use_awaitable);
                    good += text(r.reply) == body ? 1 : 0;
                }
                ++finished;
            },
            asio::detached);
    }
    w.run_until([&] { return finished == 64; });
    CHECK(good == 64 * 50);
    CHECK(w.cli->counters().completed == 64 * 50);
}

TEST_CASE("asio: spinning before sleeping gives the same results", "[asio][spin]") {
    rpc::async_options ao;
    ao.spin_polls = 50;
    ao.spin_for = 20us;
    world w(options(), ao);
    int good = 0;
    bool done = false;
    asio::co_spawn(
        w.ctx,
        [&]() -> awaitable {
            for (int i = 0; i < 200; ++i) {
                const call_result r = co_await w.acli->async_call(w.p, echo, bytes_of("spin"), {},
                                                                  asio::use_awaitable);
                good += text(r.reply) == "spin" ? 1 : 0;
            }
            done = true;
        },
        asio::detached);
    w.run_until([&] { return done; });
    CHECK(good == 200);
}

// ---- cancellation ------------------------------------------------------------------------------

namespace {

/// A callback that keeps what it got.
struct outcome {
    std::optional<std::error_code> ec;
    call_result r;
    std::string reply;
    auto handler() {
        return [this](std::error_code e, call_result got) {
            ec = e;
            r = got;
            reply = text(got.reply);
        };
    }
    [[nodiscard]] bool done() const { return ec.has_value(); }
};

} // namespace

TEST_CASE("asio cancel: in flight, the call ends cancelled; the server's late reply is dropped",
          "[asio][cancel]") {
    world w;
    asio::cancellation_signal sig;
    outcome got;
    w.acli->async_call(w.p, deferring, bytes_of("slow"), {},
                       asio::bind_cancellation_slot(sig.slot(), got.handler()));
    w.run_until([&] { return w.runs == 1; }); // it runs; its answer waits
    sig.emit(asio::cancellation_type::terminal);
    w.run_until([&] { return got.done(); });
    CHECK(*got.ec == call_status::cancelled);
    CHECK(*got.ec == std::errc::operation_canceled);
    CHECK(got.r.reply.empty());
    CHECK(w.cli->counters().cancelled == 1);
    CHECK(w.acli->outstanding() == 0);
    // The answer comes after all: dropped unread, the connection stays.
    REQUIRE(w.srv->reply(w.deferred.at(0), bytes_of("too late")));
    outcome next;
    w.acli->async_call(w.p, echo, bytes_of("next"), {}, next.handler());
    w.run_until([&] { return next.done(); });
    CHECK(next.reply == "next");
    CHECK(w.cli->counters().late_replies == 1);
    CHECK(w.cli->connected(w.p));
}

TEST_CASE("asio cancel: waiting for the connection, the call leaves unsent", "[asio][cancel]") {
    world w;
    w.clock_step = 100us; // the reconnect's backoff passes
    w.up = false;
    w.cut();
    w.run_until([&] {
        (void)w.cli->poll({}); // the client sees the connection go
        return w.cli->state(w.p) == rpc::peer_state::reconnecting;
    });
    asio::cancellation_signal sig;
    outcome got;
    w.acli->async_call(w.p, echo, bytes_of("waits"), {},
                       asio::bind_cancellation_slot(sig.slot(), got.handler()));
    CHECK(w.acli->outstanding() == 1);
    sig.emit(asio::cancellation_type::terminal);
    w.run_until([&] { return got.done(); });
    CHECK(*got.ec == call_status::cancelled);
    w.up = true; // the connection comes back: nothing of that call is sent
    outcome after;
    w.acli->async_call(w.p, echo, bytes_of("after"), {}, after.handler());
    w.run_until([&] { return after.done(); });
    CHECK(after.reply == "after");
    CHECK(w.runs == 1);
    CHECK(w.cli->counters().cancelled == 1);
}

TEST_CASE("asio cancel: a reply that arrived but is not yet delivered wins", "[asio][cancel]") {
    world w;
    w.flowing = false;
    asio::cancellation_signal sig;
    outcome got;
    w.acli->async_call(w.p, echo, bytes_of("arrived"), {},
                       asio::bind_cancellation_slot(sig.slot(), got.handler()));
    REQUIRE(w.move()); // the reply is in the client, the adapter not told yet
    sig.emit(asio::cancellation_type::terminal);
    w.ring();
    w.run_until([&] { return got.done(); });
    CHECK(!*got.ec);
    CHECK(got.reply == "arrived");
    CHECK(w.cli->counters().cancelled == 0);
}

TEST_CASE("asio cancel: after completion, and total cancellation, do nothing", "[asio][cancel]") {
    world w;
    asio::cancellation_signal sig;
    outcome first;
    w.acli->async_call(w.p, echo, bytes_of("one"), {},
                       asio::bind_cancellation_slot(sig.slot(), first.handler()));
    w.run_until([&] { return first.done(); });
    sig.emit(asio::cancellation_type::terminal); // no handler in the slot any more
    CHECK(first.reply == "one");
    // Total cancellation asks for no side effects, which a call sent cannot
    // promise (it may have run): ignored.
    outcome second;
    w.acli->async_call(w.p, deferring, bytes_of("two"), {},
                       asio::bind_cancellation_slot(sig.slot(), second.handler()));
    w.run_until([&] { return w.runs == 2; });
    sig.emit(asio::cancellation_type::total);
    REQUIRE(w.srv->reply(w.deferred.at(0), bytes_of("answered")));
    w.run_until([&] { return second.done(); });
    CHECK(!*second.ec);
    CHECK(second.reply == "answered");
    CHECK(w.cli->counters().cancelled == 0);
}

TEST_CASE("asio cancel: a timeout with awaitable_operators cancels the call", "[asio][cancel]") {
    using namespace asio::experimental::awaitable_operators;
    world w;
    std::optional<std::size_t> won;
    asio::co_spawn(
        w.ctx,
        [&]() -> awaitable {
            asio::steady_timer t(w.ctx, 20ms);
            const auto r = co_await (
                w.acli->async_call(w.p, deferring, bytes_of("slow"), {}, asio::use_awaitable) ||
                t.async_wait(asio::use_awaitable));
            won = r.index();
        },
        asio::detached);
    w.run_until([&] { return won.has_value(); });
    CHECK(*won == 1); // the timer
    CHECK(w.cli->counters().cancelled == 1);
    CHECK(w.acli->outstanding() == 0);
}

TEST_CASE("asio: an adapter destroyed with calls out ends them cancelled, posted",
          "[asio][cancel]") {
    world w;
    outcome got;
    w.acli->async_call(w.p, deferring, bytes_of("orphan"), {}, got.handler());
    w.run_until([&] { return w.runs == 1; });
    w.acli.reset();
    CHECK(!got.done());
    w.ctx.poll();
    REQUIRE(got.done());
    CHECK(*got.ec == call_status::cancelled);
    CHECK(w.cli->in_flight() == 0);
}

// ---- allocations -------------------------------------------------------------------------------

TEST_CASE("asio: no allocation per call through the awaitable path, over 100 000 calls",
          "[asio][hot]") {
    world w;
    std::uint64_t during = 0;
    int good = 0;
    bool done = false;
    asio::co_spawn(
        w.ctx,
        [&]() -> awaitable {
            const auto run = [&](int calls) -> awaitable {
                for (int i = 0; i < calls; ++i) {
                    const call_result r = co_await w.acli->async_call(
                        w.p, echo, bytes_of("0123456789abcdef"), {}, asio::use_awaitable);
                    good += r.reply.size() == 16 ? 1 : 0;
                }
            };
            co_await run(1000); // warm-up: the table, the recycled frames, the waits' memory
            const std::uint64_t before = test::allocations.load();
            co_await run(100'000);
            during = test::allocations.load() - before;
            done = true;
        },
        asio::detached);
    w.run_until([&] { return done; });
    CHECK(good == 101'000);
    INFO("allocations over 100 000 calls: " << during);
    CHECK(during == 0);
}

TEST_CASE("asio: a handler over the inline buffer lives in its allocator's memory (counted)",
          "[asio][hot]") {
    world w;
    std::array<std::byte, 256> big{}; // captured by value: over call_handler::inline_bytes
    int ran = 0;
    const auto call = [&] {
        w.acli->async_call(w.p, echo, bytes_of("big"), {},
                           [&ran, big](std::error_code ec, call_result) {
                               ran += !ec && big[0] == std::byte{0} ? 1 : 0;
                           });
    };
    call();
    w.run_until([&] { return ran == 1; });
    const std::uint64_t before = test::allocations.load();
    for (int i = 0; i < 10; ++i) {
        call();
        w.run_until([&] { return ran == i + 2; });
    }
    // Ten handlers in std::allocator's memory: the count sees the adapter's allocations.
    CHECK(test::allocations.load() - before >= 10);
}

TEST_CASE("asio: no allocation per call with 16 coroutines in flight", "[asio][hot]") {
    world w(options(16));
    std::uint64_t before = 0, after = 0;
    int finished = 0, warmed = 0;
    for (int k = 0; k < 16; ++k) {
        asio::co_spawn(
            w.ctx,
            [&]() -> awaitable {
                for (int i = 0; i < 200; ++i)
                    (void)co_await w.acli->async_call(w.p, echo, bytes_of("x"), {},
                                                      asio::use_awaitable);
                if (++warmed == 16)
                    before = test::allocations.load();
                for (int i = 0; i < 2000; ++i)
                    (void)co_await w.acli->async_call(w.p, echo, bytes_of("x"), {},
                                                      asio::use_awaitable);
                if (++finished == 16)
                    after = test::allocations.load();
            },
            asio::detached);
    }
    w.run_until([&] { return finished == 16; });
    // Each result frees the frame of its call before its coroutine starts
    // the next: Asio's per-thread frame cache suffices.
    CHECK(after - before == 0);
}

TEST_CASE("asio: a handler that throws leaves run(); the rest of its round still completes",
          "[asio][tokens]") {
    world w;
    w.flowing = false;
    bool second = false;
    w.acli->async_call(w.p, echo, bytes_of("a"), {},
                       [](std::error_code, call_result) { throw std::runtime_error("handler"); });
    w.acli->async_call(w.p, echo, bytes_of("b"), {}, [&](std::error_code ec, call_result r) {
        second = !ec && text(r.reply) == "b";
    });
    REQUIRE(w.move()); // both replies in the client: one round
    w.ring();
    CHECK_THROWS_AS(w.ctx.run_for(2s), std::runtime_error);
    CHECK_FALSE(second);
    w.ctx.restart();
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (!second && std::chrono::steady_clock::now() < deadline)
        w.ctx.run_one_for(10ms);
    CHECK(second);
    CHECK(w.acli->outstanding() == 0);
}

TEST_CASE("asio: a descriptor the reactor refuses is an rdmax::error that says so",
          "[asio][setup]") {
    asio::io_context ctx;
    try {
        rdmax::detail::fd_watch w(ctx, -1);
        FAIL("no error");
    } catch (const rdmax::error& e) {
        CHECK(e.verb() == "asio::posix::stream_descriptor::assign");
        CHECK(std::string(e.what()).find("descriptor -1") != std::string::npos);
    }
}

// Not run by the suite (hidden tag): the adapter's own cost per call, for a
// profiler. `valgrind --tool=callgrind build/tests/test_asio_client
// "[.overhead]"`, then callgrind_annotate --inclusive=yes: compare
// rpc::client::start with the handler's completion path (docs/bench-rpc.md).
// Calls: RDMAX_OVERHEAD_CALLS (default 3000), awaited then chained callbacks.
TEST_CASE("asio: calls in a row for a profiler (awaitable, callback)", "[.overhead]") {
    const char* env = std::getenv("RDMAX_OVERHEAD_CALLS");
    const int calls = env != nullptr ? std::atoi(env) : 3000;
    std::array<std::byte, 64> body{};
    int ok = 0;
    {
        world w;
        bool done = false;
        asio::co_spawn(
            w.ctx,
            [&]() -> awaitable {
                for (int i = 0; i < calls; ++i)
                    ok += (co_await w.acli->async_call(w.p, echo, body, {}, asio::use_awaitable))
                              .status == call_status::ok;
                done = true;
            },
            asio::detached);
        w.run_until([&] { return done; });
    }
    {
        world w;
        int left = calls;
        std::function<void()> next = [&] {
            if (left-- > 0)
                w.acli->async_call(w.p, echo, body, {}, [&](std::error_code ec, call_result) {
                    ok += !ec;
                    next();
                });
        };
        next();
        w.run_until([&] { return left < 0; });
    }
    CHECK(ok == 2 * calls);
}

TEST_CASE("asio: the calls a round's handlers start share one doorbell", "[asio][doorbell]") {
    const auto chains = [](bool batch) {
        rpc::async_options ao;
        ao.batch_doorbells = batch;
        world w(options(16), ao);
        int done = 0, good = 0;
        std::function<void(int, int)> next = [&](int k, int i) {
            if (i == 20) {
                ++done;
                return;
            }
            w.acli->async_call(w.p, echo, bytes_of("x"), {},
                               [&, k, i](std::error_code ec, const call_result& r) {
                                   good += !ec && text(r.reply) == "x" ? 1 : 0;
                                   next(k, i + 1);
                               });
        };
        for (int k = 0; k < 16; ++k)
            next(k, 0);
        w.run_until([&] { return done == 16; });
        CHECK(good == 16 * 20);
        CHECK(w.c->unrung.empty());
        CHECK_FALSE(w.c->held);
        return w.c->doorbells;
    };
    const std::uint32_t batched = chains(true);
    const std::uint32_t unbatched = chains(false);
    INFO("doorbells for 320 calls: batched " << batched << ", unbatched " << unbatched);
    CHECK(unbatched == 320);
    // The first 16 calls start outside any round (one each); the others in
    // rounds of up to 16 results.
    CHECK(batched < 16 + 304 / 4);
}

TEST_CASE("asio: a handler that throws leaves no call held", "[asio][doorbell]") {
    world w;
    w.flowing = false;
    bool second = false;
    w.acli->async_call(w.p, echo, bytes_of("a"), {}, [&](std::error_code, call_result) {
        w.acli->async_call(w.p, echo, bytes_of("b"), {}, [&](std::error_code ec, call_result r) {
            second = !ec && text(r.reply) == "b";
        });
        throw std::runtime_error("handler");
    });
    REQUIRE(w.move());
    w.ring();
    const std::size_t sent = w.c->outbox.size();
    CHECK_THROWS_AS(w.ctx.run_for(2s), std::runtime_error);
    CHECK(w.c->unrung.empty()); // the call it started went
    CHECK_FALSE(w.c->held);
    CHECK(w.c->outbox.size() == sent + 1);
    w.ctx.restart();
    w.flowing = true;
    w.run_until([&] { return second; });
}

TEST_CASE("a handler that closes the adapter after starting a call leaves nothing held",
          "[asio][doorbell]") {
    world w;
    bool first = false;
    std::optional<rpc::call_result> orphaned;
    w.acli->async_call(w.p, echo, bytes_of("a"), {}, [&](std::error_code, call_result) {
        first = true;
        w.acli->async_call(w.p, deferring, bytes_of("b"), {},
                           [&](std::error_code, call_result r) { orphaned = r; });
        w.acli.reset(); // closes: the call just started is cancelled
    });
    w.run_until([&] { return first && orphaned.has_value(); });
    CHECK(orphaned->status == call_status::cancelled);
    CHECK(w.c->unrung.empty());
    CHECK_FALSE(w.c->held);
    // The client is no longer holding: a call started on it directly rings at once.
    const std::uint32_t rung = w.c->doorbells;
    REQUIRE(w.cli->start(w.p, echo, bytes_of("c")) == call_status::ok);
    CHECK(w.c->doorbells == rung + 1);
}
