#pragma once
// Anonymous pages for the tests that unmap memory and map new pages at the
// same address, and the physical frames behind them.

#include <cstddef>
#include <cstdint>
#include <fcntl.h>
#include <span>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

#include "catch.hpp"
#include "loopback.hpp"

namespace rdmax::test {

inline const std::size_t page_bytes = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));

/// Anonymous pages (at `where`, MAP_FIXED, when given), filled with a pattern.
inline std::byte* map_at(void* where, std::size_t len, unsigned seed) {
    void* p = mmap(where, len, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | (where != nullptr ? MAP_FIXED : 0), -1, 0);
    REQUIRE(p != MAP_FAILED);
    auto* b = static_cast<std::byte*>(p);
    fill_pattern(std::span(b, len), seed);
    return b;
}

/// The physical frame behind each page of [p, p + len), from /proc/self/pagemap
/// (frames read as 0 without CAP_SYS_ADMIN).
inline std::vector<std::uint64_t> frames(const std::byte* p, std::size_t len) {
    const int fd = open("/proc/self/pagemap", O_RDONLY);
    REQUIRE(fd >= 0);
    std::vector<std::uint64_t> out;
    for (std::size_t off = 0; off < len; off += page_bytes) {
        std::uint64_t entry = 0;
        const auto at =
            static_cast<off_t>((reinterpret_cast<std::uintptr_t>(p) + off) / page_bytes * 8);
        REQUIRE(pread(fd, &entry, sizeof entry, at) == static_cast<ssize_t>(sizeof entry));
        REQUIRE((entry >> 63) == 1); // present
        out.push_back(entry & ((std::uint64_t{1} << 55) - 1));
    }
    close(fd);
    return out;
}

} // namespace rdmax::test
