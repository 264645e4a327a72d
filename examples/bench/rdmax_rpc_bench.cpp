// rdmax_rpc_bench: RPC echo latency and rate over rdmax::rpc, against the
// same echo over send/receive on rdmax verbs and over TCP, in one run.
//
//   rdmax_rpc_bench [-a ADDR] [-n CALLS] [--sweep size|outstanding|clients|api|tcp|all]
//                   [--transports rdmax,local,rdmax-tcp,sendrecv,tcp] [--json FILE]
//                   [--api poll,poll-each,awaitable,callback] [--spin-us N] [--no-batch]
//
// "rdmax" is rdmax::rpc through the device, "local" the same calls through
// the node's memory (both ends are on this node: shared rings, CMA),
// "rdmax-tcp" the same calls over rdmax's TCP transport (tcp alone in
// rpc_options::transports), "tcp" a plain TCP echo (fixed-size messages, no
// framing: the floor TCP gives); with only local, rdmax-tcp and tcp asked
// for, no device is opened (a machine without RDMA: rpc::server and
// rpc::client built with no device, on 127.0.0.1). The
// server runs in a thread of this process (one thread for all clients,
// spinning); the clients run in the main thread, each with K calls in
// flight, each request carrying its own bytes, and every reply is checked
// byte for byte. Each point reports the median and 99th percentile of the
// call latency (start to result, read with the cycle counter) and the calls
// per second. Sweeps (each over every transport):
//   size         64 B .. 64 KiB, 1 call in flight, 1 client
//   outstanding  1 .. 64 calls in flight, 64 B, 1 client
//   clients      1 .. 16 clients, 16 in flight each, 64 B
//   latency      64 B, 1 in flight, 1 client: one point, for rounds against the floor
//   syscalls     64 B, 16 in flight, 1 client, rdmax: one point, for strace -c
//   tcp          64 B x1, 64 B x16, 1 MiB x1 (1 client): rdmax-tcp against tcp,
//                with the ratios of p50 and calls/s printed at the end
//   api          64 B, 1, 16 and 64 in flight, 1 client, rdmax and local: each
//                API of --api (built with Asio: rpc::async_client), with the
//                ratio to poll's p50 and calls/s of the same point in this run
// --api names how the rdmax and local clients call: poll (start/poll, spinning;
// the default), poll-each (the same loop, but each result ended and its
// successor started in turn, the round's doorbells held to its end: the
// adapter's pattern, and then the ratios' base), awaitable (K coroutines on an io_context, one call
// each at a time) or callback (K chains of callbacks); --spin-us lets the adapter spin that long
// before it sleeps on the client's descriptor (0: it sleeps at once);
// --no-batch: each call the adapter's handlers start rings its own doorbell
// (async_options::batch_doorbells off). bells/call: the rdmax client's
// doorbells per call (its scheduler's ibv_post_send calls). timed: calls/s x
// mean latency, the calls inside their timed start-to-result span on average
// (Little's law): K for the coroutines and callbacks, whose next call starts
// as the last ends; fewer for poll, whose loop takes a round's results first
// and starts their successors after, their doorbells one by one, outside the
// spans. With the server the bottleneck (16, 64 in flight) p50 follows it.
// TCP runs over 127.0.0.1 (plain sockets, TCP_NODELAY). writeimm (not in
// the default list) is the bare verbs rdmax's RPC uses, with nothing of its
// own: what rdmax adds is the difference. The wire floor
// (ib_write_lat, ib_send_lat) is run by examples/bench/rpc-bench.
#include <algorithm>
#include <arpa/inet.h>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <functional>
#include <getopt.h>
#include <memory>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <optional>
#include <poll.h>
#include <string>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#ifdef RDMAX_BENCH_ASIO
#include <rdmax/asio/client.hpp>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference" // in Asio's own code (see client.hpp)
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/use_awaitable.hpp>
#pragma GCC diagnostic pop
#endif

#include "bench_common.hpp"

namespace {

using namespace rdmax;
using namespace rdmax::bench;

struct point {
    std::string transport;
    std::size_t bytes = 64;
    int outstanding = 1;
    int clients = 1;
    std::string api = "poll"; ///< rdmax and local: poll, awaitable or callback
};

struct figures {
    double p50_us = 0, p99_us = 0, mean_us = 0, calls_per_s = 0;
    long calls = 0, bad = 0;
    double doorbells_per_call = 0; ///< rdmax through the device: the client's, per call (0: none)
};

/// The client's doorbells over its connection to `peer` (its scheduler's), per call.
double doorbells_per_call(const rpc::client& cli, rpc::peer_id peer, long calls) {
    const auto c = cli.scheduler_counters(peer);
    return c && calls > 0 ? static_cast<double>(c->doorbells) / static_cast<double>(calls) : 0.0;
}

/// Per-call latencies and the run's length, in cycles; figures at the end.
class recorder {
public:
    explicit recorder(long calls) { lat_.reserve(static_cast<std::size_t>(calls)); }
    void add(std::uint64_t c) { lat_.push_back(c); }
    figures finish(double per_us, std::uint64_t elapsed, long bad) {
        std::sort(lat_.begin(), lat_.end());
        const auto pct = [&](double p) {
            if (lat_.empty())
                return 0.0;
            const auto i = std::min(lat_.size() - 1,
                                    static_cast<std::size_t>(p * static_cast<double>(lat_.size())));
            return static_cast<double>(lat_[i]) / per_us;
        };
        figures f;
        f.p50_us = pct(0.5);
        f.p99_us = pct(0.99);
        double sum = 0;
        for (const std::uint64_t c : lat_)
            sum += static_cast<double>(c);
        f.mean_us = lat_.empty() ? 0.0 : sum / static_cast<double>(lat_.size()) / per_us;
        f.calls = static_cast<long>(lat_.size());
        f.calls_per_s = elapsed > 0 ? static_cast<double>(lat_.size()) * per_us * 1e6 /
                                          static_cast<double>(elapsed)
                                    : 0.0;
        f.bad = bad;
        return f;
    }

private:
    std::vector<std::uint64_t> lat_;
};

/// A request's bytes: call number n's pattern.
void fill(std::span<std::byte> b, std::uint64_t n) {
    std::memcpy(b.data(), &n, std::min<std::size_t>(8, b.size()));
    for (std::size_t i = 8; i < b.size(); ++i)
        b[i] = static_cast<std::byte>((n * 13 + i) % 251);
}
bool same(std::span<const std::byte> a, std::span<const std::byte> b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size()) == 0;
}

