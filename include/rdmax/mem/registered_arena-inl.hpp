#pragma once
// The bodies of basic_registered_arena's members (registered_arena.hpp holds
// the class, what it promises and its API; this file, how it keeps that).
// Included at the end of registered_arena.hpp; including it alone includes
// that first.

#include <rdmax/mem/registered_arena.hpp>

namespace rdmax {

template <registrar Registrar>
inline basic_registered_arena<Registrar>::~basic_registered_arena() {
    stat_ = {};        // the stat thread reads counters() no more
    pressure_.reset(); // no pressure call from here on
    {
        std::lock_guard g(trim_mutex_);
        stopping_ = true;
    }
    trim_cv_.notify_one();
    trimmer_.join();
    for (auto& a : areas_)
        if (a)
            release(*a);
}

template <registrar Registrar>
inline auto basic_registered_arena<Registrar>::allocate(std::size_t bytes, std::size_t alignment)
    -> block {
    if (bytes == 0 || alignment == 0 || (alignment & (alignment - 1)) != 0 ||
        alignment > span_bytes || bytes > (std::size_t{1} << 46))
        throw std::bad_alloc();
    const std::size_t need = bytes < alignment ? alignment : bytes;
    for (;;) {
        {
            std::lock_guard g(lock_);
            if (const found f = try_allocate_locked(need); f.at != nullptr) {
                ++allocations_;
                return {f.at, bytes, f.in->keys.lkey, f.in->keys.rkey};
            }
        }
        add_area(need); // no room: a new area, registered outside the lock
    }
}

template <registrar Registrar>
inline void basic_registered_arena<Registrar>::deallocate(void* p, std::size_t bytes) noexcept {
    if (p == nullptr)
        return;
    bool wake = false;
    {
        std::lock_guard g(lock_);
        free_locked(static_cast<std::byte*>(p), bytes);
        ++frees_;
        wake = idle_bytes_ > opt_.high_watermark;
    }
    if (wake && !trim_requested_.exchange(true, std::memory_order_relaxed)) {
        // Rare: crossing the watermark. The trimmer reads the flag under
        // trim_mutex_; passing through it puts this notify after that
        // read, or after the trimmer began to wait. Without it, a notify
        // between the two is lost, and with the flag left set no later
        // free notifies again: trimming would stop for good.
        { std::lock_guard t(trim_mutex_); }
        trim_cv_.notify_one();
    }
}

template <registrar Registrar>
inline auto basic_registered_arena<Registrar>::counters() const noexcept -> arena_counters {
    arena_counters c;
    {
        // These change under the lock, with the blocks: no atomics on
        // the allocation path.
        std::lock_guard g(lock_);
        c.allocations = allocations_;
        c.frees = frees_;
        c.allocated_bytes = allocated_bytes_;
    }
    c.areas_registered = areas_registered_.load(std::memory_order_relaxed);
    c.areas_released = areas_released_.load(std::memory_order_acquire);
    c.huge_page_areas = huge_areas_.load(std::memory_order_relaxed);
    c.trims = trims_.load(std::memory_order_relaxed);
    c.pressure_events = pressure_events_.load(std::memory_order_relaxed);
    c.registered_bytes = registered_bytes_.load(std::memory_order_relaxed);
    return c;
}

template <registrar Registrar>
template <rights A>
inline auto basic_registered_arena<Registrar>::checked_area(const void* p, std::size_t n,
                                                            const char* what) const -> const area& {
    const area* a = area_of(p);
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    const auto base = a != nullptr ? reinterpret_cast<std::uintptr_t>(a->m.base) : 0;
    if (a == nullptr || n == 0 || n > UINT32_MAX || n > base + a->m.bytes - at)
        throw_error("registered_arena", ERANGE,
                    fmt::format("{}({}, {}) is not inside one area of the arena", what, p, n));
    if (!has(opt_.area_rights, A))
        throw_error("registered_arena", EACCES,
                    fmt::format("{}: the arena's registrations lack the rights asked for", what));
    return *a;
}

template <registrar Registrar>
inline auto basic_registered_arena<Registrar>::take_spans(std::size_t n) noexcept -> span* {
    for (auto& ap : areas_) {
        if (!ap || ap->dedicated || ap->free_spans < n)
            continue;
        area& a = *ap;
        const std::size_t total = a.spans.size();
        for (std::size_t k = 0; k < total; ++k) {
            const std::size_t i = (a.hint + k) % total;
            if (i + n > total)
                continue;
            std::size_t j = 0;
            while (j < n && a.spans[i + j].state == span_free)
                ++j;
            if (j == n) {
                if (a.idle())
                    idle_bytes_ -= a.m.bytes;
                a.free_spans -= n;
                a.hint = (i + n) % total;
                return &a.spans[i];
            }
            k += j; // skip past the used span
        }
    }
    return nullptr;
}

template <registrar Registrar>
inline auto basic_registered_arena<Registrar>::try_allocate_locked(std::size_t need) -> found {
    if (need > opt_.area_bytes / 2)
        return take_dedicated(need);
    if (need > (smallest << (classes - 1))) { // a run of whole spans
        const std::size_t n = (need + span_bytes - 1) / span_bytes;
        if (n < run_cache_.size() && run_cache_[n] != nullptr) { // a run freed lately
            span* s = std::exchange(run_cache_[n], nullptr);
            allocated_bytes_ += n * span_bytes;
            return {span_base(*s), s->owner};
        }
        span* s = take_spans(n);
        if (s == nullptr)
            return {};
        s->state = span_run_head;
        s->run = static_cast<std::uint32_t>(n);
        for (std::size_t j = 1; j < n; ++j)
            s[j].state = span_run_tail;
        allocated_bytes_ += n * span_bytes;
        return {span_base(*s), s->owner};
    }
    const unsigned c = class_of(need);
    const std::size_t size = smallest << c;
    span* s = partial_[c];
    if (s == nullptr) {
        s = take_spans(1);
        if (s == nullptr)
            return {};
        reset(*s);
        s->state = static_cast<std::uint8_t>(c);
        partial_push(c, *s);
    }
    std::byte* p;
    if (s->free != nullptr) {
        p = static_cast<std::byte*>(s->free);
        s->free = *static_cast<void**>(s->free);
    } else {
        p = span_base(*s) + std::size_t{s->bump} * size;
        ++s->bump;
    }
    ++s->used;
    if (s->used == span_bytes / size)
        partial_remove(c, *s);
    allocated_bytes_ += size;
    return {p, s->owner};
}

template <registrar Registrar>
inline auto basic_registered_arena<Registrar>::take_dedicated(std::size_t need) -> found {
    for (auto& ap : areas_) // an idle dedicated area that fits
        if (ap && ap->dedicated && ap->idle() && ap->m.bytes >= need &&
            ap->m.bytes - need < opt_.area_bytes) {
            ap->free_spans = 0;
            idle_bytes_ -= ap->m.bytes;
            allocated_bytes_ += ap->m.bytes;
            return {ap->m.base, ap.get()};
        }
    return {};
}

template <registrar Registrar>
inline void basic_registered_arena<Registrar>::free_locked(std::byte* p,
                                                           std::size_t bytes) noexcept {
    area* a = area_of(p);
    if (a == nullptr)
        return; // not ours: ignore rather than corrupt
    if (a->dedicated) {
        a->free_spans = a->spans.size();
        idle_bytes_ += a->m.bytes;
        allocated_bytes_ -= a->m.bytes;
        return;
    }
    static_cast<void>(bytes);
    const std::size_t index = static_cast<std::size_t>(p - a->m.base) / span_bytes;
    span& s = a->spans[index];
    if (s.state == span_run_head) {
        const std::size_t n = s.run;
        allocated_bytes_ -= n * span_bytes;
        if (n < run_cache_.size() && run_cache_[n] == nullptr) {
            run_cache_[n] = &s; // kept whole for the next run of that length
            return;
        }
        for (std::size_t j = 0; j < n; ++j)
            reset((&s)[j]);
        give_back_spans(*a, n);
        return;
    }
    if (s.state >= classes)
        return; // a tail or a free span: not a block start
    const unsigned c = s.state;
    const std::size_t size = smallest << c;
    *reinterpret_cast<void**>(p) = s.free;
    s.free = p;
    if (!s.in_partial)
        partial_push(c, s);
    --s.used;
    allocated_bytes_ -= size;
    // An empty span goes back to its area, unless it is the class's only
    // one with room: a block allocated and freed over and over would
    // otherwise take and return a span each time. trim() takes it back.
    if (s.used == 0 && !(partial_[c] == &s && s.next_partial == nullptr)) {
        partial_remove(c, s);
        reset(s);
        give_back_spans(*a, 1);
    }
}

template <registrar Registrar>
inline void basic_registered_arena<Registrar>::add_area(std::size_t need) {
    const bool dedicated = need > opt_.area_bytes / 2;
    const std::size_t two_mib = std::size_t{2} << 20;
    const std::size_t bytes =
        dedicated ? (need + two_mib - 1) / two_mib * two_mib : opt_.area_bytes;
    auto fresh = std::make_unique<area>();
    fresh->m = detail::map_area(bytes, opt_.area_bytes, opt_.huge_pages, opt_.shareable);
    try {
        std::lock_guard r(registrar_mutex_);
        fresh->reg = reg_.reg(fresh->m.base, fresh->m.bytes, opt_.area_rights);
    } catch (...) {
        detail::unmap_area(fresh->m);
        throw;
    }
    fresh->keys = Registrar::keys(fresh->reg);
    fresh->dedicated = dedicated;
    fresh->spans.resize(dedicated ? 1 : bytes / span_bytes);
    for (span& sp : fresh->spans)
        sp.owner = fresh.get();
    fresh->free_spans = fresh->spans.size();
    const auto base = reinterpret_cast<std::uintptr_t>(fresh->m.base);
    std::lock_guard g(lock_);
    try {
        areas_by_address_.insert(base, table_end(*fresh), fresh.get());
        areas_.push_back(std::move(fresh));
    } catch (...) {
        areas_by_address_.erase(base, table_end(*fresh));
        {
            std::lock_guard r(registrar_mutex_);
            reg_.dereg(fresh->reg);
        }
        detail::unmap_area(fresh->m);
        throw;
    }
    idle_bytes_ += areas_.back()->m.bytes;
    areas_registered_.fetch_add(1, std::memory_order_relaxed);
    registered_bytes_.fetch_add(areas_.back()->m.bytes, std::memory_order_relaxed);
    if (areas_.back()->m.huge)
        huge_areas_.fetch_add(1, std::memory_order_relaxed);
}

template <registrar Registrar>
inline void basic_registered_arena<Registrar>::release(area& a) noexcept {
    {
        std::lock_guard r(registrar_mutex_);
        if (release_listener_)
            release_listener_(a.m.base, a.m.bytes);
        reg_.dereg(a.reg);
    }
    detail::unmap_area(a.m);
    // Release: whoever sees the count sees the deregistration done.
    areas_released_.fetch_add(1, std::memory_order_release);
    registered_bytes_.fetch_sub(a.m.bytes, std::memory_order_relaxed);
}

template <registrar Registrar>
inline std::size_t basic_registered_arena<Registrar>::trim_down_to(std::size_t keep, bool count) {
    // One trim at a time, so that trim() returns only when the areas it
    // found idle are gone, even those the background thread took first.
    std::lock_guard one(trim_serial_);
    if (count)
        trims_.fetch_add(1, std::memory_order_relaxed);
    std::vector<std::unique_ptr<area>> going;
    {
        std::lock_guard g(lock_);
        // Runs and empty spans kept for reuse go back to their areas first.
        for (span*& r : run_cache_)
            if (r != nullptr) {
                const std::size_t n = r->run;
                for (std::size_t j = 0; j < n; ++j)
                    reset(r[j]);
                give_back_spans(*r->owner, n);
                r = nullptr;
            }
        for (unsigned c = 0; c < classes; ++c)
            for (span* sp = partial_[c]; sp != nullptr;) {
                span* next = sp->next_partial;
                if (sp->used == 0) {
                    partial_remove(c, *sp);
                    reset(*sp);
                    give_back_spans(*sp->owner, 1);
                }
                sp = next;
            }
        for (auto& ap : areas_) {
            if (idle_bytes_ <= keep)
                break;
            if (ap && ap->idle()) {
                const auto base = reinterpret_cast<std::uintptr_t>(ap->m.base);
                areas_by_address_.erase(base, table_end(*ap));
                idle_bytes_ -= ap->m.bytes;
                going.push_back(std::move(ap));
            }
        }
        std::erase(areas_, nullptr);
    }
    std::size_t released = 0;
    for (auto& a : going) { // outside the lock: these are system calls
        released += a->m.bytes;
        release(*a);
    }
    return released;
}

template <registrar Registrar>
inline void basic_registered_arena<Registrar>::trim_loop() {
    std::unique_lock g(trim_mutex_);
    for (;;) {
        trim_cv_.wait(
            g, [this] { return stopping_ || trim_requested_.load(std::memory_order_relaxed); });
        if (stopping_)
            return;
        trim_requested_.store(false, std::memory_order_relaxed);
        g.unlock();
        trim_down_to(opt_.high_watermark, false);
        g.lock();
    }
}

} // namespace rdmax
