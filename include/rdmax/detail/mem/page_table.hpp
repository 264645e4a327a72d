#pragma once
// page_table<T>: which T covers the page holding an address, in at most four
// dependent loads (the registration cache's hit path).
//
// A radix tree over page numbers, shaped like the x86-64 page tables: four
// levels of 512 slots (4 KiB nodes), so 36 bits of page number, the whole
// 48-bit user address space with 4 KiB pages. A slot holds either a child
// node or, tagged with its low bit, a T* covering everything below that slot.
// A range is stored as the fewest slots that tile it: a 2 MiB-aligned 256 MiB
// range takes 128 slots one level above the leaves, a page takes one leaf
// slot. Ranges must be page-aligned and disjoint, which is the cache's
// invariant; nodes left empty by erase() are freed.
//
// Threads: one writer at a time (the cache's lock), and readers without any
// lock. Slots are atomics, and a node is never given back to the heap while
// the table lives (emptied nodes wait on a free list for reuse), so a reader
// racing with a writer follows only pointers to live nodes and values: it may
// see a value that is on its way out or in, which the cache checks after
// taking a reference. Addresses beyond the table's reach (above 2^48 with
// 4 KiB pages) are refused by covers(); the cache then asks its tree.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

namespace rdmax {

template <class T>
class page_table {
    static_assert(alignof(T) >= 2, "the low bit of a T* tags a value slot");

public:
    static constexpr unsigned bits_per_level = 9;
    static constexpr unsigned levels = 4;
    static constexpr std::size_t fanout = std::size_t{1} << bits_per_level;

    explicit page_table(unsigned page_shift) noexcept
        : page_shift_(page_shift) {}
    page_table(const page_table&) = delete;
    page_table& operator=(const page_table&) = delete;
    ~page_table() {
        clear(root_);
        clear_free();
    }

    /// Forgets every node without freeing or reading any (a forked child's
    /// cache, whose table a parent thread may have been changing at fork).
    void abandon() noexcept {
        for (auto& slot : root_.slot)
            slot.store(0, std::memory_order_relaxed);
        root_.used = 0;
        free_ = nullptr;
    }

    /// Whether [start, end) lies inside the space this table can hold.
    [[nodiscard]] bool covers(std::uintptr_t start, std::uintptr_t end) const noexcept {
        return ((end - 1) >> page_shift_) < (std::uintptr_t{1} << (levels * bits_per_level)) &&
               start < end;
    }

    /// The value covering the page of addr, or nullptr. Safe beside a writer.
    [[nodiscard]] T* find(std::uintptr_t addr) const noexcept {
        const std::uintptr_t page = addr >> page_shift_;
        const node* n = &root_;
        for (unsigned level = 0;; ++level) {
            const std::uintptr_t s = n->slot[index(page, level)].load(std::memory_order_acquire);
            if ((s & value_tag) != 0)
                return reinterpret_cast<T*>(s & ~value_tag);
            if (s == 0 || level + 1 == levels)
                return nullptr;
            n = reinterpret_cast<const node*>(s);
        }
    }

    /// Maps every page of [start, end) to v; those pages must map to nothing.
    /// On std::bad_alloc the table is left as it was.
    void insert(std::uintptr_t start, std::uintptr_t end, T* v) {
        const std::uintptr_t lo = start >> page_shift_, hi = end >> page_shift_;
        try {
            set(root_, 0, lo, hi, reinterpret_cast<std::uintptr_t>(v) | value_tag);
        } catch (...) {
            unset(root_, 0, lo, hi);
            throw;
        }
    }

    /// Unmaps every page of [start, end).
    void erase(std::uintptr_t start, std::uintptr_t end) noexcept {
        unset(root_, 0, start >> page_shift_, end >> page_shift_);
    }

    /// Bytes of nodes allocated (the root and the free list included).
    [[nodiscard]] std::size_t bytes() const noexcept { return nodes_ * sizeof(node); }

private:
    static constexpr std::uintptr_t value_tag = 1;

