#pragma once
// rdmax_reg_bench --dmabuf: registering dma-bufs (udmabuf: memfd pages
// exported by the kernel) against a dmabuf_cache hit, beside the same sizes
// of host memory against a registration_cache hit, in one run.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <rdmax/verbs/protection_domain.hpp>

#include "bench_stats.hpp"

namespace rdmax::bench {

struct dmabuf_bench_options {
    std::vector<std::size_t> sizes;
    std::uint32_t iterations = 0; ///< registrations per size up to 1 MiB (reg_iterations)
    std::uint32_t ops = 0;        ///< cache hits per timed batch
    std::uint32_t batches = 0;
};

/// Prints the table and the target line; adds a JSON object per size.
/// Returns false when the target (hit >= 100x cheaper) is not met.
bool run_dmabuf_bench(const verbs::protection_domain& pd, const std::string& device,
                      const dmabuf_bench_options& opt, json_list& json);

} // namespace rdmax::bench
