#pragma once
// export_table: the owner's side of memory shared with peers on the node.
// The owner publishes a shared_segment under an id; a peer maps it (through
// its mapping_cache) and may use it for as long as the id's generation in
// the table is the one it mapped. Revoking sets the generation to 0: the
// peer's next use sees it and fails cleanly (its mapping still holds the
// pages, so nothing faults), and a use that raced with the revocation is
// reported too (the peer checks the generation again after it copied).
//
// The table lives in a control segment of its own, which the peer maps
// read-only: a generation check is one load, no system call.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <rdmax/local/shared_segment.hpp>

namespace rdmax::local {

/// One slot of the table, as both sides see it.
struct export_slot {
    std::atomic<std::uint64_t> generation; ///< 0: nothing published here (or revoked)
    std::uint64_t bytes;
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);

/// What a peer is told of an export (the descriptor goes beside, by SCM_RIGHTS).
struct export_notice {
    std::uint32_t id = 0;
    std::uint32_t reserved = 0;
    std::uint64_t generation = 0;
    std::uint64_t bytes = 0;
};

class export_table {
public:
    /// Room for `slots` exports at once. Throws rdmax::error.
    explicit export_table(std::uint32_t slots = 1024);
    export_table(const export_table&) = delete;
    export_table& operator=(const export_table&) = delete;

    /// Publishes `seg` (the caller keeps it alive, and keeps its size) under
    /// a free id with a new generation. Throws if every slot is taken.
    export_notice publish(const shared_segment& seg) { return publish_bytes(seg.size()); }
    /// As publish(), for memory of `bytes` the caller maps by other means
    /// (an arena's area: local/exporter.hpp).
    export_notice publish_bytes(std::uint64_t bytes);
    /// Revokes an export: its id's generation becomes 0, then the id is free
    /// for another publish (with a newer generation). False if `n` is not
    /// the live export of its id.
    bool revoke(const export_notice& n) noexcept;

    /// The control segment, for the peer (map it read-only).
    [[nodiscard]] const shared_segment& control() const noexcept { return control_; }
    [[nodiscard]] std::uint32_t slots() const noexcept { return slots_; }
    [[nodiscard]] std::size_t live() const noexcept { return live_; }

    /// The table in a control segment's bytes (either side); empty if it is too short.
    [[nodiscard]] static std::span<export_slot> view(std::span<std::byte> control,
                                                     std::uint32_t slots) noexcept;

private:
    shared_segment control_;
    std::span<export_slot> table_;
    std::uint32_t slots_;
    std::vector<std::uint32_t> free_;
    std::uint64_t next_generation_ = 1;
    std::size_t live_ = 0;
};

} // namespace rdmax::local
