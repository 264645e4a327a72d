// pingpong: send/receive round-trip latency over one rdma_cm connection.
//
//   server:  pingpong [-b ADDR] [-p PORT] [-s SIZE] [-n ITERS] [-t SECONDS] [-e]
//   client:  pingpong [-d DEVICE] [-p PORT] [-s SIZE] [-n ITERS] [-t SECONDS] [-e] SERVER_ADDR
//
// The client sends message 0, the server answers with message 0, and so on.
// Both ends check every message they receive; the client times each round
// trip and prints the latency. examples/demo runs both ends on one device.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <getopt.h>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

namespace {

using namespace rdmax;
using namespace std::chrono_literals;
using steady = std::chrono::steady_clock;

constexpr const char* usage_text = R"(usage:
  pingpong [-b ADDR] [-p PORT] [-s SIZE] [-n ITERS] [-t SECONDS] [-e]                 (server)
  pingpong [-d DEVICE] [-p PORT] [-s SIZE] [-n ITERS] [-t SECONDS] [-e] SERVER_ADDR   (client)

Send/receive round trips of SIZE bytes; the client prints their latency.
  -b ADDR     server: IP address to listen on. rdma_cm needs an address that an
              RDMA device carries (with a wildcard address it could not tell on
              which device to make the queue pair); default: the IPv4 address of
              the first device with an ACTIVE port (192.0.2.1 in the rdmax VM)
  -d DEVICE   client: device to connect from (default: the first ACTIVE one)
  -p PORT     rdma_cm port (default 18515)
  -s SIZE     message size in bytes, 8 to 67108864 (default 64)
  -n ITERS    timed round trips (default 1000), after 16 untimed ones
  -t SECONDS  give up when a connection or a message takes longer (default 30)
  -e          sleep on completion events instead of spinning (perftest's -e)
Both ends must use the same -s and -n.
)";

struct usage_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct options {
    std::string bind;   // server: address to listen on
    std::string device; // client: device to connect from
    std::string server; // client: the server's address; empty: be the server
    std::uint16_t port = 18515;
    std::uint32_t size = 64;
    std::uint32_t iters = 1000;
    std::chrono::seconds timeout{30};
    bool events = false; // sleep on a completion channel rather than spin
};

/// The client tells the server its -s and -n in the connect request, so that
/// a mismatch fails at once rather than as a timeout.
struct hello {
    std::uint32_t size;
    std::uint32_t iters;
};

constexpr std::uint32_t warmup = 16; // untimed: the first may wait for the peer's first receive
constexpr std::uint32_t recv_slots = 4;

std::uint64_t number(const char* text, std::uint64_t lo, std::uint64_t hi, int flag) {
    std::uint64_t v = 0;
    const char* end = text + std::strlen(text);
    const auto [p, ec] = std::from_chars(text, end, v);
    if (ec != std::errc{} || p != end || v < lo || v > hi)
        throw usage_error(fmt::format("-{} {}: expected a number from {} to {}",
                                      static_cast<char>(flag), text, lo, hi));
    return v;
}

options parse(int argc, char** argv) {
    static const option long_options[] = {{"help", no_argument, nullptr, 'h'}, {}};
    options o;
    for (int c; (c = getopt_long(argc, argv, "b:d:p:s:n:t:eh", long_options, nullptr)) != -1;) {
        switch (c) {
        case 'b': o.bind = optarg; break;
        case 'd': o.device = optarg; break;
        case 'p': o.port = static_cast<std::uint16_t>(number(optarg, 1, 65535, c)); break;
        case 's': o.size = static_cast<std::uint32_t>(number(optarg, 8, 1 << 26, c)); break;
        case 'n': o.iters = static_cast<std::uint32_t>(number(optarg, 1, 100'000'000, c)); break;
        case 't': o.timeout = std::chrono::seconds(number(optarg, 1, 86'400, c)); break;
        case 'e': o.events = true; break;
        case 'h': std::fputs(usage_text, stdout); std::exit(0);
        default: throw usage_error("unknown option");
        }
    }
    if (argc - optind > 1)
        throw usage_error("more than one server address");
    if (optind < argc)
        o.server = argv[optind];
    if (!o.server.empty() && !o.bind.empty())
        throw usage_error("-b is for the server; the client takes the server's address");
    return o;
}

/// The IPv4 address of the first device with an ACTIVE port: its RoCE v2 GID
/// is the address mapped into IPv6 (::ffff:a.b.c.d).
std::string first_active_ipv4() {
    const verbs::context ctx = verbs::context::open_first_active();
    const auto g = ctx.preferred_gid(1);
    if (!g || !g->value.is_ipv4_mapped())
        throw std::runtime_error(
            fmt::format("{} has no IPv4 address to listen on: pass -b ADDR", ctx.name()));
    const auto& r = g->value.raw;
    return fmt::format("{}.{}.{}.{}", r[12], r[13], r[14], r[15]);
}

void posted(status s, const char* what) {
    if (s != status::ok)
        throw std::runtime_error(fmt::format("{}: {}", what, to_string(s)));
}

/// A message: its sequence number, then that number's low byte repeated.
std::byte fill_byte(std::uint64_t seq) {
    return static_cast<std::byte>(seq & 0xff);
}

void fill(std::span<std::byte> msg, std::uint64_t seq) {
    std::memcpy(msg.data(), &seq, sizeof seq);
    std::fill(msg.begin() + sizeof seq, msg.end(), fill_byte(seq));
}

void check(std::span<const std::byte> msg, std::uint64_t seq) {
    std::uint64_t got = 0;
    std::memcpy(&got, msg.data(), sizeof got);
    if (got != seq)
        throw std::runtime_error(fmt::format("message {} carries sequence number {}", seq, got));
    const auto bad = std::find_if(msg.begin() + sizeof seq, msg.end(),
                                  [seq](std::byte b) { return b != fill_byte(seq); });
    if (bad != msg.end())
        throw std::runtime_error(fmt::format("message {}: byte {} is {:#04x}, expected {:#04x}",
                                             seq, bad - msg.begin(), std::to_integer<int>(*bad),
                                             std::to_integer<int>(fill_byte(seq))));
}

/// Sends go unsignaled: a success reports nothing, but the queue pair needs
/// its send completions polled to reuse send-queue slots, and a failed send
/// shows up here.
void reap_sends(verbs::queue_pair<verbs::rc>& qp) {
    verbs::completion c;
    if (const int n = qp.poll_send(std::span(&c, 1)); n != 0)
        throw std::runtime_error(fmt::format(
            "send failed: {}", n < 0 ? "cannot poll the completion queue" : c.status_name()));
}

/// Waits for the next message; throws when the peer leaves, the receive
/// fails, or the deadline passes. Spinning, it polls (the lowest latency) and
/// looks at the clock and the connection only every 4096 polls: a clock read
/// can cost a microsecond (a VM without a TSC clock source), and wait_recv
/// spinning reads it after every poll. With -e, wait_recv sleeps on the
/// receive queue's completion channel, 100 ms at a time.
verbs::completion next_message(verbs::connection& conn, const options& o) {
    const auto deadline = steady::now() + o.timeout;
    verbs::completion c;
    for (std::uint32_t polls = 1;; ++polls) {
        const int n = o.events ? conn.qp().wait_recv(std::span(&c, 1), 100ms)
                               : conn.qp().poll_recv(std::span(&c, 1));
        if (n > 0)
            break;
        if (n < 0)
            throw std::runtime_error("cannot poll the receive completion queue");
        if (!o.events && polls % 4096 != 0)
            continue;
        if (conn.peer_disconnected()) {
            // A message that came just before the disconnect is still queued.
            if (conn.qp().poll_recv(std::span(&c, 1)) > 0 && c.ok())
                break;
            throw std::runtime_error("the peer disconnected");
        }
        if (steady::now() >= deadline)
            throw std::runtime_error(fmt::format("no message within {} s", o.timeout.count()));
    }
    if (!c.ok()) {
        reap_sends(conn.qp()); // a failed send of ours is the better explanation
        throw std::runtime_error(fmt::format("receive failed: {}", c.status_name()));
    }
    return c;
}

/// The messages of one end: a send buffer, then recv_slots receive buffers,
/// in one registration (registering is slow: do it once, before timing).
struct buffers {
    std::uint32_t size;
    std::vector<std::byte> bytes;
    memory_region<rights::local_write> mr;

    buffers(const verbs::protection_domain& pd, std::uint32_t message_size)
        : size(message_size)
        , bytes(std::size_t{size} * (1 + recv_slots))
        , mr(pd, bytes) {}
    [[nodiscard]] local_buffer<rights::local_write> send() const { return mr.local(0, size); }
    [[nodiscard]] local_buffer<rights::local_write> recv(std::uint64_t k) const {
        return mr.local((1 + k) * size, size);
    }
};

std::span<std::byte> bytes_of(local_buffer<rights::local_write> b) {
    return {b.addr, b.length};
}

/// Receives message `seq`, checks it, and posts its buffer again.
void receive(verbs::connection& conn, const buffers& buf, std::uint64_t seq, const options& o) {
    const verbs::completion c = next_message(conn, o);
    if (c.byte_len != o.size)
        throw std::runtime_error(
            fmt::format("message {}: {} bytes, expected {}", seq, c.byte_len, o.size));
    check(bytes_of(buf.recv(c.wr_id)), seq);
    posted(conn.qp().post_recv(buf.recv(c.wr_id), c.wr_id), "post_recv");
}

void post_receives(verbs::connection& conn, const buffers& buf) {
    for (std::uint64_t k = 0; k < recv_slots; ++k)
        posted(conn.qp().post_recv(buf.recv(k), k), "post_recv");
}

void send(verbs::connection& conn, const buffers& buf, std::uint64_t seq) {
    posted(conn.qp().send(buf.send(), seq, {.signaled = false}), "send");
}

int serve(options o) {
    if (o.bind.empty())
        o.bind = first_active_ipv4();
    verbs::listener lst(o.bind, o.port);
    const verbs::context ctx = lst.device();
    const verbs::protection_domain pd(ctx);
    const buffers buf(pd, o.size);
    // Receives complete here: poll_recv spins on it, wait_recv sleeps on its channel (-e).
    verbs::completion_channel events(ctx);
    verbs::completion_queue recv_cq(ctx, recv_slots, &events);
    fmt::print("[server] listening on {}:{} ({})\n", o.bind, o.port, ctx.name());

    verbs::connection conn = lst.accept(pd, {}, {.recv_cq = &recv_cq}, o.timeout);
    post_receives(conn, buf); // the client's first send may come sooner: it then retries (RNR)
    const auto h = conn.peer_payload_as<hello>();
    if (!h || h->size != o.size || h->iters != o.iters)
        throw std::runtime_error(fmt::format(
            "the client runs -s {} -n {}, this server -s {} -n {}: use the same on both ends",
            h ? h->size : 0, h ? h->iters : 0, o.size, o.iters));

    const std::uint64_t rounds = std::uint64_t{warmup} + o.iters;
    for (std::uint64_t seq = 0; seq < rounds; ++seq) {
        receive(conn, buf, seq, o);
        fill(bytes_of(buf.send()), seq);
        send(conn, buf, seq);
        reap_sends(conn.qp());
    }
    // Leave once the client has hung up: disconnecting first could drop our last answer.
    if (!conn.wait_disconnected(o.timeout))
        throw std::runtime_error("the client did not disconnect");
    fmt::print("[server] answered {} messages of {} bytes, every one checked\n", rounds, o.size);
    return 0;
}

void print_latency(std::vector<double> us) {
    std::sort(us.begin(), us.end());
    const auto n = static_cast<double>(us.size());
    // Nearest rank: the smallest sample that q of all samples do not exceed.
    const auto rank = [&](double q) { return us[static_cast<std::size_t>(std::ceil(q * n)) - 1]; };
    fmt::print("[client] round-trip latency (us): min {:.1f}  median {:.1f}  avg {:.1f}  p99 "
               "{:.1f}  max {:.1f}\n",
               us.front(), rank(0.5), std::accumulate(us.begin(), us.end(), 0.0) / n, rank(0.99),
               us.back());
}

int client(const options& o) {
    const verbs::context ctx =
        o.device.empty() ? verbs::context::open_first_active() : verbs::context::open(o.device);
    const verbs::protection_domain pd(ctx);
    const buffers buf(pd, o.size);
    verbs::completion_channel events(ctx); // as in serve()
    verbs::completion_queue recv_cq(ctx, recv_slots, &events);
    const hello h{o.size, o.iters};
    verbs::connection conn = verbs::connection::connect(pd, o.server, o.port, verbs::payload_of(h),
                                                        {.recv_cq = &recv_cq}, o.timeout);
    post_receives(conn, buf);
    fmt::print("[client] connected to {}:{} from {}\n", o.server, o.port, ctx.name());

    std::vector<double> us; // allocated before timing starts
    us.reserve(o.iters);
    for (std::uint64_t seq = 0; seq < std::uint64_t{warmup} + o.iters; ++seq) {
        fill(bytes_of(buf.send()), seq);
        const auto start = steady::now();
        send(conn, buf, seq);
        receive(conn, buf, seq, o);
        const auto end = steady::now();
        if (seq >= warmup)
            us.push_back(std::chrono::duration<double, std::micro>(end - start).count());
        reap_sends(conn.qp());
    }
    conn.disconnect();
    fmt::print("[client] {} round trips of {} bytes (after {} untimed), every message checked\n",
               o.iters, o.size, warmup);
    print_latency(std::move(us));
    return 0;
}

} // namespace

int main(int argc, char** argv) {
    // Line-buffered, so that a server's and a client's lines on one pipe come in order.
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    try {
        const options o = parse(argc, argv);
        return o.server.empty() ? serve(o) : client(o);
    } catch (const usage_error& e) {
        fmt::print(stderr, "pingpong: {}\n{}", e.what(), usage_text);
        return 2;
    } catch (const std::exception& e) {
        fmt::print(stderr, "pingpong: {}\n", e.what());
        return 1;
    }
}
