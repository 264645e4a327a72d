// rdmax_local_bench: moving bytes between two processes on one node, every
// path in one run: one copy by cross-memory attach (cma), one copy through a
// mapping of the peer's exported memory found in the mapping cache (mapped:
// the writer exports its buffer with local::exporter, the reader maps it with
// local::importer, as two services would),
// two copies through a shared bounce buffer (bounce), the message ring for
// small messages (ring), and soft-RoCE's loopback (rxe, where a device is).
//
//   rdmax_local_bench [-s MIN] [-S MAX] [-n ITERS] [--json FILE] [--no-rxe] [-a ADDR]
//   (sizes with K/M/G suffixes)
//
// Bandwidth: the reader process pulls SIZE bytes from the writer process
// ITERS times (cma: process_vm_readv; mapped: memcpy from the mapped export;
// bounce: the writer copies into a shared buffer in 1 MiB chunks, the reader
// copies out, pipelined over two chunks; rxe: an RDMA read between two queue
// pairs on the device). Latency: a 64 B ping-pong between the two processes
// (ring: two message rings; rxe: send/receive on a queue pair pair), half the
// median round trip. The mapping cache: a hit (lookup and generation check)
// against a fresh map (through the importer: a request to the writer, its
// descriptor back, mmap). Every transfer's bytes are checked.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <getopt.h>
#include <new>
#include <optional>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/detail/local/spsc_ring.hpp>
#include <rdmax/local/cma.hpp>
#include <rdmax/local/descriptor_passing.hpp>
#include <rdmax/local/exporter.hpp>
#include <rdmax/local/importer.hpp>
#include <rdmax/local/mapping_cache.hpp>
#include <rdmax/local/shared_segment.hpp>

#include "bench_common.hpp"
#include "bench_stats.hpp"

namespace {

using namespace rdmax;
using namespace rdmax::bench;
using namespace rdmax::local;

std::FILE* json_out = nullptr;
/// Each ping-pong ring's block: 64 KiB of records.
constexpr std::size_t ring_bytes = spsc_ring::bytes_for(1 << 16);
double per_us = 1;

void fill(std::span<std::byte> b, unsigned seed) {
    for (std::size_t i = 0; i < b.size(); i += 64)
        b[i] = static_cast<std::byte>((i / 64 + seed) % 251);
}
bool check(std::span<const std::byte> b, unsigned seed) {
    for (std::size_t i = 0; i < b.size(); i += 64)
        if (b[i] != static_cast<std::byte>((i / 64 + seed) % 251))
            return false;
    return true;
}

/// CPU time of the calling thread (user and system), in microseconds.
double thread_cpu_us() {
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) * 1e6 + static_cast<double>(t.tv_nsec) / 1e3;
}

/// op: "pull" (bandwidth: the reader takes `bytes` from the writer) or
/// "pingpong" (a 64 B message there and back: lat_us is half the round trip).
/// cpu_us: CPU time per transfer of every thread that copies (the reader's,
/// and the writer's on the bounce path); 0 where not measured.
void record(const char* path, const char* op, std::size_t bytes, double mbps, double lat_us,
            double cpu_us = 0) {
    fmt::print("{:<8} {:<8} {:>10} {:>12.1f} {:>12.2f} {:>12.2f}\n", path, op, bytes, mbps, lat_us,
               cpu_us);
    std::fflush(stdout);
    if (json_out != nullptr)
        fmt::print(json_out,
                   "{{\"kind\":\"local\",\"path\":\"{}\",\"op\":\"{}\",\"bytes\":{},"
                   "\"MBps\":{:.1f},\"lat_us\":{:.3f},\"cpu_us\":{:.3f}}}\n",
                   path, op, bytes, mbps, lat_us, cpu_us);
}

/// The writer process: a child that keeps `src` (in a shared segment, so the
/// mapped path can export it) and serves the bounce path when asked.
struct writer {
    pid_t pid = -1;
    int cmd = -1, ack = -1; // pipes: commands to the child, acknowledgements back
    ~writer() {
        if (pid > 0) {
            char c = 'q';
            (void)!write(cmd, &c, 1);
            int st = 0;
            waitpid(pid, &st, 0);
        }
        if (cmd >= 0)
            close(cmd);
        if (ack >= 0)
            close(ack);
    }
};

/// The shared state of the bounce path: two 1 MiB chunks and their flags.
struct bounce_area {
    static constexpr std::size_t chunk = 1 << 20;
    std::atomic<std::uint64_t> full[2];  ///< the writer's count of chunks put in each
    std::atomic<std::uint64_t> empty[2]; ///< the reader's count of chunks taken from each
};

