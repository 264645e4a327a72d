// The userfaultfd monitor under the registration cache (counting registrar):
// every way the kernel takes pages away from a cached range invalidates it,
// memory it cannot watch is never cached, the pending queue stays bounded in
// a munmap loop, and a forked child's cache is inert. SKIP (77) where
// userfaultfd is unavailable.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <rdmax/mem/auto_monitor.hpp>
#include <rdmax/mem/pending_invalidations.hpp>
#include <rdmax/mem/registration_cache.hpp>
#include <rdmax/mem/uffd_monitor.hpp>

#include "../support/catch.hpp"
#include "../support/skip_reason.hpp"

using namespace rdmax;
using cache_t = registration_cache<counting_registrar, uffd_monitor>;
constexpr rdmax::rights lw = rights::local_write;

namespace {

const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));

/// Anonymous memory that the test unmaps in pieces; what is left goes at the end.
struct mapping {
    std::byte* base;
    std::size_t len;
    explicit mapping(std::size_t pages)
        : len(pages * page) {
        void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        REQUIRE(p != MAP_FAILED);
        base = static_cast<std::byte*>(p);
        std::memset(base, 1, len);
    }
    ~mapping() { munmap(base, len); }
    [[nodiscard]] std::byte* at(std::size_t page_no) const { return base + page_no * page; }
};

/// Whether a get() of [p, p + len) hits what is cached (no new registration).
bool cached(cache_t& c, const void* p, std::size_t len) {
    const auto regs = c.registrar_ref().regs;
    auto h = c.get<lw>(p, len);
    return c.registrar_ref().regs == regs;
}

} // namespace

TEST_CASE("uffd: munmap of part of a cached range invalidates it before munmap returns") {
    mapping m(8);
    cache_t c{counting_registrar{}};
    c.get<lw>(m.at(0), 8 * page).reset();
    CHECK(cached(c, m.at(2), page));
    REQUIRE(munmap(m.at(3), page) == 0); // a middle page
    CHECK(c.monitor_ref().pending());
    CHECK_FALSE(cached(c, m.at(0), page)); // the first get after munmap already knows
    CHECK(c.counters().invalidations == 1);
    CHECK(c.registrar_ref().live == 1); // the old registration is gone, the new one is live
}