/// One in-flight call slot of a client: its request bytes and when it started.
struct call_slot {
    std::vector<std::byte> req;
    std::uint64_t started = 0;
};

// ---- rdmax::rpc ----------------------------------------------------------------------------

/// A server and clients through the device where there is one (`pd`), else
/// node-local alone (rpc::server and rpc::client built with no device).
std::unique_ptr<rpc::server> make_server(const verbs::protection_domain* pd,
                                         const std::string& addr, const rpc::rpc_options& o) {
    return pd != nullptr ? std::make_unique<rpc::server>(*pd, addr, 0, o)
                         : std::make_unique<rpc::server>(addr, 0, o);
}
std::unique_ptr<rpc::client> make_client(const verbs::protection_domain* pd,
                                         const rpc::rpc_options& o) {
    return pd != nullptr ? std::make_unique<rpc::client>(*pd, o) : std::make_unique<rpc::client>(o);
}

/// `each` (--api poll-each): the loop ends and restarts each result in
/// turn, `batch` holding the round's doorbells, as the Asio adapter runs its
/// handlers; else it takes a round's results, then starts their successors.
figures run_rpc(const verbs::protection_domain* pd, const std::string& addr, const point& p,
                long calls, double per_us, bool local, bool each = false, bool batch = true) {
    rpc::rpc_options o = rpc::rpc_options{}.with_env();
    o.local = local; // "rdmax": through the device; "local": through the node's memory
    if (p.transport == "rdmax-tcp") {
        pd = nullptr; // over TCP alone: no device, no node-local path
        o.transports = rpc::transport_set{} | rpc::transport::tcp;
    }
    o.slots = static_cast<std::uint16_t>(std::max(p.outstanding, 1));
    const std::unique_ptr<rpc::server> made = make_server(pd, addr, o);
    rpc::server& srv = *made;
    srv.on(1, [](rpc::request_context& c) { c.reply(c.body()); });
    std::atomic<bool> stop{false};
    std::thread serve([&] {
        while (!stop.load(std::memory_order_relaxed))
            (void)srv.poll();
    });
    struct client_state {
        std::unique_ptr<rpc::client> cli;
        rpc::peer_id peer;
        std::vector<call_slot> slots;
        std::vector<std::byte> reply_buf;
    };
    std::vector<client_state> cs(static_cast<std::size_t>(p.clients));
    figures f;
    try {
        for (auto& c : cs) {
            c.cli = make_client(pd, o);
            c.peer = c.cli->connect(addr, srv.port());
            c.slots.resize(static_cast<std::size_t>(p.outstanding));
            for (auto& s : c.slots)
                s.req.resize(p.bytes);
            c.reply_buf.resize(p.bytes);
        }
        recorder rec(calls);
        long started = 0, done = 0, bad = 0;
        const bool big = p.bytes + 48 > o.slot_bytes;
        const auto start = [&](client_state& c, std::size_t k) {
            fill(c.slots[k].req, static_cast<std::uint64_t>(started));
            c.slots[k].started = cycles();
            rpc::call_options co{.cookie = k};
            if (big)
                co.reply_into = c.reply_buf; // one call in flight per client at this size
            if (c.cli->start(c.peer, 1, c.slots[k].req, co) != rpc::call_status::ok)
                throw bench_failure("rpc start refused");
            ++started;
        };
        const auto end = [&](client_state& c, std::size_t k, const rpc::call_result& r) {
            rec.add(cycles() - c.slots[k].started);
            if (r.status != rpc::call_status::ok || !same(r.reply, c.slots[k].req))
                ++bad;
        };
        const std::uint64_t t0 = cycles();
        for (auto& c : cs)
            for (std::size_t k = 0; k < c.slots.size() && started < calls; ++k)
                start(c, k);
        rpc::call_result out[64];
        std::size_t again[64];
        const auto limit = static_cast<std::uint64_t>(per_us * 120e6);
        while (done < started) {
            if (cycles() - t0 > limit)
                throw bench_failure("rpc: no progress for 120 s");
            for (auto& c : cs) {
                const int n = c.cli->poll(out);
                if (each) {
                    // Each result in turn: its end stamped, its successor
                    // started; the round's doorbells held to its end (the
                    // adapter's handlers run so, async_options::batch_doorbells).
                    if (batch)
                        c.cli->hold_doorbells();
                    for (int i = 0; i < n; ++i) {
                        const auto k = static_cast<std::size_t>(out[i].cookie);
                        end(c, k, out[i]);
                        c.cli->release(out[i].cookie);
                        if (started < calls)
                            start(c, k);
                    }
                    c.cli->ring_held();
                    done += n;
                    continue;
                }
                for (int i = 0; i < n; ++i) {
                    const auto k = static_cast<std::size_t>(out[i].cookie);
                    end(c, k, out[i]);
                    again[i] = k;
                }
                c.cli->release();
                for (int i = 0; i < n; ++i)
                    if (started < calls)
                        start(c, again[i]);
                done += n;
            }
        }
        f = rec.finish(per_us, cycles() - t0, bad);
        for (const auto& c : cs)
            f.doorbells_per_call += doorbells_per_call(*c.cli, c.peer, started);
    } catch (...) {
        stop = true;
        serve.join();
        throw;
    }
    cs.clear();
    stop = true;
    serve.join();
    return f;
}

