#pragma once
// The memory behind a registered arena's areas: mapped aligned to their size,
// on 2 MiB pages where the system allows (src/mem/arena_memory.cpp).

#include <cstddef>

namespace rdmax::detail {

/// Maps and unmaps areas (src/mem/arena_memory.cpp).
struct area_mapping {
    std::byte* base = nullptr;
    std::size_t bytes = 0;
    bool huge = false;
};
/// `bytes` (a multiple of 2 MiB) aligned to `align`; throws rdmax::error.
[[nodiscard]] area_mapping map_area(std::size_t bytes, std::size_t align, bool huge_pages);
void unmap_area(const area_mapping& m) noexcept;

} // namespace rdmax::detail
