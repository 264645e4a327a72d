// The registration cache on a real device: RDMA moves the bytes the process
// maps now, never those of memory it unmapped (the stale-data test, under every
// monitor that applies), /proc/self/pagemap agrees, data goes out from raw
// pointers through the cache, and fork() leaves the parent's registrations
// moving the parent's bytes.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include <rdmax/mem/verbs_cache.hpp>

#include "../support/loopback.hpp"
#include "../support/pages.hpp"

using namespace rdmax;
using namespace rdmax::test;

namespace {

constexpr rdmax::rights rr = rights::remote_read;
constexpr rdmax::rights rw = rights::remote_write;
constexpr rdmax::rights lw = rights::local_write;

rcache_options with_monitor(monitor_kind k) {
    rcache_options o;
    o.monitor = k;
    return o;
}

verbs_cache make_cache(const verbs::protection_domain& pd, monitor_kind k) {
    return verbs_cache(verbs_registrar(pd), auto_monitor(k), with_monitor(k));
}

/// RDMA-reads [src, src + len) of this process, addressed through the cache,
/// into `into`.
template <class Cache>
void read_through(loopback& lp, Cache& cache, const std::byte* src, std::size_t len,
                  registered& into) {
    auto token = cache.template remote<rr>(src, len);
    REQUIRE(lp.a.read(into.mr.local(0, len), token.buffer, 0, 1) == status::ok);
    REQUIRE(wait_send(lp.a).ok());
}

} // namespace

TEST_CASE("stale data: after munmap and mmap at the same address, RDMA reads the new bytes") {
    constexpr std::size_t len = 4 * 4096;
    loopback lp;
    registered into(lp.pd, len);

    // Every monitor that applies here: kmod (where the module is loaded, as
    // in the VM) and uffd by themselves, manual with the application's
    // invalidate().
    std::vector<monitor_kind> kinds{monitor_kind::uffd, monitor_kind::manual};
    if (kmod_monitor::available())
        kinds.insert(kinds.begin(), monitor_kind::kmod);
    else
        WARN("the rdmax module is not loaded: the kmod monitor is not tried here");
    for (const monitor_kind k : kinds) {
        DYNAMIC_SECTION("monitor " << to_string(k)) {
            auto cache = make_cache(lp.pd, k);
            std::byte* buf = map_at(nullptr, len, 1);
            read_through(lp, cache, buf, len, into);
            CHECK(has_pattern(into.bytes, 1));

            REQUIRE(munmap(buf, len) == 0);
            if (k == monitor_kind::manual)
                cache.invalidate(buf, len); // what the application owes this monitor
            REQUIRE(map_at(buf, len, 2) == buf);
            read_through(lp, cache, buf, len, into);
            CHECK(has_pattern(into.bytes, 2));
            CHECK(cache.counters().invalidations == 1);
            CHECK(cache.counters().registrations == 2);
            munmap(buf, len);
        }
    }
}

TEST_CASE("stale data: memfd pages replaced through the file (ftruncate, punch hole, MADV_REMOVE "
          "through another mapping): RDMA reads the new bytes") {
    // userfaultfd sees none of these in this mapping: under uffd such memory
    // is registered per use; the module sees them and keeps caching.
    constexpr std::size_t len = 4 * 4096;
    loopback lp;
    registered into(lp.pd, len);
    std::vector<monitor_kind> kinds{monitor_kind::uffd};
    if (kmod_monitor::available())
        kinds.insert(kinds.begin(), monitor_kind::kmod);
    else
        WARN("the rdmax module is not loaded: the kmod monitor is not tried here");
    for (const monitor_kind k : kinds) {
        DYNAMIC_SECTION("monitor " << to_string(k)) {
            const int fd = memfd_create("rdmax-rxe-test", MFD_CLOEXEC);
            REQUIRE(fd >= 0);
            REQUIRE(ftruncate(fd, static_cast<off_t>(len)) == 0);
            void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            REQUIRE(p != MAP_FAILED);
            void* other = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            REQUIRE(other != MAP_FAILED);
            auto* buf = static_cast<std::byte*>(p);
            auto cache = make_cache(lp.pd, k);

            fill_pattern(std::span(buf, len), 1);
            read_through(lp, cache, buf, len, into);
            CHECK(has_pattern(into.bytes, 1));

            REQUIRE(ftruncate(fd, 0) == 0); // the pages leave the file
            REQUIRE(ftruncate(fd, static_cast<off_t>(len)) == 0);
            fill_pattern(std::span(buf, len), 2); // new pages
            read_through(lp, cache, buf, len, into);
            CHECK(has_pattern(into.bytes, 2));

            REQUIRE(fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                              static_cast<off_t>(len)) == 0);
            fill_pattern(std::span(buf, len), 3);
            read_through(lp, cache, buf, len, into);
            CHECK(has_pattern(into.bytes, 3));

            REQUIRE(madvise(other, len, MADV_REMOVE) == 0); // through the other mapping
            fill_pattern(std::span(buf, len), 4);
            read_through(lp, cache, buf, len, into);
            CHECK(has_pattern(into.bytes, 4));

            if (k == monitor_kind::uffd) {
                CHECK(cache.counters().uncached == 4);
                CHECK(cache.counters().registered_count == 0);
            } else {
                CHECK(cache.counters().invalidations >= 3);
            }
            munmap(other, len);
            munmap(p, len);
            close(fd);
        }
    }
}

