// Surviving failures, without a device and on a virtual clock: keepalive
// (detection within keepalive_timeout + 10 %), reconnect backoff and its
// jitter, calls re-sent after a reconnect and answered once (the server's
// reply cache), a server that restarted (unknown_outcome), calls that wait
// for the connection or fail fast, the reply cache's window and linger, and
// a drain. A real rpc::client and rpc::server talk through fake links
// (tests/support/fake_link.hpp); connections are cut, lost or silenced by
// hand. The same scenarios run on soft-RoCE in the resilience suite, where
// times are reported, not gated.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <malloc.h>
#include <map>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <rdmax/detail/rpc/reply_cache.hpp>

#include "../support/catch.hpp"
#include "../support/counting_new.hpp"
#include "../support/redialing_pair.hpp"

using namespace rdmax;
using namespace rdmax::test::rpc_unit;

namespace {

constexpr std::uint16_t run_once = 1; ///< counts its runs per call id, replies with the body
constexpr std::uint16_t deferring = 2;

rpc::rpc_options options() {
    rpc::rpc_options o;
    o.slots = 4;
    o.slot_bytes = 256;
    o.max_message = 64 << 10;
    o.local = false;
    o.call_timeout = 30s;
    o.housekeeping = 10ms;
    o.keepalive = 100ms;
    o.keepalive_timeout = 1000ms;
    o.reconnect_backoff = 50ms;
    o.reconnect_backoff_max = 400ms;
    o.reply_cache_linger = 2s;
    return o;
}

/// A client and a server, the connections between them made (and cut) by
/// hand, the server restartable, time virtual.
struct world : test::redialing_pair {
    std::map<std::uint64_t, int> runs; ///< executions per call id, over every server
    std::vector<rpc::deferred_call> deferred;
    std::vector<time_point> attempts; ///< when the client tried to connect again
    std::vector<peer_state> states;

    explicit world(rpc::rpc_options opts = options())
        : redialing_pair(opts) {
        start_server();
        connect([this] { attempts.push_back(virtual_now); });
        cli->on_state_change([this](peer_id, peer_state st) { states.push_back(st); });
    }
    void start_server() {
        make_server();
        srv->on(run_once, [this](rpc::request_context& ctx) {
            ++runs[ctx.call_id()];
            ctx.reply(ctx.body());
        });
        srv->on(deferring, [this](rpc::request_context& ctx) {
            ++runs[ctx.call_id()];
            deferred.push_back(ctx.defer());
        });
    }
    /// The server process dies and another starts (a new incarnation).
    void restart_server() {
        cut();
        srv.reset();
        start_server();
    }
    /// Everything in flight lands, both ways (unless `silent`: the server
    /// takes nothing and says nothing).
    void pump() {
        for (int round = 0; round < 64; ++round) {
            const bool moving = !c->outbox.empty() || !s->outbox.empty();
            (void)land_both_ways();
            if (!moving)
                return;
        }
    }
    /// Time passes in housekeeping steps; both sides poll (and the messages
    /// flow) at each, unless the server is silent.
    std::vector<call_result> tick(std::chrono::nanoseconds d, bool silent = false) {
        std::vector<call_result> got;
        for (auto end = virtual_now + d; virtual_now < end;) {
            virtual_now += o.housekeeping;
            const auto more = poll();
            got.insert(got.end(), more.begin(), more.end());
            if (!silent) {
                (void)srv->poll();
                pump();
            }
        }
        const auto more = poll();
        got.insert(got.end(), more.begin(), more.end());
        return got;
    }
    std::vector<call_result> poll() {
        std::array<call_result, 16> out;
        const int n = cli->poll(out);
        return {out.begin(), out.begin() + n};
    }
    call_status start(std::uint16_t method, std::string_view body, rpc::call_options co = {}) {
        return cli->start(p, method, bytes_of(body), co);
    }
    /// Controls the client sent on the current connection and not yet landed.
    [[nodiscard]] int controls_out(rpc::control what) const {
        return static_cast<int>(
            std::count_if(c->outbox.begin(), c->outbox.end(), [&](const auto& m) {
                const rpc::imm_fields f = rpc::decode_imm(m.imm);
                return rpc::is_control(f) && f.slot == static_cast<std::uint32_t>(what);
            }));
    }
};

} // namespace

