#pragma once
// dmabuf_cache: registering a range of a dma-buf that was registered before
// costs a lookup, not an ibv_reg_dmabuf_mr, as registration_cache does for
// host memory; it is that cache, over an address space of its own.
//
// How. Each buffer added gets a slot of 2^40 bytes (1 TiB) in the cache's
// space, its bytes at (slot << 40) + offset, slots 1 to 255. A
// registration_cache over that space does everything else: disjoint
// registrations merged over the union of what was asked, CLOCK eviction
// within the same knobs (RDMAX_RCACHE_*), hits without a lock, the same
// counters. Buffers are at least a slot apart, so two buffers' ranges never
// merge. And the space's addresses are the MRs' iovas, so a held buffer's
// local() / remote() are ready for the verbs (never to dereference).
//
// Identity: a buffer is (st_dev, st_ino) of its file, read once by add(). A
// buffer the application closed and its exporter freed is never found again:
//  - while the cache can find a buffer, it cannot be freed: add() keeps a dup
//    of its fd until the buffer is forgotten, and every cached MR holds its own
//    reference on it (the kernel's umem keeps the dma-buf), so the memory
//    outlives the application's close;
//  - after forget(), nothing of it stays in the cache (its registrations are
//    invalidated, its slot freed), and a new buffer has a new identity:
//    Linux numbers dma-buf inodes from a 64-bit counter of their own
//    (drivers/dma-buf/dma-buf.c, dmabuf_inode), never reused while it runs.
// forget() is how a buffer's memory is given back: a cache that keeps a buffer
// keeps it allocated, as the host cache keeps pages pinned.
//
// Threads: get-side calls (local, remote) are registration_cache's (hits take
// no lock); add() and forget() take the slot table's mutex, which a miss also
// takes to find the buffer's fd.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <sys/types.h>

#include <infiniband/verbs.h>

#include <rdmax/mem/buffer.hpp>
#include <rdmax/mem/monitor.hpp>
#include <rdmax/mem/rcache_options.hpp>
#include <rdmax/mem/registrar.hpp>
#include <rdmax/mem/registration_cache.hpp>
#include <rdmax/mem/rights.hpp>
#include <rdmax/verbs/protection_domain.hpp>

namespace rdmax {

/// A dma-buf's identity: its file's device and inode (fstat).
struct dmabuf_identity {
    dev_t dev = 0;
    ino_t ino = 0;
    bool operator==(const dmabuf_identity&) const = default;
};

/// The buffers a dmabuf_cache knows: slot -> (identity, fd dup, size).
class dmabuf_slots {
public:
    static constexpr unsigned slot_shift = 40;
    static constexpr std::size_t slots = 256; ///< slot 0 unused: no address is null

    dmabuf_slots() = default;
    dmabuf_slots(const dmabuf_slots&) = delete;
    dmabuf_slots& operator=(const dmabuf_slots&) = delete;
    ~dmabuf_slots(); ///< closes the dups left

    struct found {
        unsigned slot = 0;
        std::size_t size = 0;
        std::uint32_t generation = 0; ///< of the slot, while this buffer has it
    };
    /// Adds `fd`'s buffer (dup, then fstatfs/fstat of the dup) or counts one
    /// more add() of it. Throws EINVAL for what is no dma-buf of 1 byte to
    /// 1 TiB less a page, ENOSPC with 255 buffers.
    found add(int fd);
    /// One add() of the buffer of `slot` in `generation` undone (EBADF if the
    /// slot has moved on: a token forgotten before); true when it was the
    /// last: the slot is then closed (its dup too), its generation moves on,
    /// and it is not reused until free(slot).
    bool release(unsigned slot, std::uint32_t generation);
    void free(unsigned slot);
    /// Whether a token of `slot` in `generation` is still its buffer's: one load.
    [[nodiscard]] bool current(unsigned slot, std::uint32_t generation) const noexcept {
        return slot < slots && generation_[slot].load(std::memory_order_acquire) == generation;
    }
    /// The fd and size of `slot`'s buffer for a registration: under the mutex
    /// the caller holds through its ibv_reg_dmabuf_mr. -1 when the slot is empty.
    struct use {
        std::unique_lock<std::mutex> lock;
        int fd = -1;
        std::size_t size = 0;
    };
    [[nodiscard]] use lend(unsigned slot);

private:
    struct buffer {
        dmabuf_identity id;
        int fd = -1;
        std::size_t size = 0;
        std::size_t adds = 0;
        bool closing = false; ///< released, its registrations not yet invalidated
    };
    std::mutex mutex_;
    std::array<buffer, slots> table_{};
    /// Moves on when a slot's buffer is forgotten: tokens of it go stale.
    std::array<std::atomic<std::uint32_t>, slots> generation_{};
};

/// Registers ranges of the cache's space with ibv_reg_dmabuf_mr of the buffer
/// whose slot they are in (a registrar, registrar.hpp).
class dmabuf_registrar {
public:
    using handle = ibv_mr*;
    dmabuf_registrar(const verbs::protection_domain& pd, dmabuf_slots& slots) noexcept
        : pd_(&pd)
        , slots_(&slots) {}
    [[nodiscard]] handle reg(void* addr, std::size_t len, rights granted);
    void dereg(handle h) noexcept { ibv_dereg_mr(h); }
    [[nodiscard]] static mr_keys keys(handle h) noexcept { return verbs_registrar::keys(h); }

private:
    const verbs::protection_domain* pd_;
    dmabuf_slots* slots_;
};
static_assert(registrar<dmabuf_registrar>);

class dmabuf_cache {
public:
    using cache_type = registration_cache<dmabuf_registrar, manual_monitor>;
    template <class Buffer>
    using held = cache_type::held<Buffer>;

