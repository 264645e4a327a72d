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
// Disjointness also lets a radix page table (page_table.hpp) map each page to
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

namespace rdmax {

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
    }

    registration_cache(const registration_cache&) = delete;
    registration_cache& operator=(const registration_cache&) = delete;

    /// Every handle must be gone before the cache is.
    ~registration_cache() {
        // In a forked child the mutex may have been held by a parent thread
        // at fork (inside ibv_reg_mr in a miss, say), and stays locked there
        // for good: never wait for it.
        // Nor walk what it guards then: that thread may have been half-way
        // through changing the tree, the ring or the page table. The child
        // leaks them all (the hooks are normal_link, so the containers' own
        // ends touch no entry either).
        std::unique_lock lock(mutex_, std::defer_lock);
        if (!forked())
            lock.lock();
        else if (!lock.try_lock()) {
            pages_.abandon();
            return;
        }
        while (!ring_.empty())
            remove_locked(ring_.front());
        while (!free_.empty()) {
            entry& e = free_.front();
            free_.pop_front();
            delete &e;
        }
    }

    /// A registration containing [addr, addr + len) with at least rights A.
    /// Throws rdmax::error if registering fails (after evicting idle
    /// registrations and trying once more when the cause was a lack of resources).
    template <rights A>
    [[nodiscard]] handle get(const void* addr, std::size_t len) {
        const auto a = reinterpret_cast<std::uintptr_t>(addr);
        if (len == 0 || a + len < a)
            throw_error("registration_cache::get", EINVAL,
                        len == 0 ? "zero length" : "the range wraps around");
        const std::uintptr_t start = a & ~(page_ - 1);
        const std::uintptr_t end = (a + len + page_ - 1) & ~(page_ - 1);
        if (forked()) [[unlikely]]
            throw_error("registration_cache::get", EPERM,
                        "this cache belongs to the parent process (fork): its registrations live "
                        "in the parent's device context; open a context and a cache in the child");
        if (mon_.pending())
            drain_monitor();
        if (opt_.enable) [[likely]] {
            if (pages_.covers(start, end)) [[likely]] {
                if (entry* e = try_hit(start, end, A))
                    return handle(this, e);
            } else { // beyond the page table's reach: the tree, under the lock
                std::unique_lock lock(mutex_);
                if (entry* e = find_containing(start, end); e != nullptr && usable(*e, A)) {
                    e->state.fetch_add(one_ref | one_hit, std::memory_order_relaxed);
                    touch(*e);
                    return handle(this, e);
                }
            }
        }
        // Verbs refuse remote write or atomic without local write: grant it.
        constexpr rights registered_rights = valid(A) ? A : A | rights::local_write;
        return miss(start, end, registered_rights);
    }

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
    void invalidate(const void* addr, std::size_t len) {
        const auto a = reinterpret_cast<std::uintptr_t>(addr);
        if (a + len < a)
            throw_error("registration_cache::invalidate", EINVAL, "the range wraps around");
        if (len == 0 || forked())
            return; // a child's cache is inert: the registrations are the parent's
        std::unique_lock lock(mutex_);
        invalidate_locked(a & ~(page_ - 1), a + len);
    }

    /// Deregisters every idle registration.
    void flush() {
        if (forked())
            return; // a child's cache is inert, and its mutex may never come free
        std::unique_lock lock(mutex_);
        mon_.drain(&on_invalidated, this);
        for (auto it = ring_.begin(); it != ring_.end();) {
            entry& e = *it++;
            if (refs(e.state.load(std::memory_order_relaxed)) == 0)
                remove_locked(e);
        }
    }

    [[nodiscard]] rcache_counters counters() const noexcept {
        rcache_counters c;
        {
            // Hits live in the entries until they leave; sum them up (not in
            // a forked child whose mutex a parent thread held at fork).
            std::unique_lock lock(mutex_, std::defer_lock);
            if (!forked())
                lock.lock();
            c.hits = hits_.load(std::memory_order_relaxed);
            if (lock.owns_lock() || lock.try_lock())
                for (const entry& e : ring_)
                    c.hits += e.state.load(std::memory_order_relaxed) >> hit_shift;
        }
        c.misses = misses_.load(std::memory_order_relaxed);
        c.lookups = c.hits + c.misses; // one atomic less on the hit path
        c.merges = merges_.load(std::memory_order_relaxed);
        c.evictions = evictions_.load(std::memory_order_relaxed);
        c.thrash = thrash_.load(std::memory_order_relaxed);
        c.invalidations = invalidations_.load(std::memory_order_relaxed);
        c.registrations = registrations_.load(std::memory_order_relaxed);
        c.uncached = uncached_.load(std::memory_order_relaxed);
        c.registered_count = count_.load(std::memory_order_relaxed);
        c.registered_bytes = bytes_.load(std::memory_order_relaxed);
        return c;
    }

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
    [[nodiscard]] entry* try_hit(std::uintptr_t start, std::uintptr_t end, rights want) noexcept {
        entry* e = pages_.find(start);
        if (e == nullptr)
            return nullptr;
        std::uint64_t s = e->state.load(std::memory_order_acquire);
        do {
            if ((s & dead) != 0)
                return nullptr; // leaving, or on the free list
        } while (!e->state.compare_exchange_weak(
            s, s + one_ref + one_hit, std::memory_order_acquire, std::memory_order_acquire));
        // Held and live: its fields cannot change now. Is it still the one
        // the page table pointed at when we looked?
        if (e->start <= start && e->end >= end && usable(*e, want)) [[likely]] {
            touch(*e);
            if (((s >> hit_shift) + 1) >= hits_harvest) [[unlikely]]
                harvest_hits(*e);
            return e;
        }
        e->state.fetch_sub(one_hit, std::memory_order_relaxed); // not a hit after all
        release(e);
        return nullptr;
    }

    /// Moves an entry's hit count to the cache's counter before it overflows.
    void harvest_hits(entry& e) noexcept {
        const std::uint64_t h = e.state.load(std::memory_order_relaxed) >> hit_shift;
        e.state.fetch_sub(h << hit_shift, std::memory_order_relaxed);
        hits_.fetch_add(h, std::memory_order_relaxed);
    }

    /// The entry whose range contains [start, end), if any (the writer's view).
    [[nodiscard]] entry* lookup(std::uintptr_t start, std::uintptr_t end) noexcept {
        if (!pages_.covers(start, end))
            return find_containing(start, end);
        entry* e = pages_.find(start);
        return e != nullptr && e->end >= end ? e : nullptr;
    }

    /// Marks e recently used for CLOCK, writing only when the bit changes, so
    /// that hits on one entry from many threads do not bounce its cache line
    /// more than the reference count does.
    static void touch(entry& e) noexcept {
        if (!e.referenced.load(std::memory_order_relaxed))
            e.referenced.store(true, std::memory_order_relaxed);
    }

    [[nodiscard]] entry* find_containing(std::uintptr_t start, std::uintptr_t end) noexcept {
        auto it = tree_.upper_bound(start, by_start{});
        if (it == tree_.begin())
            return nullptr;
        --it;
        return it->end >= end ? &*it : nullptr;
    }

    /// The first entry that overlaps or touches [start, end).
    [[nodiscard]] typename tree_t::iterator first_touching(std::uintptr_t start) noexcept {
        auto it = tree_.upper_bound(start, by_start{});
        if (it != tree_.begin()) {
            auto prev = std::prev(it);
            if (prev->end >= start)
                return prev;
        }
        return it;
    }

    handle miss(std::uintptr_t start, std::uintptr_t end, rights want) {
        std::unique_lock lock(mutex_);
        misses_.fetch_add(1, std::memory_order_relaxed);
        if (mon_.pending())
            mon_.drain(&on_invalidated, this);
        if (!opt_.enable)
            return uncached(start, end, want);
        // Another thread may have registered it while we waited for the lock.
        if (entry* e = lookup(start, end); e != nullptr && usable(*e, want)) {
            e->state.fetch_add(one_ref, std::memory_order_relaxed);
            touch(*e);
            return handle(this, e);
        }
        note_if_thrashing(start, end);
        // Merge with everything it overlaps or touches, widening the rights.
        std::uintptr_t lo = start, hi = end;
        rights widened = want;
        std::size_t merged = 0;
        for (auto it = first_touching(start); it != tree_.end() && it->start <= end;) {
            entry& e = *it++;
            if (!mon_.valid(e.watch)) {
                remove_locked(e); // stale: never merged into anything
                invalidations_.fetch_add(1, std::memory_order_relaxed);
                continue;
            }
            lo = std::min(lo, e.start);
            hi = std::max(hi, e.end);
            widened = widened | e.granted;
            ++merged;
        }
        entry* fresh = nullptr;
        if (merged == 0) {
            fresh = make_entry(start, end, want);
        } else {
            try {
                fresh = make_entry(lo, hi, widened);
            } catch (const rdmax::error& err) {
                // The union may not be registrable (read-only pages under a
                // request for write, say): serve this request alone, uncached,
                // so that the cached ones stay disjoint.
                if (err.code().value() != EFAULT && err.code().value() != EACCES &&
                    err.code().value() != EINVAL)
                    throw;
                return uncached(start, end, want);
            }
        }
        if (!mon_.valid(fresh->watch)) {
            // Memory the monitor cannot watch (for userfaultfd, a file
            // mapping): caching it could serve it stale after an unmap.
            if (merged != 0) {
                destroy(fresh);
                return uncached(start, end, want);
            }
            fresh->state.store(dead | one_ref, std::memory_order_relaxed);
            uncached_.fetch_add(1, std::memory_order_relaxed);
            return handle(this, fresh);
        }
        if (merged != 0) {
            for (auto it = first_touching(lo); it != tree_.end() && it->start <= hi;) {
                entry& e = *it++;
                if (e.start >= lo && e.end <= hi)
                    remove_locked(e);
            }
            merges_.fetch_add(merged, std::memory_order_relaxed);
        }
        fresh->state.store(one_ref, std::memory_order_release);
        if (pages_.covers(fresh->start, fresh->end)) {
            try {
                pages_.insert(fresh->start, fresh->end, fresh);
            } catch (...) {
                abandon_locked(fresh);
                throw;
            }
        }
        // Live (above): a racing hit that finds it in the page table may
        // take a reference as soon as it is there.
        tree_.insert(*fresh);
        ring_.push_back(*fresh);
        count_.fetch_add(1, std::memory_order_relaxed);
        bytes_.fetch_add(fresh->end - fresh->start, std::memory_order_relaxed);
        enforce_limits();
        return handle(this, fresh);
    }

    /// Gives up an entry whose page-table insertion failed: pages inserted
    /// before the failure may have let a lock-free hit take a reference. It
    /// is marked dead (no hit takes one after that), then the miss's own
    /// reference goes as release() lets one go: whichever release takes the
    /// count to zero, as seen in its own previous value, destroys it. (Judging
    /// by the count seen when marking it dead lost the entry when the hit's
    /// release came between the two: issue 23, item 3.) Under mutex_.
    void abandon_locked(entry* e) noexcept {
        e->state.fetch_or(dead, std::memory_order_acq_rel);
        // Test seam: a registrar may watch this moment (a unit test races a
        // holder's release here); compiled away for every other registrar.
        if constexpr (requires { reg_.test_abandoned_marked_dead(); })
            reg_.test_abandoned_marked_dead();
        const std::uint64_t prev = e->state.fetch_sub(one_ref, std::memory_order_acq_rel);
        if ((prev & low_mask) == (dead | one_ref))
            destroy(e); // the holder's release, if any, saw it still referenced
    }

    /// A registration for this request only, outside the tree; its handle's
    /// release deregisters it.
    handle uncached(std::uintptr_t start, std::uintptr_t end, rights want) {
        entry* e = make_entry(start, end, want);
        e->state.store(dead | one_ref, std::memory_order_relaxed);
        uncached_.fetch_add(1, std::memory_order_relaxed);
        return handle(this, e);
    }

    /// Registers [start, end) and watches it; on a lack of resources, evicts
    /// every idle registration and tries once more.
    entry* make_entry(std::uintptr_t start, std::uintptr_t end, rights granted) {
        std::unique_ptr<entry, recycler> e(take_entry(), recycler{this});
        e->start = start;
        e->end = end;
        e->granted = granted;
        // Watch first, so that an unmap racing with the registration is seen.
        e->watch = mon_.watch(start, end - start);
        try {
            e->reg = register_range(start, end, granted);
        } catch (...) {
            mon_.unwatch(e->watch);
            throw;
        }
        e->keys = Registrar::keys(e->reg);
        registrations_.fetch_add(1, std::memory_order_relaxed);
        return e.release();
    }

    typename Registrar::handle register_range(std::uintptr_t start, std::uintptr_t end,
                                              rights granted) {
        void* addr = reinterpret_cast<void*>(start);
        try {
            return reg_.reg(addr, end - start, granted);
        } catch (const rdmax::error& err) {
            const int code = err.code().value();
            if (code != ENOMEM && code != EAGAIN && code != EPERM)
                throw;
            evict_idle(SIZE_MAX); // pinned memory or MR slots ran out: make room
            return reg_.reg(addr, end - start, granted);
        }
    }

    void enforce_limits() {
        const auto over = [this] {
            return count_.load(std::memory_order_relaxed) > opt_.max_count ||
                   bytes_.load(std::memory_order_relaxed) > opt_.max_bytes;
        };
        while (over() && evict_idle(1) != 0) {
        }
    }

    /// CLOCK: sweeps the ring from its hand (the front), giving referenced
    /// entries a second chance; evicts up to `most` idle entries. Returns how
    /// many it evicted.
    std::size_t evict_idle(std::size_t most) {
        std::size_t evicted = 0;
        // Two sweeps: the first may only clear referenced bits.
        for (std::size_t steps = 2 * ring_.size(); steps > 0 && evicted < most && !ring_.empty();
             --steps) {
            entry& e = ring_.front();
            if (refs(e.state.load(std::memory_order_acquire)) == 0 &&
                !e.referenced.exchange(false, std::memory_order_relaxed)) {
                recently_evicted_[evicted_next_++ % recently_evicted_.size()] = {e.start, e.end};
                remove_locked(e);
                evictions_.fetch_add(1, std::memory_order_relaxed);
                ++evicted;
                continue;
            }
            ring_.splice(ring_.end(), ring_, ring_.begin()); // advance the hand
        }
        return evicted;
    }

    /// A miss for [start, end) that one of the last evictions took away is
    /// thrashing: the limits are below the working set, and the cache registers
    /// where it should hit. Counted, and said once per cache. Under mutex_.
    void note_if_thrashing(std::uintptr_t start, std::uintptr_t end) {
        const auto evicted_here = [&](const std::pair<std::uintptr_t, std::uintptr_t>& r) {
            return r.first < end && start < r.second;
        };
        if (std::none_of(recently_evicted_.begin(), recently_evicted_.end(), evicted_here))
            return;
        if (thrash_.fetch_add(1, std::memory_order_relaxed) == 0)
            fmt::print(stderr,
                       "rdmax: the registration cache is thrashing: a range evicted moments "
                       "ago is registered again ({} registrations, {} bytes cached; limits "
                       "max_count {}, max_bytes {}): raise RDMAX_RCACHE_MAX_COUNT or "
                       "RDMAX_RCACHE_MAX_BYTES\n",
                       count_.load(std::memory_order_relaxed),
                       bytes_.load(std::memory_order_relaxed), opt_.max_count, opt_.max_bytes);
    }

    void invalidate_locked(std::uintptr_t start, std::uintptr_t end) {
        for (auto it = first_touching(start); it != tree_.end() && it->start < end;) {
            entry& e = *it++;
            if (e.end <= start)
                continue; // touches but does not overlap
            remove_locked(e);
            invalidations_.fetch_add(1, std::memory_order_relaxed);
        }
    }

    /// Takes e out of the tree and the ring; deregisters it now if idle,
    /// else its last handle will.
    void remove_locked(entry& e) noexcept {
        removals_.fetch_add(1, std::memory_order_relaxed);
        if (pages_.covers(e.start, e.end))
            pages_.erase(e.start, e.end);
        tree_.erase(tree_.iterator_to(e));
        ring_.erase(ring_.iterator_to(e));
        count_.fetch_sub(1, std::memory_order_relaxed);
        bytes_.fetch_sub(e.end - e.start, std::memory_order_relaxed);
        const std::uint64_t prev = e.state.fetch_or(dead, std::memory_order_acq_rel);
        if ((prev >> hit_shift) != 0) {
            e.state.fetch_sub(prev & ~low_mask, std::memory_order_relaxed);
            hits_.fetch_add(prev >> hit_shift, std::memory_order_relaxed);
        }
        if (refs(prev) == 0)
            destroy(&e);
    }

    void destroy(entry* e) noexcept {
        // In a forked child the registration is the parent's: deregistering
        // it through the shared verbs file would destroy it there.
        if (!forked()) [[likely]] {
            reg_.dereg(e->reg);
            mon_.unwatch(e->watch);
        }
        put_entry(e);
    }

    /// Entries are type-stable (see Threads above): taken from the free
    /// list, and given back to it; the state stays dead while there.
    entry* take_entry() {
        if (free_.empty())
            return new entry;
        entry& e = free_.front();
        free_.pop_front();
        return &e;
    }
    void put_entry(entry* e) noexcept {
        e->state.store(dead, std::memory_order_relaxed);
        e->referenced.store(false, std::memory_order_relaxed);
        free_.push_front(*e);
    }
    struct recycler {
        registration_cache* cache;
        void operator()(entry* e) const noexcept { cache->put_entry(e); }
    };

    void release(entry* e) noexcept {
        const std::uint64_t prev = e->state.fetch_sub(one_ref, std::memory_order_acq_rel);
        if ((prev & low_mask) == (dead | one_ref)) {
            // The last reference to an entry that left the tree. The
            // registrar is used under the lock only. In a forked child
            // nothing is deregistered, and the mutex may be held for good by
            // a parent thread that is not there: then the entry is left.
            std::unique_lock lock(mutex_, std::defer_lock);
            if (!forked())
                lock.lock();
            if (lock.owns_lock() || lock.try_lock())
                destroy(e);
        }
    }

    /// Whether this is a forked child of the process that built the cache
    /// (fork_policy.hpp): checked before the mutex is, every time.
    [[nodiscard]] bool forked() const noexcept { return fork_generation() != fork_generation_; }

    static void on_invalidated(void* self, std::uintptr_t start, std::uintptr_t end) {
        static_cast<registration_cache*>(self)->invalidate_locked(start, end);
    }

    void drain_monitor() {
        if (forked())
            return; // get() throws next; the monitor's news are the parent's
        std::unique_lock lock(mutex_);
        mon_.drain(&on_invalidated, this);
    }

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
};

} // namespace rdmax

// The nested types, defined in their own headers (each includes this one
// first, so any of the four may be included alone).
#include <rdmax/mem/cache_handle.hpp>
#include <rdmax/mem/cache_held.hpp>
#include <rdmax/mem/cache_session.hpp>
