// The load client of the resilience suite (tests/rxe/run_resilience.sh).
//
//   resilience_client --addr ADDR --port PORT --tag N --json FILE --outcomes FILE
//                     [--inflight K] [--seconds S] [--size BYTES] [--die-after N]
//                     [--connect-seconds S]
//   resilience_client --addr ADDR --port PORT --finish
//
// Keeps K calls in flight (default 16) to resilience_server, mixed: even
// sequence numbers call method 1 marked idempotent, odd ones method 2 (not
// idempotent). A request starts with the tag and its sequence number, then
// bytes that depend on both; every ok reply must echo it exactly. Runs until
// SIGTERM or S seconds (default 300), then starts nothing new and waits for
// every call in flight to end (each has its deadline: RDMAX_RPC_TIMEOUT_MS).
// --die-after N: raises SIGKILL on itself once N calls ended ok, with calls
// in flight (a client killed mid-call). --finish: one call of method 3,
// which ends the server (its host cannot see the clients end).
//
// OUTCOMES gets one line a method-2 call, "TAG SEQ STATUS" (STATUS a number,
// rpc::call_status), for the checker to hold against the server's log. JSON
// gets the counts by outcome, latency of ok calls (p50, p99), calls/s, the
// connection's state changes and every gap of over 200 ms between two ok
// results (wall-clock seconds), and the client's counters. State changes and
// the first ok after a gap are also said on stdout as they happen
// ("state reconnecting at T", "resumed at T after G s"), and every 500th
// ok result ("progress N ok").
// Exit status 0 when every call ended ok or unknown_outcome and every reply
// was right; 1 otherwise.
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <getopt.h>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

