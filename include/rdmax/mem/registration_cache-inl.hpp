#pragma once
// The bodies of registration_cache's members (registration_cache.hpp holds
// the class, its invariants and its API; this file, how it keeps them).
// Included at the end of registration_cache.hpp; including it alone includes
// that first.

#include <rdmax/mem/registration_cache.hpp>

namespace rdmax {

template <registrar Registrar, monitor Monitor>
inline registration_cache<Registrar, Monitor>::~registration_cache() {
    stat_ = {}; // the stat thread reads counters() no more
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

template <registrar Registrar, monitor Monitor>
template <rights A>
inline auto registration_cache<Registrar, Monitor>::get(const void* addr, std::size_t len)
    -> handle {
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

template <registrar Registrar, monitor Monitor>
inline void registration_cache<Registrar, Monitor>::invalidate(const void* addr, std::size_t len) {
    const auto a = reinterpret_cast<std::uintptr_t>(addr);
    if (a + len < a)
        throw_error("registration_cache::invalidate", EINVAL, "the range wraps around");
    if (len == 0 || forked())
        return; // a child's cache is inert: the registrations are the parent's
    std::unique_lock lock(mutex_);
    invalidate_locked(a & ~(page_ - 1), a + len);
}

template <registrar Registrar, monitor Monitor>
inline void registration_cache<Registrar, Monitor>::flush() {
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

template <registrar Registrar, monitor Monitor>
inline rcache_counters registration_cache<Registrar, Monitor>::counters() const noexcept {
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

template <registrar Registrar, monitor Monitor>
inline auto registration_cache<Registrar, Monitor>::try_hit(std::uintptr_t start,
                                                            std::uintptr_t end,
                                                            rights want) noexcept -> entry* {
    entry* e = pages_.find(start);
    if (e == nullptr)
        return nullptr;
    std::uint64_t s = e->state.load(std::memory_order_acquire);
    do {
        if ((s & dead) != 0)
            return nullptr; // leaving, or on the free list
    } while (!e->state.compare_exchange_weak(s, s + one_ref + one_hit, std::memory_order_acquire,
                                             std::memory_order_acquire));
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

template <registrar Registrar, monitor Monitor>
inline void registration_cache<Registrar, Monitor>::harvest_hits(entry& e) noexcept {
    const std::uint64_t h = e.state.load(std::memory_order_relaxed) >> hit_shift;
    e.state.fetch_sub(h << hit_shift, std::memory_order_relaxed);
    hits_.fetch_add(h, std::memory_order_relaxed);
}

template <registrar Registrar, monitor Monitor>
inline auto registration_cache<Registrar, Monitor>::lookup(std::uintptr_t start,
                                                           std::uintptr_t end) noexcept -> entry* {
    if (!pages_.covers(start, end))
        return find_containing(start, end);
    entry* e = pages_.find(start);
    return e != nullptr && e->end >= end ? e : nullptr;
}

template <registrar Registrar, monitor Monitor>
inline auto registration_cache<Registrar, Monitor>::find_containing(std::uintptr_t start,
                                                                    std::uintptr_t end) noexcept
    -> entry* {
    auto it = tree_.upper_bound(start, by_start{});
    if (it == tree_.begin())
        return nullptr;
    --it;
    return it->end >= end ? &*it : nullptr;
}

template <registrar Registrar, monitor Monitor>
inline auto registration_cache<Registrar, Monitor>::first_touching(std::uintptr_t start) noexcept ->
    typename tree_t::iterator {
    auto it = tree_.upper_bound(start, by_start{});
    if (it != tree_.begin()) {
        auto prev = std::prev(it);
        if (prev->end >= start)
            return prev;
    }
    return it;
}

template <registrar Registrar, monitor Monitor>
inline auto registration_cache<Registrar, Monitor>::miss(std::uintptr_t start, std::uintptr_t end,
                                                         rights want) -> handle {
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
    const merged_span m = merge_span(start, end, want);
    entry* fresh = register_span(m, start, end, want);
    if (fresh == nullptr)
        return uncached(start, end, want);
    if (!mon_.valid(fresh->watch)) {
        // Memory the monitor cannot watch (for userfaultfd, a file
        // mapping): caching it could serve it stale after an unmap.
        if (m.merged != 0) {
            destroy(fresh);
            return uncached(start, end, want);
        }
        fresh->state.store(dead | one_ref, std::memory_order_relaxed);
        uncached_.fetch_add(1, std::memory_order_relaxed);
        return handle(this, fresh);
    }
    publish_locked(fresh, m);
    return handle(this, fresh);
}

template <registrar Registrar, monitor Monitor>
inline auto registration_cache<Registrar, Monitor>::merge_span(std::uintptr_t start,
                                                               std::uintptr_t end,
                                                               rights want) noexcept
    -> merged_span {
    // Merge with everything it overlaps or touches, widening the rights.
    merged_span m{start, end, want};
    for (auto it = first_touching(start); it != tree_.end() && it->start <= end;) {
        entry& e = *it++;
        if (!mon_.valid(e.watch)) {
            remove_locked(e); // stale: never merged into anything
            invalidations_.fetch_add(1, std::memory_order_relaxed);
            continue;
        }
        m.lo = std::min(m.lo, e.start);
        m.hi = std::max(m.hi, e.end);
        m.granted = m.granted | e.granted;
        ++m.merged;
    }
    return m;
}

template <registrar Registrar, monitor Monitor>
inline auto registration_cache<Registrar, Monitor>::register_span(const merged_span& m,
                                                                  std::uintptr_t start,
                                                                  std::uintptr_t end, rights want)
    -> entry* {
    if (m.merged == 0)
        return make_entry(start, end, want);
    try {
        return make_entry(m.lo, m.hi, m.granted);
    } catch (const rdmax::error& err) {
        // The union may not be registrable (read-only pages under a
        // request for write, say): serve this request alone, uncached,
        // so that the cached ones stay disjoint.
        if (err.code().value() != EFAULT && err.code().value() != EACCES &&
            err.code().value() != EINVAL)
            throw;
        return nullptr;
    }
}

template <registrar Registrar, monitor Monitor>
inline void registration_cache<Registrar, Monitor>::publish_locked(entry* fresh,
                                                                   const merged_span& m) {
    if (m.merged != 0) {
        for (auto it = first_touching(m.lo); it != tree_.end() && it->start <= m.hi;) {
            entry& e = *it++;
            if (e.start >= m.lo && e.end <= m.hi)
                remove_locked(e);
        }
        merges_.fetch_add(m.merged, std::memory_order_relaxed);
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
}

template <registrar Registrar, monitor Monitor>
inline void registration_cache<Registrar, Monitor>::abandon_locked(entry* e) noexcept {
    e->state.fetch_or(dead, std::memory_order_acq_rel);
    // Test seam: a registrar may watch this moment (a unit test races a
    // holder's release here); compiled away for every other registrar.
    if constexpr (requires { reg_.test_abandoned_marked_dead(); })
        reg_.test_abandoned_marked_dead();
    const std::uint64_t prev = e->state.fetch_sub(one_ref, std::memory_order_acq_rel);
    if ((prev & low_mask) == (dead | one_ref))
        destroy(e); // the holder's release, if any, saw it still referenced
}

template <registrar Registrar, monitor Monitor>
inline auto registration_cache<Registrar, Monitor>::uncached(std::uintptr_t start,
                                                             std::uintptr_t end, rights want)
    -> handle {
    entry* e = make_entry(start, end, want);
    e->state.store(dead | one_ref, std::memory_order_relaxed);
    uncached_.fetch_add(1, std::memory_order_relaxed);
    return handle(this, e);
}

template <registrar Registrar, monitor Monitor>
inline auto registration_cache<Registrar, Monitor>::make_entry(std::uintptr_t start,
                                                               std::uintptr_t end, rights granted)
    -> entry* {
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

template <registrar Registrar, monitor Monitor>
inline auto registration_cache<Registrar, Monitor>::register_range(std::uintptr_t start,
                                                                   std::uintptr_t end,
                                                                   rights granted) ->
    typename Registrar::handle {
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

template <registrar Registrar, monitor Monitor>
inline void registration_cache<Registrar, Monitor>::enforce_limits() {
    const auto over = [this] {
        return count_.load(std::memory_order_relaxed) > opt_.max_count ||
               bytes_.load(std::memory_order_relaxed) > opt_.max_bytes;
    };
    while (over() && evict_idle(1) != 0) {
    }
}

template <registrar Registrar, monitor Monitor>
inline std::size_t registration_cache<Registrar, Monitor>::evict_idle(std::size_t most) {
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

template <registrar Registrar, monitor Monitor>
inline void registration_cache<Registrar, Monitor>::note_if_thrashing(std::uintptr_t start,
                                                                      std::uintptr_t end) {
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
                   count_.load(std::memory_order_relaxed), bytes_.load(std::memory_order_relaxed),
                   opt_.max_count, opt_.max_bytes);
}

template <registrar Registrar, monitor Monitor>
inline void registration_cache<Registrar, Monitor>::invalidate_locked(std::uintptr_t start,
                                                                      std::uintptr_t end) {
    for (auto it = first_touching(start); it != tree_.end() && it->start < end;) {
        entry& e = *it++;
        if (e.end <= start)
            continue; // touches but does not overlap
        remove_locked(e);
        invalidations_.fetch_add(1, std::memory_order_relaxed);
    }
}

template <registrar Registrar, monitor Monitor>
inline void registration_cache<Registrar, Monitor>::remove_locked(entry& e) noexcept {
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

template <registrar Registrar, monitor Monitor>
inline void registration_cache<Registrar, Monitor>::destroy(entry* e) noexcept {
    // In a forked child the registration is the parent's: deregistering
    // it through the shared verbs file would destroy it there.
    if (!forked()) [[likely]] {
        reg_.dereg(e->reg);
        mon_.unwatch(e->watch);
    }
    put_entry(e);
}

template <registrar Registrar, monitor Monitor>
inline auto registration_cache<Registrar, Monitor>::take_entry() -> entry* {
    if (free_.empty())
        return new entry;
    entry& e = free_.front();
    free_.pop_front();
    return &e;
}

template <registrar Registrar, monitor Monitor>
inline void registration_cache<Registrar, Monitor>::put_entry(entry* e) noexcept {
    e->state.store(dead, std::memory_order_relaxed);
    e->referenced.store(false, std::memory_order_relaxed);
    free_.push_front(*e);
}

template <registrar Registrar, monitor Monitor>
inline void registration_cache<Registrar, Monitor>::release(entry* e) noexcept {
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

template <registrar Registrar, monitor Monitor>
inline void registration_cache<Registrar, Monitor>::drain_monitor() {
    if (forked())
        return; // get() throws next; the monitor's news are the parent's
    std::unique_lock lock(mutex_);
    mon_.drain(&on_invalidated, this);
}

} // namespace rdmax
