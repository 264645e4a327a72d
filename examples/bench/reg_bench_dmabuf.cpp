// rdmax_reg_bench --dmabuf (reg_bench_dmabuf.hpp). Each size: a udmabuf of
// that many bytes, ibv_reg_dmabuf_mr + ibv_dereg_mr of it timed as
// ibv_reg_mr + ibv_dereg_mr is (time_registration), then batches of
// dmabuf_cache hits; beside it the host figures of the same size.
#include "reg_bench_dmabuf.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include <rdmax/mem/dmabuf_cache.hpp>
#include <rdmax/mem/udmabuf_provider.hpp>
#include <rdmax/mem/verbs_cache.hpp>

#include "bench_common.hpp"

namespace rdmax::bench {

namespace {

constexpr rights reg_rights = rights::local_write | rights::remote_write | rights::remote_read;
constexpr double ratio_target = 100;

double median_us(const std::vector<std::uint64_t>& a, const std::vector<std::uint64_t>& b,
                 double per_us) {
    std::vector<double> us;
    us.reserve(a.size());
    for (std::size_t i = 0; i < a.size(); ++i)
        us.push_back(static_cast<double>(a[i] + b[i]) / per_us);
    return median(us);
}

reg_cycles time_dmabuf_registration(const verbs::protection_domain& pd, int fd, std::size_t bytes,
                                    std::uint32_t iterations) {
    reg_cycles out;
    for (std::uint32_t i = 0; i <= iterations; ++i) { // round 0 untimed
        const std::uint64_t t0 = cycles();
        ibv_mr* mr =
            ::ibv_reg_dmabuf_mr(pd.get(), 0, bytes, dmabuf_iova_base, fd, to_ibv(reg_rights));
        const std::uint64_t t1 = cycles();
        if (mr == nullptr)
            fail(fmt::format("ibv_reg_dmabuf_mr of {}: {}", human_bytes(bytes),
                             std::strerror(errno)));
        ::ibv_dereg_mr(mr);
        const std::uint64_t t2 = cycles();
        if (i != 0) {
            out.reg.push_back(t1 - t0);
            out.dereg.push_back(t2 - t1);
        }
    }
    return out;
}

// Batches of `ops` get + release of [0, bytes) through `get`, one registration.
template <class Get>
std::vector<std::uint64_t> time_hits(const dmabuf_bench_options& opt, Get&& get) {
    std::vector<std::uint64_t> out;
    std::uint64_t keys = 0;
    for (std::uint32_t b = 0; b < opt.batches; ++b) {
        const std::uint64_t t0 = cycles();
        for (std::uint32_t i = 0; i < opt.ops; ++i)
            keys += get();
        out.push_back(cycles() - t0);
    }
    if (keys == 0)
        fail("every hit had lkey 0");
    return out;
}

struct row {
    std::size_t bytes;
    std::uint32_t iterations;
    double host_reg_us, host_hit_us, dmabuf_reg_us, dmabuf_hit_us;
};

row measure(const verbs::protection_domain& pd, const dmabuf_bench_options& opt,
            const mapping& host, std::size_t bytes) {
    row r{bytes, reg_iterations(opt.iterations, bytes), 0, 0, 0, 0};
    udmabuf_provider provider; // the library's udmabuf exporter, as a test runtime would be
    const void* mem = provider.allocate(bytes);
    const int fd = provider.export_range(mem, bytes).fd;
    cycle_rate rate;
    rate.start();
    const reg_cycles host_reg = time_registration(pd, host.data(), bytes, reg_rights, r.iterations);
    const reg_cycles dma_reg = time_dmabuf_registration(pd, fd, bytes, r.iterations);

    auto host_cache = make_verbs_cache(pd);
    (void)host_cache.local<reg_rights>(host.data(), bytes); // the miss
    const auto host_hits = time_hits(opt, [&] {
        return std::uint64_t{host_cache.local<reg_rights>(host.data(), bytes).buffer.lkey};
    });
    dmabuf_cache cache(pd);
    const auto b = cache.add(fd);
    (void)cache.local<reg_rights>(b, 0, bytes); // the miss
    const auto dma_hits = time_hits(
        opt, [&] { return std::uint64_t{cache.local<reg_rights>(b, 0, bytes).buffer.lkey}; });
    const rcache_counters c = cache.counters();
    if (c.registrations != 1 || c.hits != std::uint64_t{opt.batches} * opt.ops)
        fail(fmt::format("{}: the dma-buf cache did not serve every get from one registration: "
                         "{}",
                         human_bytes(bytes), c));
    cache.forget(b);
    rate.stop();

    const double per_us = rate.per_us();
    r.host_reg_us = median_us(host_reg.reg, host_reg.dereg, per_us);
    r.dmabuf_reg_us = median_us(dma_reg.reg, dma_reg.dereg, per_us);
    const auto per_op = [&](const std::vector<std::uint64_t>& batches) {
        std::vector<double> us;
        us.reserve(batches.size());
        for (const std::uint64_t batch : batches)
            us.push_back(static_cast<double>(batch) / per_us / opt.ops);
        return median(us);
    };
    r.host_hit_us = per_op(host_hits);
    r.dmabuf_hit_us = per_op(dma_hits);
    return r;
}

} // namespace

bool run_dmabuf_bench(const verbs::protection_domain& pd, const std::string& device,
                      const dmabuf_bench_options& opt, json_list& json) {
    fmt::print("{}"
               "     dma-buf registration (udmabuf) vs a dmabuf_cache hit, beside host memory\n"
               " Device         : {}\n"
               " reg            : ibv_reg_dmabuf_mr / ibv_reg_mr + dereg, median\n"
               " hit            : get + release of the whole buffer; {} batches of {}; median\n"
               "{}",
               result_line, device, opt.batches, opt.ops, result_line);
    fmt::print(" {:>10} {:>6} {:>14} {:>14} {:>16} {:>16} {:>11}\n", "#bytes", "#iters",
               "host_reg[usec]", "host_hit[usec]", "dmabuf_reg[usec]", "dmabuf_hit[usec]",
               "dmabuf r/h");
    std::fflush(stdout);
    const mapping host(opt.sizes.back(), true);
    double least = 1e300;
    std::size_t least_at = 0;
    for (const std::size_t bytes : opt.sizes) {
        const row r = measure(pd, opt, host, bytes);
        const double ratio = r.dmabuf_reg_us / r.dmabuf_hit_us;
        if (ratio < least) {
            least = ratio;
            least_at = bytes;
        }
        fmt::print(" {:>10} {:>6} {:>14.2f} {:>14.4f} {:>16.2f} {:>16.4f} {:>11.0f}\n", r.bytes,
                   r.iterations, r.host_reg_us, r.host_hit_us, r.dmabuf_reg_us, r.dmabuf_hit_us,
                   ratio);
        std::fflush(stdout);
        json.add(fmt::format(R"({{"bytes":{},"host_reg_us":{:.3f},"host_hit_us":{:.4f},)"
                             R"("dmabuf_reg_us":{:.3f},"dmabuf_hit_us":{:.4f}}})",
                             r.bytes, r.host_reg_us, r.host_hit_us, r.dmabuf_reg_us,
                             r.dmabuf_hit_us));
    }
    fmt::print("{}", result_line);
    const bool met = least >= ratio_target;
    fmt::print(" target: dmabuf_cache hit >= {:.0f}x cheaper than ibv_reg_dmabuf_mr + "
               "ibv_dereg_mr at every size: {} (least {:.0f}x, at {})\n",
               ratio_target, met ? "met" : "NOT met", least, human_bytes(least_at));
    return met;
}

} // namespace rdmax::bench
