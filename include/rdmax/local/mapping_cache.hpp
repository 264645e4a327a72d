#pragma once
// mapping_cache: a peer's mappings of the memory an owner exported to it
// (seed 003's grant/mapping cache): an export is mapped once, at its first
// use, and kept, so that a one-copy transfer from or into it costs a memcpy,
// not a mapping. Same shape as the registration cache: hits in nanoseconds,
// least-recently-used eviction past a count and a byte limit, counters.
//
// Never stale: every use compares the export's generation with the owner's
// table (one load from the control segment, mapped read-only), so an export
// the owner revoked is refused at the next use, and its mapping dropped; a
// copy that raced with the revocation is reported (revoked) after the fact,
// its bytes not to be trusted. The mapping keeps the pages alive whatever the
// owner does with its own, so no use faults.
//
// One thread at a time.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <boost/intrusive/list.hpp>
#include <fmt/format.h>

#include <rdmax/detail/local/export_table.hpp>
#include <rdmax/local/mapping_options.hpp>
#include <rdmax/local/shared_segment.hpp>

namespace rdmax::local {

enum class map_status : std::uint8_t {
    ok = 0,
    revoked,      ///< the owner revoked the export (or replaced it): not used
    out_of_range, ///< [offset, offset + length) is not inside the export
    map_failed,   ///< the export could not be mapped (its descriptor, mmap)
    read_only,    ///< a copy into an export the owner shared read-only
};

[[nodiscard]] constexpr std::string_view to_string(map_status s) noexcept {
    switch (s) {
    case map_status::ok: return "ok";
    case map_status::revoked: return "export revoked";
    case map_status::out_of_range: return "range outside the export";
    case map_status::map_failed: return "the export could not be mapped";
    case map_status::read_only: return "the export is read-only";
    }
    return "unknown";
}

struct mapping_counters {
    std::uint64_t hits = 0;
    std::uint64_t misses = 0;        ///< mapped at this use
    std::uint64_t evictions = 0;     ///< dropped for the limits
    std::uint64_t invalidations = 0; ///< dropped because the owner revoked or replaced the export
    std::uint64_t refused = 0;       ///< uses of a revoked export
    std::uint64_t raced = 0;         ///< copies the owner revoked the export during
    std::uint64_t mapped_count = 0;  ///< now
    std::uint64_t mapped_bytes = 0;  ///< now
};

class mapping_cache {
public:
    /// Maps an export the cache does not have: typically asks the owner for
    /// its descriptor and attaches it (shared_segment::attach). May throw:
    /// the use then reports map_failed.
    using attach_fn = std::function<shared_segment(const export_notice&)>;

    /// `table`: the owner's export table, in the control segment as this
    /// process maps it (export_table::view); it must outlive the cache.
    mapping_cache(std::span<const export_slot> table, attach_fn attach,
                  mapping_options opts = mapping_options{}.with_env());
    mapping_cache(const mapping_cache&) = delete;
    mapping_cache& operator=(const mapping_cache&) = delete;
    ~mapping_cache();

    /// One copy out of the export: [offset, offset + out.size()) into `out`.
    map_status copy_out(const export_notice& e, std::uint64_t offset,
                        std::span<std::byte> out) noexcept {
        std::byte* p = nullptr;
        if (const map_status s = at(e, offset, out.size(), p); s != map_status::ok)
            return s;
        std::memcpy(out.data(), p, out.size());
        return after_copy(e);
    }
    /// One copy into the export.
    map_status copy_in(const export_notice& e, std::uint64_t offset,
                       std::span<const std::byte> in) noexcept {
        std::byte* p = nullptr;
        if (const map_status s = at(e, offset, in.size(), p); s != map_status::ok)
            return s;
        if (!entries_[e.id].seg.writable())
            return map_status::read_only;
        std::memcpy(p, in.data(), in.size());
        return after_copy(e);
    }
    /// The export's mapped bytes at [offset, offset + len), for a caller that
    /// copies itself (then calls still_valid(e)).
    map_status at(const export_notice& e, std::uint64_t offset, std::size_t len,
                  std::byte*& out) noexcept {
        entry* en = find(e);
        if (en == nullptr)
            return last_;
        if (offset > e.bytes || len > e.bytes - offset)
            return map_status::out_of_range;
        out = en->seg.data() + offset;
        return map_status::ok;
    }
    /// Still the export the owner has published (after a copy: the copy's
    /// bytes are good only if this holds).
    [[nodiscard]] bool still_valid(const export_notice& e) const noexcept {
        return e.id < table_.size() &&
               table_[e.id].generation.load(std::memory_order_acquire) == e.generation;
    }

    /// Why the last use that reported map_failed failed (the attach
    /// function's error), for a message; empty before any failure.
    [[nodiscard]] std::string_view failure() const noexcept { return failure_; }

    /// Drops every mapping.
    void clear() noexcept;
    [[nodiscard]] const mapping_counters& counters() const noexcept { return counters_; }
    [[nodiscard]] const mapping_options& options() const noexcept { return opts_; }

private:
    struct entry : boost::intrusive::list_base_hook<> {
        shared_segment seg;
        std::uint64_t generation = 0;
    };

    entry* find(const export_notice& e) noexcept {
        if (e.id >= table_.size()) {
            last_ = map_status::revoked;
            return nullptr;
        }
        entry& en = entries_[e.id];
        const std::uint64_t now = table_[e.id].generation.load(std::memory_order_acquire);
        if (en.seg && en.generation == e.generation && now == e.generation) {
            ++counters_.hits;
            lru_.splice(lru_.begin(), lru_, lru_.iterator_to(en));
            return &en;
        }
        if (en.seg && en.generation != now)
            drop(en, counters_.invalidations); // the owner revoked or replaced it
        if (now != e.generation || e.generation == 0) {
            ++counters_.refused;
            last_ = map_status::revoked;
            return nullptr;
        }
        return map(en, e);
    }
    map_status after_copy(const export_notice& e) noexcept {
        // The copy's loads before the generation's second load (a seqlock's
        // read side). ThreadSanitizer does not model fences, and GCC refuses
        // them under it: there the acquire load alone stands.
#if !defined(__SANITIZE_THREAD__)
        std::atomic_thread_fence(std::memory_order_acquire);
#endif
        if (still_valid(e))
            return map_status::ok;
        ++counters_.raced;
        return map_status::revoked;
    }
    entry* map(entry& en, const export_notice& e) noexcept;
    void note_failure(std::string_view why) noexcept;
    void drop(entry& en, std::uint64_t& counter) noexcept;

    std::span<const export_slot> table_;
    attach_fn attach_;
    mapping_options opts_;
    std::vector<entry> entries_; ///< by export id
    boost::intrusive::list<entry> lru_;
    mapping_counters counters_;
    map_status last_ = map_status::ok;
    std::string failure_;
};

} // namespace rdmax::local

template <>
struct fmt::formatter<rdmax::local::mapping_counters> {
    constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
    auto format(const rdmax::local::mapping_counters& c, fmt::format_context& ctx) const {
        return fmt::format_to(ctx.out(),
                              "hits {} misses {} evictions {} invalidations {} refused {} raced {} "
                              "mapped {} ({} bytes)",
                              c.hits, c.misses, c.evictions, c.invalidations, c.refused, c.raced,
                              c.mapped_count, c.mapped_bytes);
    }
};