TEST_CASE("keepalive: an idle link is probed each interval; a live peer's pong keeps it",
          "[rpc-resilience][keepalive]") {
    world w;
    (void)w.tick(350ms, true); // the server silent: probes pile up
    CHECK(w.controls_out(rpc::control::ping) >= 2);
    CHECK(w.controls_out(rpc::control::ping) <= 3);
    w.pump(); // they land; the server answers each
    CHECK(w.cli->state(w.p) == peer_state::ready);
    (void)w.tick(5s); // a peer that answers is never declared gone
    CHECK(w.cli->state(w.p) == peer_state::ready);
    CHECK(w.cli->counters().keepalive_timeouts == 0);
    // About one per interval, and the answer's round trip (a pong goes at
    // the server's next housekeeping round): at least one per two intervals.
    CHECK(w.cli->counters().keepalive_probes >= 25);
    CHECK(w.srv->counters().keepalive_timeouts == 0);
}

TEST_CASE("keepalive: a silent server is detected within keepalive_timeout + 10 %",
          "[rpc-resilience][keepalive]") {
    const auto timeout = GENERATE(1000ms, 300ms);
    rpc::rpc_options o = options();
    o.keepalive = timeout / 5;
    o.keepalive_timeout = timeout;
    world w(o);
    w.up = false; // it stays gone
    REQUIRE(w.start(run_once, "x") == call_status::ok);
    const time_point from = virtual_now;
    std::optional<time_point> detected;
    while (virtual_now - from < 3 * timeout) {
        (void)w.tick(o.housekeeping, true); // no connection event ever comes
        if (w.cli->state(w.p) != peer_state::ready) {
            detected = virtual_now;
            break;
        }
    }
    REQUIRE(detected);
    const auto took = *detected - from;
    INFO("detected after " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                           << " ms, keepalive_timeout " << timeout.count() << " ms");
    CHECK(took >= timeout);
    CHECK(took <= timeout + timeout / 10);
    std::printf(
        "keepalive (virtual clock, housekeeping %lld ms): silent server detected %lld ms "
        "after the call started, keepalive_timeout %lld ms\n",
        static_cast<long long>(
            std::chrono::duration_cast<std::chrono::milliseconds>(o.housekeeping).count()),
        static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()),
        static_cast<long long>(timeout.count()));
    CHECK(w.cli->counters().keepalive_timeouts == 1);
    CHECK(w.states.front() == peer_state::reconnecting);
}

TEST_CASE("keepalive: the server drops a client silent for keepalive_timeout",
          "[rpc-resilience][keepalive]") {
    world w;
    REQUIRE(w.srv->peers() == 1);
    for (int i = 0; i < 120 && w.srv->peers() == 1; ++i) {
        virtual_now += w.o.housekeeping;
        (void)w.srv->poll(); // the client never polls: never answers
    }
    CHECK(w.srv->peers() == 0);
    CHECK(w.srv->counters().keepalive_timeouts == 1);
    CHECK(w.srv->cached_clients() == 1); // its replies linger for its reconnect
    virtual_now += w.o.reply_cache_linger - 20ms;
    (void)w.srv->poll();
    CHECK(w.srv->cached_clients() == 1);
    virtual_now += 30ms;
    (void)w.srv->poll();
    CHECK(w.srv->cached_clients() == 0); // and go after reply_cache_linger
}

TEST_CASE("reconnect: backoff doubles from reconnect_backoff up to its most, each wait "
          "jittered to 50-100 %; the session is ready at the first attempt that works",
          "[rpc-resilience][reconnect]") {
    world w;
    w.up = false;
    w.cut();
    const time_point lost = virtual_now;
    (void)w.tick(3s);
    REQUIRE(w.attempts.size() >= 8);
    // A link that failed: soon (a random part of the first step).
    // (Seen at a housekeeping round, tried at a later one.)
    CHECK(w.attempts[0] - lost <= w.o.reconnect_backoff / 2 + 2 * w.o.housekeeping);
    // The step doubled once when the connection was lost, and at each failure.
    std::chrono::nanoseconds step = 2 * w.o.reconnect_backoff;
    for (std::size_t i = 1; i < w.attempts.size(); ++i) {
        const auto gap = w.attempts[i] - w.attempts[i - 1];
        INFO("attempt " << i << " after " << gap.count() << " ns, step " << step.count());
        CHECK(gap >= step / 2);
        CHECK(gap <= step + w.o.housekeeping);
        step = std::min<std::chrono::nanoseconds>(2 * step, w.o.reconnect_backoff_max);
    }
    CHECK(w.cli->state(w.p) == peer_state::reconnecting);
    CHECK(w.cli->counters().reconnect_attempts == w.attempts.size());
    w.up = true;
    const time_point back = virtual_now;
    const std::size_t tried = w.attempts.size();
    for (int i = 0; i < 100 && w.cli->state(w.p) != peer_state::ready; ++i)
        (void)w.tick(w.o.housekeeping);
    CHECK(w.cli->state(w.p) == peer_state::ready);
    CHECK(w.attempts.size() == tried + 1);
    CHECK(virtual_now - back <= w.o.reconnect_backoff_max + w.o.housekeeping);
    CHECK(w.cli->counters().reconnects == 1);
    CHECK(w.states == std::vector<peer_state>{peer_state::reconnecting, peer_state::ready});
}