TEST_CASE("uffd: mmap MAP_FIXED over a cached range, MADV_DONTNEED and mremap invalidate it") {
    mapping m(8);
    cache_t c{counting_registrar{}};

    c.get<lw>(m.at(0), 2 * page).reset();
    void* p = mmap(m.at(0), 2 * page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    REQUIRE(p == m.at(0));
    CHECK_FALSE(cached(c, m.at(0), 2 * page));

    c.get<lw>(m.at(4), page).reset();
    REQUIRE(madvise(m.at(4), page, MADV_DONTNEED) == 0);
    CHECK_FALSE(cached(c, m.at(4), page));

    c.get<lw>(m.at(6), 2 * page).reset();
    void* moved = mremap(m.at(6), 2 * page, 2 * page, MREMAP_MAYMOVE | MREMAP_FIXED, m.at(2));
    REQUIRE(moved == m.at(2));
    CHECK_FALSE(cached(c, m.at(2), 2 * page)); // drains the queue
    CHECK(c.counters().invalidations >= 3);
    // [6, 8) is a hole now: a new mapping there must be registered anew.
    REQUIRE(mmap(m.at(6), 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                 -1, 0) == m.at(6));
    CHECK_FALSE(cached(c, m.at(6), 2 * page));
    CHECK(c.monitor_ref().events() >= 4);
}

TEST_CASE("uffd: unrelated munmaps leave cached ranges alone; a re-mapped range is watched") {
    mapping m(4);
    cache_t c{counting_registrar{}};
    c.get<lw>(m.at(0), page).reset();
    {
        mapping other(4); // mapped and unmapped, never registered
    }
    CHECK(cached(c, m.at(0), page));
    CHECK(c.counters().invalidations == 0);
    // Unmap and map again at the same address: the second registration must be
    // watched too, although the first one's pieces were registered before.
    REQUIRE(munmap(m.at(0), page) == 0);
    REQUIRE(mmap(m.at(0), page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1,
                 0) == m.at(0));
    CHECK_FALSE(cached(c, m.at(0), page));
    REQUIRE(munmap(m.at(0), page) == 0);
    REQUIRE(mmap(m.at(0), page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1,
                 0) == m.at(0));
    CHECK_FALSE(cached(c, m.at(0), page));
}

TEST_CASE("uffd: an in-use registration that is unmapped leaves at once, deregistered at release") {
    mapping m(4);
    cache_t c{counting_registrar{}};
    auto h = c.get<lw>(m.at(0), 2 * page);
    REQUIRE(munmap(m.at(0), 2 * page) == 0);
    REQUIRE(mmap(m.at(0), 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                 -1, 0) == m.at(0));
    auto fresh = c.get<lw>(m.at(0), 2 * page);
    CHECK(fresh.lkey() != h.lkey());
    CHECK(c.registrar_ref().live == 2);
    h.reset();
    CHECK(c.registrar_ref().live == 1);
}

TEST_CASE("uffd: memory it cannot watch (a file mapping) is registered per use, never cached") {
    char path[] = "/tmp/rdmax-uffd-XXXXXX";
    const int fd = mkstemp(path);
    REQUIRE(fd >= 0);
    unlink(path);
    REQUIRE(ftruncate(fd, static_cast<off_t>(4 * page)) == 0);
    void* p = mmap(nullptr, 4 * page, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    REQUIRE(p != MAP_FAILED);
    cache_t c{counting_registrar{}};
    {
        auto h = c.get<lw>(p, page);
        CHECK(c.counters().uncached == 1);
        CHECK(c.counters().registered_count == 0);
    }
    CHECK(c.registrar_ref().live == 0);
    CHECK_FALSE(cached(c, p, page));
    munmap(p, 4 * page);
}

TEST_CASE("uffd: the pending queue stays bounded in a munmap loop, and loses nothing") {
    constexpr std::size_t n = 2000;
    mapping m(2 * n);
    cache_t c{counting_registrar{}, {}, [] {
                  rcache_options o;
                  o.max_count = 2 * n;
                  return o;
              }()};
    for (std::size_t i = 0; i < n; ++i) // every other page: nothing merges
        c.get<lw>(m.at(2 * i), page).reset();
    REQUIRE(c.counters().registered_count == n);
    // Unmap them all without calling into the cache: the queue must not grow.
    for (std::size_t i = 0; i < n; ++i)
        REQUIRE(munmap(m.at(2 * i), page) == 0);
    CHECK(c.monitor_ref().queued() <= pending_invalidations<64>::capacity);
    c.flush(); // drains the queue (after the reader has queued the last event)
    CHECK(c.monitor_ref().events() == n);
    CHECK(c.counters().registered_count == 0);
    CHECK(c.counters().invalidations == n);
    CHECK(c.registrar_ref().live == 0);
}

TEST_CASE("pending_invalidations merges and stays within capacity") {
    pending_invalidations<4> q;
    q.add(10, 20);
    q.add(20, 30); // touching: merged
    q.add(5, 8);
    q.add(40, 50);
    q.add(60, 70);
    REQUIRE(q.size() == 4);
    q.add(100, 110); // full: the closest pair (5-8 and 10-30) merges first
    CHECK(q.size() == 4);
    CHECK(q.overflow_merges() == 1);
    CHECK(q[0].start == 5);
    CHECK(q[0].end == 30);
    CHECK(q[3].start == 100);
    q.add(0, 1000); // swallows everything
    CHECK(q.size() == 1);
    CHECK(q[0].end == 1000);
}

TEST_CASE("fork: the child's cache is inert; the parent's keeps its registrations") {
    mapping m(4);
    cache_t c{counting_registrar{}};
    auto held = c.get<lw>(m.at(0), page);
    c.get<lw>(m.at(2), page).reset();
    std::fflush(nullptr);
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        int failures = 0;
        try {
            c.get<lw>(m.at(0), page).reset();
            ++failures; // must have thrown
        } catch (const rdmax::error& e) {
            failures += std::strstr(e.what(), "fork") == nullptr;
        }
        const auto deregs = c.registrar_ref().deregs;
        held.reset(); // the last handle: forgotten, not deregistered
        c.invalidate(m.at(2), page);
        failures += c.registrar_ref().deregs != deregs;
        munmap(m.at(0), 4 * page); // the child's own copy: must not reach the parent
        _exit(failures == 0 ? 0 : 1);
    }
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
    CHECK(c.counters().invalidations == 0); // the child's munmap is not ours
    CHECK(cached(c, m.at(0), page));
    CHECK(cached(c, m.at(2), page));
    held.reset();
    CHECK(c.registrar_ref().live == 2);
}

TEST_CASE("auto_monitor: resolves names, and none turns caching off") {
    auto_monitor a(monitor_kind::automatic);
    CHECK(a.kind() == monitor_kind::uffd); // this machine has no /dev/rdmax monitor
    CHECK(auto_monitor(monitor_kind::manual).kind() == monitor_kind::manual);
    CHECK_THROWS_AS(auto_monitor(monitor_kind::kmod), rdmax::error);
    mapping m(2);
    registration_cache<counting_registrar, auto_monitor> off{counting_registrar{},
                                                             auto_monitor(monitor_kind::none)};
    off.get<lw>(m.at(0), page).reset();
    off.get<lw>(m.at(0), page).reset();
    CHECK(off.registrar_ref().regs == 2);
    CHECK(off.registrar_ref().live == 0);
}

std::optional<std::string> rdmax::test::skip_reason() {
    if (uffd_monitor::available())
        return std::nullopt;
    try {
        uffd_monitor probe; // throws, saying why
    } catch (const std::exception& e) {
        return e.what();
    }
    return "userfaultfd is unavailable";
}