struct shared_state {
    shared_segment src;         ///< the writer's buffer (exported for the mapped path)
    export_notice src_export;   ///< the writer's export of src, as it told the reader
    std::optional<importer> im; ///< the reader's, over a channel to the writer's exporter
    shared_segment bounce;      ///< bounce_area, then 2 chunks
    shared_segment rings;       ///< two message rings for the ping-pong
    std::size_t max = 0;
};

/// The writer's exporter: publishes src, tells the reader, then answers its
/// requests on a thread of its own until the reader closes the channel.
void serve_exports(shared_state& s, unix_channel ch) {
    static exporter ex(4); // lives until the writer's _exit
    const export_notice n = ex.share(s.src, false);
    ch.send(std::as_bytes(std::span(&n, 1)));
    std::thread([c = std::move(ch)]() mutable {
        try {
            while (ex.answer(c, std::chrono::seconds(1))) {
            }
        } catch (...) {
        }
    }).detach();
}

void writer_loop(shared_state& s, int cmd, int ack) {
    auto* b = reinterpret_cast<bounce_area*>(s.bounce.data());
    std::byte* chunks = s.bounce.data() + 4096;
    spsc_ring in(s.rings.bytes().first(ring_bytes));
    spsc_ring out(s.rings.bytes().subspan(ring_bytes));
    for (;;) {
        char c = 0;
        if (read(cmd, &c, 1) != 1 || c == 'q')
            _exit(0);
        if (c == 'b') { // bounce: size and iterations follow
            std::uint64_t args[2];
            if (read(cmd, args, sizeof args) != sizeof args)
                _exit(2);
            const std::size_t size = args[0];
            const double cpu0 = thread_cpu_us();
            std::uint64_t put = 0;
            for (std::uint64_t it = 0; it < args[1]; ++it)
                for (std::size_t off = 0; off < size; off += bounce_area::chunk) {
                    const std::size_t n = std::min(bounce_area::chunk, size - off);
                    const std::size_t k = put % 2;
                    // Until the reader took what this chunk held.
                    while (b->full[k].load(std::memory_order_relaxed) !=
                           b->empty[k].load(std::memory_order_acquire)) {
                    }
                    std::memcpy(chunks + k * bounce_area::chunk, s.src.data() + off, n);
                    b->full[k].fetch_add(1, std::memory_order_release);
                    ++put;
                }
            // The writer's share of the CPU, before the acknowledgement.
            const double cpu = thread_cpu_us() - cpu0;
            if (write(ack, "k", 1) != 1 || write(ack, &cpu, sizeof cpu) != sizeof cpu)
                _exit(2);
            continue;
        } else if (c == 'p') { // ping-pong: echo N messages
            std::uint64_t n = 0;
            if (read(cmd, &n, sizeof n) != sizeof n)
                _exit(2);
            std::array<std::byte, 256> m{};
            for (std::uint64_t i = 0; i < n;) {
                std::size_t len = 0;
                if (in.try_pop(m, len) != ring_status::ok)
                    continue;
                while (out.try_push({m.data(), len}) == ring_status::full) {
                }
                ++i;
            }
        }
        c = 'k';
        if (write(ack, &c, 1) != 1)
            _exit(2);
    }
}

