#pragma once
// basic_registered_arena<Registrar>: memory that is registered before anyone
// asks for it (seed 000's pre-registration, LITE's one key per area).
//
// Areas of area_bytes (aligned to their size, on 2 MiB pages where the system
// allows) are registered whole: one memory region, so one key, per area. An
// area is cut into 64 KiB spans; a span serves one size class (64 B to 32 KiB,
// powers of two) from its own free list, and larger requests take runs of
// whole spans; requests larger than an area get an area of their own. The key
// of any pointer into the arena is found in O(1): a page table indexed by the
// area number.
//
// Lazy unmap: freed blocks stay mapped and registered and are reused. An
// area goes back to the system only when every block of it is free, and only
// above the high watermark (by a background thread), on trim(), or under
// memory pressure (a PSI trigger, detail/mem/memory_pressure.hpp); it is deregistered before it is
// unmapped, so no registration ever outlives the pages it covers. Nothing is MADV_DONTNEED'd inside
// a registered area: that would leave the registration on the old pages.
//
// Threads: allocate and deallocate take one spinlock for a few dozen
// instructions, and make no system call unless a new area is needed (which
// registers it outside the spinlock; calls to the registrar are serialized,
// so it need not be thread-safe).

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <memory_resource> // the resource's base class, declared here
#include <mutex>
#include <new>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <rdmax/detail/mem/area_mapping.hpp>
#include <rdmax/detail/mem/memory_pressure.hpp>
#include <rdmax/detail/mem/page_table.hpp>
#include <rdmax/detail/mem/spin_lock.hpp>
#include <rdmax/error.hpp>
#include <rdmax/mem/arena_options.hpp>
#include <rdmax/mem/buffer.hpp>
#include <rdmax/mem/registrar.hpp>
#include <rdmax/mem/rights.hpp>
#include <rdmax/stats/counter_fields.hpp>
#include <rdmax/stats/publisher.hpp>

namespace rdmax {

/// The member bodies are in registered_arena-inl.hpp.
template <registrar Registrar>
class basic_registered_arena {
public:
    /// A block handed out: its memory and the keys of the area it lies in.
    struct block {
        std::byte* data = nullptr;
        std::size_t size = 0; ///< what was asked for (the block may be larger)
        std::uint32_t lkey = 0;
        std::uint32_t rkey = 0;
    };

    static constexpr std::size_t span_bytes = std::size_t{64} << 10;
    static constexpr std::size_t smallest = 64;
    static constexpr unsigned classes = 10; ///< 64 B .. 32 KiB

    explicit basic_registered_arena(Registrar reg, arena_options opt = {})
        : reg_(std::move(reg))
        , opt_(checked(opt))
        , areas_by_address_(static_cast<unsigned>(__builtin_ctzl(opt_.area_bytes))) {
        trimmer_ = std::thread([this] { trim_loop(); });
        if (opt_.trim_under_pressure)
            pressure_.emplace([this] { trim_for_pressure(); });
        stat_ =
            stats::pulled("arena", {}, stats::arena_fields(), [this](std::span<std::uint64_t> v) {
                stats::arena_values(counters(), v);
            });
    }
    basic_registered_arena(const basic_registered_arena&) = delete;
    basic_registered_arena& operator=(const basic_registered_arena&) = delete;

    /// Every block must have been given back (or be no longer used).
    ~basic_registered_arena();

    /// `bytes` of registered memory aligned to `alignment` (a power of two,
    /// at most 64 KiB). Throws std::bad_alloc for zero or absurd sizes, and
    /// rdmax::error when a new area cannot be mapped or registered.
    [[nodiscard]] block allocate(std::size_t bytes,
                                 std::size_t alignment = alignof(std::max_align_t));

    /// Gives back a block from allocate() (`bytes` as asked for).
    void deallocate(void* p, std::size_t bytes) noexcept;

    /// The keys of the area holding p, in O(1); nullopt if p is not in the arena.
    [[nodiscard]] std::optional<mr_keys> keys_of(const void* p) const noexcept {
        const area* a = area_of(p);
        if (a == nullptr)
            return std::nullopt;
        return a->keys;
    }

    /// The registrar's handle of the area holding p (with verbs_registrar, the
    /// area's ibv_mr: what handle_issuer binds memory windows to); nullopt if
    /// p is not in the arena.
    [[nodiscard]] std::optional<typename Registrar::handle>
    registration_of(const void* p) const noexcept {
        const area* a = area_of(p);
        if (a == nullptr)
            return std::nullopt;
        return a->reg;
    }

