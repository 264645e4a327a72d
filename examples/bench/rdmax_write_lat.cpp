// rdmax_write_lat: RDMA write latency over rdmax, measured as perftest's
// ib_write_lat measures it, with the same flags and columns.
//
// Ping-pong: each side RDMA-writes `size` bytes into the other's receive area,
// the last byte carrying the iteration number (mod 256), and spins on the last
// byte of its own receive area until the peer's write of that iteration has
// landed. The server writes first. The time between two successive posts of
// one side is a round trip; half of it is a sample, and the samples are
// reduced as perftest reduces them.
//
// Writes are unsignaled (the library signals one in every send_depth / 2 for
// its slot accounting) and go inline up to -I bytes when the device allows.
//
//   server:  rdmax_write_lat -s 64 -n 10000
//   client:  rdmax_write_lat -s 64 -n 10000 192.0.2.1
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "bench_common.hpp"

namespace {

using namespace rdmax;
using namespace rdmax::bench;

struct latency_stats {
    double min_us = 0, max_us = 0, typical_us = 0, avg_us = 0, stdev_us = 0, p99_us = 0,
           p999_us = 0;
};

/// perftest's print_report_lat: the n - 1 gaps between successive posts,
/// sorted, the two longest dropped; typical is the median; the percentiles
/// index the sorted gaps at ceil(m * 0.99) and ceil(m * 0.999); t_max is the
/// gap just past the kept ones. (perftest rounds each deviation to a whole
/// microsecond before squaring; the standard deviation here does not.)
/// Turns posted[] into the sorted gaps, in place.
latency_stats summarize(std::span<std::uint64_t> posted, double cycles_per_us) {
    if (posted.size() < fewest_iterations)
        fail("too few iterations to summarize");
    for (std::size_t i = 0; i + 1 < posted.size(); ++i)
        posted[i] = posted[i + 1] - posted[i];
    const std::span<std::uint64_t> gaps = posted.first(posted.size() - 1);
    std::sort(gaps.begin(), gaps.end());
    const std::size_t kept = gaps.size() - 2;      // perftest's LAT_MEASURE_TAIL
    const double per_sample = 2.0 * cycles_per_us; // half a round trip, in microseconds
    const auto us = [&](std::uint64_t c) { return static_cast<double>(c) / per_sample; };

    latency_stats s;
    s.min_us = us(gaps[0]);
    s.max_us = us(gaps[kept]);
    s.typical_us =
        kept % 2 == 0 ? (us(gaps[kept / 2]) + us(gaps[kept / 2 - 1])) / 2 : us(gaps[kept / 2]);
    double sum = 0;
    for (std::size_t i = 0; i < kept; ++i)
        sum += us(gaps[i]);
    s.avg_us = sum / static_cast<double>(kept);
    double squares = 0;
    for (std::size_t i = 0; i < kept; ++i)
        squares += (us(gaps[i]) - s.avg_us) * (us(gaps[i]) - s.avg_us);
    s.stdev_us = std::sqrt(squares / static_cast<double>(kept));
    const auto at_fraction = [&](double f) {
        return us(gaps[static_cast<std::size_t>(std::ceil(static_cast<double>(kept) * f))]);
    };
    s.p99_us = at_fraction(0.99);
    s.p999_us = at_fraction(0.999);
    return s;
}

[[nodiscard]] std::byte counter_byte(std::uint32_t iteration) noexcept {
    return static_cast<std::byte>(static_cast<unsigned char>(iteration & 0xffu));
}

/// One size's ping-pong; fills posted[] with the cycle count of every post.
/// Nothing in the loop allocates or calls the kernel: the clock is the cycle
/// counter, the wait a load, the post one ibv_post_send (rxe's doorbell is a
/// system call of the provider's own, as it is for perftest).
void ping_pong(session& s, const options& opt, std::uint32_t size, std::span<std::uint64_t> posted,
               cycle_rate& rate) {
    auto& qp = s.qp();
    const bool server = opt.is_server();
    const std::uint32_t iterations = opt.iterations;
    const local_buffer<region_rights> source = s.send_area(size);
    const remote_buffer<region_rights> target = s.peer_receive_area();
    std::atomic_ref<std::byte> outgoing(s.send_bytes()[size - 1]);
    std::atomic_ref<std::byte> incoming(s.receive_bytes()[size - 1]);
    const std::uint64_t stall_limit = s.to_cycles(opt.timeout);
    verbs::send_flags unsignaled;
    unsignaled.signaled = false;

    rate.start();
    std::uint32_t sent = 0;
    std::uint32_t received = 0;
    while (sent < iterations || received < iterations) {
        if (received < iterations && !(server && sent == 0)) {
            const std::byte expected = counter_byte(++received);
            const auto arrived = [&] {
                return incoming.load(std::memory_order_acquire) == expected;
            };
            if (!spin_until(arrived, stall_limit))
                fail(fmt::format("{} bytes: no write from the peer for iteration {} within {} s",
                                 size, received, opt.timeout.count()));
        }
        if (sent < iterations) {
            posted[sent] = cycles();
            outgoing.store(counter_byte(++sent), std::memory_order_release);
            if (qp.send_slots_free() == 0)
                s.reclaim_slots(1);
            if (const status st = qp.write(source, target, 0, sent, unsignaled); st != status::ok)
                fail(fmt::format("{} bytes: write {} refused: {} (errno {})", size, sent,
                                 to_string(st), qp.last_errno()));
        }
    }
    rate.stop();
}

void print_header(session& s, const options& opt) {
    auto& qp = s.qp();
    fmt::print("{}"
               "                    RDMA_Write Latency Test (rdmax)\n"
               " Device         : {}\t\tConnection     : RC, rdma_cm port {}\n"
               " TX depth       : {}\t\tSignaled       : 1 in {} writes (selective)\n"
               " Max inline data: {}[B]\t\tMtu            : {}[B]\n"
               "{}",
               result_line, s.device().name(), opt.port, qp.send_depth(),
               std::max<std::uint32_t>(1, qp.send_depth() / 2), qp.max_inline(),
               verbs::mtu_bytes(s.device().port(qp.config().port).active_mtu), result_line);
    fmt::print(" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]"
               "    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n");
    std::fflush(stdout);
}

void run(int argc, char** argv) {
    options defaults;
    defaults.tool = tool_kind::write_lat;
    defaults.size = 2;          // perftest's DEF_SIZE_LAT
    defaults.iterations = 1000; // DEF_ITERS
    defaults.max_inline = 220;  // DEF_INLINE_WRITE
    // perftest's default is 1 (a send queue of one, every write signaled and
    // polled); selective signaling needs room to leave writes unsignaled.
    defaults.tx_depth = 128;
    const options opt = parse_options(argc, argv, defaults);
    json_lines json(opt.json_path);

    verbs::qp_config cfg;
    cfg.send_depth = opt.tx_depth;
    cfg.recv_depth = 1; // no receives: writes consume none
    cfg.max_send_sge = 1;
    cfg.max_recv_sge = 1;
    cfg.max_inline = opt.max_inline;
    cfg.max_batch = 1;
    session s(opt, cfg);
    print_header(s, opt);

    std::vector<std::uint64_t> posted(opt.iterations); // allocated once, before any timed loop
    std::uint64_t step = 0;
    for (const std::uint32_t size : opt.sizes()) {
        // Clear the byte this size polls, then meet the peer: no write of
        // this size may land before both sides are ready for it.
        std::atomic_ref<std::byte>(s.receive_bytes()[size - 1]).store(std::byte{0});
        s.barrier(++step);
        cycle_rate rate;
        ping_pong(s, opt, size, posted, rate);
        const latency_stats st = summarize(posted, rate.per_us());
        fmt::print(
            " {:<7} {}          {:<7.2f}        {:<7.2f}      {:<7.2f}  \t       {:<7.2f}     "
            "\t{:<7.2f}\t\t{:<7.2f} \t\t{:<7.2f}\n",
            size, opt.iterations, st.min_us, st.max_us, st.typical_us, st.avg_us, st.stdev_us,
            st.p99_us, st.p999_us);
        std::fflush(stdout);
        json.write(fmt::format(
            R"({{"tool":"rdmax_write_lat","side":"{}","bytes":{},"iterations":{},)"
            R"("t_min_us":{:.3f},"t_max_us":{:.3f},"t_typical_us":{:.3f},"t_avg_us":{:.3f},)"
            R"("t_stdev_us":{:.3f},"p99_us":{:.3f},"p999_us":{:.3f},"inline":{}}})",
            opt.is_server() ? "server" : "client", size, opt.iterations, st.min_us, st.max_us,
            st.typical_us, st.avg_us, st.stdev_us, st.p99_us, st.p999_us,
            size <= s.qp().max_inline() ? "true" : "false"));
    }
    // A last meeting, so that neither side disconnects while the other still
    // waits for a write.
    s.barrier(++step);
    fmt::print("{}", result_line);
    s.connection().disconnect();
}

} // namespace

int main(int argc, char** argv) {
    return run_tool(tool_kind::write_lat, [&] { run(argc, argv); });
}