void bench_pulls(shared_state& s, writer& w, std::size_t size, int iters) {
    std::vector<std::byte> dst(size);
    const auto remote = reinterpret_cast<std::uint64_t>(s.src.data()); // same address in the child
    // cma
    {
        if (cma_read(w.pid, remote, dst) != cma_status::ok)
            throw bench_failure(fmt::format("cma: {}", why_not_permitted(w.pid)));
        const double cpu0 = thread_cpu_us();
        const std::uint64_t t0 = cycles();
        for (int i = 0; i < iters; ++i)
            if (cma_read(w.pid, remote, dst) != cma_status::ok)
                throw bench_failure("cma_read");
        const double us = static_cast<double>(cycles() - t0) / per_us / iters;
        const double cpu = (thread_cpu_us() - cpu0) / iters;
        if (!check(dst, 1))
            throw bench_failure("cma: wrong bytes");
        record("cma", "pull", size, static_cast<double>(size) / us, us, cpu);
    }
    // mapped: the writer's export of its buffer, found in the importer's
    // cache (mapped at the first use, a hit after)
    {
        const exported_range r{s.src_export, 0, size};
        std::fill(dst.begin(), dst.end(), std::byte{0});
        if (s.im->copy_out(r, 0, dst) != map_status::ok)
            throw bench_failure(fmt::format("mapped: copy_out: {}", s.im->failure()));
        const double cpu0 = thread_cpu_us();
        const std::uint64_t t0 = cycles();
        for (int i = 0; i < iters; ++i)
            if (s.im->copy_out(r, 0, dst) != map_status::ok)
                throw bench_failure("mapped: copy_out");
        const double us = static_cast<double>(cycles() - t0) / per_us / iters;
        const double cpu = (thread_cpu_us() - cpu0) / iters;
        if (!check(dst, 1))
            throw bench_failure("mapped: wrong bytes");
        record("mapped", "pull", size, static_cast<double>(size) / us, us, cpu);
    }
    // bounce: two copies, pipelined over two chunks
    {
        auto* b = reinterpret_cast<bounce_area*>(s.bounce.data());
        for (int k = 0; k < 2; ++k) {
            b->full[k].store(0);
            b->empty[k].store(0);
        }
        std::byte* chunks = s.bounce.data() + 4096;
        std::fill(dst.begin(), dst.end(), std::byte{0});
        const char c = 'b';
        const std::uint64_t args[2] = {size, static_cast<std::uint64_t>(iters)};
        const double cpu0 = thread_cpu_us();
        const std::uint64_t t0 = cycles();
        if (write(w.cmd, &c, 1) != 1 || write(w.cmd, args, sizeof args) != sizeof args)
            throw bench_failure("bounce: the writer is gone");
        std::uint64_t got = 0;
        for (int it = 0; it < iters; ++it)
            for (std::size_t off = 0; off < size; off += bounce_area::chunk) {
                const std::size_t n = std::min(bounce_area::chunk, size - off);
                const std::size_t k = got % 2;
                const auto deadline = cycles() + static_cast<std::uint64_t>(per_us * 30e6);
                while (b->full[k].load(std::memory_order_acquire) ==
                       b->empty[k].load(std::memory_order_relaxed))
                    if (cycles() > deadline)
                        throw bench_failure("bounce: the writer stalled");
                std::memcpy(dst.data() + off, chunks + k * bounce_area::chunk, n);
                b->empty[k].fetch_add(1, std::memory_order_release);
                ++got;
            }
        const double reader_cpu = thread_cpu_us() - cpu0;
        char a = 0;
        double writer_cpu = 0;
        if (read(w.ack, &a, 1) != 1 ||
            read(w.ack, &writer_cpu, sizeof writer_cpu) != sizeof writer_cpu)
            throw bench_failure("bounce: no acknowledgement");
        const double us = static_cast<double>(cycles() - t0) / per_us / iters;
        if (!check(dst, 1))
            throw bench_failure("bounce: wrong bytes");
        record("bounce", "pull", size, static_cast<double>(size) / us, us,
               (reader_cpu + writer_cpu) / iters);
    }
}

void bench_ring(shared_state& s, writer& w, int iters) {
    spsc_ring to(s.rings.bytes().first(ring_bytes));
    spsc_ring from(s.rings.bytes().subspan(ring_bytes));
    if (!to.valid() || !from.valid())
        throw bench_failure("ring: not laid out");
    const char c = 'p';
    const auto n = static_cast<std::uint64_t>(iters);
    if (write(w.cmd, &c, 1) != 1 || write(w.cmd, &n, sizeof n) != sizeof n)
        throw bench_failure("ring: the writer is gone");
    std::array<std::byte, 64> msg{};
    std::array<std::byte, 256> back{};
    std::vector<std::uint64_t> rtt;
    rtt.reserve(static_cast<std::size_t>(iters));
    for (int i = 0; i < iters; ++i) {
        fill(msg, static_cast<unsigned>(i));
        msg[63] = static_cast<std::byte>(i);
        const std::uint64_t t0 = cycles();
        while (to.try_push(msg) != ring_status::ok) {
        }
        std::size_t len = 0;
        const auto deadline = t0 + static_cast<std::uint64_t>(per_us * 10e6);
        while (from.try_pop(back, len) != ring_status::ok)
            if (cycles() > deadline)
                throw bench_failure("ring: no echo");
        rtt.push_back(cycles() - t0);
        if (len != 64 || std::memcmp(back.data(), msg.data(), 64) != 0)
            throw bench_failure("ring: wrong echo");
    }
    char a = 0;
    if (read(w.ack, &a, 1) != 1)
        throw bench_failure("ring: no acknowledgement");
    std::sort(rtt.begin(), rtt.end());
    const double half = static_cast<double>(rtt[rtt.size() / 2]) / per_us / 2;
    record("ring", "pingpong", 64, 64 / half, half);
}