// ---- rdmax::rpc through the Asio adapter ----------------------------------------------------

#ifdef RDMAX_BENCH_ASIO
/// One client, K calls in flight through rpc::async_client: K coroutines, or
/// K chains of callbacks (each starts its next call from its handler).
class async_run {
public:
    async_run(rpc::async_client& a, rpc::peer_id peer, const point& p, long calls)
        : a_(a)
        , peer_(peer)
        , calls_(calls)
        , rec_(calls)
        , lanes_(static_cast<std::size_t>(p.outstanding)) {
        for (auto& l : lanes_)
            l.req.resize(p.bytes);
    }
    figures run(asio::io_context& io, bool coroutines, double per_us) {
        const std::uint64_t t0 = cycles();
        for (std::size_t k = 0; k < lanes_.size(); ++k) {
            if (coroutines)
                asio::co_spawn(io, lane(k), asio::detached);
            else
                next(k);
        }
        io.run_for(std::chrono::seconds(120));
        if (done_ < calls_)
            throw bench_failure("rpc (async): no progress for 120 s");
        return rec_.finish(per_us, cycles() - t0, bad_);
    }

private:
    void begin(std::size_t k) {
        fill(lanes_[k].req, static_cast<std::uint64_t>(started_++));
        lanes_[k].started = cycles();
    }
    void end(std::size_t k, std::error_code ec, const rpc::call_result& r) {
        rec_.add(cycles() - lanes_[k].started);
        if (ec || !same(r.reply, lanes_[k].req))
            ++bad_;
        ++done_;
    }
    asio::awaitable<void> lane(std::size_t k) {
        while (started_ < calls_) {
            begin(k);
            const auto [ec, r] = co_await a_.async_call(
                peer_, 1, lanes_[k].req, {}, asio::experimental::as_tuple(asio::use_awaitable));
            end(k, ec, r);
        }
    }
    void next(std::size_t k) {
        if (started_ >= calls_)
            return;
        begin(k);
        a_.async_call(peer_, 1, lanes_[k].req, {},
                      [this, k](std::error_code ec, const rpc::call_result& r) {
                          end(k, ec, r);
                          next(k);
                      });
    }

    rpc::async_client& a_;
    rpc::peer_id peer_;
    long calls_, started_ = 0, done_ = 0, bad_ = 0;
    recorder rec_;
    std::vector<call_slot> lanes_;
};

figures run_rpc_async(const verbs::protection_domain* pd, const std::string& addr, const point& p,
                      long calls, double per_us, bool local, long spin_us, bool batch) {
    rpc::rpc_options o = rpc::rpc_options{}.with_env();
    o.local = local;
    o.slots = static_cast<std::uint16_t>(std::max(p.outstanding, 1));
    const std::unique_ptr<rpc::server> made = make_server(pd, addr, o);
    rpc::server& srv = *made;
    srv.on(1, [](rpc::request_context& c) { c.reply(c.body()); });
    std::atomic<bool> stop{false};
    std::thread serve([&] {
        while (!stop.load(std::memory_order_relaxed))
            (void)srv.poll();
    });
    figures f;
    try {
        asio::io_context io(1); // one thread runs it: Asio takes fewer locks
        const std::unique_ptr<rpc::client> made_cli = make_client(pd, o);
        rpc::client& cli = *made_cli;
        const rpc::peer_id peer = cli.connect(addr, srv.port());
        rpc::async_options ao;
        ao.spin_for = std::chrono::microseconds(spin_us);
        ao.batch_doorbells = batch;
        rpc::async_client a(io, cli, ao);
        async_run r(a, peer, p, calls);
        f = r.run(io, p.api == "awaitable", per_us);
        f.doorbells_per_call = doorbells_per_call(cli, peer, calls);
    } catch (...) {
        stop = true;
        serve.join();
        throw;
    }
    stop = true;
    serve.join();
    return f;
}
#endif

// ---- send/receive on rdmax verbs -----------------------------------------------------------

/// A connection's registered buffers: K receive and K send buffers of `bytes`.
struct sr_buffers {
    std::vector<std::byte> mem;
    memory_region<rights::local_write> mr;
    std::size_t bytes;
    int k;
    sr_buffers(const verbs::protection_domain& pd, std::size_t b, int k_)
        : mem(2 * static_cast<std::size_t>(k_) * std::max<std::size_t>(b, 8))
        , mr(pd, mem.data(), mem.size())
        , bytes(std::max<std::size_t>(b, 8))
        , k(k_) {}
    [[nodiscard]] local_buffer<rights::local_write> recv(std::size_t i) const {
        return mr.local(i * bytes, bytes);
    }
    [[nodiscard]] local_buffer<rights::local_write> send(std::size_t i) const {
        return mr.local((static_cast<std::size_t>(k) + i) * bytes, bytes);
    }
};

verbs::qp_config sr_config(int k) {
    verbs::qp_config cfg;
    cfg.send_depth = static_cast<std::uint32_t>(std::max(64, 4 * k));
    cfg.recv_depth = static_cast<std::uint32_t>(std::max(64, 2 * k));
    cfg.max_inline = 256;
    return cfg;
}