TEST_CASE("retry: a reply lost with its connection is answered from the reply cache, "
          "the handler run once",
          "[rpc-resilience][retry]") {
    world w;
    rpc::call_options co;
    co.cookie = 7;
    REQUIRE(w.start(run_once, "once", co) == call_status::ok);
    // The request lands and runs; its reply is lost with the connection.
    while (!w.c->outbox.empty())
        if (const auto imm = w.c->land_one())
            inside::receive_imm(*w.srv, *w.s, *imm);
    REQUIRE(w.runs.size() == 1);
    w.cut();
    const auto got = w.tick(200ms);
    REQUIRE(got.size() == 1);
    CHECK(got[0].status == call_status::ok);
    CHECK(got[0].cookie == 7);
    CHECK(got[0].peer == w.p);
    CHECK(text(got[0].reply) == "once");
    CHECK(w.runs.begin()->second == 1);
    CHECK(w.srv->counters().duplicates == 1);
    CHECK(w.cli->counters().retried_calls == 1);
}

TEST_CASE("retry: a request lost with its connection runs once on the next",
          "[rpc-resilience][retry]") {
    world w;
    REQUIRE(w.start(run_once, "lost") == call_status::ok);
    w.cut(); // it never landed
    const auto got = w.tick(200ms);
    REQUIRE(got.size() == 1);
    CHECK(got[0].status == call_status::ok);
    CHECK(text(got[0].reply) == "lost");
    REQUIRE(w.runs.size() == 1);
    CHECK(w.runs.begin()->second == 1);
    CHECK(w.srv->counters().duplicates == 0);
}

TEST_CASE("retry: call() waits through the reconnect and gets its reply",
          "[rpc-resilience][retry]") {
    world w;
    w.up = false;
    w.cut();
    (void)w.tick(100ms);
    REQUIRE(w.cli->state(w.p) == peer_state::reconnecting);
    REQUIRE(w.start(run_once, "queued") == call_status::ok); // waits, copied
    rpc::call_options quick;
    quick.fail_fast = true;
    CHECK(w.start(run_once, "nope", quick) == call_status::peer_gone);
    w.up = true;
    const auto got = w.tick(1s);
    REQUIRE(got.size() == 1);
    CHECK(got[0].status == call_status::ok);
    CHECK(text(got[0].reply) == "queued");
    CHECK(w.cli->counters().retried_calls == 0); // it had never gone: a first copy
}

TEST_CASE("retry: a call waiting for the connection ends timed_out at its deadline",
          "[rpc-resilience][retry]") {
    world w;
    w.up = false;
    w.cut();
    (void)w.tick(50ms);
    rpc::call_options co;
    co.timeout = 300ms;
    REQUIRE(w.start(run_once, "late", co) == call_status::ok);
    const auto got = w.tick(400ms);
    REQUIRE(got.size() == 1);
    CHECK(got[0].status == call_status::timed_out);
    CHECK(w.runs.empty());
}

TEST_CASE("retry: after a server restart a call that may have run ends unknown_outcome; "
          "an idempotent one is sent again",
          "[rpc-resilience][retry][restart]") {
    world w;
    rpc::call_options plain;
    plain.cookie = 1;
    rpc::call_options idem;
    idem.cookie = 2;
    idem.idempotent = true;
    REQUIRE(w.start(run_once, "a", plain) == call_status::ok);
    REQUIRE(w.start(run_once, "b", idem) == call_status::ok);
    while (!w.c->outbox.empty()) // both run on the old server
        if (const auto imm = w.c->land_one())
            inside::receive_imm(*w.srv, *w.s, *imm);
    REQUIRE(w.runs.size() == 2);
    const std::uint64_t before = w.srv->incarnation();
    w.restart_server();
    CHECK(w.srv->incarnation() != before);
    auto got = w.tick(300ms);
    std::sort(got.begin(), got.end(),
              [](const call_result& x, const call_result& y) { return x.cookie < y.cookie; });
    REQUIRE(got.size() == 2);
    CHECK(got[0].status == call_status::unknown_outcome);
    CHECK(got[1].status == call_status::ok);
    CHECK(text(got[1].reply) == "b");
    CHECK(w.cli->counters().unknown_outcomes == 1);
    for (const auto& [id, n] : w.runs) // "a" ran once (the old server); "b" twice, by design
        CHECK(n <= (id == w.runs.rbegin()->first ? 2 : 1));
}

