// The userfaultfd monitor under the registration cache (counting registrar):
// every way the kernel takes pages away from a cached range invalidates it,
// memory it cannot watch is never cached, the pending queue stays bounded in
// a munmap loop, and a forked child's cache is inert. SKIP (77) where
// userfaultfd is unavailable.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <memory>
#include <poll.h>
#include <string>
#include <string_view>
#include <sys/mman.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <rdmax/detail/mem/pending_invalidations.hpp>
#include <rdmax/mem/auto_monitor.hpp>
#include <rdmax/mem/kmod_monitor.hpp>
#include <rdmax/mem/registration_cache.hpp>
#include <rdmax/mem/uffd_monitor.hpp>

#include "../support/catch.hpp"
#include "../support/skip_reason.hpp"

// Replaced for the whole test binary, to fail the allocations of one
// thread on demand (the reader thread's never fail).
namespace {
thread_local bool fail_allocations = false;
} // namespace

void* operator new(std::size_t n) {
    if (fail_allocations)
        throw std::bad_alloc();
    if (void* p = std::malloc(n == 0 ? 1 : n))
        return p;
    throw std::bad_alloc();
}
// The pairs of the malloc above (GCC cannot tell that they are replaced together).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void operator delete(void* p) noexcept {
    std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
    std::free(p);
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
    return fail_allocations ? nullptr : std::malloc(n == 0 ? 1 : n);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
    std::free(p);
}
#pragma GCC diagnostic pop

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

TEST_CASE("uffd: a watch with no memory for its count is refused, and changes nothing") {
    mapping m(8);
    const auto at = [&](std::size_t p) { return reinterpret_cast<std::uintptr_t>(m.at(p)); };
    uffd_monitor mon;
    // The old code ended the process here (an allocation under noexcept).
    fail_allocations = true;
    const auto lost = mon.watch(at(0), page);
    fail_allocations = false;
    CHECK(lost.end == 0); // not cacheable: the caller registers per use
    // The counts were left as they were: one watch and one unwatch leave
    // nothing watched (an unwatch splits nothing: no allocation there).
    // The whole mapping is watched (the kernel may have merged it with a
    // neighbour: under ASan it often has).
    const auto t = mon.watch(at(0), 8 * page);
    REQUIRE((t.start <= at(0) && t.end >= at(8)));
    fail_allocations = true;
    mon.unwatch(t);
    fail_allocations = false;
    const auto again = mon.watch(at(0), page);
    CHECK((again.start <= at(0) && again.end >= at(1)));
    const auto before = mon.events();
    REQUIRE(madvise(m.at(0), page, MADV_DONTNEED) == 0);
    mon.drain([](void*, std::uintptr_t, std::uintptr_t) {}, nullptr);
    CHECK(mon.events() > before);
    mon.unwatch(again);
}

TEST_CASE("uffd: a drain returns while other threads unmap watched memory without pause") {
    // settle() waited for the reader to be idle; with munmaps coming as fast
    // as it reads them it never was, and every get() after one spun in it.
    constexpr std::size_t threads = 3;
    std::vector<std::unique_ptr<mapping>> ms;
    for (std::size_t i = 0; i < threads; ++i)
        ms.push_back(std::make_unique<mapping>(16));
    uffd_monitor mon;
    for (const auto& m : ms)
        REQUIRE(mon.watch(reinterpret_cast<std::uintptr_t>(m->base), m->len).end != 0);
    std::atomic<bool> stop{false};
    std::vector<std::thread> unmappers;
    for (std::size_t i = 0; i < threads; ++i)
        unmappers.emplace_back([&, i] {
            for (std::size_t n = 0; !stop.load(std::memory_order_relaxed); ++n)
                (void)madvise(ms[i]->at(n % 16), page, MADV_DONTNEED);
        });
    using clock = std::chrono::steady_clock;
    const auto until = clock::now() + std::chrono::seconds(2);
    clock::duration longest{};
    std::size_t drains = 0;
    while (clock::now() < until) {
        const auto t0 = clock::now();
        mon.drain([](void*, std::uintptr_t, std::uintptr_t) {}, nullptr);
        longest = std::max(longest, clock::now() - t0);
        ++drains;
    }
    stop = true;
    for (auto& t : unmappers)
        t.join();
    INFO("drains " << drains << ", longest "
                   << std::chrono::duration_cast<std::chrono::milliseconds>(longest).count()
                   << " ms, events " << mon.events());
    CHECK(mon.events() > 100);
    CHECK(longest < std::chrono::seconds(2)); // one batch, even descheduled under TSan
}

