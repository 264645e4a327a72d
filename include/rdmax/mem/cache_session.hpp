#pragma once
// registration_cache<Registrar, Monitor>::session: a per-thread front end
// whose small table of recent registrations serves repeats with plain loads
// and an increment, no atomic read-modify-write.
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include <rdmax/mem/cache_handle.hpp>
#include <rdmax/mem/cache_held.hpp>
#include <rdmax/mem/fork_policy.hpp>
#include <rdmax/mem/registration_cache.hpp>
#include <rdmax/mem/rights.hpp>

namespace rdmax {

/// A front end of the cache for one thread (the one posting on a queue
/// pair, say). It keeps a reference on each of the last registrations it
/// served, in a small table of its own, so that asking again for memory it
/// asked for lately costs no atomic read-modify-write at all: a handful of
/// loads and a plain increment. The cache's own get() needs two atomics
/// (reference and release), and on this kind of CPU one costs ~6 ns.
///
/// A session and the handles it gives belong to one thread, and must go
/// before the cache does. The registrations it holds (at most `slots`)
/// cannot be evicted while it holds them; one that is invalidated is
/// never served again, and its reference is dropped at the session's next
/// call or at its end.
template <registrar Registrar, monitor Monitor>
class registration_cache<Registrar, Monitor>::session {
public:
    static constexpr std::size_t slots = 32;

    explicit session(registration_cache& c) noexcept
        : cache_(&c)
        , seen_(c.removals_.load(std::memory_order_relaxed)) {}
    session(const session&) = delete;
    session& operator=(const session&) = delete;
    ~session() {
        for (slot& s : table_)
            if (s.e != nullptr)
                cache_->release(s.e);
        flush_hits();
    }

    /// As registration_cache::get.
    template <rights A>
    [[nodiscard]] handle get(const void* addr, std::size_t len) {
        const auto a = reinterpret_cast<std::uintptr_t>(addr);
        registration_cache& c = *cache_;
        // In a forked child, before anything of the monitor's is read (the
        // kmod status area is not mapped there): the cache's get() throws.
        if (c.forked()) [[unlikely]]
            return c.get<A>(addr, len);
        if (c.mon_.pending() || c.removals_.load(std::memory_order_relaxed) != seen_) [[unlikely]]
            sweep();
        slot& s = table_[(a >> c.page_shift_) % slots];
        if (s.e != nullptr && s.start <= a && len != 0 && a + len <= s.end && a + len > a &&
            c.usable(*s.e, A) && (s.e->state.load(std::memory_order_relaxed) & dead) == 0)
            [[likely]] {
            ++s.users;
            if (++hits_ == 1024) [[unlikely]]
                flush_hits();
            return handle(&c, s.e, &s.users);
        }
        handle h = c.get<A>(addr, len);
        if (s.users == 0 && (h.e_->state.load(std::memory_order_relaxed) & dead) == 0) {
            // Keep it: the slot takes over the handle's reference.
            if (s.e != nullptr)
                c.release(s.e);
            s = slot{h.e_, h.e_->start, h.e_->end, 1};
            h.users_ = &s.users;
        }
        return h;
    }

    /// As registration_cache::local and remote.
    template <rights A>
    [[nodiscard]] held<local_buffer<A>> local(const void* addr, std::size_t len) {
        return hold_local<A>(get<A>(addr, len), addr, len);
    }
    template <rights A>
    [[nodiscard]] held<remote_buffer<A>> remote(const void* addr, std::size_t len) {
        return hold_remote<A>(get<A>(addr, len), addr, len);
    }

private:
    struct slot {
        entry* e = nullptr;
        std::uintptr_t start = 0;
        std::uintptr_t end = 0;
        std::uint32_t users = 0; ///< this session's handles on it
    };

    /// Lets the monitor's news reach the cache, and drops idle slots
    /// whose registration left the cache.
    void sweep() noexcept {
        registration_cache& c = *cache_;
        if (c.forked())
            return; // the monitor's news and the entries are the parent's
        if (c.mon_.pending())
            c.drain_monitor();
        seen_ = c.removals_.load(std::memory_order_relaxed);
        for (slot& s : table_) {
            if (s.e != nullptr && s.users == 0 &&
                (s.e->state.load(std::memory_order_relaxed) & dead) != 0) {
                c.release(s.e);
                s = slot{};
            }
        }
    }

    void flush_hits() noexcept {
        cache_->hits_.fetch_add(hits_, std::memory_order_relaxed);
        hits_ = 0;
    }

    registration_cache* cache_;
    std::uint64_t seen_;
    std::uint64_t hits_ = 0;
    std::array<slot, slots> table_{};
};

} // namespace rdmax
