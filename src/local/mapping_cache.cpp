#include <exception>

#include <fmt/format.h>

#include <rdmax/local/mapping_cache.hpp>

namespace rdmax::local {

mapping_options mapping_options::with_env() const {
    return config::apply_env(*this, mapping_knobs, "mapping_options::with_env");
}

mapping_cache::mapping_cache(std::span<const export_slot> table, attach_fn attach,
                             mapping_options opts)
    : table_(table)
    , attach_(std::move(attach))
    , opts_(opts)
    , entries_(table.size()) {}

mapping_cache::~mapping_cache() {
    clear();
}

void mapping_cache::clear() noexcept {
    while (!lru_.empty()) {
        std::uint64_t ignored = 0;
        drop(lru_.front(), ignored);
    }
}

void mapping_cache::drop(entry& en, std::uint64_t& counter) noexcept {
    lru_.erase(lru_.iterator_to(en));
    counters_.mapped_bytes -= en.seg.size();
    --counters_.mapped_count;
    en.seg = shared_segment();
    en.generation = 0;
    ++counter;
}

void mapping_cache::note_failure(std::string_view why) noexcept {
    last_ = map_status::map_failed;
    try {
        failure_.assign(why); // a failure's path: an allocation is fine here
    } catch (...) {
        failure_.clear();
    }
}

mapping_cache::entry* mapping_cache::map(entry& en, const export_notice& e) noexcept {
    shared_segment seg;
    try {
        seg = attach_(e);
    } catch (const std::exception& x) {
        note_failure(x.what());
        return nullptr;
    } catch (...) {
        note_failure("the attach function failed");
        return nullptr;
    }
    if (!seg || seg.size() < e.bytes) {
        note_failure(fmt::format("export {} mapped {} bytes of its {}", e.id, seg.size(), e.bytes));
        return nullptr;
    }
    // Room first: the least recently used go.
    while (!lru_.empty() && (counters_.mapped_count + 1 > opts_.max_count ||
                             counters_.mapped_bytes + seg.size() > opts_.max_bytes))
        drop(lru_.back(), counters_.evictions);
    ++counters_.misses;
    en.seg = std::move(seg);
    en.generation = e.generation;
    lru_.push_front(en);
    ++counters_.mapped_count;
    counters_.mapped_bytes += en.seg.size();
    // Published again between the check and the mapping? Then it is not this one.
    if (!still_valid(e)) {
        drop(en, counters_.invalidations);
        ++counters_.refused;
        last_ = map_status::revoked;
        return nullptr;
    }
    return &en;
}

} // namespace rdmax::local