TEST_CASE("auto_monitor: resolves names, and none turns caching off") {
    // The suite runs natively (no module) and in the VM (the module loaded):
    // automatic picks the module where it can be used, userfaultfd elsewhere.
    const bool module = kmod_monitor::available();
    auto_monitor a(monitor_kind::automatic);
    CHECK(a.kind() == (module ? monitor_kind::kmod : monitor_kind::uffd));
    CHECK(auto_monitor(monitor_kind::manual).kind() == monitor_kind::manual);
    if (::access("/dev/rdmax", F_OK) != 0)
        CHECK_THROWS_AS(auto_monitor(monitor_kind::kmod), rdmax::error);
    mapping m(2);
    registration_cache<counting_registrar, auto_monitor> off{counting_registrar{},
                                                             auto_monitor(monitor_kind::none)};
    off.get<lw>(m.at(0), page).reset();
    off.get<lw>(m.at(0), page).reset();
    CHECK(off.registrar_ref().regs == 2);
    CHECK(off.registrar_ref().live == 0);
}

// ---- pending(): never false between a munmap's return and the cache having
// ---- dropped the range (issue 23, item 1).

namespace {

/// One event's life after the munmap that caused it returned, as the two words
/// pending() loads: the reader took it (reading), queued it, left; a drain
/// took it; the sink returned (only then may pending() say false).
struct world {
    static constexpr std::uint32_t stages[][2] = {
        {1, 0}, // read, not yet queued
        {1, 1}, // queued, the reader still between poll and queueing
        {0, 1}, // the reader done
        {0, 2}, // a drain took it: the sink runs
        {0, 0}, // the sink returned
    };
    static constexpr int done = 4;
    int stage = 0;
    int loads = 0;
    int advance_after_first = 0; ///< stages the other threads move on between the loads
};

/// A word whose load() moves the world on after the first load, as the reader
/// and a drain on other threads can.
struct word {
    world* w;
    int which; ///< 0: the reader's, 1: the monitor's state
    [[nodiscard]] std::uint32_t load(std::memory_order) const noexcept {
        const std::uint32_t v = world::stages[w->stage][which];
        if (++w->loads == 1)
            w->stage = std::min(world::done, w->stage + w->advance_after_first);
        return v;
    }
};

} // namespace

TEST_CASE("uffd: pending() is true from munmap's return until the sink returned, in every "
          "interleaving of its loads") {
    for (int start = 0; start < world::done; ++start) {
        for (int moved = 0; start + moved <= world::done; ++moved) {
            world w{start, 0, moved};
            const bool pending = detail::uffd_pending(word{&w, 0}, word{&w, 1});
            INFO("stage " << start << ", " << moved << " stages on between the loads");
            // False only once the sink has returned, before the second load.
            CHECK((pending || start + moved == world::done));
        }
    }
}

TEST_CASE("uffd: pending() stays true while drain's sink runs, false after") {
    mapping m(4);
    uffd_monitor mon;
    const auto t = mon.watch(reinterpret_cast<std::uintptr_t>(m.at(0)), 2 * page);
    REQUIRE(mon.valid(t));
    REQUIRE(munmap(m.at(0), page) == 0);
    CHECK(mon.pending()); // from the moment munmap returned
    struct seen {
        uffd_monitor* mon;
        std::uintptr_t unmapped;
        int calls = 0; ///< for the page unmapped (others' munmaps may come too)
        int pending_inside = 0;
    } s{&mon, reinterpret_cast<std::uintptr_t>(m.at(0))};
    mon.drain(
        [](void* ctx, std::uintptr_t start, std::uintptr_t end) {
            auto* got = static_cast<seen*>(ctx);
            if (start <= got->unmapped && got->unmapped < end) {
                ++got->calls;
                got->pending_inside += got->mon->pending() ? 1 : 0;
            }
        },
        &s);
    CHECK(s.calls == 1);
    CHECK(s.pending_inside == 1); // the entry is still in the page table there
    mon.unwatch(t);
}