figures run_sendrecv(const verbs::protection_domain& pd, const std::string& addr, const point& p,
                     long calls, double per_us) {
    const std::size_t bytes = std::max<std::size_t>(p.bytes, 8);
    verbs::listener lst(addr, 0);
    const std::uint16_t port = lst.port();
    std::atomic<bool> stop{false}, server_failed{false};
    std::thread serve([&] {
        try {
            struct conn {
                std::unique_ptr<sr_buffers> buf;
                std::optional<verbs::connection> c;
                std::size_t next_send = 0;
            };
            std::vector<conn> conns(static_cast<std::size_t>(p.clients));
            for (auto& c : conns) {
                verbs::connection_request req = lst.next_request(std::chrono::seconds(10));
                req.create_qp(pd, sr_config(p.outstanding));
                c.buf = std::make_unique<sr_buffers>(pd, bytes, p.outstanding);
                for (int i = 0; i < p.outstanding; ++i)
                    if (req.qp().post_recv(c.buf->recv(static_cast<std::size_t>(i)),
                                           static_cast<std::uint64_t>(i)) != status::ok)
                        throw bench_failure("post_recv");
                c.c.emplace(req.accept({}, std::chrono::seconds(10)));
            }
            verbs::completion wc[32];
            while (!stop.load(std::memory_order_relaxed)) {
                for (auto& c : conns) {
                    auto& qp = c.c->qp();
                    (void)qp.poll_send(wc); // failures only: unsignaled sends
                    const int n = qp.poll_recv(wc);
                    for (int i = 0; i < n; ++i) {
                        if (!wc[i].ok())
                            throw bench_failure("sendrecv server: receive failed");
                        const auto r = static_cast<std::size_t>(wc[i].wr_id);
                        // Echo: copy out, give the receive back, send.
                        const std::size_t s =
                            c.next_send++ % static_cast<std::size_t>(p.outstanding);
                        std::memcpy(c.buf->send(s).addr, c.buf->recv(r).addr, wc[i].byte_len);
                        if (qp.post_recv(c.buf->recv(r), r) != status::ok)
                            throw bench_failure("sendrecv server: post_recv");
                        auto src = *c.buf->send(s).sub(0, wc[i].byte_len);
                        status st;
                        while ((st = qp.send(src, s, verbs::send_flags{.signaled = false})) ==
                               status::queue_full)
                            (void)qp.wait_send_slots(1, std::chrono::milliseconds(100));
                        if (st != status::ok)
                            throw bench_failure("sendrecv server: send");
                    }
                }
            }
        } catch (const std::exception& e) {
            fmt::print(stderr, "rdmax_rpc_bench: sendrecv server: {}\n", e.what());
            server_failed = true;
        }
    });
    figures f;
    try {
        struct client_state {
            std::unique_ptr<sr_buffers> buf;
            std::optional<verbs::connection> c;
            std::vector<call_slot> slots;
        };
        std::vector<client_state> cs(static_cast<std::size_t>(p.clients));
        for (auto& c : cs) {
            c.buf = std::make_unique<sr_buffers>(pd, bytes, p.outstanding);
            verbs::prepared_connection pc(pd, addr, port, sr_config(p.outstanding));
            for (int i = 0; i < p.outstanding; ++i)
                if (pc.qp().post_recv(c.buf->recv(static_cast<std::size_t>(i)),
                                      static_cast<std::uint64_t>(i)) != status::ok)
                    throw bench_failure("post_recv");
            c.c.emplace(pc.connect({}, std::chrono::seconds(10)));
            c.slots.resize(static_cast<std::size_t>(p.outstanding));
        }
        recorder rec(calls);
        long started = 0, done = 0, bad = 0;
        std::vector<std::byte> expect(bytes);
        const auto start = [&](client_state& c, std::size_t k) {
            auto dst = c.buf->send(k);
            fill({dst.addr, bytes},
                 static_cast<std::uint64_t>(k) | (static_cast<std::uint64_t>(started) << 8));
            c.slots[k].req.assign(dst.addr, dst.addr + bytes);
            c.slots[k].started = cycles();
            auto& qp = c.c->qp();
            status st;
            while ((st = qp.send(dst, k, verbs::send_flags{.signaled = false})) ==
                   status::queue_full)
                (void)qp.wait_send_slots(1, std::chrono::milliseconds(100));
            if (st != status::ok)
                throw bench_failure("sendrecv client: send");
            ++started;
        };
        const std::uint64_t t0 = cycles();
        for (auto& c : cs)
            for (std::size_t k = 0; k < c.slots.size() && started < calls; ++k)
                start(c, k);
        verbs::completion wc[32];
        const auto limit = static_cast<std::uint64_t>(per_us * 120e6);
        while (done < started) {
            if (cycles() - t0 > limit || server_failed)
                throw bench_failure("sendrecv: no progress");
            for (auto& c : cs) {
                auto& qp = c.c->qp();
                (void)qp.poll_send(wc);
                const int n = qp.poll_recv(wc);
                for (int i = 0; i < n; ++i) {
                    if (!wc[i].ok())
                        throw bench_failure("sendrecv client: receive failed");
                    const auto r = static_cast<std::size_t>(wc[i].wr_id);
                    const std::span<const std::byte> got(c.buf->recv(r).addr, wc[i].byte_len);
                    std::uint64_t id = 0;
                    std::memcpy(&id, got.data(), 8);
                    const std::size_t k = id & 0xff;
                    if (k >= c.slots.size()) {
                        ++bad;
                        continue;
                    }
                    rec.add(cycles() - c.slots[k].started);
                    if (!same(got, c.slots[k].req))
                        ++bad;
                    if (qp.post_recv(c.buf->recv(r), r) != status::ok)
                        throw bench_failure("sendrecv client: post_recv");
                    ++done;
                    if (started < calls)
                        start(c, k);
                }
            }
        }
        f = rec.finish(per_us, cycles() - t0, bad);
        for (auto& c : cs)
            c.c->disconnect(std::chrono::milliseconds(500));
    } catch (...) {
        stop = true;
        serve.join();
        throw;
    }
    stop = true;
    serve.join();
    return f;
}

// ---- bare write-with-immediate on rdmax verbs ------------------------------------------------
// The verbs rdmax's RPC stands on, with nothing of it: each side's ring
// registered whole, zero-length receives on a shared receive queue, the echo
// written back from where the request landed. What rdmax adds is the
// difference between this and "rdmax".