namespace {

using namespace rdmax;
using steady = std::chrono::steady_clock;

volatile std::sig_atomic_t stop_requested = 0;
extern "C" void on_term(int /*sig*/) {
    stop_requested = 1;
}

struct options {
    std::string addr;
    std::uint16_t port = 7480;
    std::uint64_t tag = 1;
    std::string json;
    std::string outcomes;
    int inflight = 16;
    int seconds = 300;
    std::size_t size = 64;
    long die_after = 0;
    int connect_seconds = 60;
    bool finish = false;
};

[[noreturn]] void usage() {
    std::fputs("usage: resilience_client --addr ADDR --port PORT --tag N --json FILE "
               "--outcomes FILE [--inflight K] [--seconds S] [--size BYTES] [--die-after N] "
               "[--connect-seconds S] | --finish\n",
               stderr);
    std::exit(2);
}

options parse(int argc, char** argv) {
    static const option longs[] = {{"addr", required_argument, nullptr, 'a'},
                                   {"port", required_argument, nullptr, 'p'},
                                   {"tag", required_argument, nullptr, 't'},
                                   {"json", required_argument, nullptr, 'j'},
                                   {"outcomes", required_argument, nullptr, 'o'},
                                   {"inflight", required_argument, nullptr, 'k'},
                                   {"seconds", required_argument, nullptr, 's'},
                                   {"size", required_argument, nullptr, 'b'},
                                   {"die-after", required_argument, nullptr, 'd'},
                                   {"connect-seconds", required_argument, nullptr, 'c'},
                                   {"finish", no_argument, nullptr, 'f'},
                                   {nullptr, 0, nullptr, 0}};
    options o;
    for (int c; (c = getopt_long(argc, argv, "", longs, nullptr)) != -1;) {
        switch (c) {
        case 'a': o.addr = optarg; break;
        case 'p': o.port = static_cast<std::uint16_t>(std::atoi(optarg)); break;
        case 't': o.tag = std::strtoull(optarg, nullptr, 10); break;
        case 'j': o.json = optarg; break;
        case 'o': o.outcomes = optarg; break;
        case 'k': o.inflight = std::max(1, std::atoi(optarg)); break;
        case 's': o.seconds = std::atoi(optarg); break;
        case 'b': o.size = std::max<std::size_t>(16, std::strtoull(optarg, nullptr, 10)); break;
        case 'd': o.die_after = std::atol(optarg); break;
        case 'c': o.connect_seconds = std::atoi(optarg); break;
        case 'f': o.finish = true; break;
        default: usage();
        }
    }
    if (optind != argc || o.addr.empty() ||
        (o.die_after == 0 && !o.finish && (o.json.empty() || o.outcomes.empty())))
        usage();
    return o;
}

double wall_now() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

/// The request of call `seq`: tag, seq, then bytes of both.
void fill(std::vector<std::byte>& req, std::uint64_t tag, std::uint64_t seq) {
    std::memcpy(req.data(), &tag, 8);
    std::memcpy(req.data() + 8, &seq, 8);
    for (std::size_t j = 16; j < req.size(); ++j)
        req[j] = static_cast<std::byte>((seq * 131 + tag * 7 + j) % 251);
}

struct gap {
    double from = 0, to = 0;
};

struct tally {
    std::map<rpc::call_status, long> by_status;
    std::map<rpc::call_status, long> refused; ///< start() said no
    long ok_idempotent = 0, ok_not = 0, bad_replies = 0, done = 0;
    std::vector<double> lat_us;
    std::vector<std::pair<double, rpc::peer_state>> states;
    std::vector<gap> gaps;
    double last_ok = 0;
};

std::string json_of(const options& o, const tally& t, const rpc::client& cli, double secs) {
    std::vector<double> lat = t.lat_us;
    std::sort(lat.begin(), lat.end());
    const auto pct = [&](double p) {
        return lat.empty()
                   ? 0.0
                   : lat[std::min(lat.size() - 1,
                                  static_cast<std::size_t>(p * static_cast<double>(lat.size())))];
    };
    const auto count = [&](rpc::call_status s) {
        const auto it = t.by_status.find(s);
        return it == t.by_status.end() ? 0L : it->second;
    };
    long other = 0;
    for (const auto& [s, n] : t.by_status)
        if (s != rpc::call_status::ok && s != rpc::call_status::unknown_outcome &&
            s != rpc::call_status::peer_gone && s != rpc::call_status::timed_out)
            other += n;
    std::string states, gaps, refused;
    for (const auto& [when, st] : t.states)
        states += fmt::format(R"({}{{"t": {:.3f}, "state": "{}"}})", states.empty() ? "" : ", ",
                              when, st);
    for (const gap& g : t.gaps)
        gaps += fmt::format(R"({}{{"from": {:.3f}, "to": {:.3f}}})", gaps.empty() ? "" : ", ",
                            g.from, g.to);
    for (const auto& [s, n] : t.refused)
        refused += fmt::format("{}\"{}\": {}", refused.empty() ? "" : ", ",
                               static_cast<std::uint32_t>(s), n);
    const rpc::rpc_counters& c = cli.counters();
    return fmt::format(
        "{{\"tag\": {}, \"calls\": {}, \"ok\": {}, \"ok_idempotent\": {}, \"ok_not_idempotent\": "
        "{}, \"unknown_outcome\": {}, \"peer_gone\": {}, \"timed_out\": {}, \"other\": {}, "
        "\"bad_replies\": {}, \"refused_at_start\": {{{}}}, \"seconds\": {:.3f}, "
        "\"calls_per_s\": {:.1f}, \"p50_us\": {:.1f}, \"p99_us\": {:.1f}, \"inflight\": {}, "
        "\"states\": [{}], \"gaps\": [{}], \"counters\": {{\"reconnects\": {}, "
        "\"reconnect_attempts\": {}, \"retried_calls\": {}, \"unknown_outcomes\": {}, "
        "\"keepalive_probes\": {}, \"keepalive_timeouts\": {}, \"goaways\": {}, \"timed_out\": "
        "{}, \"link_failures\": {}}}}}\n",
        o.tag, t.done, count(rpc::call_status::ok), t.ok_idempotent, t.ok_not,
        count(rpc::call_status::unknown_outcome), count(rpc::call_status::peer_gone),
        count(rpc::call_status::timed_out), other, t.bad_replies, refused, secs,
        secs > 0 ? static_cast<double>(count(rpc::call_status::ok)) / secs : 0.0, pct(0.5),
        pct(0.99), o.inflight, states, gaps, c.reconnects, c.reconnect_attempts, c.retried_calls,
        c.unknown_outcomes, c.keepalive_probes, c.keepalive_timeouts, c.goaways, c.timed_out,
        c.link_failures);
}

rpc::peer_id connect_with_retries(rpc::client& cli, const options& o) {
    const auto until = steady::now() + std::chrono::seconds(o.connect_seconds);
    for (;;) {
        try {
            return cli.connect(o.addr, o.port);
        } catch (const std::exception& e) {
            if (steady::now() >= until)
                throw;
            // The server may still be starting: its listener is not up yet.
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
    }
}

int run(const options& o) {
    verbs::context ctx = verbs::context::open_first_active();
    verbs::protection_domain pd(ctx);
    rpc::client cli(pd);
    tally t;
    cli.on_state_change([&](rpc::peer_id, rpc::peer_state st) {
        const double now = wall_now();
        t.states.emplace_back(now, st);
        fmt::print("resilience_client {}: state {} at {:.3f}\n", o.tag, st, now);
        std::fflush(stdout);
    });
    const rpc::peer_id peer = connect_with_retries(cli, o);
    if (o.finish) {
        const rpc::call_result r = cli.call(peer, 3, {}, {.idempotent = true});
        fmt::print("resilience_client: finish: {}\n", r.status);
        return r.status == rpc::call_status::ok ? 0 : 1;
    }
    std::signal(SIGTERM, on_term);
    std::signal(SIGINT, on_term);
    std::FILE* outcomes = o.outcomes.empty() ? nullptr : std::fopen(o.outcomes.c_str(), "w");
    const auto k = static_cast<std::size_t>(std::min<int>(o.inflight, cli.slots(peer)));
    std::vector<std::vector<std::byte>> reqs(k, std::vector<std::byte>(o.size));
    std::vector<std::uint64_t> seq_of(k, 0);
    std::vector<steady::time_point> started(k);
    std::uint64_t next_seq = 0;
    const auto t0 = steady::now();
    const auto end_at = t0 + std::chrono::seconds(o.seconds);
    t.last_ok = wall_now();
    fmt::print("resilience_client {}: connected, {} in flight\n", o.tag, k);
    std::fflush(stdout);
    const auto start = [&](std::size_t i) {
        const std::uint64_t seq = next_seq++;
        fill(reqs[i], o.tag, seq);
        seq_of[i] = seq;
        started[i] = steady::now();
        const bool idem = seq % 2 == 0;
        const rpc::call_status s =
            cli.start(peer, idem ? 1 : 2, reqs[i], {.cookie = i, .idempotent = idem});
        if (s == rpc::call_status::ok)
            return true;
        ++t.refused[s];
        if (!idem && outcomes != nullptr)
            fmt::print(outcomes, "{} {} {}\n", o.tag, seq, 100 + static_cast<std::uint32_t>(s));
        return false;
    };
    rpc::call_result out[64];
    std::vector<std::size_t> idle;
    for (std::size_t i = 0; i < k; ++i)
        idle.push_back(i);
    for (;;) {
        const bool stopping = stop_requested != 0 || steady::now() >= end_at;
        if (!stopping) {
            std::vector<std::size_t> still;
            for (std::size_t i : idle)
                if (!start(i))
                    still.push_back(i);
            idle = std::move(still);
            if (cli.state(peer) == rpc::peer_state::closed)
                break;
        }
        if (stopping && cli.in_flight() == 0)
            break;
        const int n = cli.wait(out, std::chrono::milliseconds(50));
        const double now = wall_now();
        for (int j = 0; j < n; ++j) {
            const auto i = static_cast<std::size_t>(out[j].cookie);
            const bool idem = seq_of[i] % 2 == 0;
            idle.push_back(i);
            ++t.done;
            ++t.by_status[out[j].status];
            if (!idem && outcomes != nullptr)
                fmt::print(outcomes, "{} {} {}\n", o.tag, seq_of[i],
                           static_cast<std::uint32_t>(out[j].status));
            if (out[j].status != rpc::call_status::ok) {
                if (out[j].status != rpc::call_status::unknown_outcome)
                    fmt::print(stderr, "resilience_client {}: call {} ({}): {}\n", o.tag, seq_of[i],
                               idem ? "idempotent" : "not idempotent", out[j].status);
                continue;
            }
            if (!std::equal(out[j].reply.begin(), out[j].reply.end(), reqs[i].begin(),
                            reqs[i].end())) {
                ++t.bad_replies;
                fmt::print(stderr, "resilience_client {}: call {}: the reply differs\n", o.tag,
                           seq_of[i]);
            }
            ++(idem ? t.ok_idempotent : t.ok_not);
            t.lat_us.push_back(
                std::chrono::duration<double, std::micro>(steady::now() - started[i]).count());
            if (now - t.last_ok > 0.2) {
                t.gaps.push_back({t.last_ok, now});
                fmt::print("resilience_client {}: resumed at {:.3f} after {:.3f} s\n", o.tag, now,
                           now - t.last_ok);
                std::fflush(stdout);
            }
            t.last_ok = now;
            if ((t.ok_idempotent + t.ok_not) % 500 == 0) {
                fmt::print("resilience_client {}: progress {} ok\n", o.tag,
                           t.ok_idempotent + t.ok_not);
                std::fflush(stdout);
            }
            if (o.die_after > 0 && t.ok_idempotent + t.ok_not >= o.die_after) {
                cli.release();
                for (std::size_t r : idle)
                    (void)start(r);
                std::raise(SIGKILL); // with calls in flight
            }
        }
        cli.release();
    }
    const double secs = std::chrono::duration<double>(steady::now() - t0).count();
    if (outcomes != nullptr)
        std::fclose(outcomes);
    const std::string json = json_of(o, t, cli, secs);
    if (std::FILE* f = std::fopen(o.json.c_str(), "w")) {
        std::fputs(json.c_str(), f);
        std::fclose(f);
    }
    fmt::print("resilience_client {}: {}", o.tag, json);
    fmt::print("resilience_client {}: {}\n", o.tag, cli.counters());
    long not_ok = 0;
    for (const auto& [s, n] : t.by_status)
        if (s != rpc::call_status::ok && s != rpc::call_status::unknown_outcome)
            not_ok += n;
    return not_ok == 0 && t.bad_replies == 0 && t.refused.empty() ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
    try {
        return run(parse(argc, argv));
    } catch (const std::exception& e) {
        fmt::print(stderr, "resilience_client: {}\n", e.what());
        return 1;
    }
}
