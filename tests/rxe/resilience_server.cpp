// The server of the resilience suite (tests/rxe/run_resilience.sh).
//
//   resilience_server --addr ADDR --port PORT --log FILE --stats FILE [--deadline S]
//
// Method 1 (the clients mark it idempotent) echoes the request. Method 2
// (not idempotent) echoes it too, but first appends one line to FILE:
//     TAG SEQ CLIENT_INCARNATION CALL_ID SERVER_INCARNATION
// (TAG and SEQ are the request's first 16 bytes, which the client chose), in
// one write(2) to a file opened O_APPEND: a line is there once its handler
// ran, even if the server is killed the next instant, and a restarted server
// appends to the same file. So the checker counts every execution of every
// call across restarts. Every 100 ms (and at exit) the server writes its
// figures, as one JSON object, to STATS (written aside, then renamed):
// pid, incarnation, executions, peers, cached_clients, cached_calls and
// counters. "serving on ADDR:PORT" on stdout says it listens. SIGTERM, or a
// call of method 3 (resilience_client --finish), ends it (status 0); so
// does the deadline (default 600 s; status 1).
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <getopt.h>
#include <string>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

namespace {

using namespace rdmax;
using steady = std::chrono::steady_clock;

volatile std::sig_atomic_t stop_requested = 0;
bool finish_requested = false; ///< by method 3, not by a signal
extern "C" void on_term(int /*sig*/) {
    stop_requested = 1;
}

struct options {
    std::string addr;
    std::uint16_t port = 7480;
    std::string log;
    std::string stats;
    int deadline_s = 600;
};

[[noreturn]] void usage() {
    std::fputs("usage: resilience_server --addr ADDR --port PORT --log FILE --stats FILE "
               "[--deadline S]\n",
               stderr);
    std::exit(2);
}

options parse(int argc, char** argv) {
    static const option longs[] = {
        {"addr", required_argument, nullptr, 'a'},     {"port", required_argument, nullptr, 'p'},
        {"log", required_argument, nullptr, 'l'},      {"stats", required_argument, nullptr, 's'},
        {"deadline", required_argument, nullptr, 'd'}, {nullptr, 0, nullptr, 0}};
    options o;
    for (int c; (c = getopt_long(argc, argv, "", longs, nullptr)) != -1;) {
        switch (c) {
        case 'a': o.addr = optarg; break;
        case 'p': o.port = static_cast<std::uint16_t>(std::atoi(optarg)); break;
        case 'l': o.log = optarg; break;
        case 's': o.stats = optarg; break;
        case 'd': o.deadline_s = std::atoi(optarg); break;
        default: usage();
        }
    }
    if (optind != argc || o.addr.empty() || o.log.empty() || o.stats.empty())
        usage();
    return o;
}

/// The request's tag and sequence number (its first 16 bytes), or false.
bool ids_of(std::span<const std::byte> body, std::uint64_t& tag, std::uint64_t& seq) {
    if (body.size() < 16)
        return false;
    std::memcpy(&tag, body.data(), 8);
    std::memcpy(&seq, body.data() + 8, 8);
    return true;
}

void write_stats(const options& o, const rpc::server& srv, std::uint64_t executions,
                 std::uint64_t refused_ids) {
    const rpc::rpc_counters& c = srv.counters();
    const double now =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    const std::string json = fmt::format(
        "{{\"time\": {:.3f}, \"pid\": {}, \"incarnation\": \"{:016x}\", \"executions\": {}, "
        "\"bad_requests\": {}, \"peers\": {}, \"cached_clients\": {}, \"cached_calls\": {}, "
        "\"connected\": {}, \"disconnected\": {}, \"duplicates\": {}, "
        "\"unknown_outcomes\": {}, \"keepalive_probes\": {}, \"keepalive_timeouts\": {}, "
        "\"rejected\": {}}}\n",
        now, getpid(), srv.incarnation(), executions, refused_ids, srv.peers(),
        srv.cached_clients(), srv.cached_calls(), c.connected, c.disconnected, c.duplicates,
        c.unknown_outcomes, c.keepalive_probes, c.keepalive_timeouts, c.rejected());
    const std::string tmp = o.stats + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "w");
    if (f == nullptr)
        return;
    std::fputs(json.c_str(), f);
    std::fclose(f);
    std::rename(tmp.c_str(), o.stats.c_str());
}

int serve(const options& o) {
    verbs::context ctx = verbs::context::open_by_address(o.addr);
    verbs::protection_domain pd(ctx);
    rpc::server srv(pd, o.addr, o.port);
    const int log_fd = ::open(o.log.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (log_fd < 0)
        throw std::runtime_error(fmt::format("{}: {}", o.log, std::strerror(errno)));
    std::uint64_t executions = 0, bad_requests = 0;
    srv.on(1, [&](rpc::request_context& c) {
        if (!c.idempotent())
            ++bad_requests;
        c.reply(c.body());
    });
    srv.on(2, [&](rpc::request_context& c) {
        std::uint64_t tag = 0, seq = 0;
        if (c.idempotent() || !ids_of(c.body(), tag, seq)) {
            ++bad_requests;
            c.fail(rpc::call_status::handler_failed);
            return;
        }
        // One write: the line is whole in the file once this returns.
        const std::string line =
            fmt::format("{} {} {:016x} {} {:016x}\n", tag, seq, c.client_incarnation(), c.call_id(),
                        srv.incarnation());
        if (::write(log_fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
            ++bad_requests;
            c.fail(rpc::call_status::handler_failed);
            return;
        }
        ++executions;
        c.reply(c.body());
    });
    // Method 3: the clients are done (tests/multihost/run.sh: the server's
    // host cannot see them end).
    srv.on(3, [](rpc::request_context& c) {
        c.reply({});
        finish_requested = true;
        stop_requested = 1;
    });
    std::signal(SIGTERM, on_term);
    std::signal(SIGINT, on_term);
    fmt::print("resilience_server: serving on {}:{} (pid {}, incarnation {:016x})\n", o.addr,
               srv.port(), getpid(), srv.incarnation());
    std::fflush(stdout);
    write_stats(o, srv, executions, bad_requests);
    const auto deadline = steady::now() + std::chrono::seconds(o.deadline_s);
    auto next_stats = steady::now();
    while (stop_requested == 0 && steady::now() < deadline) {
        (void)srv.wait(std::chrono::milliseconds(20));
        if (steady::now() >= next_stats) {
            write_stats(o, srv, executions, bad_requests);
            next_stats = steady::now() + std::chrono::milliseconds(100);
        }
    }
    // The finish call's reply is only posted: a server that ended at once
    // destroyed its QP before a reply lost on the wire was sent again (seen
    // after the link-down step on 7.x, whose client then waited in vain).
    // Serve on until every client has gone, for 10 s at most.
    const auto linger = steady::now() + std::chrono::seconds(10);
    while (finish_requested && steady::now() < linger) {
        const rpc::rpc_counters c = srv.counters();
        if (c.disconnected >= c.connected)
            break;
        (void)srv.wait(std::chrono::milliseconds(20));
    }
    write_stats(o, srv, executions, bad_requests);
    fmt::print("resilience_server: {} executions; {}\n", executions, srv.counters());
    ::close(log_fd);
    return stop_requested != 0 && bad_requests == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
    try {
        return serve(parse(argc, argv));
    } catch (const std::exception& e) {
        fmt::print(stderr, "resilience_server: {}\n", e.what());
        return 1;
    }
}
