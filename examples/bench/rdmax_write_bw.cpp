// rdmax_write_bw: RDMA write bandwidth over rdmax, measured as perftest's
// ib_write_bw measures it, with the same flags and columns.
//
// The client keeps up to TX_DEPTH writes in flight, posts them in chains of
// POST_LIST (one doorbell each, through the queue pair's batch()), asks for a
// completion on every CQ_MOD-th write and on the last, and counts completions:
// an RC send queue completes in order, so the completion of write k accounts
// for every write up to k. The server only exposes its memory and waits,
// asleep, for the client's "size done" word in its inbox.
//
//   server:  rdmax_write_bw -s 65536 -n 5000
//   client:  rdmax_write_bw -s 65536 -n 5000 192.0.2.1
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "bench_common.hpp"

namespace {

using namespace rdmax;
using namespace rdmax::bench;

/// perftest's MSG_SIZE_CQ_MOD_LIMIT: above it a single-size run signals every
/// write unless -Q was given.
constexpr std::uint32_t cq_mod_size_limit = 8192;
/// perftest skips the peak (an O(n^2 / CQ_MOD) search) beyond this many iterations.
constexpr std::uint32_t peak_iteration_limit = 20000;

/// What perftest's force_dependecies makes of -t, -Q and -l.
struct plan {
    std::uint32_t tx_depth;
    std::uint32_t cq_mod;
    std::uint32_t post_list;
};

plan make_plan(const options& opt) {
    plan p{opt.tx_depth, opt.cq_mod, opt.post_list};
    p.tx_depth = std::min(p.tx_depth, opt.iterations);
    if (p.post_list > 1) {
        if (opt.iterations % p.post_list != 0)
            fail(fmt::format("-n {} is not a multiple of -l {}", opt.iterations, p.post_list));
        if (!opt.cq_mod_given)
            p.cq_mod = p.post_list;
        else if (p.post_list % p.cq_mod != 0)
            fail(fmt::format("-l {} is not a multiple of -Q {}", p.post_list, p.cq_mod));
    }
    if (!opt.all_sizes && opt.size > cq_mod_size_limit && !opt.cq_mod_given)
        p.cq_mod = 1;
    p.cq_mod = std::min(p.cq_mod, p.tx_depth);
    if (p.post_list > p.tx_depth)
        fail(fmt::format("-l {} exceeds the send queue (-t, at most -n): {}", p.post_list,
                         p.tx_depth));
    return p;
}

/// The cycle count at which the completion of write `index` was seen.
struct completion_mark {
    std::uint32_t index;
    std::uint64_t at;
};

struct bandwidth_stats {
    double peak_MBps = 0, avg_MBps = 0, msg_rate_Mpps = 0;
};

/// perftest's print_report_bw: the average over the first post to the last
/// completion; the peak is the best rate over any run from a chain's post to
/// a later completion. MB = 2^20 bytes.
bandwidth_stats summarize(std::uint32_t size, std::uint32_t iterations, std::uint32_t post_list,
                          std::span<const std::uint64_t> posted,
                          std::span<const completion_mark> marks, double cycles_per_us) {
    constexpr double mebibyte = 1048576.0;
    bandwidth_stats s;
    const double total_us = static_cast<double>(marks.back().at - posted[0]) / cycles_per_us;
    s.avg_MBps = static_cast<double>(size) * iterations / total_us * 1e6 / mebibyte;
    s.msg_rate_Mpps = iterations / total_us;
    if (iterations > peak_iteration_limit)
        return s;
    auto best_cycles_per_write = static_cast<double>(marks.back().at - posted[0]);
    std::size_t first_mark = 0;
    for (std::uint32_t i = 0; i < iterations; i += post_list) {
        while (marks[first_mark].index < i)
            ++first_mark;
        for (std::size_t m = first_mark; m < marks.size(); ++m) {
            const double per_write = static_cast<double>(marks[m].at - posted[i]) /
                                     static_cast<double>(marks[m].index - i + 1);
            best_cycles_per_write = std::min(best_cycles_per_write, per_write);
        }
    }
    s.peak_MBps =
        static_cast<double>(size) * cycles_per_us * 1e6 / (best_cycles_per_write * mebibyte);
    return s;
}

/// One size, client side. The timed loop allocates nothing (posted[] and
/// marks are sized before it) and reads only the cycle counter; its system
/// calls are rxe's doorbells inside ibv_post_send, as for perftest.
void stream(session& s, const plan& p, std::uint32_t size, std::uint32_t iterations,
            std::span<std::uint64_t> posted, std::vector<completion_mark>& marks,
            std::chrono::seconds timeout, cycle_rate& rate) {
    auto& qp = s.qp();
    const local_buffer<region_rights> source = s.send_area(size);
    const remote_buffer<region_rights> target = s.peer_receive_area();
    const std::uint64_t stall_limit = s.to_cycles(timeout);
    verbs::send_flags signaled;
    verbs::send_flags unsignaled;
    unsignaled.signaled = false;
    verbs::completion done[16];
    marks.clear();

    rate.start();
    std::uint32_t issued = 0;
    std::uint32_t completed = 0;
    std::uint64_t last_progress = cycles();
    std::uint32_t idle_polls = 0;
    while (completed < iterations) {
        while (issued < iterations && issued - completed + p.post_list <= p.tx_depth) {
            const std::uint32_t chain = std::min(p.post_list, iterations - issued);
            verbs::send_batch batch = qp.batch();
            posted[issued] = cycles();
            for (std::uint32_t k = issued; k < issued + chain; ++k) {
                const bool ask = (k + 1) % p.cq_mod == 0 || k + 1 == iterations;
                if (const status st =
                        batch.write(source, target, 0, k, ask ? signaled : unsignaled);
                    st != status::ok)
                    fail(fmt::format("{} bytes: staging write {} refused: {}", size, k,
                                     to_string(st)));
            }
            if (const status st = batch.post(); st != status::ok)
                fail(fmt::format("{} bytes: posting writes {}..{} refused: {} (errno {})", size,
                                 issued, issued + chain - 1, to_string(st), qp.last_errno()));
            issued += chain;
        }
        const int n = qp.poll_send(done);
        if (n < 0)
            fail("polling the send completion queue failed");
        if (n == 0) {
            if ((++idle_polls & 1023u) == 0 && cycles() - last_progress > stall_limit)
                fail(fmt::format("{} bytes: no completion for {} s ({} of {} writes done)", size,
                                 timeout.count(), completed, iterations));
            continue;
        }
        const std::uint64_t now = cycles();
        for (int i = 0; i < n; ++i) {
            const verbs::completion& c = done[static_cast<std::size_t>(i)];
            if (!c.ok())
                fail(fmt::format("{} bytes: write {} failed: {}", size, c.wr_id, c.status_name()));
            completed = static_cast<std::uint32_t>(c.wr_id) + 1;
            marks.push_back({static_cast<std::uint32_t>(c.wr_id), now});
        }
        last_progress = now;
    }
    rate.stop();
}

void print_header(session& s, const options& opt, const plan& p) {
    auto& qp = s.qp();
    fmt::print("{}"
               "                    RDMA_Write BW Test (rdmax)\n"
               " Device         : {}\t\tConnection     : RC, rdma_cm port {}\n"
               " TX depth       : {}\t\tCQ Moderation  : {}\n"
               " Post List      : {}\t\tMax inline data: {}[B]\n"
               " Mtu            : {}[B]\n"
               "{}",
               result_line, s.device().name(), opt.port, p.tx_depth, p.cq_mod, p.post_list,
               qp.max_inline(), verbs::mtu_bytes(s.device().port(qp.config().port).active_mtu),
               result_line);
    if (!opt.is_server())
        fmt::print(" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   "
                   "MsgRate[Mpps]\n");
    std::fflush(stdout);
}

void run(int argc, char** argv) {
    options defaults;
    defaults.tool = tool_kind::write_bw;
    defaults.size = 65536;      // perftest's DEF_SIZE_BW
    defaults.iterations = 5000; // DEF_ITERS_WB
    defaults.max_inline = 0;    // perftest inlines nothing in bandwidth tests
    defaults.tx_depth = 128;    // DEF_TX_BW
    defaults.cq_mod = 100;      // DEF_CQ_MOD
    const options opt = parse_options(argc, argv, defaults);
    const plan p = make_plan(opt);
    json_lines json(opt.json_path);

    verbs::qp_config cfg;
    // Twice the writes kept in flight, so that the library's own signaling
    // interval (at most half the queue) is never shorter than CQ_MOD: then
    // every completion is one this loop asked for.
    cfg.send_depth = 2 * p.tx_depth;
    cfg.signal_interval = p.cq_mod;
    cfg.max_batch = p.post_list;
    cfg.recv_depth = 1;
    cfg.max_send_sge = 1;
    cfg.max_recv_sge = 1;
    cfg.max_inline = opt.max_inline;
    session s(opt, cfg);
    print_header(s, opt, p);

    const std::vector<std::uint32_t> sizes = opt.sizes();
    if (opt.is_server()) {
        // Generous: soft-RoCE under qemu moves about 30 MB/s; a client slower
        // than 1 MiB/s has failed, and would have said so and disconnected.
        std::uint64_t step = 0;
        for (const std::uint32_t size : sizes) {
            const auto expected =
                std::chrono::seconds(static_cast<std::uint64_t>(size) * opt.iterations / 1048576);
            s.wait_for(++step, opt.timeout + expected, true);
        }
        fmt::print(" the client finished {} size{}\n{}", sizes.size(), sizes.size() == 1 ? "" : "s",
                   result_line);
        return;
    }

    std::vector<std::uint64_t> posted(opt.iterations);
    std::vector<completion_mark> marks;
    marks.reserve(opt.iterations / p.cq_mod + 2);
    std::uint64_t step = 0;
    for (const std::uint32_t size : sizes) {
        cycle_rate rate;
        stream(s, p, size, opt.iterations, posted, marks, opt.timeout, rate);
        const bandwidth_stats st =
            summarize(size, opt.iterations, p.post_list, posted, marks, rate.per_us());
        s.signal(++step); // tells the server this size is done
        fmt::print(" {:<7}    {:<10}       {:<7.2f}            {:<7.2f}\t\t   {:<7.6f}\n", size,
                   opt.iterations, st.peak_MBps, st.avg_MBps, st.msg_rate_Mpps);
        std::fflush(stdout);
        json.write(fmt::format(
            R"({{"tool":"rdmax_write_bw","bytes":{},"iterations":{},"bw_peak_MBps":{:.3f},)"
            R"("bw_avg_MBps":{:.3f},"msg_rate_Mpps":{:.6f},"tx_depth":{},"cq_mod":{},)"
            R"("post_list":{},"inline":{}}})",
            size, opt.iterations, st.peak_MBps, st.avg_MBps, st.msg_rate_Mpps, p.tx_depth, p.cq_mod,
            p.post_list, size <= s.qp().max_inline() ? "true" : "false"));
    }
    fmt::print("{}", result_line);
    s.connection().disconnect();
}

} // namespace

int main(int argc, char** argv) {
    return run_tool(tool_kind::write_bw, [&] { run(argc, argv); });
}
