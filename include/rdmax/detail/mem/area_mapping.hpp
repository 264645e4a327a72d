#pragma once
// The memory behind a registered arena's areas: mapped aligned to their size,
// on 2 MiB pages where the system allows (src/mem/arena_memory.cpp); private
// anonymous memory, or, for a shareable arena, a memfd mapped shared, whose
// descriptor another process on the node can map (local/exporter.hpp).

#include <cstddef>

namespace rdmax::detail {

/// Maps and unmaps areas (src/mem/arena_memory.cpp).
struct area_mapping {
    std::byte* base = nullptr;
    std::size_t bytes = 0;
    bool huge = false;
    int fd = -1; ///< the memfd behind a shareable area; -1 otherwise
};
/// `bytes` (a multiple of 2 MiB) aligned to `align`, backed by a memfd when
/// `shareable`; throws rdmax::error.
[[nodiscard]] area_mapping map_area(std::size_t bytes, std::size_t align, bool huge_pages,
                                    bool shareable = false);
void unmap_area(const area_mapping& m) noexcept;

} // namespace rdmax::detail