TEST_CASE("uffd: a get from another thread while a drain's sink runs never hits the unmapped "
          "range") {
    // The sink pauses (in the cache, the entries are not yet erased); a thread
    // whose get() is ordered after the munmap must see pending() and wait for
    // the cache's lock, so it never hits the old registration.
    mapping m(4);
    uffd_monitor mon;
    const auto t = mon.watch(reinterpret_cast<std::uintptr_t>(m.at(0)), page);
    REQUIRE(mon.valid(t));
    REQUIRE(munmap(m.at(0), page) == 0);
    std::atomic<int> phase{0};
    std::atomic<bool> seen_pending{false};
    std::thread other([&] {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (phase.load() != 1 && std::chrono::steady_clock::now() < deadline)
            std::this_thread::yield();
        seen_pending = mon.pending(); // inside the sink, from another thread
        phase = 2;
    });
    struct ctx_t {
        std::atomic<int>* phase;
    } ctx{&phase};
    mon.drain(
        [](void* c, std::uintptr_t, std::uintptr_t) {
            auto* p = static_cast<ctx_t*>(c)->phase;
            *p = 1;
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
            while (p->load() != 2 && std::chrono::steady_clock::now() < deadline)
                std::this_thread::yield();
        },
        &ctx);
    other.join();
    CHECK(phase.load() == 2);
    CHECK(seen_pending.load());
    mon.unwatch(t);
}

// ---- UFFDIO_REGISTER and the watch count are one step (issue 23, item 2).