    /// [p, p + n) as a local buffer with the arena's key; throws if it is not
    /// inside one area or the arena's rights lack A.
    template <rights A>
    [[nodiscard]] local_buffer<A> local(const void* p, std::size_t n) const {
        const area& a = checked_area<A>(p, n, "local");
        return {static_cast<std::byte*>(const_cast<void*>(p)), static_cast<std::uint32_t>(n),
                a.keys.lkey};
    }
    /// The token a peer needs to address [p, p + n).
    template <rights A>
    [[nodiscard]] remote_buffer<A> remote(const void* p, std::size_t n) const {
        const area& a = checked_area<A>(p, n, "remote");
        return {reinterpret_cast<std::uintptr_t>(p), n, a.keys.rkey, 0};
    }

    /// The area of a shareable arena that holds [p, p + n): what another
    /// process maps to reach it (local/exporter.hpp).
    struct shared_area {
        int fd = -1; ///< the area's memfd, the arena's: dup it to keep it
        std::byte* base = nullptr;
        std::size_t bytes = 0;
    };
    /// Throws rdmax::error if the arena is not shareable or [p, p + n) is not
    /// inside one of its areas. Valid while a block in the area is held.
    [[nodiscard]] shared_area area_for_sharing(const void* p, std::size_t n) const {
        if (!opt_.shareable)
            throw_error("registered_arena::area_for_sharing", EINVAL,
                        "the arena was not made shareable (arena_options::shareable)");
        const area& a = checked_area<rights::local_read>(p, n, "area_for_sharing");
        return {a.m.fd, a.m.base, a.m.bytes};
    }
    /// Called with each area's base and size before the area goes back to
    /// the system (from the thread that trims, or the destructor), so that
    /// whoever shared it revokes it first. One listener; empty to remove.
    void on_release(std::function<void(const std::byte*, std::size_t)> listener) {
        std::lock_guard r(registrar_mutex_);
        release_listener_ = std::move(listener);
    }

    /// Gives every wholly free area back to the system now (deregistered,
    /// then unmapped). Returns the bytes released.
    std::size_t trim() { return trim_down_to(0, true); }

    /// Called by a memory-pressure watcher: as trim(), counted apart.
    std::size_t trim_for_pressure() {
        pressure_events_.fetch_add(1, std::memory_order_relaxed);
        return trim();
    }

    [[nodiscard]] arena_counters counters() const noexcept;
    [[nodiscard]] const arena_options& options() const noexcept { return opt_; }
    [[nodiscard]] Registrar& registrar_ref() noexcept { return reg_; }

    /// Bytes in areas that hold no block (kept registered for reuse).
    [[nodiscard]] std::size_t idle_bytes() const noexcept {
        std::lock_guard g(lock_);
        return idle_bytes_;
    }

    /// A std::pmr::memory_resource over this arena (mem/arena_resource.hpp).
    class resource;

private:
    // A span's state: a size class (0..classes-1), or one of these.
    static constexpr std::uint8_t span_free = 0xff;
    static constexpr std::uint8_t span_run_head = 0xfe; ///< first span of a run
    static constexpr std::uint8_t span_run_tail = 0xfd;

    struct area;
    struct span {
        area* owner = nullptr;
        std::uint8_t state = span_free;
        std::uint32_t used = 0; ///< blocks handed out (class spans)
        std::uint32_t bump = 0; ///< blocks never handed out start here
        std::uint32_t run = 0;  ///< spans in the run (run heads)
        void* free = nullptr;   ///< freed blocks, linked through themselves
        span* next_partial = nullptr;
        span* prev_partial = nullptr;
        bool in_partial = false;
    };

    struct area {
        detail::area_mapping m;
        typename Registrar::handle reg{};
        mr_keys keys;
        std::vector<span> spans;
        std::size_t free_spans = 0;
        std::size_t hint = 0; ///< where the search for a free span starts
        bool dedicated = false;
        [[nodiscard]] bool idle() const noexcept { return free_spans == spans.size(); }
    };

    static arena_options checked(arena_options o) {
        if (o.area_bytes < (std::size_t{2} << 20) || (o.area_bytes & (o.area_bytes - 1)) != 0)
            throw_error("registered_arena", EINVAL,
                        "area_bytes must be a power of two of at least 2 MiB");
        return o;
    }

    static unsigned class_of(std::size_t n) noexcept {
        unsigned c = 0;
        while ((smallest << c) < n)
            ++c;
        return c;
    }