void bench_map_cache(shared_state& s) {
    mapping_cache& cache = s.im->cache();
    const export_notice e = s.src_export;
    std::byte* p = nullptr;
    if (cache.at(e, 0, 64, p) != map_status::ok)
        throw bench_failure("map cache: first lookup");
    constexpr int hits = 1'000'000;
    std::uint64_t t0 = cycles();
    std::uintptr_t sink = 0;
    for (int i = 0; i < hits; ++i) {
        (void)cache.at(e, static_cast<std::uint64_t>(i & 63), 64, p);
        sink += reinterpret_cast<std::uintptr_t>(p);
    }
    const double hit_ns = static_cast<double>(cycles() - t0) / per_us * 1000 / hits;
    // A fresh map each time: clear, then look up.
    constexpr int misses = 200;
    t0 = cycles();
    for (int i = 0; i < misses; ++i) {
        cache.clear();
        (void)cache.at(e, 0, 64, p);
        sink += reinterpret_cast<std::uintptr_t>(p);
    }
    const double miss_us = static_cast<double>(cycles() - t0) / per_us / misses;
    fmt::print("map cache: hit {:.1f} ns, fresh map {:.2f} us ({} bytes){}\n", hit_ns, miss_us,
               s.src.size(), sink == 0 ? " " : "");
    if (json_out != nullptr)
        fmt::print(json_out, "{{\"kind\":\"map_cache\",\"hit_ns\":{:.2f},\"miss_us\":{:.3f}}}\n",
                   hit_ns, miss_us);
}

/// soft-RoCE's loopback: two queue pairs on the device, in this process.
void bench_rxe(const std::string& addr, std::size_t min, std::size_t max, int iters) {
    verbs::context ctx =
        addr.empty() ? verbs::context::open_first_active() : verbs::context::open_by_address(addr);
    verbs::protection_domain pd(ctx);
    verbs::queue_pair<verbs::rc> a(pd), b(pd);
    verbs::connect_pair(a, b);
    std::vector<std::byte> src(max), dst(max);
    fill(src, 1);
    memory_region<rights::local_write | rights::remote_read> msrc(pd, src.data(), src.size());
    memory_region<rights::local_write> mdst(pd, dst.data(), dst.size());
    verbs::completion c[1];
    for (std::size_t size = min; size <= max; size *= 4) {
        const int n = size >= (8U << 20) ? std::max(2, iters / 8) : iters;
        const std::uint64_t t0 = cycles();
        // A read is at most the port's max message (8 MiB on soft-RoCE).
        const std::size_t most = b.max_message();
        for (int i = 0; i < n; ++i)
            for (std::size_t off = 0; off < size; off += most) {
                const std::size_t len = std::min(most, size - off);
                const status st = b.read(mdst.local(off, len), msrc.remote(), off, 1);
                if (st != status::ok)
                    throw bench_failure(fmt::format("rxe: read: {}", to_string(st)));
                if (b.wait_send(c, std::chrono::seconds(30)) != 1 || !c[0].ok())
                    throw bench_failure(fmt::format("rxe: read: {}", c[0].status_name()));
            }
        const double us = static_cast<double>(cycles() - t0) / per_us / n;
        if (!check({dst.data(), size}, 1))
            throw bench_failure("rxe: wrong bytes");
        record("rxe", "pull", size, static_cast<double>(size) / us, us);
    }
    // 64 B ping-pong: send/receive between the two queue pairs.
    std::array<std::byte, 64> m{};
    memory_region<rights::local_write> mm(pd, m.data(), m.size());
    std::array<std::byte, 64> r{};
    memory_region<rights::local_write> mr(pd, r.data(), r.size());
    std::vector<std::uint64_t> rtt;
    for (int i = 0; i < 2000; ++i) {
        if (b.post_recv(mr.local(), 2) != status::ok || a.post_recv(mr.local(), 3) != status::ok)
            throw bench_failure("rxe: post_recv");
        const std::uint64_t t0 = cycles();
        if (a.send(mm.local(), 4, verbs::send_flags{.signaled = false}) != status::ok ||
            b.wait_recv(c, std::chrono::seconds(10)) != 1 ||
            b.send(mm.local(), 5, verbs::send_flags{.signaled = false}) != status::ok ||
            a.wait_recv(c, std::chrono::seconds(10)) != 1)
            throw bench_failure("rxe: ping-pong");
        rtt.push_back(cycles() - t0);
        verbs::completion sc[4];
        (void)a.poll_send(sc);
        (void)b.poll_send(sc);
    }
    std::sort(rtt.begin(), rtt.end());
    const double half = static_cast<double>(rtt[rtt.size() / 2]) / per_us / 2;
    record("rxe", "pingpong", 64, 64 / half, half);
}

} // namespace