TEST_CASE("retry: a copy that comes while its first is deferred waits for that answer",
          "[rpc-resilience][retry][deferred]") {
    world w;
    REQUIRE(w.start(deferring, "slow") == call_status::ok);
    w.pump();
    REQUIRE(w.deferred.size() == 1);
    w.cut();
    auto got = w.tick(200ms); // reconnected, re-sent: the copy waits
    CHECK(got.empty());
    CHECK(w.deferred.size() == 1); // not run again
    CHECK(w.srv->counters().duplicates == 1);
    // The first copy's connection is gone: its answer goes to the copy.
    CHECK(w.srv->reply(w.deferred[0], bytes_of("done")));
    w.pump();
    got = w.tick(20ms);
    REQUIRE(got.size() == 1);
    CHECK(got[0].status == call_status::ok);
    CHECK(text(got[0].reply) == "done");
    CHECK(w.runs.begin()->second == 1);
}

TEST_CASE("retry: an answer given after the connection went is kept for the copy",
          "[rpc-resilience][retry][deferred]") {
    world w;
    w.up = false;
    REQUIRE(w.start(deferring, "slow") == call_status::ok);
    w.pump();
    REQUIRE(w.deferred.size() == 1);
    w.cut();
    (void)w.tick(100ms);
    CHECK_FALSE(w.srv->reply(w.deferred[0], bytes_of("kept"))); // nobody to send it to yet
    w.up = true;
    const auto got = w.tick(1s);
    REQUIRE(got.size() == 1);
    CHECK(got[0].status == call_status::ok);
    CHECK(text(got[0].reply) == "kept");
    CHECK(w.deferred.size() == 1);
}

TEST_CASE("reply cache: a copy of a call the window let go ends unknown_outcome, "
          "never runs again",
          "[rpc-resilience][reply-cache]") {
    rpc::rpc_options o = options();
    o.reply_cache_calls = 2;
    world w(o);
    REQUIRE(w.start(run_once, "first") == call_status::ok);
    while (!w.c->outbox.empty())
        if (const auto imm = w.c->land_one())
            inside::receive_imm(*w.srv, *w.s, *imm);
    // Its reply is held back; two later calls push it out of the window.
    auto held = std::move(w.s->outbox);
    w.s->outbox.clear();
    for (const char* b : {"second", "third"}) {
        REQUIRE(w.start(run_once, b) == call_status::ok);
        w.pump();
    }
    CHECK(w.poll().size() == 2);
    w.cut();
    const auto got = w.tick(200ms);
    REQUIRE(got.size() == 1);
    CHECK(got[0].status == call_status::unknown_outcome);
    for (const auto& [id, n] : w.runs)
        CHECK(n == 1);
    CHECK(w.srv->counters().unknown_outcomes == 1);
}

TEST_CASE("reply cache: freed at the client's goodbye, or after the linger",
          "[rpc-resilience][reply-cache]") {
    SECTION("goodbye") {
        world w;
        REQUIRE(w.start(run_once, "x") == call_status::ok);
        w.pump();
        CHECK(w.srv->cached_clients() == 1);
        CHECK(w.srv->cached_calls() == 1);
        w.cli->disconnect(w.p);
        w.pump();
        (void)w.tick(20ms, true);
        (void)w.srv->poll();
        CHECK(w.srv->peers() == 0);
        CHECK(w.srv->cached_clients() == 0);
        CHECK(w.cli->state(w.p) == peer_state::closed);
    }
    SECTION("crash: the linger") {
        world w;
        w.up = false;
        REQUIRE(w.start(run_once, "x") == call_status::ok);
        w.pump();
        w.cut();
        (void)w.tick(100ms);
        CHECK(w.srv->peers() == 0);
        CHECK(w.srv->cached_clients() == 1);
        (void)w.tick(w.o.reply_cache_linger);
        CHECK(w.srv->cached_clients() == 0);
    }
}

