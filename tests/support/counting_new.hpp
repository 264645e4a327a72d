#pragma once
// Replaces every form of global operator new and delete with malloc and free,
// counting the allocations: for tests that show a path allocates nothing.
// Include it in one translation unit of a test program only (it defines the
// replacements). Every form pairs with free(), so that sanitizers see no mix
// of their allocator with this one. Allocations inside a test::not_counted
// scope (not_counted.hpp) are left out.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "not_counted.hpp"

namespace rdmax::test {
/// Allocations made by operator new since the program started.
inline std::atomic<std::uint64_t> allocations{0};
} // namespace rdmax::test

// The replacements pair malloc with free; GCC cannot see that they pair, and
// warns where it inlines them.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

void* operator new(std::size_t n) {
    if (rdmax::test::not_counted_depth == 0)
        rdmax::test::allocations.fetch_add(1, std::memory_order_relaxed);
    if (void* p = std::malloc(n == 0 ? 1 : n))
        return p;
    throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
    return operator new(n);
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
    if (rdmax::test::not_counted_depth == 0)
        rdmax::test::allocations.fetch_add(1, std::memory_order_relaxed);
    return std::malloc(n == 0 ? 1 : n);
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept {
    return operator new(n, t);
}
void operator delete(void* p) noexcept {
    std::free(p);
}
void operator delete[](void* p) noexcept {
    std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
    std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
    std::free(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
    std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
    std::free(p);
}