/// A ring of K slots of `bytes`, registered for the peer's writes.
struct wi_ring {
    std::vector<std::byte> mem;
    memory_region<rights::local_write | rights::remote_write> mr;
    std::size_t bytes;
    wi_ring(const verbs::protection_domain& pd, std::size_t b, int k)
        : mem(static_cast<std::size_t>(k) * std::max<std::size_t>(b, 8))
        , mr(pd, mem.data(), mem.size())
        , bytes(std::max<std::size_t>(b, 8)) {}
    [[nodiscard]] local_buffer<rights::local_write> slot(std::size_t i, std::size_t n) const {
        return mr.local(i * bytes, n);
    }
    [[nodiscard]] remote_buffer<rights::remote_write> token() const {
        return remote_buffer<rights::remote_write>(mr.remote());
    }
};

figures run_writeimm(const verbs::protection_domain& pd, const std::string& addr, const point& p,
                     long calls, double per_us) {
    const std::size_t bytes = std::max<std::size_t>(p.bytes, 8);
    if (bytes > (1U << 19) - 1)
        throw bench_failure("writeimm: at most 512 KiB (the immediate's length bits)");
    verbs::shared_receive_queue srq_s(pd, 1024), srq_c(pd, 1024);
    verbs::completion_queue rcq_s(pd.device(), 1024), rcq_c(pd.device(), 1024);
    const auto post_empty = [](verbs::shared_receive_queue& q, std::uint32_t n) {
        for (std::uint32_t done = 0; done < n; done += 64)
            if (q.post_empty(std::min(64U, n - done), 0) != status::ok)
                throw bench_failure("post_srq_recv");
    };
    post_empty(srq_s, 1024);
    post_empty(srq_c, 1024);
    const auto cfg = [&](verbs::completion_queue& cq, verbs::shared_receive_queue& q) {
        verbs::qp_config c = sr_config(p.outstanding);
        c.recv_cq = &cq;
        c.srq = &q;
        return c;
    };
    verbs::listener lst(addr, 0);
    const std::uint16_t port = lst.port();
    std::atomic<bool> stop{false}, server_failed{false};
    std::thread serve([&] {
        try {
            struct conn {
                std::unique_ptr<wi_ring> ring;
                std::optional<verbs::connection> c;
                remote_buffer<rights::remote_write> peer{};
            };
            std::vector<conn> conns(static_cast<std::size_t>(p.clients));
            for (auto& c : conns) {
                verbs::connection_request req = lst.next_request(std::chrono::seconds(10));
                req.create_qp(pd, cfg(rcq_s, srq_s));
                c.ring = std::make_unique<wi_ring>(pd, bytes, p.outstanding);
                c.peer = *req.peer_payload_as<remote_buffer<rights::remote_write>>();
                c.c.emplace(
                    req.accept(verbs::payload_of(c.ring->token()), std::chrono::seconds(10)));
            }
            ibv_wc wc[32];
            std::uint32_t owed = 0;
            while (!stop.load(std::memory_order_relaxed)) {
                for (auto& c : conns) {
                    verbs::completion sc[8];
                    (void)c.c->qp().poll_send(sc);
                }
                const int n = rcq_s.poll(wc);
                for (int i = 0; i < n; ++i) {
                    if (wc[i].status != IBV_WC_SUCCESS)
                        throw bench_failure("writeimm server: receive failed");
                    conn* c = nullptr;
                    for (auto& x : conns)
                        if (x.c->qp().qp_num() == wc[i].qp_num)
                            c = &x;
                    if (c == nullptr)
                        throw bench_failure("writeimm server: a completion of no connection");
                    const std::uint32_t imm = ntohl(wc[i].imm_data);
                    const std::size_t slot = imm >> 19, len = imm & ((1U << 19) - 1);
                    auto& qp = c->c->qp();
                    status st;
                    while ((st = qp.write_imm(c->ring->slot(slot, len), c->peer, slot * bytes, imm,
                                              slot, verbs::send_flags{.signaled = false})) ==
                           status::queue_full)
                        (void)qp.wait_send_slots(1, std::chrono::milliseconds(100));
                    if (st != status::ok)
                        throw bench_failure("writeimm server: write");
                }
                owed += static_cast<std::uint32_t>(std::max(n, 0));
                if (owed >= 32) {
                    post_empty(srq_s, owed);
                    owed = 0;
                }
            }
        } catch (const std::exception& e) {
            fmt::print(stderr, "rdmax_rpc_bench: writeimm server: {}\n", e.what());
            server_failed = true;
        }
    });
    figures f;
    try {
        struct client_state {
            std::unique_ptr<wi_ring> ring; // replies land here
            std::unique_ptr<sr_buffers> out;
            std::optional<verbs::connection> c;
            remote_buffer<rights::remote_write> peer{};
            std::vector<call_slot> slots;
        };
        std::vector<client_state> cs(static_cast<std::size_t>(p.clients));
        for (auto& c : cs) {
            c.ring = std::make_unique<wi_ring>(pd, bytes, p.outstanding);
            c.out = std::make_unique<sr_buffers>(pd, bytes, p.outstanding);
            c.c.emplace(verbs::connection::connect(pd, addr, port,
                                                   verbs::payload_of(c.ring->token()),
                                                   cfg(rcq_c, srq_c), std::chrono::seconds(10)));
            c.peer = *c.c->peer_payload_as<remote_buffer<rights::remote_write>>();
            c.slots.resize(static_cast<std::size_t>(p.outstanding));
        }
        recorder rec(calls);
        long started = 0, done = 0, bad = 0;
        std::uint32_t owed = 0;
        const auto start = [&](client_state& c, std::size_t k) {
            auto src = c.out->send(k);
            fill({src.addr, bytes}, static_cast<std::uint64_t>(started));
            c.slots[k].req.assign(src.addr, src.addr + bytes);
            c.slots[k].started = cycles();
            const auto imm = static_cast<std::uint32_t>((k << 19) | bytes);
            auto& qp = c.c->qp();
            status st;
            while ((st = qp.write_imm(src, c.peer, k * bytes, imm, k,
                                      verbs::send_flags{.signaled = false})) == status::queue_full)
                (void)qp.wait_send_slots(1, std::chrono::milliseconds(100));
            if (st != status::ok)
                throw bench_failure("writeimm client: write");
            ++started;
        };
        const std::uint64_t t0 = cycles();
        for (auto& c : cs)
            for (std::size_t k = 0; k < c.slots.size() && started < calls; ++k)
                start(c, k);
        ibv_wc wc[32];
        const auto limit = static_cast<std::uint64_t>(per_us * 120e6);
        while (done < started) {
            if (cycles() - t0 > limit || server_failed)
                throw bench_failure("writeimm: no progress");
            for (auto& c : cs) {
                verbs::completion sc[8];
                (void)c.c->qp().poll_send(sc);
            }
            const int n = rcq_c.poll(wc);
            for (int i = 0; i < n; ++i) {
                if (wc[i].status != IBV_WC_SUCCESS)
                    throw bench_failure("writeimm client: receive failed");
                client_state* c = nullptr;
                for (auto& x : cs)
                    if (x.c->qp().qp_num() == wc[i].qp_num)
                        c = &x;
                if (c == nullptr)
                    throw bench_failure("writeimm client: a completion of no connection");
                const std::uint32_t imm = ntohl(wc[i].imm_data);
                const std::size_t k = imm >> 19;
                rec.add(cycles() - c->slots[k].started);
                const auto got = c->ring->slot(k, bytes);
                if (!same({got.addr, bytes}, c->slots[k].req))
                    ++bad;
                ++done;
                if (started < calls)
                    start(*c, k);
            }
            owed += static_cast<std::uint32_t>(std::max(n, 0));
            if (owed >= 32) {
                post_empty(srq_c, owed);
                owed = 0;
            }
        }
        f = rec.finish(per_us, cycles() - t0, bad);
        for (auto& c : cs)
            c.c->disconnect(std::chrono::milliseconds(500));
    } catch (...) {
        stop = true;
        serve.join();
        throw;
    }
    stop = true;
    serve.join();
    return f;
}