TEST_CASE("drain: goaway, acknowledged; calls in flight answered, new ones wait; then the "
          "client connects again",
          "[rpc-resilience][drain]") {
    world w;
    REQUIRE(w.start(deferring, "in flight") == call_status::ok);
    w.pump();
    inside::begin_drain(*w.srv);
    (void)w.tick(20ms);
    CHECK(w.srv->counters().goaways == 1);
    CHECK(w.cli->state(w.p) == peer_state::draining);
    CHECK_FALSE(inside::drained(*w.srv));                   // the deferred call is not answered
    REQUIRE(w.start(run_once, "after") == call_status::ok); // waits for the next connection
    CHECK(w.runs.size() == 1);
    REQUIRE(w.srv->reply(w.deferred[0], bytes_of("finished")));
    auto got = w.tick(20ms);
    REQUIRE(got.size() == 1);
    CHECK(text(got[0].reply) == "finished");
    CHECK(inside::drained(*w.srv));
    inside::end_drain(*w.srv);
    w.c->leave();     // the close reaches the client
    w.start_server(); // another server takes the address
    got = w.tick(1s);
    REQUIRE(got.size() == 1);
    CHECK(got[0].status == call_status::ok);
    CHECK(text(got[0].reply) == "after");
    CHECK(w.cli->state(w.p) == peer_state::ready);
    CHECK(w.attempts.size() == 1);
}

TEST_CASE("control messages a side may not send end the link", "[rpc-resilience][reject]") {
    world w;
    // A client that says goaway (the server's to say).
    inside::receive_imm(*w.srv, *w.s,
                        rpc::encode_imm(rpc::message_kind::request,
                                        static_cast<std::uint32_t>(rpc::control::goaway), 0));
    CHECK(w.srv->counters().rejected_malformed == 1);
    // A server that says bye (the client's).
    inside::receive_imm(*w.cli, *w.c,
                        rpc::encode_imm(rpc::message_kind::reply,
                                        static_cast<std::uint32_t>(rpc::control::bye), 0));
    CHECK(w.cli->counters().rejected_malformed == 1);
    CHECK(w.cli->state(w.p) != peer_state::ready);
}

TEST_CASE("retry: a copy that waited for a first copy that never ran (its body was being read "
          "when its connection went) runs in its stead, once",
          "[rpc-resilience][retry]") {
    world w;
    const std::string big(1000, 'b'); // over the slot: the server READs it
    std::vector<std::byte> back(1000);
    rpc::call_options co;
    co.reply_into = back;
    REQUIRE(w.start(run_once, big, co) == call_status::ok);
    w.s->hold_completions = true; // the READ does not complete
    while (!w.c->outbox.empty())
        if (const auto imm = w.c->land_one())
            inside::receive_imm(*w.srv, *w.s, *imm);
    REQUIRE(w.s->reads_started == 1);
    CHECK(w.runs.empty());
    // The connection fails; the client connects again and sends the copy,
    // which reaches the server before it has noticed the first connection went.
    w.cut();
    for (int i = 0; i < 10 && w.attempts.empty(); ++i) {
        virtual_now += w.o.housekeeping;
        (void)w.poll();
    }
    REQUIRE(w.attempts.size() == 1);
    while (!w.c->outbox.empty())
        if (const auto imm = w.c->land_one())
            inside::receive_imm(*w.srv, *w.s, *imm);
    CHECK(w.runs.empty()); // it waits for the first copy
    CHECK(w.srv->counters().duplicates == 1);
    // The server tears the first connection down: the first copy never ran,
    // so the waiting one runs now.
    const auto got = w.tick(100ms);
    REQUIRE(got.size() == 1);
    CHECK(got[0].status == call_status::ok);
    CHECK(text(got[0].reply) == big);
    REQUIRE(w.runs.size() == 1);
    CHECK(w.runs.begin()->second == 1);
}

