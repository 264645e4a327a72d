#pragma once
// registration_cache<Registrar, Monitor>: registering a buffer that was
// registered before costs a lookup, not an ibv_reg_mr.
//
// The structure and its invariant. Cached registrations are kept DISJOINT
// (UCX's choice): a request that overlaps or touches cached ones is merged
// with them into one registration over the union, with the union of their
// rights, and the old ones leave the tree. So "which registration contains
// [a, b)" is one ordered-set search (the last one starting at or before a),
// and "which overlap [a, b)" walks forward from there: O(log n + k), on a
// Boost.Intrusive red-black tree whose node is the cache entry itself (one
// allocation per registration, in the tree and the eviction ring at once).
// Disjointness also lets a radix page table (detail/mem/page_table.hpp) map each page to
// the one entry covering it: hits look there, in four loads instead of a tree
// walk (UCX's design).
//
// Lifetimes. A handle holds a reference. An entry that leaves the tree while
// held (invalidated, merged away) is "dead": the last handle's release
// deregisters it; an idle one is deregistered at once. Reference count, dead
// bit and a hit counter share one atomic word, so exactly one of the two
// frees it, and a hit is one compare-and-swap.
//
// Threads. A hit takes no lock: it finds the entry in the page table, takes a
// reference with a compare-and-swap that fails on a dead entry, then checks
// that the entry it now holds covers the request. That is safe because
// entries and page-table nodes are type-stable: a freed entry waits on a free
// list for reuse and is deleted only with the cache, so a hit racing with a
// removal touches live memory, and at worst takes a reference on the entry's
// next incarnation, which the check then catches. Misses, invalidation and
// eviction take one mutex. Eviction is CLOCK (second chance, the usual
// approximation of least-recently-used): a hit sets the entry's referenced
// bit instead of moving it in a list.
//
// Monitors report unmapped ranges through drain(), which the cache calls at
// its next operation: nothing is deregistered inside a monitor's callback.
// Memory the monitor cannot watch is registered per use, never cached.
//
// fork(): in a child the cache is inert (fork_policy.hpp): get() throws, and
// registrations are forgotten without being deregistered.

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <memory>
#include <mutex>
#include <unistd.h>
#include <utility>

#include <boost/intrusive/list.hpp>
#include <boost/intrusive/set.hpp>
#include <fmt/format.h>

#include <rdmax/detail/mem/page_table.hpp>
#include <rdmax/error.hpp>
#include <rdmax/mem/buffer.hpp>
#include <rdmax/mem/fork_policy.hpp>
#include <rdmax/mem/monitor.hpp>
#include <rdmax/mem/rcache_options.hpp>
#include <rdmax/mem/registrar.hpp>
#include <rdmax/mem/rights.hpp>
#include <rdmax/stats/counter_fields.hpp>
#include <rdmax/stats/publisher.hpp>

namespace rdmax {

/// The member bodies are in registration_cache-inl.hpp.
template <registrar Registrar, monitor Monitor = manual_monitor>
class registration_cache {
    struct entry;

public:
    /// A reference to a cached registration that covers what get() asked for
    /// (mem/cache_handle.hpp).
    class handle;
    /// A buffer with the reference that keeps its key valid (mem/cache_held.hpp).
    template <class Buffer>
    struct held;
    /// A per-thread front end that serves repeats without atomics
    /// (mem/cache_session.hpp).
    class session;

    explicit registration_cache(Registrar reg, Monitor mon = {}, rcache_options opt = {})
        : reg_(std::move(reg))
        , mon_(std::move(mon))
        , opt_(opt)
        , page_(static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE)))
        , page_shift_(static_cast<unsigned>(__builtin_ctzl(page_)))
        , pages_(page_shift_) {
        // A monitor that watches nothing (auto_monitor's none) forbids caching.
        if constexpr (requires { mon_.caching(); })
            opt_.enable = opt_.enable && mon_.caching();
        // Limits left to be derived and not derived (make_verbs_cache derives
        // them from the device): none.
        if (opt_.max_count == 0)
            opt_.max_count = SIZE_MAX;
        if (opt_.max_bytes == 0)
            opt_.max_bytes = SIZE_MAX;
        // rdmax-stat reads the counters from the stat thread: counters() is
        // any thread's to call, so a hit gains nothing for it.
        stat_ =
            stats::pulled("rcache", {}, stats::rcache_fields(), [this](std::span<std::uint64_t> v) {
                stats::rcache_values(counters(), v);
            });
    }

    registration_cache(const registration_cache&) = delete;
    registration_cache& operator=(const registration_cache&) = delete;

    /// Every handle must be gone before the cache is.
    ~registration_cache();

    /// A registration containing [addr, addr + len) with at least rights A.
    /// Throws rdmax::error if registering fails (after evicting idle
    /// registrations and trying once more when the cause was a lack of resources).
    template <rights A>
    [[nodiscard]] handle get(const void* addr, std::size_t len);

    /// [addr, addr + len) as a local buffer (an SGE) with the cache's key:
    ///     auto src = cache.local<rights::local_read>(data, n);
    ///     qp.write(src.buffer, peer, 0, wr_id); // keep src until it completes
    /// Throws as get() does, or EINVAL above 4 GiB (one SGE's limit).
    template <rights A>
    [[nodiscard]] held<local_buffer<A>> local(const void* addr, std::size_t len) {
        return hold_local<A>(get<A>(addr, len), addr, len);
    }

    /// [addr, addr + len) as the token a peer uses to address it.
    template <rights A>
    [[nodiscard]] held<remote_buffer<A>> remote(const void* addr, std::size_t len) {
        return hold_remote<A>(get<A>(addr, len), addr, len);
    }

    /// Forgets every registration overlapping [addr, addr + len): idle ones are
    /// deregistered now, ones in use when their last handle goes.
    /// An empty range invalidates nothing; one that wraps around is refused.
    void invalidate(const void* addr, std::size_t len);

    /// Deregisters every idle registration.
    void flush();

    [[nodiscard]] rcache_counters counters() const noexcept;

    [[nodiscard]] const rcache_options& options() const noexcept { return opt_; }
    [[nodiscard]] Registrar& registrar_ref() noexcept { return reg_; }
    [[nodiscard]] Monitor& monitor_ref() noexcept { return mon_; }

    /// Bytes of bookkeeping per cached registration.
    static constexpr std::size_t entry_bytes = sizeof(entry);

