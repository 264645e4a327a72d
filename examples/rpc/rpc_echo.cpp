// rpc_echo: an RPC echo service and its client (rdmax::rpc).
//
//   server:  rpc_echo --server [--addr ADDR] [--port PORT] [--clients N] [--timeout SECONDS]
//   client:  rpc_echo --connect ADDR [--port PORT] [--calls N] [--size BYTES]
//                     [--outstanding K] [--verify]
//
// The server answers method 1 with the request's bytes, from one thread,
// for any number of clients; it exits once N clients came and went (0:
// never), or with status 1 at the deadline if fewer came and left. The client keeps K
// calls in flight, each with its own bytes, checks every reply with
// --verify, and prints the rate, the median and 99th percentile latency, and
// its counters. Exit status 0 when every call came back right.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <getopt.h>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

#include "first_address.hpp"

namespace {

using namespace rdmax;
using steady = std::chrono::steady_clock;
constexpr std::uint16_t method_echo = 1;

struct options {
    bool server = false;
    std::string addr;
    std::uint16_t port = 7471;
    int clients = 0;
    int timeout_s = 600;
    long calls = 1000;
    std::size_t size = 64;
    int outstanding = 8;
    bool verify = false;
};

[[noreturn]] void usage() {
    std::fputs("usage:\n"
               "  rpc_echo --server [--addr ADDR] [--port PORT] [--clients N] [--timeout S]\n"
               "  rpc_echo --connect ADDR [--port PORT] [--calls N] [--size BYTES]\n"
               "           [--outstanding K] [--verify]\n",
               stderr);
    std::exit(2);
}

options parse(int argc, char** argv) {
    static const option longs[] = {{"server", no_argument, nullptr, 'S'},
                                   {"connect", required_argument, nullptr, 'c'},
                                   {"addr", required_argument, nullptr, 'a'},
                                   {"port", required_argument, nullptr, 'p'},
                                   {"clients", required_argument, nullptr, 'N'},
                                   {"timeout", required_argument, nullptr, 't'},
                                   {"calls", required_argument, nullptr, 'n'},
                                   {"size", required_argument, nullptr, 's'},
                                   {"outstanding", required_argument, nullptr, 'k'},
                                   {"verify", no_argument, nullptr, 'v'},
                                   {"help", no_argument, nullptr, 'h'},
                                   {nullptr, 0, nullptr, 0}};
    options o;
    for (int c; (c = getopt_long(argc, argv, "", longs, nullptr)) != -1;) {
        switch (c) {
        case 'S': o.server = true; break;
        case 'c':
        case 'a': o.addr = optarg; break;
        case 'p': o.port = static_cast<std::uint16_t>(std::atoi(optarg)); break;
        case 'N': o.clients = std::atoi(optarg); break;
        case 't': o.timeout_s = std::atoi(optarg); break;
        case 'n': o.calls = std::atol(optarg); break;
        case 's': o.size = static_cast<std::size_t>(std::atol(optarg)); break;
        case 'k': o.outstanding = std::max(1, std::atoi(optarg)); break;
        case 'v': o.verify = true; break;
        default: usage();
        }
    }
    if (optind != argc || (!o.server && o.addr.empty()))
        usage();
    return o;
}

int serve(const options& o) {
    // The device that carries the address (a wildcard names none).
    const std::string addr = o.addr.empty() ? examples::first_active_ipv4() : o.addr;
    verbs::context ctx = verbs::context::open_by_address(addr);
    verbs::protection_domain pd(ctx);
    rpc::server srv(pd, addr, o.port);
    srv.on(method_echo, [](rpc::request_context& c) { c.reply(c.body()); });
    fmt::print("rpc_echo: serving on {}:{} ({})\n", addr, srv.port(), ctx.name());
    std::fflush(stdout);
    const auto deadline = steady::now() + std::chrono::seconds(o.timeout_s);
    while (steady::now() < deadline) {
        (void)srv.wait(std::chrono::milliseconds(50));
        if (o.clients > 0 && srv.counters().connected >= static_cast<std::uint64_t>(o.clients) &&
            srv.peers() == 0)
            break;
    }
    fmt::print("rpc_echo: server {}\n", srv.counters());
    // Served: N clients came and all of them left. A deadline that cuts a
    // client off mid-run is a failure, not a pass.
    const bool served =
        o.clients == 0 ||
        (srv.counters().connected >= static_cast<std::uint64_t>(o.clients) && srv.peers() == 0);
    if (o.clients > 0 && srv.peers() != 0)
        fmt::print(stderr,
                   "rpc_echo: the deadline ({} s) passed with {} client(s) still connected\n",
                   o.timeout_s, srv.peers());
    return served && srv.counters().rejected() == 0 ? 0 : 1;
}

int call(const options& o) {
    verbs::context ctx = verbs::context::open_first_active();
    verbs::protection_domain pd(ctx);
    rpc::client cli(pd);
    // The server may still be starting: try for a few seconds.
    rpc::peer_id peer;
    for (int attempt = 0;; ++attempt) {
        try {
            peer = cli.connect(o.addr, o.port);
            break;
        } catch (const std::exception& e) {
            if (attempt >= 20)
                throw;
            std::this_thread::sleep_for(std::chrono::milliseconds(500));
        }
    }
    const int k = std::min<int>(o.outstanding, cli.slots(peer));
    // One request buffer per slot: its bytes say which call it is.
    std::vector<std::vector<std::byte>> reqs(static_cast<std::size_t>(k),
                                             std::vector<std::byte>(o.size));
    std::vector<steady::time_point> started(static_cast<std::size_t>(k));
    std::vector<double> lat_us;
    lat_us.reserve(static_cast<std::size_t>(o.calls));
    long sent = 0, done = 0, bad = 0;
    const auto fill = [&](std::size_t i, long n) {
        for (std::size_t j = 0; j < reqs[i].size(); ++j)
            reqs[i][j] = static_cast<std::byte>((static_cast<std::size_t>(n) * 31 + j) % 251);
    };
    std::vector<long> which(static_cast<std::size_t>(k), 0);
    const auto start = [&](std::size_t i) {
        fill(i, sent);
        which[i] = sent;
        started[i] = steady::now();
        const rpc::call_status s =
            cli.start(peer, method_echo, reqs[i], {.cookie = static_cast<std::uint64_t>(i)});
        if (s != rpc::call_status::ok)
            throw std::runtime_error(fmt::format("call {}: {}", sent, s));
        ++sent;
    };
    const auto t0 = steady::now();
    for (std::size_t i = 0; i < reqs.size() && sent < o.calls; ++i)
        start(i);
    rpc::call_result out[64];
    std::vector<std::size_t> again;
    while (done < sent) {
        const int n = cli.poll(out);
        for (int j = 0; j < n; ++j) {
            const auto i = static_cast<std::size_t>(out[j].cookie);
            lat_us.push_back(
                std::chrono::duration<double, std::micro>(steady::now() - started[i]).count());
            ++done;
            if (out[j].status != rpc::call_status::ok) {
                fmt::print(stderr, "rpc_echo: call {}: {}\n", which[i], out[j].status);
                ++bad;
            } else if (o.verify && !std::equal(out[j].reply.begin(), out[j].reply.end(),
                                               reqs[i].begin(), reqs[i].end())) {
                fmt::print(stderr, "rpc_echo: call {}: the reply differs\n", which[i]);
                ++bad;
            }
            again.push_back(i);
        }
        cli.release();
        for (std::size_t i : again)
            if (sent < o.calls)
                start(i);
        again.clear();
        if (bad > 0 && !cli.connected(peer))
            break;
    }
    const double secs = std::chrono::duration<double>(steady::now() - t0).count();
    std::sort(lat_us.begin(), lat_us.end());
    const auto pct = [&](double p) {
        return lat_us.empty() ? 0.0
                              : lat_us[std::min(lat_us.size() - 1,
                                                static_cast<std::size_t>(
                                                    p * static_cast<double>(lat_us.size())))];
    };
    fmt::print("rpc_echo: {} calls of {} B, {} in flight, {}: {:.0f} calls/s, p50 {:.1f} us, "
               "p99 {:.1f} us, {} bad{}\n",
               done, o.size, k,
               cli.is_local(peer) ? "through this node's memory" : "through the RDMA device",
               secs > 0 ? static_cast<double>(done) / secs : 0.0, pct(0.5), pct(0.99), bad,
               o.verify ? " (every reply checked)" : "");
    fmt::print("rpc_echo: client {}\n", cli.counters());
    return bad == 0 && done == o.calls ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
    try {
        const options o = parse(argc, argv);
        return o.server ? serve(o) : call(o);
    } catch (const std::exception& e) {
        fmt::print(stderr, "rpc_echo: {}\n", e.what());
        return 1;
    }
}