TEST_CASE("stale data: the test sees the bug when nothing invalidates (the control)") {
    constexpr std::size_t len = 4096;
    loopback lp;
    registered into(lp.pd, len);
    auto cache = make_cache(lp.pd, monitor_kind::manual);
    std::byte* buf = map_at(nullptr, len, 1);
    read_through(lp, cache, buf, len, into);
    REQUIRE(munmap(buf, len) == 0);
    REQUIRE(map_at(buf, len, 2) == buf);
    read_through(lp, cache, buf, len, into); // a cached, stale registration
    CHECK(has_pattern(into.bytes, 1));       // the old pages' bytes: what rdmax must prevent
    CHECK_FALSE(has_pattern(into.bytes, 2));
    munmap(buf, len);
}

TEST_CASE("pagemap: the pages behind a cached registration are the pages mapped now") {
    constexpr std::size_t len = 4 * 4096;
    loopback lp;
    registered src(lp.pd, len);
    auto cache = make_cache(lp.pd, monitor_kind::uffd);
    std::byte* buf = map_at(nullptr, len, 1);
    const auto before = frames(buf, len);

    // RDMA writes into the cached registration land in the frames mapped now.
    fill_pattern(src.bytes, 5);
    {
        auto dst = cache.remote<rw>(buf, len);
        REQUIRE(lp.a.write(src.mr.local(), dst.buffer, 0, 1) == status::ok);
        REQUIRE(wait_send(lp.a).ok());
    }
    CHECK(has_pattern(std::span(buf, len), 5));
    CHECK(frames(buf, len) == before);

    // New pages at the same address: the cache must register them anew, and
    // the RDMA write must land in them.
    REQUIRE(munmap(buf, len) == 0);
    REQUIRE(map_at(buf, len, 2) == buf);
    const auto after = frames(buf, len);
    if (before[0] != 0) // frames are visible (root): they must differ somewhere
        CHECK(after != before);
    fill_pattern(src.bytes, 9);
    {
        auto dst = cache.remote<rw>(buf, len);
        REQUIRE(lp.a.write(src.mr.local(), dst.buffer, 0, 2) == status::ok);
        REQUIRE(wait_send(lp.a).ok());
    }
    CHECK(has_pattern(std::span(buf, len), 9));
    CHECK(frames(buf, len) == after);
    CHECK(cache.counters().invalidations == 1);
    munmap(buf, len);
}

TEST_CASE("data path: write from any buffer; the cache supplies both keys") {
    loopback lp;
    auto cache = make_verbs_cache(lp.pd, with_monitor(monitor_kind::uffd));
    std::vector<std::byte> out(10000), in(10000, std::byte{0});
    fill_pattern(out, 3);
    for (int round = 0; round < 3; ++round) {
        auto src = cache.local<rights::local_read>(out.data() + 100, 9000);
        auto dst = cache.remote<rw>(in.data(), in.size());
        REQUIRE(lp.a.write(src.buffer, dst.buffer, 100, 7) == status::ok);
        REQUIRE(wait_send(lp.a).ok());
    }
    CHECK(has_pattern(std::span(in).subspan(100, 9000), 3 + 100));
    CHECK(in[99] == std::byte{0});
    const auto n = cache.counters();
    CHECK(n.misses == 2); // the first round registered both buffers, the rest hit
    CHECK(n.hits == 4);
    // Bad input is refused before anything is posted.
    CHECK_THROWS_AS(cache.local<lw>(out.data(), 0), rdmax::error);
    auto small = cache.local<lw>(out.data(), 64);
    CHECK_THROWS_AS(small.registration.local<lw>(out.data(), 1 << 20), rdmax::error);
}

TEST_CASE("fork: the parent's cached registration keeps moving the parent's bytes") {
    constexpr std::size_t len = 2 * 4096;
    loopback lp;
    registered into(lp.pd, len);
    auto cache = make_cache(lp.pd, monitor_kind::uffd);
    std::byte* buf = map_at(nullptr, len, 1);
    read_through(lp, cache, buf, len, into);
    std::fflush(nullptr);
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        fill_pattern(std::span(buf, len), 77); // the child's copy
        bool refused = false;
        try {
            static_cast<void>(cache.get<rr>(buf, len));
        } catch (const rdmax::error&) {
            refused = true;
        }
        _exit(refused ? 0 : 1);
    }
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
    fill_pattern(std::span(buf, len), 4); // the parent writes after fork
    read_through(lp, cache, buf, len, into);
    CHECK(has_pattern(into.bytes, 4));
    CHECK(cache.counters().registrations == 1); // still the registration from before fork
    munmap(buf, len);
}