private:
    /// A handle and the buffer it covers, for local() and remote(). Defined
    /// in cache_handle.hpp, where handle is complete (clang wants a by-value
    /// parameter's type complete where the function is defined).
    template <rights A>
    static held<local_buffer<A>> hold_local(handle h, const void* addr, std::size_t len);
    template <rights A>
    static held<remote_buffer<A>> hold_remote(handle h, const void* addr, std::size_t len);

    // normal_link, not the default safe_link: a container's destructor then
    // does not walk its elements, which a forked child's must not (~registration_cache).
    using ring_hook = boost::intrusive::list_base_hook<
        boost::intrusive::link_mode<boost::intrusive::normal_link>>;
    using tree_hook =
        boost::intrusive::set_base_hook<boost::intrusive::optimize_size<true>,
                                        boost::intrusive::link_mode<boost::intrusive::normal_link>>;

    // The state word: reference count in bits 0-30, the dead bit (set once
    // the entry left the tree, or never entered it), hits in bits 32-63.
    static constexpr std::uint64_t one_ref = 1;
    static constexpr std::uint64_t dead = std::uint64_t{1} << 31;
    static constexpr unsigned hit_shift = 32;
    static constexpr std::uint64_t one_hit = std::uint64_t{1} << hit_shift;
    static constexpr std::uint64_t low_mask = one_hit - 1;
    /// Hits an entry holds before they move to the cache's counter.
    static constexpr std::uint64_t hits_harvest = std::uint64_t{1} << 31;
    [[nodiscard]] static constexpr std::uint64_t refs(std::uint64_t state) noexcept {
        return state & (dead - 1);
    }

    struct entry : tree_hook, ring_hook {
        std::uintptr_t start = 0;
        std::uintptr_t end = 0;
        typename Registrar::handle reg{};
        [[no_unique_address]] typename Monitor::token watch{};
        mr_keys keys;
        rights granted = rights::local_read;
        std::atomic<std::uint64_t> state{dead};
        std::atomic<bool> referenced{false};
    };
    static_assert(sizeof(entry) <= 192, "at most 192 bytes of metadata per registration");

    struct by_start {
        bool operator()(const entry& a, const entry& b) const noexcept { return a.start < b.start; }
        bool operator()(std::uintptr_t a, const entry& b) const noexcept { return a < b.start; }
        bool operator()(const entry& a, std::uintptr_t b) const noexcept { return a.start < b; }
    };
    using tree_t = boost::intrusive::set<entry, boost::intrusive::base_hook<tree_hook>,
                                         boost::intrusive::compare<by_start>>;
    using ring_t = boost::intrusive::list<entry, boost::intrusive::base_hook<ring_hook>>;

    [[nodiscard]] bool usable(const entry& e, rights want) const noexcept {
        return has(e.granted, want) && mon_.valid(e.watch);
    }

    /// The hit path, without a lock: a referenced live entry that covers
    /// [start, end) with rights `want`, or nullptr.
    [[nodiscard]] entry* try_hit(std::uintptr_t start, std::uintptr_t end, rights want) noexcept;

    /// Moves an entry's hit count to the cache's counter before it overflows.
    void harvest_hits(entry& e) noexcept;

    /// The entry whose range contains [start, end), if any (the writer's view).
    [[nodiscard]] entry* lookup(std::uintptr_t start, std::uintptr_t end) noexcept;

    /// Marks e recently used for CLOCK, writing only when the bit changes, so
    /// that hits on one entry from many threads do not bounce its cache line
    /// more than the reference count does.
    static void touch(entry& e) noexcept {
        if (!e.referenced.load(std::memory_order_relaxed))
            e.referenced.store(true, std::memory_order_relaxed);
    }

    [[nodiscard]] entry* find_containing(std::uintptr_t start, std::uintptr_t end) noexcept;

    /// The first entry that overlaps or touches [start, end).
    [[nodiscard]] typename tree_t::iterator first_touching(std::uintptr_t start) noexcept;

    /// The slow path, under mutex_: registers [start, end) with rights `want`,
    /// merged with every cached registration it overlaps or touches.
    handle miss(std::uintptr_t start, std::uintptr_t end, rights want);

    /// What a miss of [start, end) covers once merged with the cached
    /// registrations it overlaps or touches (stale ones are dropped on the way).
    struct merged_span {
        std::uintptr_t lo, hi;
        rights granted;
        std::size_t merged = 0;
    };
    merged_span merge_span(std::uintptr_t start, std::uintptr_t end, rights want) noexcept;
    /// Registers the span; nullptr when the union cannot be registered (the
    /// request is then served alone, uncached). Under mutex_.
    entry* register_span(const merged_span& m, std::uintptr_t start, std::uintptr_t end,
                         rights want);
    /// Puts a fresh, watched entry in the page table, tree and ring in place
    /// of what it merged, and enforces the limits. Under mutex_.
    void publish_locked(entry* fresh, const merged_span& m);

    /// Gives up an entry whose page-table insertion failed: pages inserted
    /// before the failure may have let a lock-free hit take a reference. It
    /// is marked dead (no hit takes one after that), then the miss's own
    /// reference goes as release() lets one go: whichever release takes the
    /// count to zero, as seen in its own previous value, destroys it. (Judging
    /// by the count seen when marking it dead lost the entry when the hit's
    /// release came between the two: issue 23, item 3.) Under mutex_.
    void abandon_locked(entry* e) noexcept;

    /// A registration for this request only, outside the tree; its handle's
    /// release deregisters it.
    handle uncached(std::uintptr_t start, std::uintptr_t end, rights want);

    /// Registers [start, end) and watches it; on a lack of resources, evicts
    /// every idle registration and tries once more.
    entry* make_entry(std::uintptr_t start, std::uintptr_t end, rights granted);

    typename Registrar::handle register_range(std::uintptr_t start, std::uintptr_t end,
                                              rights granted);

    void enforce_limits();

    /// CLOCK: sweeps the ring from its hand (the front), giving referenced
    /// entries a second chance; evicts up to `most` idle entries. Returns how
    /// many it evicted.
    std::size_t evict_idle(std::size_t most);

    /// A miss for [start, end) that one of the last evictions took away is
    /// thrashing: the limits are below the working set, and the cache registers
    /// where it should hit. Counted, and said once per cache. Under mutex_.
    void note_if_thrashing(std::uintptr_t start, std::uintptr_t end);

    void invalidate_locked(std::uintptr_t start, std::uintptr_t end);

    /// Takes e out of the tree and the ring; deregisters it now if idle,
    /// else its last handle will.
    void remove_locked(entry& e) noexcept;

    void destroy(entry* e) noexcept;

    /// Entries are type-stable (see Threads above): taken from the free
    /// list, and given back to it; the state stays dead while there.
    entry* take_entry();
    void put_entry(entry* e) noexcept;
    struct recycler {
        registration_cache* cache;
        void operator()(entry* e) const noexcept { cache->put_entry(e); }
    };

    void release(entry* e) noexcept;

    /// Whether this is a forked child of the process that built the cache
    /// (fork_policy.hpp): checked before the mutex is, every time.
    [[nodiscard]] bool forked() const noexcept { return fork_generation() != fork_generation_; }

    static void on_invalidated(void* self, std::uintptr_t start, std::uintptr_t end) {
        static_cast<registration_cache*>(self)->invalidate_locked(start, end);
    }

    void drain_monitor();

    Registrar reg_;
    Monitor mon_;
    rcache_options opt_;
    std::uintptr_t page_;
    unsigned page_shift_;
    std::uint32_t fork_generation_ = fork_generation();
    mutable std::mutex mutex_; ///< writers only: hits take no lock
    page_table<entry> pages_;
    tree_t tree_;
    ring_t ring_;
    ring_t free_; ///< recycled entries (the ring hook is free while there)
    std::atomic<std::uint64_t> hits_{0}, misses_{0}, merges_{0}, evictions_{0}, invalidations_{0},
        registrations_{0}, uncached_{0}, count_{0}, bytes_{0};
    std::atomic<std::uint64_t> removals_{0}; ///< sessions drop what left since they last looked
    std::atomic<std::uint64_t> thrash_{0};
    /// The ranges of the last evictions ({0, 0}: none yet), for thrash_. Under mutex_.
    std::array<std::pair<std::uintptr_t, std::uintptr_t>, 64> recently_evicted_{};
    std::size_t evicted_next_ = 0;
    stats::pulled stat_; ///< dropped first thing in the destructor
};

} // namespace rdmax

// The nested types, defined in their own headers (each includes this one
// first, so any of them may be included alone), then the member bodies.
#include <rdmax/mem/cache_handle.hpp>
#include <rdmax/mem/cache_held.hpp>
#include <rdmax/mem/cache_session.hpp>
#include <rdmax/mem/registration_cache-inl.hpp>
