// The accelerator seam (issue 30, item 5): accelerator_cache over the one
// provider this project can test, udmabuf_provider (memfd pages exported by
// the kernel, mapped here to fill and check). An address freed and allocated
// again is a new buffer to the cache, never served the old registration.
#include <cerrno>
#include <cstring>

#include "../support/error_of.hpp"
#include "../support/loopback.hpp"

using namespace rdmax;
using namespace rdmax::test;

namespace {

constexpr rights rw = rights::local_write | rights::remote_write | rights::remote_read;

void write_to(loopback& lp, accelerator_cache<udmabuf_provider>& cache, const void* dst,
              std::size_t n, unsigned seed) {
    registered src(lp.pd, n);
    fill_pattern(src.bytes, seed);
    auto remote = cache.remote<rw>(dst, n);
    REQUIRE(lp.a.write(src.mr.local(), remote.buffer, 0, seed) == status::ok);
    CHECK(wait_send(lp.a).ok());
}

} // namespace

TEST_CASE("udmabuf_provider: allocations, their exports, and what is not theirs") {
    udmabuf_provider p;
    auto* a = static_cast<std::byte*>(p.allocate(100 * 1024)); // rounded up to pages
    auto* b = static_cast<std::byte*>(p.allocate(4096));
    const dmabuf_export ea = p.export_range(a + 100, 1000);
    const dmabuf_export eb = p.export_range(b, 4096);
    CHECK(ea.offset == 100);
    CHECK(ea.fd >= 0);
    CHECK(ea.buffer_id != eb.buffer_id);
    CHECK(error_of([&] { (void)p.export_range(b + 1, 4096); }) == EINVAL); // past its end
    int on_stack = 0;
    CHECK(error_of([&] { (void)p.export_range(&on_stack, 4); }) == EINVAL);
    p.deallocate(a);
    CHECK(error_of([&] { p.deallocate(a); }) == EINVAL);
    CHECK(error_of([&] { (void)p.export_range(a, 1); }) == EINVAL);
    p.deallocate(b);
}

TEST_CASE("accelerator_cache: RDMA into accelerator memory by pointer, hits after the first") {
    loopback lp;
    udmabuf_provider p;
    auto* mem = static_cast<std::byte*>(p.allocate(1 << 20));
    accelerator_cache<udmabuf_provider> cache(lp.pd, p);
    write_to(lp, cache, mem + 4096, 65536, 3);
    CHECK(has_pattern(std::span(mem + 4096, 65536), 3));
    write_to(lp, cache, mem + 8192, 4096, 4); // inside the first registration
    CHECK(has_pattern(std::span(mem + 8192, 4096), 4));
    const auto c = cache.counters();
    CHECK(c.registrations == 1);
    CHECK(c.hits == 1);
    CHECK(cache.buffers() == 1);
    // The other way: a READ from accelerator memory into host memory.
    fill_pattern(std::span(mem, 1 << 20), 8);
    registered host(lp.pd, 32768);
    auto src = cache.remote<rw>(mem + 65536, 32768);
    REQUIRE(lp.a.read(host.mr.local(), src.buffer, 0, 9) == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(host.bytes, 8 + 65536));
    cache.forget(mem);
    CHECK(cache.buffers() == 0);
    p.deallocate(mem);
}

TEST_CASE("accelerator_cache: an address allocated again is a new buffer") {
    loopback lp;
    udmabuf_provider p;
    accelerator_cache<udmabuf_provider> cache(lp.pd, p);
    void* first = p.allocate(256 * 1024);
    const std::uint64_t first_id = p.export_range(first, 1).buffer_id;
    write_to(lp, cache, first, 65536, 1);
    cache.forget(first);
    p.deallocate(first);
    // Whether or not mmap hands back the same address, the id is new.
    auto* again = static_cast<std::byte*>(p.allocate(256 * 1024));
    CHECK(p.export_range(again, 1).buffer_id != first_id);
    std::memset(again, 0, 65536);
    write_to(lp, cache, again, 65536, 2);
    CHECK(has_pattern(std::span(again, 65536), 2));
    const auto c = cache.counters();
    CHECK(c.hits == 0);
    CHECK(c.registrations == 2);
    int on_stack = 0;
    CHECK(error_of([&] { (void)cache.local<rw>(&on_stack, 4); }) == EINVAL);
    cache.forget(again);
    p.deallocate(again);
}
