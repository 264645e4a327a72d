#pragma once
// spsc_ring: messages from one process to another on the same node, through
// memory both map (a shared_segment): one producer, one consumer, no lock,
// no system call. Each message is copied in by the producer and out by the
// consumer; for small messages those two copies cost less than anything
// that would save one.
//
// Layout of the block: a header (the consumer's head and the producer's tail
// on cache lines of their own, the capacity, a magic), then `capacity` bytes
// of records: [u32 length][u32 0] then the bytes, padded to 8. A record that
// would cross the end is preceded by a wrap marker (length 0xffffffff).
//
// The peer is not trusted: what the consumer reads (positions, lengths) is
// checked against the capacity before it is used, and a ring that breaks the
// rules reports corrupt; it never reads outside the block.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <span>

namespace rdmax::local {

enum class ring_status : std::uint8_t {
    ok = 0,
    empty,    ///< nothing to take
    full,     ///< no room for the message now
    too_long, ///< the message can never fit (over a quarter of the capacity), or the
              ///< caller's buffer is shorter than the message (it stays queued)
    corrupt,  ///< the peer broke the ring's rules: positions or a length out of range
};

class spsc_ring {
public:
    static constexpr std::uint32_t magic = 0x52494e47; // "RING"
    struct header {
        alignas(64) std::atomic<std::uint64_t> head; ///< consumer's: bytes taken
        alignas(64) std::atomic<std::uint64_t> tail; ///< producer's: bytes given
        alignas(64) std::uint64_t capacity;
        std::uint32_t ring_magic;
    };
    static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
                  "the ring's positions are shared between processes");

    /// Bytes a block for `capacity` bytes of records needs (capacity: a
    /// power of two, at least 256).
    [[nodiscard]] static constexpr std::size_t bytes_for(std::size_t capacity) noexcept {
        return sizeof(header) + capacity;
    }
    /// Lays a ring out in `block` (the creator does this once).
    static void format(std::span<std::byte> block, std::size_t capacity) noexcept {
        auto* h = new (block.data()) header{};
        h->head.store(0, std::memory_order_relaxed);
        h->tail.store(0, std::memory_order_relaxed);
        h->capacity = capacity;
        h->ring_magic = magic;
    }

    spsc_ring() = default;
    /// A view of a ring laid out in `block` (by format(), here or in the peer).
    /// valid() is false if the block does not hold one.
    explicit spsc_ring(std::span<std::byte> block) noexcept {
        if (block.size() < sizeof(header))
            return;
        auto* h = reinterpret_cast<header*>(block.data());
        const std::uint64_t cap = h->capacity;
        if (h->ring_magic != magic || cap < 256 || (cap & (cap - 1)) != 0 ||
            cap > block.size() - sizeof(header))
            return;
        h_ = h;
        data_ = block.data() + sizeof(header);
        cap_ = cap;
    }

    [[nodiscard]] bool valid() const noexcept { return h_ != nullptr; }
    [[nodiscard]] std::size_t capacity() const noexcept { return cap_; }
    /// Longest message: a quarter of the capacity, so that a wrap never starves.
    [[nodiscard]] std::size_t max_message() const noexcept { return cap_ / 4 - record_header; }

    /// Producer: copies `msg` in, if there is room.
    ring_status try_push(std::span<const std::byte> msg) noexcept {
        if (msg.size() > max_message())
            return ring_status::too_long;
        const std::uint64_t tail = h_->tail.load(std::memory_order_relaxed);
        const std::uint64_t head = h_->head.load(std::memory_order_acquire);
        if (tail - head > cap_)
            return ring_status::corrupt;
        const std::uint64_t need = record_bytes(msg.size());
        std::uint64_t at = tail;
        std::uint64_t to_end = cap_ - (at & (cap_ - 1));
        const bool wrap = to_end < need;
        const std::uint64_t total = need + (wrap ? to_end : 0);
        if (cap_ - (tail - head) < total)
            return ring_status::full;
        if (wrap) {
            put_length(at, wrap_marker);
            at += to_end;
        }
        put_length(at, static_cast<std::uint32_t>(msg.size()));
        if (!msg.empty())
            std::memcpy(data_ + ((at + record_header) & (cap_ - 1)), msg.data(), msg.size());
        h_->tail.store(at + need, std::memory_order_release);
        return ring_status::ok;
    }

    /// Consumer: copies the next message into `out` and returns its length
    /// in `n`. A message longer than `out` stays queued (too_long, n says how
    /// long it is).
    ring_status try_pop(std::span<std::byte> out, std::size_t& n) noexcept {
        std::uint64_t head = h_->head.load(std::memory_order_relaxed);
        const std::uint64_t tail = h_->tail.load(std::memory_order_acquire);
        if (tail - head > cap_ || ((tail - head) & 7U) != 0)
            return ring_status::corrupt;
        if (head == tail)
            return ring_status::empty;
        std::uint32_t len = get_length(head);
        if (len == wrap_marker) {
            const std::uint64_t to_end = cap_ - (head & (cap_ - 1));
            if (tail - head < to_end + record_header)
                return ring_status::corrupt;
            head += to_end;
            len = get_length(head);
        }
        if (len > max_message() || record_bytes(len) > tail - head)
            return ring_status::corrupt;
        n = len;
        if (len > out.size())
            return ring_status::too_long;
        if (len != 0)
            std::memcpy(out.data(), data_ + ((head + record_header) & (cap_ - 1)), len);
        h_->head.store(head + record_bytes(len), std::memory_order_release);
        return ring_status::ok;
    }

    /// Bytes queued (for tests and counters).
    [[nodiscard]] std::uint64_t queued() const noexcept {
        return h_->tail.load(std::memory_order_acquire) - h_->head.load(std::memory_order_acquire);
    }

private:
    static constexpr std::uint32_t wrap_marker = 0xffffffffU;
    static constexpr std::size_t record_header = 8;
    [[nodiscard]] static constexpr std::uint64_t record_bytes(std::size_t len) noexcept {
        return record_header + ((len + 7U) & ~std::uint64_t{7});
    }
    void put_length(std::uint64_t at, std::uint32_t len) noexcept {
        std::memcpy(data_ + (at & (cap_ - 1)), &len, sizeof len);
    }
    [[nodiscard]] std::uint32_t get_length(std::uint64_t at) const noexcept {
        std::uint32_t len = 0;
        std::memcpy(&len, data_ + (at & (cap_ - 1)), sizeof len);
        return len;
    }

    header* h_ = nullptr;
    std::byte* data_ = nullptr;
    std::uint64_t cap_ = 0;
};

} // namespace rdmax::local