int main(int argc, char** argv) {
    std::size_t min = 64, max = 64U << 20;
    int iters = 20;
    bool rxe = true;
    std::string addr, json;
    static const option longs[] = {{"json", required_argument, nullptr, 'j'},
                                   {"no-rxe", no_argument, nullptr, 'R'},
                                   {"help", no_argument, nullptr, 'h'},
                                   {nullptr, 0, nullptr, 0}};
    const auto size_arg = [](const char* text, const char* flag) -> std::size_t {
        try {
            return parse_size(text, flag, std::size_t{1} << 30);
        } catch (const bench_failure& e) {
            fmt::print(stderr, "rdmax_local_bench: {}\n", e.what());
            std::exit(2);
        }
    };
    for (int c; (c = getopt_long(argc, argv, "s:S:n:a:h", longs, nullptr)) != -1;) {
        switch (c) {
        case 's': min = size_arg(optarg, "-s"); break;
        case 'S': max = size_arg(optarg, "-S"); break;
        case 'n': iters = std::max(1, std::atoi(optarg)); break;
        case 'a': addr = optarg; break;
        case 'j': json = optarg; break;
        case 'R': rxe = false; break;
        default:
            std::fputs("usage: rdmax_local_bench [-s MIN] [-S MAX] [-n ITERS] [-a ADDR] "
                       "[--json FILE] [--no-rxe]\n",
                       stderr);
            return c == 'h' ? 0 : 2;
        }
    }
    try {
        per_us = estimate_cycles_per_us();
        if (!json.empty())
            json_out = std::fopen(json.c_str(), "w");
        if (!json.empty() && json_out == nullptr)
            throw bench_failure(fmt::format("--json {}: cannot write", json));
        shared_state s;
        s.max = max;
        s.src = shared_segment::create("bench-src", max);
        fill(s.src.bytes(), 1);
        s.bounce = shared_segment::create("bench-bounce", 4096 + 2 * bounce_area::chunk);
        new (s.bounce.data()) bounce_area{};
        s.rings = shared_segment::create("bench-rings", 2 * ring_bytes);
        spsc_ring::format(s.rings.bytes().first(ring_bytes), 1 << 16);
        spsc_ring::format(s.rings.bytes().subspan(ring_bytes), 1 << 16);
        auto [exports_mine, exports_theirs] = unix_channel::pair();
        writer w;
        int cmd[2], ack[2];
        if (pipe(cmd) != 0 || pipe(ack) != 0)
            throw bench_failure("pipe");
        w.pid = fork();
        if (w.pid < 0)
            throw bench_failure("fork");
        if (w.pid == 0) {
            close(cmd[1]);
            close(ack[0]);
            exports_mine = unix_channel();
            serve_exports(s, std::move(exports_theirs));
            writer_loop(s, cmd[0], ack[1]);
        }
        close(cmd[0]);
        close(ack[1]);
        exports_theirs = unix_channel();
        {
            std::vector<int> fds;
            if (exports_mine.receive(std::as_writable_bytes(std::span(&s.src_export, 1)), fds,
                                     std::chrono::seconds(10)) != sizeof s.src_export ||
                !fds.empty())
                throw bench_failure("the writer's export notice");
        }
        s.im.emplace(std::move(exports_mine));
        w.cmd = cmd[1];
        w.ack = ack[0];
        fmt::print("{:<8} {:<8} {:>10} {:>12} {:>12} {:>12}\n", "path", "op", "bytes", "MB/s", "us",
                   "cpu us");
        for (std::size_t size = min; size <= max; size *= 4) {
            fmt::print(stderr, "rdmax_local_bench: {} bytes\n", size);
            bench_pulls(s, w, size, size >= (8U << 20) ? std::max(2, iters / 4) : iters * 10);
        }
        bench_ring(s, w, 20000);
        bench_map_cache(s);
        if (rxe)
            bench_rxe(addr, min, max, iters);
        if (json_out != nullptr)
            std::fclose(json_out);
        return 0;
    } catch (const std::exception& e) {
        fmt::print(stderr, "rdmax_local_bench: {}\n", e.what());
        return 1;
    }
}
