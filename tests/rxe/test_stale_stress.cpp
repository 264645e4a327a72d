// Never stale, under threads: 4 threads each get a registration through one
// of two caches on one protection domain (which under uffd share the
// process's userfaultfd), move bytes by RDMA READ or WRITE through the device,
// and munmap + mmap at the same address (or mmap MAP_FIXED over) their own
// ranges, while both caches evict under a count limit of 4. After every
// remap the bytes are checked through the device: a READ must bring the new
// mapping's bytes, a WRITE must land in the new mapping. A stale registration
// shows as the old pages' bytes (issue 23, "Shown by").
//
// The monitor is chosen explicitly by RDMAX_STRESS_MONITOR (uffd, the rxe
// suite; kmod, the kmod suite, SKIP where /dev/rdmax is absent); checked
// operations in all by RDMAX_STRESS_OPS (default 100000).
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <sys/mman.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

#include "../support/catch.hpp"
#include "../support/skip_reason.hpp"
#include "../support/test_device.hpp"

using namespace rdmax;
using namespace rdmax::test;

namespace {

monitor_kind stress_monitor() {
    const char* m = std::getenv("RDMAX_STRESS_MONITOR");
    return m != nullptr && std::string_view(m) == "kmod" ? monitor_kind::kmod : monitor_kind::uffd;
}

/// RDMAX_STRESS_CACHES=1: one cache only (for telling a defect between two
/// caches that share the userfaultfd from one within a cache).
unsigned stress_caches() {
    const char* n = std::getenv("RDMAX_STRESS_CACHES");
    return n != nullptr && std::string_view(n) == "1" ? 1 : 2;
}

std::uint64_t stress_ops() {
    const char* n = std::getenv("RDMAX_STRESS_OPS");
    return n != nullptr ? std::strtoull(n, nullptr, 10) : 100000;
}

const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));

void fill(std::span<std::byte> out, unsigned seed) {
    for (std::size_t i = 0; i < out.size(); ++i)
        out[i] = static_cast<std::byte>((i + seed) % 251);
}
/// The seed whose pattern `in` holds (checked whole), or -1.
int seed_of(std::span<const std::byte> in) {
    if (in.empty())
        return -1;
    const int s = (static_cast<int>(in[0]) + 251) % 251;
    for (std::size_t i = 0; i < in.size(); ++i)
        if (in[i] != static_cast<std::byte>((i + static_cast<std::size_t>(s)) % 251))
            return -1;
    return s;
}

using cache_t = verbs_cache;

struct shared_state {
    std::atomic<std::uint64_t> checked{0}, stale{0}, errors{0}, remaps{0}, moved{0};
    std::mutex m;
    std::string first_problem;
    void problem(std::string what) {
        std::lock_guard l(m);
        if (first_problem.empty())
            first_problem = std::move(what);
    }
};

