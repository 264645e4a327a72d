#pragma once
// basic_registered_arena<Registrar>::resource: the arena as a
// std::pmr::memory_resource, so that a std::pmr::vector<std::byte> (or any
// pmr container) lives in registered memory under the arena's keys.

#include <cstddef>
#include <memory_resource>

#include <rdmax/mem/registered_arena.hpp>
#include <rdmax/mem/registrar.hpp>

namespace rdmax {

/// A std::pmr::memory_resource over this arena, so that a
/// std::pmr::vector<std::byte> lives in registered memory.
template <registrar Registrar>
class basic_registered_arena<Registrar>::resource : public std::pmr::memory_resource {
public:
    explicit resource(basic_registered_arena& a) noexcept
        : arena_(&a) {}
    [[nodiscard]] basic_registered_arena& arena() const noexcept { return *arena_; }

private:
    void* do_allocate(std::size_t bytes, std::size_t alignment) override {
        return arena_->allocate(bytes == 0 ? 1 : bytes, alignment).data;
    }
    void do_deallocate(void* p, std::size_t bytes, std::size_t) override {
        arena_->deallocate(p, bytes == 0 ? 1 : bytes);
    }
    [[nodiscard]] bool do_is_equal(const std::pmr::memory_resource& o) const noexcept override {
        const auto* r = dynamic_cast<const resource*>(&o);
        return r != nullptr && r->arena_ == arena_;
    }
    basic_registered_arena* arena_;
};

} // namespace rdmax