    struct node {
        std::array<std::atomic<std::uintptr_t>, fanout> slot{};
        std::size_t used = 0; ///< non-zero slots (the writer's only)
        node* next_free = nullptr;
    };

    node* make_node() {
        if (free_ == nullptr) {
            ++nodes_;
            return new node;
        }
        node* n = std::exchange(free_, free_->next_free);
        for (auto& s : n->slot) // readers may still look in: atomically
            s.store(0, std::memory_order_relaxed);
        n->used = 0;
        return n;
    }

    /// Pages one slot covers at `level` (level 0 is the root).
    static constexpr std::uintptr_t span(unsigned level) noexcept {
        return std::uintptr_t{1} << ((levels - 1 - level) * bits_per_level);
    }
    static constexpr std::size_t index(std::uintptr_t page, unsigned level) noexcept {
        return (page >> ((levels - 1 - level) * bits_per_level)) & (fanout - 1);
    }

    /// Sets the pages [lo, hi) below n (at `level`) to the tagged value v.
    void set(node& n, unsigned level, std::uintptr_t lo, std::uintptr_t hi, std::uintptr_t v) {
        const std::uintptr_t sp = span(level);
        while (lo < hi) {
            const std::uintptr_t slot_lo = lo & ~(sp - 1);
            const std::uintptr_t slot_hi = slot_lo + sp;
            auto& s = n.slot[index(lo, level)];
            const std::uintptr_t upto = slot_hi < hi ? slot_hi : hi;
            std::uintptr_t cur = s.load(std::memory_order_relaxed);
            if (lo == slot_lo && upto == slot_hi) {
                if (cur == 0)
                    ++n.used;
                s.store(v, std::memory_order_release); // the whole slot is this one value
            } else {
                if (cur == 0) {
                    // Filled below before it is published here.
                    node* child = make_node();
                    try {
                        set(*child, level + 1, lo, upto, v);
                    } catch (...) {
                        unset(*child, level + 1, lo, upto);
                        recycle(child);
                        throw;
                    }
                    s.store(reinterpret_cast<std::uintptr_t>(child), std::memory_order_release);
                    ++n.used;
                } else {
                    set(*reinterpret_cast<node*>(cur), level + 1, lo, upto, v);
                }
            }
            lo = upto;
        }
    }

    void unset(node& n, unsigned level, std::uintptr_t lo, std::uintptr_t hi) noexcept {
        const std::uintptr_t sp = span(level);
        while (lo < hi) {
            const std::uintptr_t slot_lo = lo & ~(sp - 1);
            const std::uintptr_t upto = slot_lo + sp < hi ? slot_lo + sp : hi;
            auto& s = n.slot[index(lo, level)];
            const std::uintptr_t cur = s.load(std::memory_order_relaxed);
            if ((cur & value_tag) != 0) {
                s.store(0, std::memory_order_release);
                --n.used;
            } else if (cur != 0) {
                auto* child = reinterpret_cast<node*>(cur);
                unset(*child, level + 1, lo, upto);
                if (child->used == 0) {
                    s.store(0, std::memory_order_release);
                    --n.used;
                    recycle(child);
                }
            }
            lo = upto;
        }
    }

    /// An emptied node waits for reuse: a reader may still be inside it.
    void recycle(node* n) noexcept {
        n->next_free = free_;
        free_ = n;
    }

    /// At destruction, when no reader is left.
    void clear(node& n) noexcept {
        for (auto& slot : n.slot) {
            const std::uintptr_t s = slot.load(std::memory_order_relaxed);
            if (s != 0 && (s & value_tag) == 0) {
                auto* child = reinterpret_cast<node*>(s);
                clear(*child);
                delete child;
            }
            slot.store(0, std::memory_order_relaxed);
        }
        n.used = 0;
    }

    void clear_free() noexcept {
        while (free_ != nullptr)
            delete std::exchange(free_, free_->next_free);
    }

    unsigned page_shift_;
    std::size_t nodes_ = 1;
    node* free_ = nullptr;
    node root_;
};

} // namespace rdmax