/// One thread's ranges, queue pairs and checked buffer.
class worker {
public:
    worker(verbs::protection_domain& pd, std::array<cache_t*, 2> caches, shared_state& st,
           unsigned id)
        : caches_(caches)
        , st_(st)
        , rng_(20261125 + id)
        , a_(pd)
        , b_(pd)
        , local_(4 * page)
        , local_mr_(pd, local_.data(), local_.size()) {
        verbs::connect_pair(a_, b_);
        for (std::size_t pages : {1, 2, 4}) {
            range r;
            r.len = pages * page;
            r.p = static_cast<std::byte*>(
                mmap(nullptr, r.len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
            if (r.p == MAP_FAILED)
                throw std::system_error(errno, std::generic_category(), "mmap");
            ranges_.push_back(r);
        }
    }
    worker(const worker&) = delete;
    worker& operator=(const worker&) = delete;
    ~worker() {
        for (range& r : ranges_)
            munmap(r.p, r.len);
    }

    void run(std::uint64_t ops) {
        for (std::uint64_t i = 0; i < ops && st_.errors.load() < 10; ++i) {
            range& r = ranges_[rng_() % ranges_.size()];
            cache_t& c = *caches_[rng_() % 2];
            if (i == 0 || rng_() % 2 == 0)
                remap(r, rng_() % 2 == 0);
            if (rng_() % 2 == 0)
                checked_read(c, r);
            else
                checked_write(c, r);
        }
    }

private:
    struct range {
        std::byte* p = nullptr;
        std::size_t len = 0;
        unsigned seed = 0; ///< the pattern the mapping holds now
    };

    /// New pages at the range's address: munmap then mmap there, or mmap
    /// MAP_FIXED over the old ones. Where another thread's mapping took the
    /// hole in between, the range moves.
    void remap(range& r, bool unmap_first) {
        if (unmap_first) {
            if (munmap(r.p, r.len) != 0)
                fail(fmt::format("munmap: {}", std::strerror(errno)));
            void* q = mmap(r.p, r.len, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
            if (q == MAP_FAILED || q != r.p) {
                if (q != MAP_FAILED)
                    munmap(q, r.len);
                q = mmap(nullptr, r.len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                         0);
                st_.moved.fetch_add(1, std::memory_order_relaxed);
            }
            if (q == MAP_FAILED)
                return fail(fmt::format("mmap: {}", std::strerror(errno)));
            r.p = static_cast<std::byte*>(q);
        } else {
            void* q = mmap(r.p, r.len, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            if (q != r.p)
                return fail(fmt::format("mmap MAP_FIXED: {}", std::strerror(errno)));
        }
        r.seed = 0; // fresh zero pages: no pattern
        st_.remaps.fetch_add(1, std::memory_order_relaxed);
    }

    unsigned next_seed(const range& r) {
        unsigned s = 0;
        do
            s = 1 + static_cast<unsigned>(rng_() % 250);
        while (s == r.seed);
        return s;
    }

    /// A fresh pattern into the mapping, RDMA READ of it into the local
    /// buffer through the cache's registration: the bytes must be the new ones.
    void checked_read(cache_t& c, range& r) {
        const unsigned s = next_seed(r);
        fill(std::span(r.p, r.len), s);
        r.seed = s;
        std::memset(local_.data(), 0, r.len);
        {
            auto token = c.remote<rights::remote_read>(r.p, r.len);
            if (!post_and_wait(a_.read(local_mr_.local(0, r.len), token.buffer, 0, 1)))
                return;
        }
        check(std::span<const std::byte>(local_.data(), r.len), s, "READ");
    }

    /// A fresh pattern RDMA-written into the mapping through the cache's
    /// registration: the mapping must hold it.
    void checked_write(cache_t& c, range& r) {
        const unsigned s = next_seed(r);
        fill(std::span(local_.data(), r.len), s);
        {
            auto token = c.remote<rights::remote_write>(r.p, r.len);
            if (!post_and_wait(a_.write(local_mr_.local(0, r.len), token.buffer, 0, 2)))
                return;
        }
        r.seed = s;
        check(std::span<const std::byte>(r.p, r.len), s, "WRITE");
    }

    bool post_and_wait(status posted) {
        if (posted != status::ok) {
            fail(fmt::format("post refused: {}", to_string(posted)));
            return false;
        }
        verbs::completion done[1];
        if (a_.wait_send(done, std::chrono::seconds(10)) != 1) {
            fail("no completion within 10 s");
            return false;
        }
        if (!done[0].ok()) {
            fail(fmt::format("completion: {}", done[0].status_name()));
            return false;
        }
        return true;
    }

    void check(std::span<const std::byte> got, unsigned want, const char* op) {
        st_.checked.fetch_add(1, std::memory_order_relaxed);
        if (seed_of(got) == static_cast<int>(want))
            return;
        st_.stale.fetch_add(1, std::memory_order_relaxed);
        st_.problem(fmt::format("{} of {} bytes: pattern {} expected, found {} (-1: none)", op,
                                got.size(), want, seed_of(got)));
    }

    void fail(std::string what) {
        st_.errors.fetch_add(1, std::memory_order_relaxed);
        st_.problem(std::move(what));
    }

    std::array<cache_t*, 2> caches_;
    shared_state& st_;
    std::mt19937_64 rng_;
    verbs::queue_pair<verbs::rc> a_, b_;
    std::vector<std::byte> local_;
    memory_region<all_rights> local_mr_;
    std::vector<range> ranges_;
};

} // namespace

std::optional<std::string> rdmax::test::skip_reason() {
    if (auto why = device_unavailable())
        return why;
    if (stress_monitor() == monitor_kind::kmod && !kmod_monitor::available())
        return std::string("the rdmax module is not loaded (/dev/rdmax): the kmod monitor "
                           "cannot be tested here");
    if (stress_monitor() == monitor_kind::uffd && !uffd_monitor::available())
        return std::string("userfaultfd is not available to this process");
    return std::nullopt;
}

TEST_CASE("stress: 4 threads remap their ranges under two evicting caches; never stale") {
    const monitor_kind k = stress_monitor();
    const std::uint64_t total = stress_ops();
    constexpr unsigned threads = 4;
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    rcache_options opt;
    opt.monitor = k;
    opt.max_count = 4; // 12 ranges per thread set: both caches evict all the time
    cache_t c1(verbs_registrar(pd), auto_monitor(k), opt);
    cache_t c2(verbs_registrar(pd), auto_monitor(k), opt);
    REQUIRE(c1.monitor_ref().kind() == k);

    shared_state st;
    std::vector<std::unique_ptr<worker>> workers;
    for (unsigned i = 0; i < threads; ++i)
        workers.push_back(
            std::make_unique<worker>(pd, std::array{&c1, stress_caches() == 2 ? &c2 : &c1}, st, i));
    const auto t0 = std::chrono::steady_clock::now();
    {
        std::vector<std::jthread> running;
        for (unsigned i = 0; i < threads; ++i)
            running.emplace_back([&, i] {
                try {
                    workers[i]->run(total / threads);
                } catch (const std::exception& e) {
                    st.errors.fetch_add(1);
                    st.problem(fmt::format("thread {}: {}", i, e.what()));
                }
            });
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    workers.clear();
    const auto n1 = c1.counters(), n2 = c2.counters();
    const std::string summary = fmt::format(
        "monitor {}, {} cache(s): {} checked operations, {} stale, {} errors, {} remaps ({} "
        "moved), {:.1f} s "
        "({:.0f} ops/s); cache 1: {} hits, {} misses, {} invalidations, {} evictions; cache 2: {} "
        "hits, {} misses, "
        "{} invalidations, {} evictions",
        to_string(k), stress_caches(), st.checked.load(), st.stale.load(), st.errors.load(),
        st.remaps.load(), st.moved.load(), secs, static_cast<double>(st.checked.load()) / secs,
        n1.hits, n1.misses, n1.invalidations, n1.evictions, n2.hits, n2.misses, n2.invalidations,
        n2.evictions);
    fmt::print("{}\n", summary);
    INFO(summary);
    INFO("first problem: " << st.first_problem);
    CHECK(st.errors.load() == 0);
    CHECK(st.stale.load() == 0);
    CHECK(st.checked.load() >= (total / threads) * threads);
    CHECK(n1.invalidations + n2.invalidations > 0);
    CHECK(n1.evictions + n2.evictions > 0);
}