namespace {
std::atomic<int> unwatch_phase{0}; // 1: unwatch now; 2: it returned
void let_unwatch_run() {
    unwatch_phase = 1;
    // With the count taken under the lock, the unwatch cannot run now: give
    // it a bounded chance, which it takes only when the step is split.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
    while (unwatch_phase.load() != 2 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::yield();
}
} // namespace

TEST_CASE("uffd: two monitors on the one userfaultfd: X's unwatch between Y's register and its "
          "count leaves Y watched") {
    mapping m(4);
    const auto a = reinterpret_cast<std::uintptr_t>(m.at(0));
    uffd_monitor x, y;
    const auto tx = x.watch(a, 2 * page);
    REQUIRE(x.valid(tx));
    unwatch_phase = 0;
    std::thread evict([&] {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (unwatch_phase.load() != 1 && std::chrono::steady_clock::now() < deadline)
            std::this_thread::yield();
        x.unwatch(tx); // X evicts: its count drops
        unwatch_phase = 2;
    });
    detail::uffd_test_hooks().after_register = &let_unwatch_run;
    const auto ty = y.watch(a, 2 * page); // Y misses on the same range
    detail::uffd_test_hooks().after_register = nullptr;
    evict.join();
    REQUIRE(y.valid(ty));
    y.drain([](void*, std::uintptr_t, std::uintptr_t) {}, nullptr);
    REQUIRE(munmap(m.at(0), page) == 0); // must still reach Y
    CHECK(y.pending());
    std::pair<std::uintptr_t, int> seen{a, 0};
    y.drain(
        [](void* ctx, std::uintptr_t start, std::uintptr_t end) {
            auto* s = static_cast<std::pair<std::uintptr_t, int>*>(ctx);
            s->second += start <= s->first && s->first < end ? 1 : 0;
        },
        &seen);
    CHECK(seen.second == 1);
    y.unwatch(ty);
}

// ---- The reader thread retries transient errors, and dies loudly (issue 23, item 6).

namespace {

/// The reader's poll() in a child started by in_child(): it waits until the
/// test says fail, fails `poll_failures_left` times with `poll_errno`, then
/// polls for real.
std::atomic<int> poll_failures_left{0};
std::atomic<bool> poll_fail_now{false};
std::atomic<int> poll_errno{ENOMEM};

/// Set: the next poll closes the userfaultfd's number and reports POLLNVAL,
/// as when the application closes a descriptor it does not own.
std::atomic<bool> poll_close_fd{false};

int failing_poll(pollfd* fds, unsigned long n, int timeout) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!poll_fail_now.load() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::yield();
    if (poll_close_fd.exchange(false)) {
        close(fds[0].fd);
        fds[0].revents = POLLNVAL;
        for (unsigned long i = 1; i < n; ++i)
            fds[i].revents = 0;
        return 1;
    }
    if (poll_failures_left.load() > 0) {
        --poll_failures_left;
        errno = poll_errno.load();
        return -1;
    }
    return ::poll(fds, n, timeout);
}

constexpr const char* child_env = "RDMAX_TEST_UFFD_FAILING_POLL";

/// In a child started by in_child(), the reader polls through failing_poll
/// from its first poll on (set before main, which starts the reader).
const bool poll_hook_set = [] {
    if (std::getenv(child_env) != nullptr)
        detail::uffd_test_hooks().poll = &failing_poll;
    return true;
}();

/// Runs the hidden test case `name` in a new process (this program, exec'd:
/// its userfaultfd and reader are its own, so the hook reaches a fresh reader,
/// and ThreadSanitizer allows its threads) and returns its exit status, or -1
/// if it did not end within the deadline (then it is killed): a munmap that
/// blocks forever shows as -1.
int in_child(const char* name, std::chrono::seconds deadline) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e)
        env_strings.emplace_back(*e);
    env_strings.push_back(std::string(child_env) + "=1");
    std::vector<char*> envp;
    envp.reserve(env_strings.size() + 1);
    for (auto& s : env_strings)
        envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string self = "/proc/self/exe", test = name;
    char* argv[] = {self.data(), test.data(), nullptr};
    std::fflush(nullptr);
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        execve(argv[0], argv, envp.data());
        _exit(126);
    }
    const auto until = std::chrono::steady_clock::now() + deadline;
    int status = 0;
    for (;;) {
        const pid_t r = waitpid(pid, &status, WNOHANG);
        if (r < 0)
            return -2;
        if (r == pid)
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (std::chrono::steady_clock::now() > until) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return -1;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5)); // polling a child's end
    }
}

} // namespace

TEST_CASE("uffd child: transient poll errors", "[.child]") {
    REQUIRE(detail::uffd_test_hooks().poll == &failing_poll);
    mapping m(8);
    cache_t c{counting_registrar{}};
    c.get<lw>(m.at(0), page).reset();
    c.get<lw>(m.at(4), page).reset();
    REQUIRE(cached(c, m.at(0), page));
    poll_errno = ENOMEM;
    poll_failures_left = 5;
    poll_fail_now = true;
    REQUIRE(munmap(m.at(0), page) == 0); // the reader fails 5 times, then reads it
    REQUIRE(munmap(m.at(4), page) == 0); // blocks for good if the reader left
    c.get<lw>(m.at(2), page).reset();    // drains
    CHECK(c.counters().invalidations == 2);
    CHECK(poll_failures_left.load() == 0);
    CHECK(c.monitor_ref().failed().empty());
}