TEST_CASE("retry: a copy the server can no longer vouch for (its record of the client lingered "
          "out) ends unknown_outcome, never runs again",
          "[rpc-resilience][retry]") {
    world w;
    REQUIRE(w.start(run_once, "pay") == call_status::ok);
    // The request lands and runs; its reply is lost with the connection.
    while (!w.c->outbox.empty())
        if (const auto imm = w.c->land_one())
            inside::receive_imm(*w.srv, *w.s, *imm);
    REQUIRE(w.runs.size() == 1);
    w.up = false; // a partition longer than reply_cache_linger
    w.cut();
    (void)w.tick(w.o.reply_cache_linger + 500ms);
    REQUIRE(w.srv->cached_clients() == 0); // the server forgot this client
    w.up = true;
    const auto got = w.tick(1s);
    REQUIRE(got.size() == 1);
    INFO("status " << static_cast<int>(got[0].status));
    CHECK(w.runs.begin()->second == 1);                   // ran twice
    CHECK(got[0].status == call_status::unknown_outcome); // docs/rpc.md's table
}

TEST_CASE("retry: calls requeued with every slot in flight are re-sent after failed attempts",
          "[rpc-resilience][retry]") {
    const int calls = GENERATE(3, 4); // 3 of 4 slots: fine; all 4: never re-sent
    world w;
    for (int i = 0; i < calls; ++i)
        REQUIRE(w.start(run_once, "c" + std::to_string(i)) == call_status::ok);
    w.up = false;
    w.cut();             // nothing landed
    (void)w.tick(200ms); // the first attempts fail; the old link is torn down
    w.up = true;
    const auto got = w.tick(2s);
    INFO("results " << got.size() << ", runs " << w.runs.size() << ", in_flight "
                    << w.cli->in_flight());
    CHECK(got.size() == static_cast<std::size_t>(calls));
    CHECK(w.runs.size() == static_cast<std::size_t>(calls));
}

TEST_CASE("drain: a drained session is not given up at its first failed attempt",
          "[rpc-resilience][drain]") {
    rpc::rpc_options o = options();
    o.reconnect_give_up = 10s;
    world w(o);
    inside::begin_drain(*w.srv);
    (void)w.tick(20ms);
    // Told, nothing in flight: it closed its side too and waits to connect again.
    REQUIRE(w.cli->state(w.p) == peer_state::reconnecting);
    inside::end_drain(*w.srv);
    w.up = false; // the next server is not up yet
    w.c->leave();
    (void)w.tick(200ms);
    CHECK(w.cli->state(w.p) == peer_state::reconnecting);
}

TEST_CASE("hostile: a node-local server that rewrites a staged request cannot change what the "
          "client re-sends to the next server (method, descriptors of its memory)",
          "[rpc-resilience][retry][hostile]") {
    rpc::rpc_options o = options();
    auto cli = inside::make_client(o);
    inside::use_clock(*cli, &virtual_clock);
    auto srv = inside::make_server(o);
    inside::use_clock(*srv, &virtual_clock);
    std::string seen;
    int honest_runs = 0;
    srv->on(run_once, [&](rpc::request_context& ctx) {
        ++honest_runs;
        ctx.reply(ctx.body());
    });
    srv->on(9, [&](rpc::request_context& ctx) {
        seen = text(ctx.body());
        ctx.reply({});
    });
    // The first connection: node-local (the client stages its requests in the server's ring).
    auto ca = std::make_shared<fake_end>(fake_path::node_local, o.slots, o.slot_bytes);
    auto sa = std::make_shared<fake_end>(fake_path::node_local, o.slots, o.slot_bytes);
    ca->peer = sa.get();
    sa->peer = ca.get();
    (void)inside::adopt(*srv, sa, cli->incarnation());
    const peer_id p = inside::adopt(*cli, ca, srv->incarnation());
    std::shared_ptr<fake_end> cb, sb;
    inside::redial(*cli, [&]() -> std::unique_ptr<rpc::detail::link> {
        cb = std::make_shared<fake_end>(fake_path::device, o.slots, o.slot_bytes);
        sb = std::make_shared<fake_end>(fake_path::device, o.slots, o.slot_bytes);
        cb->peer = sb.get();
        sb->peer = cb.get();
        (void)inside::adopt(*srv, sb, cli->incarnation(), inside::next_call(*cli));
        auto w = std::make_unique<test::fake_link>(cb);
        w->peer_incarnation = srv->incarnation();
        return w;
    });
    static const std::string secret = "the client's private key";
    const std::string body(40 - sizeof(rpc::message_header), 'x'); // 40 bytes staged
    REQUIRE(cli->start(p, run_once, bytes_of(body)) == call_status::ok);
    // Find the staged request in the shared segment (the server's ring) and rewrite it.
    std::uint32_t slot = 0;
    for (; slot < o.slots; ++slot)
        if (rpc::detail::load<rpc::message_header>(sa->slot_in(slot)).method == run_once)
            break;
    REQUIRE(slot < o.slots);
    auto h = rpc::detail::load<rpc::message_header>(sa->slot_in(slot));
    h.method = 9;
    h.flags = static_cast<std::uint8_t>((h.flags & ~0x3F) | rpc::flag_external_body |
                                        (h.flags & rpc::flag_epoch));
    h.body_bytes = static_cast<std::uint32_t>(secret.size());
    const rpc::buffer_descriptor d{reinterpret_cast<std::uint64_t>(secret.data()), 0,
                                   static_cast<std::uint32_t>(secret.size())};
    std::memcpy(sa->slot_in(slot), &h, sizeof h);
    std::memcpy(sa->slot_in(slot) + sizeof h, &d, sizeof d);
    // The connection fails before the server took the request; the client reconnects.
    ca->outbox.clear();
    ca->leave();
    sa->leave();
    for (int i = 0; i < 100; ++i) {
        virtual_now += o.housekeeping;
        std::array<call_result, 4> out;
        (void)cli->poll(out);
        (void)srv->poll();
        if (cb) {
            while (!cb->outbox.empty())
                if (const auto imm = cb->land_one())
                    inside::receive_imm(*srv, *sb, *imm);
            (void)srv->poll();
            while (!sb->outbox.empty())
                if (const auto imm = sb->land_one())
                    inside::receive_imm(*cli, *cb, *imm);
        }
    }
    REQUIRE(cb);
    CHECK(honest_runs == 1); // the caller's method, with the caller's body
    CHECK(seen.empty());     // not another method, with the client's own memory
    INFO("the next server was sent: \"" << seen << "\"");
    CHECK(seen != secret);
}

