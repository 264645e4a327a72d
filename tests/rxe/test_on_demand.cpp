// On-demand registration (ODP) through the cache: nothing pinned, and the
// device follows the process's pages, so data moved after munmap + mmap at the
// same address is the new pages' even with nothing watched or invalidated.
// The cache therefore watches nothing for ODP (monitor manual under auto):
// the stale-data and pagemap tests of test_registration_cache.cpp run here
// with ODP registrations and no invalidate().
//
// SKIP (77) with the reason where the device reports no on-demand paging
// (soft-RoCE before Linux 6.15, so the VM's 6.1). Where it reports ODP but
// rdmax's self-test finds it moving wrong bytes, every case here FAILS: in
// CI the VM's 7.x soft-RoCE carries the fix (tests/vm/patches). The hidden
// case [.broken] is run against the stock 7.3.4 soft-RoCE
// (RDMAX_TEST_ODP_EXPECT=broken): rdmax must refuse it.
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <fcntl.h>
#include <string_view>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/mem/on_demand_check.hpp>
#include <rdmax/mem/verbs_cache.hpp>

#include "../support/loopback.hpp"
#include "../support/pages.hpp"
#include "../support/skip_reason.hpp"

using namespace rdmax;
using namespace rdmax::test;

namespace {

const std::size_t page = page_bytes;

rcache_options on_demand(monitor_kind k = monitor_kind::automatic) {
    rcache_options o;
    o.on_demand = true;
    o.monitor = k;
    return o;
}

/// RDMA-reads [src, src + len) through the cache into `into`.
void read_through(loopback& lp, verbs_cache& cache, const std::byte* src, std::size_t len,
                  registered& into) {
    auto token = cache.remote<rights::remote_read>(src, len);
    REQUIRE(lp.a.read(into.mr.local(0, len), token.buffer, 0, 1) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
}

/// Resident anonymous memory of this process, bytes (RssAnon of /proc/self/status).
std::size_t rss_anon() {
    const int fd = open("/proc/self/status", O_RDONLY);
    REQUIRE(fd >= 0);
    std::string text(8192, '\0');
    const ssize_t n = read(fd, text.data(), text.size());
    close(fd);
    REQUIRE(n > 0);
    text.resize(static_cast<std::size_t>(n));
    const auto at = text.find("RssAnon:");
    REQUIRE(at != std::string::npos);
    return std::strtoull(text.c_str() + at + 8, nullptr, 10) * 1024;
}

bool expect_broken() {
    const char* e = std::getenv("RDMAX_TEST_ODP_EXPECT");
    return e != nullptr && std::string_view(e) == "broken";
}

} // namespace

TEST_CASE("on-demand: the device passes the self-test and the cache watches nothing") {
    loopback lp;
    const on_demand_verdict v = check_on_demand(lp.pd);
    INFO(v.problem);
    REQUIRE(v.usable());
    CHECK(v.self_tested);
    auto cache = make_verbs_cache(lp.pd, on_demand());
    CHECK(cache.monitor_ref().kind() == monitor_kind::manual);
    // A monitor named explicitly is kept.
    auto watched = make_verbs_cache(lp.pd, on_demand(monitor_kind::uffd));
    CHECK(watched.monitor_ref().kind() == monitor_kind::uffd);
}

TEST_CASE("on-demand: the registration follows new pages at the same address") {
    loopback lp;
    auto cache = make_verbs_cache(lp.pd, on_demand());
    constexpr std::size_t len = 4096;
    registered into(lp.pd, len);
    std::byte* buf = map_at(nullptr, len, 1);
    read_through(lp, cache, buf, len, into);
    CHECK(has_pattern(into.bytes, 1));
    REQUIRE(munmap(buf, len) == 0);
    REQUIRE(map_at(buf, len, 2) == buf);
    read_through(lp, cache, buf, len, into);
    CHECK(has_pattern(into.bytes, 2));
    CHECK(cache.counters().registrations == 1);
    munmap(buf, len);
}

TEST_CASE("on-demand stale data: reads and writes inside and across pages move the new bytes") {
    // The pinned cache's stale-data test with ODP registrations and nothing
    // invalidated: at offsets inside a page and across page boundaries, with
    // the 1024-byte path MTU that splits a page into packets.
    const std::size_t len = 4 * page;
    loopback lp;
    auto cache = make_verbs_cache(lp.pd, on_demand());
    registered into(lp.pd, len);
    registered from(lp.pd, len);
    std::byte* buf = map_at(nullptr, len, 1);
    // One registration with both rights, so that every range below is a hit.
    (void)cache.remote<rights::remote_read | rights::remote_write>(buf, len);
    for (int round = 0; round < 2; ++round) {
        const unsigned seed = 1 + static_cast<unsigned>(round);
        for (const std::size_t off : {std::size_t{0}, std::size_t{100}, page - 8, page + 1000}) {
            const std::size_t n = len - off - 24;
            CAPTURE(round, off);
            auto src = cache.remote<rights::remote_read>(buf + off, n);
            REQUIRE(lp.a.read(into.mr.local(0, n), src.buffer, 0, 1) == status::ok);
            REQUIRE(wait_send(lp.a).ok());
            CHECK(std::equal(into.bytes.begin(),
                             into.bytes.begin() + static_cast<std::ptrdiff_t>(n), buf + off));
        }
        // An RDMA write into the ODP pages lands there and nowhere else.
        const std::size_t woff = page / 2 + 3;
        const std::size_t wlen = 2 * page + 77;
        fill_pattern(from.bytes, 40 + seed);
        std::vector<std::byte> expect(buf, buf + len);
        std::copy_n(from.bytes.begin(), wlen, expect.begin() + static_cast<std::ptrdiff_t>(woff));
        {
            auto dst = cache.remote<rights::remote_write>(buf + woff, wlen);
            REQUIRE(lp.a.write(from.mr.local(0, wlen), dst.buffer, 0, 2) == status::ok);
            REQUIRE(wait_send(lp.a).ok());
        }
        CHECK(std::equal(expect.begin(), expect.end(), buf));
        if (round == 0) {
            REQUIRE(munmap(buf, len) == 0);
            REQUIRE(map_at(buf, len, 2) == buf); // no invalidate(): the device follows
        }
    }
    CHECK(cache.counters().invalidations == 0);
    CHECK(cache.counters().registrations == 1); // every range above was a hit
    munmap(buf, len);
}

TEST_CASE("on-demand pagemap: writes through a cached ODP registration land in the pages mapped "
          "now") {
    const std::size_t len = 4 * page;
    loopback lp;
    auto cache = make_verbs_cache(lp.pd, on_demand());
    registered src(lp.pd, len);
    std::byte* buf = map_at(nullptr, len, 1);
    const auto before = frames(buf, len);
    fill_pattern(src.bytes, 5);
    {
        auto dst = cache.remote<rights::remote_write>(buf, len);
        REQUIRE(lp.a.write(src.mr.local(), dst.buffer, 0, 1) == status::ok);
        REQUIRE(wait_send(lp.a).ok());
    }
    CHECK(has_pattern(std::span(buf, len), 5));
    CHECK(frames(buf, len) == before);

    // New pages at the same address: the same cached registration writes into them.
    REQUIRE(munmap(buf, len) == 0);
    REQUIRE(map_at(buf, len, 2) == buf);
    const auto after = frames(buf, len);
    fill_pattern(src.bytes, 6);
    {
        auto dst = cache.remote<rights::remote_write>(buf, len);
        REQUIRE(lp.a.write(src.mr.local(), dst.buffer, 0, 2) == status::ok);
        REQUIRE(wait_send(lp.a).ok());
    }
    CHECK(has_pattern(std::span(buf, len), 6));
    CHECK(frames(buf, len) == after);
    // (Frames read as 0 without CAP_SYS_ADMIN; the VM runs as root.)
    if (geteuid() == 0)
        CHECK(after != before);
    CHECK(cache.counters().registrations == 1);
    munmap(buf, len);
}

TEST_CASE("on-demand: registering untouched memory makes nothing resident; pinned does") {
    const std::size_t len = 64 << 20;
    loopback lp;
    auto* odp = static_cast<std::byte*>(
        mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    REQUIRE(odp != MAP_FAILED);
    std::size_t base = rss_anon();
    {
        auto cache = make_verbs_cache(lp.pd, on_demand());
        auto held = cache.remote<rights::remote_read>(odp, len);
        const std::size_t grown = rss_anon() - base;
        INFO("ODP registration of 64 MiB: resident +" << grown / 1024 << " KiB");
        CHECK(grown < len / 16);
    }
    munmap(odp, len);
    auto* pinned = static_cast<std::byte*>(
        mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    REQUIRE(pinned != MAP_FAILED);
    base = rss_anon();
    {
        rcache_options o;
        o.monitor = monitor_kind::manual;
        auto cache = make_verbs_cache(lp.pd, o);
        auto held = cache.remote<rights::remote_read>(pinned, len);
        const std::size_t grown = rss_anon() - base;
        INFO("pinned registration of 64 MiB: resident +" << grown / 1024 << " KiB");
        CHECK(grown > len / 2); // the control: pinning faults every page in
    }
    munmap(pinned, len);
}

TEST_CASE("on-demand: a device whose ODP moves wrong bytes is refused, never used", "[.broken]") {
    REQUIRE(expect_broken());
    loopback lp;
    const on_demand_verdict v = check_on_demand(lp.pd);
    INFO(v.problem);
    REQUIRE_FALSE(v.usable());
    CHECK(v.problem.find("self-test") != std::string::npos);
    CHECK(v.problem.find("wrong bytes") != std::string::npos);
    try {
        (void)make_verbs_cache(lp.pd, on_demand());
        FAIL("make_verbs_cache accepted on-demand paging that moves wrong bytes");
    } catch (const rdmax::error& e) {
        CHECK(e.code().value() == ENOTSUP);
        CHECK(std::string_view(e.what()).find("RDMAX_RCACHE_ODP=0") != std::string_view::npos);
    }
    // Pinned registrations on the same device still move the right bytes.
    rcache_options o;
    o.monitor = monitor_kind::manual;
    auto cache = make_verbs_cache(lp.pd, o);
    registered into(lp.pd, 3 * page);
    std::byte* buf = map_at(nullptr, 3 * page, 3);
    auto src = cache.remote<rights::remote_read>(buf + 100, 2 * page);
    REQUIRE(lp.a.read(into.mr.local(0, 2 * page), src.buffer, 0, 1) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
    CHECK(std::equal(into.bytes.begin(), into.bytes.begin() + static_cast<std::ptrdiff_t>(2 * page),
                     buf + 100));
    munmap(buf, 3 * page);
}

std::optional<std::string> rdmax::test::skip_reason() {
    if (auto why = device_unavailable())
        return why;
    const auto ctx = open_test_device();
    if (!ctx.limits().on_demand_paging)
        return fmt::format("{} reports no on-demand paging (IBV_ODP_SUPPORT); soft-RoCE has it "
                           "from Linux 6.15, this kernel is older",
                           ctx.name());
    return std::nullopt;
}