// ---- TCP on the loopback -------------------------------------------------------------------

/// rdmax-tcp against plain tcp at the points both ran, this run: the ratio
/// of p50 (rdmax-tcp / tcp: lower is better) and of calls/s (higher is).
void print_tcp_ratios(const std::vector<std::pair<point, figures>>& polled) {
    for (const auto& [p, f] : polled) {
        if (p.transport != "rdmax-tcp")
            continue;
        const auto base = std::find_if(polled.begin(), polled.end(), [&](const auto& b) {
            return b.first.transport == "tcp" && b.first.bytes == p.bytes &&
                   b.first.outstanding == p.outstanding && b.first.clients == p.clients;
        });
        if (base == polled.end())
            continue;
        fmt::print("rdmax-tcp/tcp {:>8} B x{:<3}: p50 {:.2f}x, calls/s {:.2f}x ({:.0f} MB/s "
                   "echoed vs {:.0f})\n",
                   p.bytes, p.outstanding, f.p50_us / base->second.p50_us,
                   f.calls_per_s / base->second.calls_per_s,
                   f.calls_per_s * static_cast<double>(p.bytes) * 2e-6,
                   base->second.calls_per_s * static_cast<double>(p.bytes) * 2e-6);
    }
}

int tcp_socket() {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        throw bench_failure(fmt::format("socket: {}", std::strerror(errno)));
    const int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    return fd;
}

void write_all(int fd, const std::byte* p, std::size_t n) {
    while (n > 0) {
        const ssize_t w = ::write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            throw bench_failure(fmt::format("write: {}", std::strerror(errno)));
        }
        p += w;
        n -= static_cast<std::size_t>(w);
    }
}
void read_all(int fd, std::byte* p, std::size_t n) {
    while (n > 0) {
        const ssize_t r = ::read(fd, p, n);
        if (r <= 0) {
            if (r < 0 && (errno == EINTR || errno == EAGAIN))
                continue;
            throw bench_failure("read: connection closed");
        }
        p += r;
        n -= static_cast<std::size_t>(r);
    }
}