TEST_CASE("reply cache: the memory it holds stays within reply_cache_bytes (capacity counted)",
          "[rpc-resilience][reply-cache][memory]") {
    rpc::detail::reply_cache_limits lim;
    lim.calls = 256;
    lim.bytes = 64 << 10; // one 64 KiB reply at a time
    rpc::detail::reply_cache cache(lim);
    const std::uint64_t client = 42;
    cache.attach(client, 1);
    const std::vector<std::byte> big(64 << 10), none;
    const auto before = ::mallinfo2().uordblks;
    std::uint64_t id = 1;
    // Each pass round the ring keeps one large reply within the budget, in
    // the next entry each time; the entries before keep their capacity.
    for (std::uint32_t pass = 0; pass < lim.calls; ++pass)
        for (std::uint32_t k = 0; k < lim.calls; ++k, ++id) {
            std::optional<rpc::detail::reply_cache::entry_ref> at;
            REQUIRE(cache.admit(client, id, false, virtual_now, at) ==
                    rpc::detail::reply_cache::verdict::run);
            (void)cache.done(*at, call_status::ok, k == pass ? big : none, virtual_now);
        }
    const auto held = ::mallinfo2().uordblks - before;
    INFO("reply bytes counted " << cache.bytes() << ", heap held " << (held >> 10) << " KiB");
    CHECK(cache.bytes() <= lim.bytes);
    CHECK(held <= 4 * lim.bytes); // budget plus slack
}

TEST_CASE("retry: a re-sent call whose new connection fails at its send waits for the next one",
          "[rpc-resilience][retry]") {
    world w;
    REQUIRE(w.start(run_once, "pay") == call_status::ok);
    while (!w.c->outbox.empty()) // it ran; its reply is lost
        if (const auto imm = w.c->land_one())
            inside::receive_imm(*w.srv, *w.s, *imm);
    REQUIRE(w.runs.size() == 1);
    int dials = 0;
    inside::redial(*w.cli, [&]() -> std::unique_ptr<rpc::detail::link> {
        auto e = w.join();
        if (++dials == 1)
            e->send_result = status::qp_failed; // this one breaks at its first send
        auto l = std::make_unique<test::fake_link>(e);
        l->peer_incarnation = w.srv->incarnation();
        return l;
    });
    w.cut();
    const auto got = w.tick(1s);
    REQUIRE(got.size() == 1);
    INFO("dials " << dials << ", status " << static_cast<int>(got[0].status));
    CHECK(got[0].status == call_status::ok); // answered from the cache on the next connection
}

