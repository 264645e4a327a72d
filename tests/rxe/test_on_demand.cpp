// On-demand registration through the cache: nothing pinned, and the device
// follows the process's pages, so data written after munmap + mmap at the same
// address arrives even with nothing invalidated. SKIP (77) with
// the reason where the device has no on-demand paging (soft-RoCE before Linux
// 6.15, so the VM's 6.1 kernel).
#include <cstring>
#include <sys/mman.h>

#include <fmt/format.h>

#include <rdmax/mem/verbs_cache.hpp>

#include "../support/loopback.hpp"
#include "../support/skip_reason.hpp"

using namespace rdmax;
using namespace rdmax::test;

TEST_CASE("on-demand: the registration follows new pages at the same address") {
    loopback lp;
    rcache_options o;
    o.on_demand = true;
    o.monitor = monitor_kind::manual; // nothing invalidates: the device must follow
    auto cache = make_verbs_cache(lp.pd, o);
    constexpr std::size_t len = 4096;
    registered into(lp.pd, len);
    auto* buf = static_cast<std::byte*>(
        mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    REQUIRE(buf != MAP_FAILED);
    fill_pattern(std::span(buf, len), 1);
    {
        auto src = cache.remote<rights::remote_read>(buf, len);
        REQUIRE(lp.a.read(into.mr.local(), src.buffer, 0, 1) == status::ok);
        REQUIRE(wait_send(lp.a).ok());
    }
    CHECK(has_pattern(into.bytes, 1));
    REQUIRE(munmap(buf, len) == 0);
    REQUIRE(mmap(buf, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1,
                 0) == buf);
    fill_pattern(std::span(buf, len), 2);
    {
        auto src = cache.remote<rights::remote_read>(buf, len);
        REQUIRE(lp.a.read(into.mr.local(), src.buffer, 0, 2) == status::ok);
        REQUIRE(wait_send(lp.a).ok());
    }
    CHECK(has_pattern(into.bytes, 2));
    CHECK(cache.counters().registrations == 1);
    munmap(buf, len);
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
