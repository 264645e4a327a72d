// Mapping and unmapping of registered_arena's areas.
#include <cerrno>
#include <cstdint>
#include <sys/mman.h>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/detail/mem/area_mapping.hpp>
#include <rdmax/error.hpp>

namespace rdmax::detail {

namespace {

/// A memfd of `bytes`, on reserved huge pages when asked and possible; -1
/// with errno set when the file cannot be made.
int area_file(std::size_t bytes, bool huge_pages, bool& huge) {
    huge = false;
    if (huge_pages) {
        const int fd = memfd_create("rdmax-arena", MFD_CLOEXEC | MFD_HUGETLB);
        // Sizing a hugetlbfs file succeeds even with no page reserved; the
        // pages are taken at the first touch, which would then be a SIGBUS.
        // So only a file whose pages can be had now is kept: MAP_POPULATE
        // below fails cleanly instead.
        if (fd >= 0 && ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
            huge = true;
            return fd;
        }
        if (fd >= 0)
            close(fd);
    }
    const int fd = memfd_create("rdmax-arena", MFD_CLOEXEC);
    if (fd < 0)
        return -1;
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
        const int err = errno;
        close(fd);
        errno = err;
        return -1;
    }
    return fd;
}

/// `bytes` of address space aligned to `align`: over-mapped by the
/// alignment, the ends cut off (so the area's number is its address shifted).
std::byte* reserve_aligned(std::size_t bytes, std::size_t align) {
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
    return reinterpret_cast<std::byte*>(aligned);
}

area_mapping map_shareable(std::size_t bytes, std::size_t align, bool huge_pages) {
    bool huge = false;
    int fd = area_file(bytes, huge_pages, huge);
    if (fd < 0)
        throw_error("memfd_create", errno,
                    fmt::format("a shareable arena area of {} bytes", bytes));
    std::byte* base = reserve_aligned(bytes, align);
    // The file replaces the reservation in place (MAP_FIXED over our own
    // mapping, so nothing else is clobbered). Huge pages are populated now:
    // a missing one is an error here, not a SIGBUS later.
    const int populate = huge ? MAP_POPULATE : 0;
    void* p = mmap(base, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | populate, fd, 0);
    if (p == MAP_FAILED && huge) {
        close(fd);
        fd = area_file(bytes, false, huge);
        if (fd < 0) {
            const int err = errno;
            munmap(base, bytes);
            throw_error("memfd_create", err,
                        fmt::format("a shareable arena area of {} bytes", bytes));
        }
        p = mmap(base, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
    }
    if (p == MAP_FAILED) {
        const int err = errno;
        munmap(base, bytes);
        close(fd);
        throw_error("mmap", err, fmt::format("a shareable arena area of {} bytes", bytes));
    }
    // Transparent huge pages for shared memory, where the system allows them
    // on request (shmem_enabled: advise).
    if (!huge && huge_pages)
        huge = madvise(base, bytes, MADV_HUGEPAGE) == 0;
    return {base, bytes, huge, fd};
}

} // namespace

area_mapping map_area(std::size_t bytes, std::size_t align, bool huge_pages, bool shareable) {
    if (shareable)
        return map_shareable(bytes, align, huge_pages);
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
    std::byte* base = reserve_aligned(bytes, align);
    // Transparent huge pages, where the system does them on request.
    const bool thp = huge_pages && madvise(base, bytes, MADV_HUGEPAGE) == 0;
    return {base, bytes, thp};
}

void unmap_area(const area_mapping& m) noexcept {
    munmap(m.base, m.bytes);
    // A peer that mapped the file keeps its pages: closing our descriptor
    // and unmapping our view free them only when the last mapping goes.
    if (m.fd >= 0)
        close(m.fd);
}

} // namespace rdmax::detail