TEST_CASE("reply cache: records of clients that left are bounded (2 x max_peers)",
          "[rpc-resilience][reply-cache][memory]") {
    rpc::rpc_options o = options();
    auto srv = inside::make_server(o);
    inside::use_clock(*srv, &virtual_clock);
    const auto before = ::mallinfo2().uordblks;
    constexpr int clients = 2000; // 2000 short-lived clients (or one that forges incarnations)
    for (int i = 0; i < clients; ++i) {
        auto e = std::make_shared<fake_end>(fake_path::device, o.slots, o.slot_bytes);
        (void)inside::adopt(*srv, e, 1000 + static_cast<std::uint64_t>(i));
        e->leave(); // connects, leaves without a word (no bye)
        inside::housekeep_next_poll(*srv);
        (void)srv->poll();
    }
    const auto held = ::mallinfo2().uordblks - before;
    INFO("records " << srv->cached_clients() << ", peers " << srv->peers() << ", heap held "
                    << (held >> 20) << " MiB, max_peers " << o.max_peers);
    CHECK(srv->cached_clients() <= 2 * std::size_t{o.max_peers});
}

TEST_CASE("retry: a handler that ran and answered read_failed is kept as run (handler_failed)",
          "[rpc-resilience][retry]") {
    world w;
    constexpr std::uint16_t fails_read = 5;
    w.srv->on(fails_read, [&](rpc::request_context& ctx) {
        ++w.runs[ctx.call_id()]; // side effects done; it reports a read of its own failed
        ctx.fail(call_status::read_failed);
    });
    REQUIRE(w.start(fails_read, "debit") == call_status::ok);
    while (!w.c->outbox.empty()) // it runs; its answer is lost with the connection
        if (const auto imm = w.c->land_one())
            inside::receive_imm(*w.srv, *w.s, *imm);
    REQUIRE(w.runs.size() == 1);
    w.cut();
    const auto got = w.tick(200ms);
    REQUIRE(got.size() == 1);
    CHECK(got[0].status ==
          call_status::handler_failed); // the server's own status is not a handler's
    CHECK(w.runs.begin()->second == 1);
}

TEST_CASE("reply cache: no allocation per call once the ring has been round",
          "[rpc-resilience][reply-cache][hot]") {
    rpc::detail::reply_cache cache(rpc::detail::reply_cache_limits{});
    const std::uint64_t client = 7;
    cache.attach(client, 1);
    const std::vector<std::byte> reply(64, std::byte{9});
    std::uint64_t id = 1;
    const auto run = [&](int calls) {
        for (int i = 0; i < calls; ++i, ++id) {
            std::optional<rpc::detail::reply_cache::entry_ref> at;
            (void)cache.admit(client, id, false, virtual_now, at);
            (void)cache.done(*at, call_status::ok, reply, virtual_now);
        }
    };
    run(static_cast<int>(rpc::detail::reply_cache_limits{}.calls)); // once round the ring
    const std::uint64_t before = test::allocations.load();
    run(2000);
    const std::uint64_t during = test::allocations.load() - before;
    CHECK(during == 0);
}

TEST_CASE("hostile: a client that flags every call a retry is dropped, not searched for",
          "[rpc-resilience][hostile]") {
    world w;
    const auto forge = [&](std::uint64_t call_id) {
        rpc::message_header h;
        h.call_seq = static_cast<std::uint32_t>(call_id);
        h.method = run_once;
        h.flags = rpc::flag_retry | rpc::flag_epoch;
        h.call_id = call_id;
        w.s->write_slot(0, std::as_bytes(std::span(&h, 1)));
        inside::receive_imm(*w.srv, *w.s,
                            rpc::encode_imm(rpc::message_kind::request, 0, sizeof h, true));
    };
    // A "copy" of a call this connection's handshake says was never sent before it.
    forge(inside::next_call(*w.cli) + 5);
    CHECK(w.srv->counters().rejected_malformed == 1);
    CHECK(w.runs.empty());
}

TEST_CASE("reconnect: a server that accepts and drops at once is not redialled every round",
          "[rpc-resilience][reconnect]") {
    world w;
    inside::redial(*w.cli, [&]() -> std::unique_ptr<rpc::detail::link> {
        w.attempts.push_back(virtual_now);
        auto e = w.join();
        e->leave(); // a crash-looping server: the connection is made, then ends
        w.s->leave();
        auto l = std::make_unique<test::fake_link>(e);
        l->peer_incarnation = w.srv->incarnation();
        return l;
    });
    w.cut();
    (void)w.tick(1s);
    INFO("attempts in 1 s: " << w.attempts.size() << " (backoff 50 ms doubling to 400 ms)");
    CHECK(w.attempts.size() <= 8);
}
