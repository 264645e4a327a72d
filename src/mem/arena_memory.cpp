// Mapping and unmapping of registered_arena's areas.
#include <cerrno>
#include <cstdint>
#include <sys/mman.h>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/area_mapping.hpp>

namespace rdmax::detail {

area_mapping map_area(std::size_t bytes, std::size_t align, bool huge_pages) {
    // Reserved huge pages first: the area is then 2 MiB pages for sure.
    if (huge_pages) {
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
        if (p != MAP_FAILED) {
            if ((reinterpret_cast<std::uintptr_t>(p) & (align - 1)) == 0)
                return {static_cast<std::byte*>(p), bytes, true};
            munmap(p, bytes); // not aligned to the area size: take the normal way
        }
    }
    // Over-map by the alignment and cut the ends off, so the area is aligned
    // to its size (its number is then its address shifted).
    const std::size_t span = bytes + align;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        throw_error("mmap", errno, fmt::format("an arena area of {} bytes", bytes));
    const auto start = reinterpret_cast<std::uintptr_t>(raw);
    const std::uintptr_t aligned = (start + align - 1) & ~(align - 1);
    if (aligned > start)
        munmap(raw, aligned - start);
    if (const std::uintptr_t end = start + span; end > aligned + bytes)
        munmap(reinterpret_cast<void*>(aligned + bytes), end - aligned - bytes);
    auto* base = reinterpret_cast<std::byte*>(aligned);
    // Transparent huge pages, where the system does them on request.
    const bool thp = huge_pages && madvise(base, bytes, MADV_HUGEPAGE) == 0;
    return {base, bytes, thp};
}

void unmap_area(const area_mapping& m) noexcept {
    munmap(m.base, m.bytes);
}

} // namespace rdmax::detail
