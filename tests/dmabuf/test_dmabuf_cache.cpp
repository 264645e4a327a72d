// dmabuf_cache (issue 30, item 3): dma-buf registrations cached by the buffer's
// identity and range, merged and evicted as host ones are and counted the same
// way; a buffer forgotten, closed and freed is never served again, even to a
// new buffer in the same slot. Bytes are checked in the exporter's pages.
#include <cerrno>
#include <cstring>
#include <string>
#include <sys/stat.h>
#include <unistd.h>

#include "../support/error_of.hpp"
#include "../support/loopback.hpp"
#include "../support/udmabuf.hpp"

using namespace rdmax;
using namespace rdmax::test;

namespace {

constexpr rights rw = rights::local_write | rights::remote_write | rights::remote_read;

// Writes `n` bytes of pattern `seed` from host memory into [at, at + n) of `b`.
void write_into(loopback& lp, dmabuf_cache& cache, dmabuf_cache::buffer b, std::size_t at,
                std::size_t n, unsigned seed) {
    registered src(lp.pd, n);
    fill_pattern(src.bytes, seed);
    auto dst = cache.remote<rw>(b, at, n);
    REQUIRE(lp.a.write(src.mr.local(), dst.buffer, 0, seed) == status::ok);
    CHECK(wait_send(lp.a).ok());
}

} // namespace

TEST_CASE("a repeated range of a dma-buf is a hit, and its bytes land") {
    loopback lp;
    dmabuf_cache cache(lp.pd);
    udmabuf buf(1 << 20);
    const auto b = cache.add(buf.fd);
    CHECK(b.size == buf.size);
    write_into(lp, cache, b, 4096, 65536, 4);
    CHECK(has_pattern(buf.bytes(4096, 65536), 4));
    write_into(lp, cache, b, 8192, 4096, 5); // inside the first: a hit
    CHECK(has_pattern(buf.bytes(8192, 4096), 5));
    const auto c = cache.counters();
    CHECK(c.registrations == 1);
    CHECK(c.hits == 1);
    CHECK(c.misses == 1);
    cache.forget(b);
}

TEST_CASE("touching ranges of one buffer merge; two buffers never do") {
    loopback lp;
    dmabuf_cache cache(lp.pd);
    udmabuf one(256 * 1024), two(256 * 1024);
    const auto b1 = cache.add(one.fd);
    const auto b2 = cache.add(two.fd);
    CHECK(b1.base != b2.base);
    write_into(lp, cache, b1, 0, 65536, 1);
    write_into(lp, cache, b1, 65536, 65536, 2); // touches the first: merged
    write_into(lp, cache, b2, 0, 65536, 3);
    CHECK(has_pattern(one.bytes(0, 65536), 1));
    CHECK(has_pattern(one.bytes(65536, 65536), 2));
    CHECK(has_pattern(two.bytes(0, 65536), 3));
    const auto c = cache.counters();
    CHECK(c.merges == 1);
    CHECK(c.registered_count == 2);
    // The same buffer through another fd is the same buffer.
    const int again = ::dup(one.fd);
    const auto b1_again = cache.add(again);
    ::close(again);
    CHECK(b1_again.base == b1.base);
    write_into(lp, cache, b1_again, 0, 4096, 7);
    CHECK(cache.counters().hits == 1);
    cache.forget(b1_again);
    cache.forget(b1);
    cache.forget(b2);
}

TEST_CASE("idle dma-buf registrations are evicted at the cache's limit") {
    loopback lp;
    rcache_options opt;
    opt.max_count = 2;
    dmabuf_cache cache(lp.pd, opt);
    udmabuf buf(1 << 20);
    const auto b = cache.add(buf.fd);
    for (std::size_t i = 0; i < 4; ++i)
        write_into(lp, cache, b, i * 256 * 1024, 4096, static_cast<unsigned>(10 + i));
    for (std::size_t i = 0; i < 4; ++i)
        CHECK(has_pattern(buf.bytes(i * 256 * 1024, 4096), static_cast<unsigned>(10 + i)));
    const auto c = cache.counters();
    CHECK(c.evictions >= 2);
    CHECK(c.registered_count <= 2);
    cache.forget(b);
}

TEST_CASE("a forgotten, closed and freed buffer is never served, not even to its slot's next") {
    loopback lp;
    dmabuf_cache cache(lp.pd);
    auto old_buf = std::make_unique<udmabuf>(128 * 1024);
    const auto old_b = cache.add(old_buf->fd);
    struct stat old_st {};
    REQUIRE(::fstat(old_buf->fd, &old_st) == 0);
    write_into(lp, cache, old_b, 0, 65536, 1);
    cache.forget(old_b);
    CHECK(cache.counters().registered_count == 0);
    old_buf.reset(); // the application closes it; the exporter frees it

    udmabuf fresh(128 * 1024);
    struct stat st {};
    REQUIRE(::fstat(fresh.fd, &st) == 0);
    CHECK(st.st_ino != old_st.st_ino); // dma-buf inodes are not reused
    const auto b = cache.add(fresh.fd);
    CHECK(b.base == old_b.base); // the slot is reused...
    std::memset(fresh.cpu, 0, fresh.size);
    write_into(lp, cache, b, 0, 65536, 9);
    CHECK(has_pattern(fresh.bytes(0, 65536), 9)); // ...but not the old registration
    const auto c = cache.counters();
    CHECK(c.hits == 0);
    CHECK(c.registrations == 2);
    // The old token is stale, in the slot its buffer had, and forgetting it
    // again cannot take the new buffer's place away.
    CHECK(error_of([&] { (void)cache.local<rights::local_write>(old_b, 0, 4096); }) == EBADF);
    CHECK(error_of([&] { cache.forget(old_b); }) == EBADF);
    CHECK(cache.counters().registered_count == 1);
    // Using a forgotten token registers nothing.
    cache.forget(b);
    CHECK(error_of([&] { (void)cache.local<rights::local_write>(b, 0, 4096); }) == EBADF);
}

TEST_CASE("a dma-buf cache refuses what it cannot serve, with the reason") {
    loopback lp;
    dmabuf_cache cache(lp.pd);
    udmabuf buf(64 * 1024);
    CHECK(error_of([&] { (void)cache.add(buf.memfd); }) == EINVAL); // no dma-buf
    const auto b = cache.add(buf.fd);
    CHECK(error_of([&] { (void)cache.local<rights::local_write>(b, 60 * 1024, 8192); }) == ERANGE);
    CHECK(error_of([&] { cache.forget(dmabuf_cache::buffer{12345, 4096}); }) == EINVAL);
    // A forged token that claims more than the buffer has registers nothing.
    const dmabuf_cache::buffer forged{b.base, 1 << 20, b.generation};
    CHECK(error_of([&] { (void)cache.local<rights::local_write>(forged, 128 * 1024, 4096); }) ==
          ERANGE);
    CHECK(cache.counters().registrations == 0);
    cache.forget(b);
}