    [[nodiscard]] area* area_of(const void* p) const noexcept {
        const auto a = reinterpret_cast<std::uintptr_t>(p);
        if (!areas_by_address_.covers(a, a + 1))
            return nullptr;
        return areas_by_address_.find(a);
    }

    template <rights A>
    const area& checked_area(const void* p, std::size_t n, const char* what) const;

    static std::byte* span_base(const span& s) noexcept {
        return s.owner->m.base + static_cast<std::size_t>(&s - s.owner->spans.data()) * span_bytes;
    }
    /// Back to free, still knowing its area.
    static void reset(span& s) noexcept {
        area* owner = s.owner;
        s = span{};
        s.owner = owner;
    }

    void partial_push(unsigned c, span& s) noexcept {
        s.in_partial = true;
        s.prev_partial = nullptr;
        s.next_partial = partial_[c];
        if (partial_[c] != nullptr)
            partial_[c]->prev_partial = &s;
        partial_[c] = &s;
    }
    void partial_remove(unsigned c, span& s) noexcept {
        if (s.prev_partial != nullptr)
            s.prev_partial->next_partial = s.next_partial;
        else
            partial_[c] = s.next_partial;
        if (s.next_partial != nullptr)
            s.next_partial->prev_partial = s.prev_partial;
        s.in_partial = false;
    }

    /// n contiguous free spans in a shared area; nullptr if none has them.
    span* take_spans(std::size_t n) noexcept;

    struct found {
        std::byte* at = nullptr;
        const area* in = nullptr;
    };

    found try_allocate_locked(std::size_t need);

    found take_dedicated(std::size_t need);

    void free_locked(std::byte* p, std::size_t bytes) noexcept;

    void give_back_spans(area& a, std::size_t n) noexcept {
        a.free_spans += n;
        if (a.idle())
            idle_bytes_ += a.m.bytes;
    }

    /// Maps and registers an area big enough for `need`, outside the lock.
    void add_area(std::size_t need);

    /// Where an area's entry in the table ends: its end rounded up to a whole
    /// area_bytes (the table's unit). A dedicated area is a multiple of 2 MiB
    /// only; the rest of its last unit belongs to no other area, since areas
    /// start on multiples of area_bytes.
    [[nodiscard]] std::uintptr_t table_end(const area& a) const noexcept {
        const std::uintptr_t end = reinterpret_cast<std::uintptr_t>(a.m.base) + a.m.bytes;
        return (end + opt_.area_bytes - 1) & ~(opt_.area_bytes - 1);
    }

    /// Deregisters, then unmaps: the registration never outlives its pages.
    void release(area& a) noexcept;

    /// Releases idle areas until idle bytes are at most `keep`.
    std::size_t trim_down_to(std::size_t keep, bool count);

    void trim_loop();

    Registrar reg_;
    std::mutex registrar_mutex_; ///< registrars need not be thread-safe; areas are rare
    /// Told of every area before it is released; under registrar_mutex_.
    std::function<void(const std::byte*, std::size_t)> release_listener_;
    arena_options opt_;
    mutable detail::spin_lock lock_;
    std::vector<std::unique_ptr<area>> areas_;
    page_table<area> areas_by_address_;
    std::array<span*, classes> partial_{};
    /// One freed run per length (up to half an area), kept whole: reusing it
    /// costs nothing, where searching and resetting costs a step per span.
    std::vector<span*> run_cache_ = std::vector<span*>(opt_.area_bytes / 2 / span_bytes + 1);
    std::size_t idle_bytes_ = 0;

    std::mutex trim_serial_; ///< held through a whole trim, releases included
    std::mutex trim_mutex_;
    std::condition_variable trim_cv_;
    bool stopping_ = false;
    std::atomic<bool> trim_requested_{false};
    std::thread trimmer_;
    std::optional<memory_pressure_subscription> pressure_;
    stats::pulled stat_; ///< dropped first thing in the destructor

    std::uint64_t allocations_ = 0, frees_ = 0, allocated_bytes_ = 0; ///< under lock_
    std::atomic<std::uint64_t> areas_registered_{0}, areas_released_{0}, huge_areas_{0}, trims_{0},
        pressure_events_{0}, registered_bytes_{0};
};

/// The arena over verbs memory regions in one protection domain.
using registered_arena = basic_registered_arena<verbs_registrar>;

} // namespace rdmax

// Defined in its own header, which includes this one first; then the
// member bodies.
#include <rdmax/mem/arena_resource.hpp>
#include <rdmax/mem/registered_arena-inl.hpp>