figures run_tcp(const point& p, long calls, double per_us) {
    const std::size_t bytes = std::max<std::size_t>(p.bytes, 8);
    const int lfd = tcp_socket();
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || ::listen(lfd, 64) != 0)
        throw bench_failure(fmt::format("bind/listen: {}", std::strerror(errno)));
    socklen_t len = sizeof sa;
    (void)getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len);
    std::atomic<bool> stop{false};
    std::thread serve([&] {
        std::vector<int> fds;
        std::vector<std::byte> buf(bytes);
        try {
            for (int i = 0; i < p.clients; ++i) {
                const int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
                if (fd < 0)
                    throw bench_failure("accept");
                const int one = 1;
                (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                fds.push_back(fd);
            }
            std::vector<pollfd> pfds;
            pfds.reserve(fds.size());
            for (int fd : fds)
                pfds.push_back({fd, POLLIN, 0});
            while (!stop.load(std::memory_order_relaxed)) {
                if (::poll(pfds.data(), pfds.size(), 50) <= 0)
                    continue;
                for (auto& pf : pfds) {
                    if ((pf.revents & (POLLIN | POLLHUP)) == 0)
                        continue;
                    read_all(pf.fd, buf.data(), bytes);
                    write_all(pf.fd, buf.data(), bytes);
                }
            }
        } catch (const std::exception&) {
            // A client that went away ends the server.
        }
        for (int fd : fds)
            ::close(fd);
    });
    figures f;
    std::vector<int> cfds;
    try {
        std::vector<std::vector<call_slot>> slots(static_cast<std::size_t>(p.clients));
        for (int i = 0; i < p.clients; ++i) {
            const int fd = tcp_socket();
            if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0)
                throw bench_failure(fmt::format("connect: {}", std::strerror(errno)));
            cfds.push_back(fd);
            slots[static_cast<std::size_t>(i)].resize(static_cast<std::size_t>(p.outstanding));
        }
        recorder rec(calls);
        long started = 0, done = 0, bad = 0;
        std::vector<std::byte> in(bytes);
        // Replies come back in order on each socket: a FIFO of slots per client.
        std::vector<std::vector<std::size_t>> fifo(cfds.size());
        std::vector<std::size_t> head(cfds.size(), 0);
        const auto start = [&](std::size_t c, std::size_t k) {
            auto& s = slots[c][k];
            s.req.resize(bytes);
            fill(s.req, static_cast<std::uint64_t>(started));
            s.started = cycles();
            write_all(cfds[c], s.req.data(), bytes);
            fifo[c].push_back(k);
            ++started;
        };
        const std::uint64_t t0 = cycles();
        for (std::size_t c = 0; c < cfds.size(); ++c)
            for (std::size_t k = 0; k < slots[c].size() && started < calls; ++k)
                start(c, k);
        std::vector<pollfd> pfds;
        pfds.reserve(cfds.size());
        for (int fd : cfds)
            pfds.push_back({fd, POLLIN, 0});
        while (done < started) {
            if (::poll(pfds.data(), pfds.size(), 10'000) <= 0)
                throw bench_failure("tcp: no reply for 10 s");
            for (std::size_t c = 0; c < pfds.size(); ++c) {
                if ((pfds[c].revents & POLLIN) == 0)
                    continue;
                read_all(cfds[c], in.data(), bytes);
                const std::size_t k = fifo[c][head[c]++];
                rec.add(cycles() - slots[c][k].started);
                if (!same(in, slots[c][k].req))
                    ++bad;
                ++done;
                if (started < calls)
                    start(c, k);
            }
        }
        f = rec.finish(per_us, cycles() - t0, bad);
    } catch (...) {
        stop = true;
        for (int fd : cfds)
            ::close(fd);
        serve.join();
        ::close(lfd);
        throw;
    }
    stop = true;
    for (int fd : cfds)
        ::shutdown(fd, SHUT_RDWR);
    serve.join();
    for (int fd : cfds)
        ::close(fd);
    ::close(lfd);
    return f;
}

/// An rdmax or local point through the Asio adapter (--api awaitable or callback).
figures run_async(const verbs::protection_domain* pd, const std::string& addr, const point& p,
                  long calls, double per_us, bool local, long spin_us, bool batch) {
#ifdef RDMAX_BENCH_ASIO
    if (p.api != "awaitable" && p.api != "callback")
        throw bench_failure(fmt::format("--api {}: poll, poll-each, awaitable or callback", p.api));
    return run_rpc_async(pd, addr, p, calls, per_us, local, spin_us, batch);
#else
    (void)pd, (void)addr, (void)calls, (void)per_us, (void)local, (void)spin_us, (void)batch;
    throw bench_failure(fmt::format("--api {}: built without Asio (libasio-dev)", p.api));
#endif
}

std::vector<std::string> split(const std::string& s) {
    std::vector<std::string> out;
    std::size_t at = 0;
    while (at <= s.size()) {
        const std::size_t comma = s.find(',', at);
        out.push_back(s.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
        if (comma == std::string::npos)
            break;
        at = comma + 1;
    }
    return out;
}

} // namespace

int main(int argc, char** argv) {
    std::string addr = "192.0.2.1", sweep = "all",
                transports = "rdmax,local,rdmax-tcp,sendrecv,tcp", json;
    std::string apis = "poll";
    long calls = 2000, spin_us = 0;
    bool batch = true; ///< --no-batch: async_options::batch_doorbells off
    bool addr_given = false;
    static const option longs[] = {{"sweep", required_argument, nullptr, 'w'},
                                   {"transports", required_argument, nullptr, 'T'},
                                   {"json", required_argument, nullptr, 'j'},
                                   {"api", required_argument, nullptr, 'A'},
                                   {"spin-us", required_argument, nullptr, 'S'},
                                   {"no-batch", no_argument, nullptr, 'B'},
                                   {"help", no_argument, nullptr, 'h'},
                                   {nullptr, 0, nullptr, 0}};
    for (int c; (c = getopt_long(argc, argv, "a:n:h", longs, nullptr)) != -1;) {
        switch (c) {
        case 'a':
            addr = optarg;
            addr_given = true;
            break;
        case 'n': calls = std::max(10L, std::atol(optarg)); break;
        case 'w': sweep = optarg; break;
        case 'T': transports = optarg; break;
        case 'j': json = optarg; break;
        case 'A': apis = optarg; break;
        case 'S': spin_us = std::max(0L, std::atol(optarg)); break;
        case 'B': batch = false; break;
        default:
            std::fputs("usage: rdmax_rpc_bench [-a ADDR] [-n CALLS] [--sweep "
                       "size|outstanding|clients|latency|syscalls|api|all] [--transports "
                       "rdmax,sendrecv,tcp] [--json FILE] [--api "
                       "poll,poll-each,awaitable,callback] [--spin-us N] "
                       "[--no-batch]\n",
                       stderr);
            return c == 'h' ? 0 : 2;
        }
    }
    try {
        std::vector<point> points;
        const auto add = [&](std::size_t b, int k, int c) {
            for (const std::string& t : split(transports))
                for (const std::string& api : split(apis))
                    if (api == "poll" || t == "rdmax" || t == "local")
                        points.push_back({t, b, k, c, api});
        };
        if (sweep == "size" || sweep == "all")
            for (std::size_t b : {64, 512, 4096, 65536})
                add(b, 1, 1);
        if (sweep == "outstanding" || sweep == "all")
            for (int k : {4, 16, 64})
                add(64, k, 1);
        if (sweep == "clients" || sweep == "all")
            for (int c : {4, 16})
                add(64, 16, c);
        if (sweep == "syscalls") // one point, for strace -c at two lengths (rpc-bench)
            add(64, 16, 1);
        if (sweep == "latency") // the 64 B point alone, for rounds against the floor (rpc-bench)
            add(64, 1, 1);
        if (sweep == "tcp") // rdmax's TCP transport against plain TCP, same run
            for (const auto& [b, k] : {std::pair<std::size_t, int>{64, 1}, {64, 16}, {1 << 20, 1}})
                add(b, k, 1);
        if (sweep == "api") // poll against the async adapter, same run
            for (int k : {1, 16, 64})
                add(64, k, 1);
        if (points.empty())
            throw bench_failure(
                fmt::format("--sweep {}: size, outstanding, clients, api, tcp or all", sweep));
        // The device, where a transport needs it; "local" and "tcp" run without
        // one (natively, on a machine with no RDMA), then on 127.0.0.1 unless -a.
        const auto needs_device = [](const std::string& t) {
            return t != "local" && t != "tcp" && t != "rdmax-tcp";
        };
        const auto ts = split(transports);
        std::optional<verbs::context> ctx;
        std::optional<verbs::protection_domain> pd;
        if (std::any_of(ts.begin(), ts.end(), needs_device)) {
            ctx.emplace(verbs::context::open_by_address(addr));
            pd.emplace(*ctx);
        } else if (!addr_given) {
            addr = "127.0.0.1";
        }
        const verbs::protection_domain* dev = pd ? &*pd : nullptr;
        const double per_us = estimate_cycles_per_us();
        std::FILE* out = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
        if (!json.empty() && out == nullptr)
            throw bench_failure(fmt::format("--json {}: {}", json, std::strerror(errno)));
        fmt::print(
            "{:<9} {:>8} {:>5} {:>7} {:>10} {:>10} {:>12} {:>5} {:<9} {:>6} {:>9} {:>9} {:>10}\n",
            "transport", "bytes", "out", "clients", "p50[us]", "p99[us]", "calls/s", "bad", "api",
            "timed", "p50/poll", "rate/poll", "bells/call");
        std::vector<std::pair<point, figures>> polled; // poll's figures, for the ratios
        // The ratios' base: poll-each when it runs (the adapter's own call
        // pattern, its clocks started where the adapter's are), else poll.
        const std::string base_api =
            std::ranges::count(split(apis), std::string("poll-each")) != 0 ? "poll-each" : "poll";
        long bad = 0;
        for (const point& p : points) {
            fmt::print(stderr, "rdmax_rpc_bench: {} {} B x{} in flight, {} clients\n", p.transport,
                       p.bytes, p.outstanding, p.clients);
            // Fewer calls for large messages: TCG moves them slowly.
            const long n = p.bytes > 4096 ? std::max(50L, calls / 10) : calls;
            figures f;
            const bool rpc_path = p.transport == "rdmax" || p.transport == "local";
            if (rpc_path && p.api == "poll-each")
                f = run_rpc(dev, addr, p, n, per_us, p.transport == "local", true, batch);
            else if (rpc_path && p.api != "poll")
                f = run_async(dev, addr, p, n, per_us, p.transport == "local", spin_us, batch);
            else if (p.transport == "rdmax")
                f = run_rpc(dev, addr, p, n, per_us, false);
            else if (p.transport == "local" || p.transport == "rdmax-tcp")
                f = run_rpc(dev, addr, p, n, per_us, p.transport == "local");
            else if (p.transport == "sendrecv")
                f = run_sendrecv(*pd, addr, p, n, per_us);
            else if (p.transport == "tcp")
                f = run_tcp(p, n, per_us);
            else if (p.transport == "writeimm")
                f = run_writeimm(*pd, addr, p, n, per_us);
            else
                throw bench_failure(
                    fmt::format("transport {}: rdmax, local, rdmax-tcp, sendrecv, writeimm or tcp",
                                p.transport));
            bad += f.bad;
            if (p.api == "poll" || p.api == "poll-each")
                polled.emplace_back(p, f);
            // The same point through poll() in this run: the ratios (machines here are noisy).
            const auto base = std::find_if(polled.begin(), polled.end(), [&](const auto& b) {
                return b.first.api == base_api && b.first.transport == p.transport &&
                       b.first.bytes == p.bytes && b.first.outstanding == p.outstanding &&
                       b.first.clients == p.clients;
            });
            const bool ratio = base != polled.end() && p.api != base_api;
            fmt::print(
                "{:<9} {:>8} {:>5} {:>7} {:>10.1f} {:>10.1f} {:>12.0f} {:>5} {:<9} {:>6.1f} {:>9} "
                "{:>9} {:>10}\n",
                p.transport, p.bytes, p.outstanding, p.clients, f.p50_us, f.p99_us, f.calls_per_s,
                f.bad, p.api, f.calls_per_s * f.mean_us * 1e-6,
                ratio ? fmt::format("{:.2f}", f.p50_us / base->second.p50_us) : "",
                ratio ? fmt::format("{:.2f}", f.calls_per_s / base->second.calls_per_s) : "",
                f.doorbells_per_call > 0 ? fmt::format("{:.3f}", f.doorbells_per_call) : "");
            std::fflush(stdout);
            if (out != nullptr)
                fmt::print(
                    out,
                    "{{\"kind\":\"rpc\",\"transport\":\"{}\",\"bytes\":{},\"outstanding\":{},"
                    "\"clients\":{},\"p50_us\":{:.2f},\"p99_us\":{:.2f},\"mean_us\":{:.2f},"
                    "\"calls_per_s\":{:.0f},\"calls\":{},\"bad\":{},\"api\":\"{}\","
                    "\"doorbells_per_call\":{:.3f}}}\n",
                    p.transport, p.bytes, p.outstanding, p.clients, f.p50_us, f.p99_us, f.mean_us,
                    f.calls_per_s, f.calls, f.bad, p.api, f.doorbells_per_call);
        }
        if (out != nullptr)
            std::fclose(out);
        print_tcp_ratios(polled);
        if (bad != 0)
            throw bench_failure(fmt::format("{} replies differed from their requests", bad));
        return 0;
    } catch (const std::exception& e) {
        fmt::print(stderr, "rdmax_rpc_bench: {}\n", e.what());
        return 1;
    }
}