    /// A buffer the cache knows, as add() returned it: a plain token, which
    /// goes stale (EBADF) at its buffer's last forget().
    struct buffer {
        std::uint64_t base = 0; ///< its offset 0 in the cache's space
        std::size_t size = 0;
        std::uint32_t generation = 0;
    };

    /// Options and knobs (RDMAX_RCACHE_*) as the host cache's; its limits
    /// count this cache's dma-buf registrations and bytes (none by default).
    explicit dmabuf_cache(const verbs::protection_domain& pd,
                          rcache_options opt = rcache_options{}.with_env())
        : pd_(&pd)
        , cache_(dmabuf_registrar(pd, slots_), manual_monitor{}, opt) {}

    /// Makes `fd`'s dma-buf known (the caller keeps its fd and may close it:
    /// the cache holds a dup). The same buffer added again, through any fd,
    /// is the same buffer; each add() wants its forget().
    buffer add(int fd);
    /// Undoes one add(); the last one deregisters the buffer's idle
    /// registrations (those in use go with their last handle) and closes the dup.
    void forget(buffer b);

    /// [offset, offset + len) of `b`, registered with at least rights A.
    /// Throws ERANGE outside the buffer, EBADF for a stale token, and as
    /// ibv_reg_dmabuf_mr does on a miss.
    template <rights A>
    [[nodiscard]] held<local_buffer<A>> local(buffer b, std::uint64_t offset, std::size_t len) {
        return cache_.local<A>(address(b, offset, len), len);
    }
    template <rights A>
    [[nodiscard]] held<remote_buffer<A>> remote(buffer b, std::uint64_t offset, std::size_t len) {
        return cache_.remote<A>(address(b, offset, len), len);
    }
    /// Where [offset, ...) of `b` is in the MRs' address space (their iova).
    [[nodiscard]] static std::uint64_t iova(buffer b, std::uint64_t offset) noexcept {
        return b.base + offset;
    }
    /// The protection domain the registrations are in.
    [[nodiscard]] const verbs::protection_domain& pd() const noexcept { return *pd_; }

    /// [offset, offset + len) of `b` registered on its own, outside the
    /// cache: an MR of exactly those bytes with exactly `granted`, never
    /// merged or shared, at iova(b, offset); the caller's to ibv_dereg_mr.
    /// For a key given to a peer that must die when the caller says (an RPC
    /// call's). Throws as local() does.
    [[nodiscard]] ibv_mr* register_exact(buffer b, std::uint64_t offset, std::size_t len,
                                         rights granted);
    [[nodiscard]] rcache_counters counters() const noexcept { return cache_.counters(); }
    /// Deregisters every idle registration.
    void flush() { cache_.flush(); }

private:
    [[nodiscard]] const void* address(buffer b, std::uint64_t offset, std::size_t len) const;

    const verbs::protection_domain* pd_;
    dmabuf_slots slots_; // before cache_: the registrar points at it
    cache_type cache_;
};

} // namespace rdmax