TEST_CASE("uffd child: a poll error the reader cannot go on after", "[.child]") {
    REQUIRE(detail::uffd_test_hooks().poll == &failing_poll);
    mapping m(8);
    cache_t c{counting_registrar{}};
    c.get<lw>(m.at(0), page).reset();
    c.get<lw>(m.at(4), page).reset();
    REQUIRE(cached(c, m.at(0), page));
    REQUIRE(cached(c, m.at(4), page));
    poll_errno = EBADF;
    poll_failures_left = 1;
    poll_fail_now = true;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (c.monitor_ref().failed().empty() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::yield();
    CHECK(c.monitor_ref().failed().find("poll") != std::string::npos);
    REQUIRE(munmap(m.at(0), page) == 0); // must not wait for a reader that is gone
    CHECK(c.monitor_ref().pending());    // for good
    // Nothing is served from the cache any more: the range still mapped is
    // registered anew, per use, and nothing stays cached.
    const auto regs = c.registrar_ref().regs;
    c.get<lw>(m.at(4), page).reset();
    c.get<lw>(m.at(4), page).reset();
    CHECK(c.registrar_ref().regs == regs + 2);
    CHECK(c.counters().uncached == 2);
    CHECK(c.counters().registered_count == 0);
    CHECK(c.registrar_ref().live == 0);
    CHECK(c.monitor_ref().pending());
}

/// The number of this process's userfaultfd descriptor, or -1.
int uffd_number() {
    for (int fd = 0; fd < 1024; ++fd) {
        char path[64], target[128] = {};
        std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        const ssize_t n = readlink(path, target, sizeof target - 1);
        if (n > 0 &&
            std::string_view(target, static_cast<std::size_t>(n)) == "anon_inode:[userfaultfd]")
            return fd;
    }
    return -1;
}

TEST_CASE("uffd child: a closed descriptor", "[.child]") {
    REQUIRE(detail::uffd_test_hooks().poll == &failing_poll);
    mapping m(4);
    cache_t c{counting_registrar{}};
    c.get<lw>(m.at(0), page).reset();
    const int number = uffd_number();
    REQUIRE(number >= 0);
    poll_close_fd = true; // the application closes the number under the reader
    poll_fail_now = true;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (c.monitor_ref().failed().empty() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::yield();
    CHECK(c.monitor_ref().failed().find("POLLNVAL") != std::string::npos);
    // The reader did not take the number back (it used to dup3 its eventfd
    // there, over whatever the application had opened since).
    CHECK(fcntl(number, F_GETFD) == -1);
    CHECK(c.monitor_ref().pending());
    REQUIRE(munmap(m.at(0), page) == 0);
    c.get<lw>(m.at(2), page).reset();
    c.get<lw>(m.at(2), page).reset();
    CHECK(c.counters().uncached == 2);
}

TEST_CASE("uffd: a reader whose descriptor the application closed does not take its number back") {
    CHECK(in_child("uffd child: a closed descriptor", std::chrono::seconds(20)) == 0);
}

TEST_CASE("uffd: the reader retries poll's ENOMEM; munmaps go on being seen") {
    CHECK(in_child("uffd child: transient poll errors", std::chrono::seconds(20)) == 0);
}

TEST_CASE(
    "uffd: a reader that cannot go on dies loudly: no munmap waits, the cache stops caching") {
    CHECK(in_child("uffd child: a poll error the reader cannot go on after",
                   std::chrono::seconds(20)) == 0);
}

// ---- Memory whose pages can go through a file is never cached (issue 23, item 7).

namespace {

void* map_memfd(std::size_t len, int flags) {
    const int fd = memfd_create("rdmax-uffd-test", MFD_CLOEXEC);
    REQUIRE(fd >= 0);
    REQUIRE(ftruncate(fd, static_cast<off_t>(len)) == 0);
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, flags, fd, 0);
    close(fd);
    REQUIRE(p != MAP_FAILED);
    return p;
}

void check_served_per_use(const char* what, void* p) {
    INFO(what);
    cache_t c{counting_registrar{}};
    c.get<lw>(p, page).reset();
    c.get<lw>(p, page).reset();
    CHECK(c.registrar_ref().regs == 2);
    CHECK(c.counters().uncached == 2);
    CHECK(c.counters().registered_count == 0);
    CHECK(c.registrar_ref().live == 0);
}

} // namespace

TEST_CASE("uffd: memfd, shmem and shared anonymous memory are registered per use; private "
          "anonymous memory is cached") {
    for (const bool text : {false, true}) {
        INFO((text ? "/proc/self/maps as text" : "PROCMAP_QUERY where the kernel has it"));
        detail::uffd_test_hooks().no_procmap_query = text;
        void* shared = map_memfd(4 * page, MAP_SHARED);
        void* priv = map_memfd(4 * page, MAP_PRIVATE);
        void* shared_anon =
            mmap(nullptr, 4 * page, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        REQUIRE(shared_anon != MAP_FAILED);
        check_served_per_use("memfd MAP_SHARED", shared);
        check_served_per_use("memfd MAP_PRIVATE", priv);
        check_served_per_use("MAP_SHARED | MAP_ANONYMOUS", shared_anon);
        {
            mapping m(4);
            cache_t c{counting_registrar{}};
            c.get<lw>(m.at(1), 2 * page).reset();
            CHECK(cached(c, m.at(1), page));
            CHECK(c.counters().uncached == 0);
            CHECK(c.counters().registered_count == 1);
        }
        munmap(shared, 4 * page);
        munmap(priv, 4 * page);
        munmap(shared_anon, 4 * page);
    }
    detail::uffd_test_hooks().no_procmap_query = false;
}

TEST_CASE("uffd: a range across two private anonymous mappings is cached; one with a hole or a "
          "memfd part is not") {
    mapping m(6);
    // Two VMAs: different protections on [0, 3) and [3, 6).
    REQUIRE(mprotect(m.at(3), 3 * page, PROT_READ) == 0);
    {
        cache_t c{counting_registrar{}};
        c.get<rights::local_read>(m.at(2), 2 * page).reset();
        CHECK(c.counters().registered_count == 1);
        CHECK(c.counters().uncached == 0);
    }
    REQUIRE(munmap(m.at(3), page) == 0); // a hole in the middle
    {
        cache_t c{counting_registrar{}};
        c.get<rights::local_read>(m.at(2), 3 * page).reset();
        CHECK(c.counters().registered_count == 0);
        CHECK(c.counters().uncached == 1);
    }
    REQUIRE(mmap(m.at(3), page, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_FIXED, -1,
                 0) == m.at(3));
    {
        cache_t c{counting_registrar{}};
        c.get<rights::local_read>(m.at(2), 3 * page).reset();
        CHECK(c.counters().registered_count == 0);
        CHECK(c.counters().uncached == 1);
    }
}

namespace {
std::byte* race_at = nullptr; ///< the second mapping of the race below
void unmap_race_at() {
    munmap(race_at, 2 * page);
}
void remap_race_at() {
    // A hook cannot REQUIRE; a failed mmap leaves a hole, which watch() must refuse too.
    (void)mmap(race_at, 2 * page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
}
} // namespace

TEST_CASE("uffd: a mapping unmapped before UFFDIO_REGISTER and mapped again after it is not "
          "cached") {
    // The first look sees [0, 2) and [2, 4); [2, 4) goes before the
    // registration (which passes over the hole) and comes back, with the same
    // bounds and unregistered, before the second look. It used to be cached,
    // and its next munmap, which no one hears, left the registration stale.
    mapping m(4);
    REQUIRE(mprotect(m.at(2), 2 * page, PROT_READ) == 0); // two mappings
    race_at = m.at(2);
    cache_t c{counting_registrar{}};
    detail::uffd_test_hooks().before_register = &unmap_race_at;
    detail::uffd_test_hooks().after_register = &remap_race_at;
    c.get<rights::local_read>(m.at(1), 2 * page).reset();
    detail::uffd_test_hooks().before_register = nullptr;
    detail::uffd_test_hooks().after_register = nullptr;
    CHECK(c.counters().registered_count == 0);
    CHECK(c.counters().uncached == 1);
    // What it would have served stale: the second mapping replaced in silence.
    REQUIRE(munmap(m.at(2), 2 * page) == 0);
    REQUIRE(mmap(m.at(2), 2 * page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
            m.at(2));
    const auto regs = c.registrar_ref().regs;
    c.get<rights::local_read>(m.at(1), 2 * page).reset();
    CHECK(c.registrar_ref().regs == regs + 1);
    // Without the race the same request is cached.
    c.get<rights::local_read>(m.at(1), 2 * page).reset();
    CHECK(c.counters().registered_count == 1);
}

TEST_CASE("uffd: only anonymous memory and the kernel's own /anon_hugepage count as seen in "
          "full; a file named like it does not") {
    CHECK(detail::uffd_sees_everything(false, 0, ""));
    CHECK(detail::uffd_sees_everything(false, 0, "[heap]"));
    CHECK(detail::uffd_sees_everything(false, 123, "/anon_hugepage"));
    CHECK(detail::uffd_sees_everything(false, 123, "/anon_hugepage (deleted)"));
    CHECK_FALSE(detail::uffd_sees_everything(true, 0, ""));
    CHECK_FALSE(detail::uffd_sees_everything(true, 123, "/anon_hugepage"));
    CHECK_FALSE(detail::uffd_sees_everything(false, 123, "/anon_hugepage_files/data"));
    CHECK_FALSE(detail::uffd_sees_everything(false, 123, "/anon_hugepages.db"));
    CHECK_FALSE(detail::uffd_sees_everything(false, 123, "/anon_hugepage (deleted)x"));
}

// ---- Watching does not change what the application's mremap does (issue 23, item 8).

TEST_CASE("uffd: a fixed mremap of a mapping part of which is cached moves it whole, as without "
          "rdmax") {
    // The kernel refuses (6.1: EFAULT) or stops part way (6.17+) a move across
    // a userfaultfd-registered VMA and an unregistered one; the monitor
    // registers whole mappings, so a mapping made in one mmap stays one VMA.
    mapping m(4);
    for (std::size_t i = 0; i < 4; ++i)
        std::memset(m.at(i), static_cast<int>('a' + i), page);
    void* dst = mmap(nullptr, 4 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(dst != MAP_FAILED);
    registration_cache<counting_registrar, auto_monitor> c{counting_registrar{},
                                                           auto_monitor(monitor_kind::uffd)};
    {
        auto held = c.local<lw>(m.at(2), 2 * page);
        void* moved = mremap(m.base, 4 * page, 4 * page, MREMAP_MAYMOVE | MREMAP_FIXED, dst);
        INFO("mremap: " << (moved == MAP_FAILED ? std::strerror(errno) : "moved"));
        REQUIRE(moved == dst);
    }
    auto* q = static_cast<unsigned char*>(dst);
    for (std::size_t i = 0; i < 4; ++i)
        CHECK(q[i * page] == 'a' + i); // every page moved, none left behind
    unsigned char probe = 0;
    CHECK(mincore(m.base, page, &probe) == -1); // the old place is empty
    CHECK(errno == ENOMEM);
    // The cache saw the move: the old registration is gone.
    c.get<lw>(q + 2 * page, page).reset();
    CHECK(c.counters().invalidations == 1);
    CHECK(c.registrar_ref().live == 1);
    m.base = static_cast<std::byte*>(dst); // unmapped at the end
}

TEST_CASE("uffd: a mapping placed beside a watched one, which the kernel then merges with it, "
          "is cached") {
    mapping m(8);
    REQUIRE(munmap(m.at(4), 4 * page) == 0);
    cache_t c{counting_registrar{}};
    c.get<lw>(m.at(0), page).reset(); // watches [0, 4)
    REQUIRE(mmap(m.at(4), 4 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                 -1, 0) == m.at(4));
    c.get<lw>(m.at(6), page).reset(); // watches [4, 8), which the kernel merges into [0, 8)
    CHECK(c.counters().registered_count == 2);
    CHECK(c.counters().uncached == 0);
    CHECK(cached(c, m.at(6), page));
    REQUIRE(munmap(m.at(6), page) == 0);
    CHECK_FALSE(cached(c, m.at(6), page));
    CHECK(cached(c, m.at(0), page));
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
