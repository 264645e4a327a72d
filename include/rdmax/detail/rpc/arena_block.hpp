#pragma once
// A block of a registered arena that gives itself back: the rings, staging
// slots and the server's body blocks of an RPC connection.

#include <cstddef>
#include <cstdint>
#include <utility>

#include <rdmax/mem/buffer.hpp>
#include <rdmax/mem/registered_arena.hpp>

namespace rdmax::rpc::detail {

/// A block of a registered arena, given back when this goes.
class arena_block {
public:
    arena_block() = default;
    arena_block(registered_arena& arena, std::size_t bytes)
        : arena_(&arena)
        , block_(arena.allocate(bytes, 64)) {}
    arena_block(arena_block&& o) noexcept
        : arena_(std::exchange(o.arena_, nullptr))
        , block_(o.block_) {}
    arena_block& operator=(arena_block&& o) noexcept {
        if (this != &o) {
            reset();
            arena_ = std::exchange(o.arena_, nullptr);
            block_ = o.block_;
        }
        return *this;
    }
    arena_block(const arena_block&) = delete;
    arena_block& operator=(const arena_block&) = delete;
    ~arena_block() { reset(); }

    void reset() noexcept {
        if (arena_ != nullptr)
            arena_->deallocate(block_.data, block_.size);
        arena_ = nullptr;
    }
    [[nodiscard]] explicit operator bool() const noexcept { return arena_ != nullptr; }
    [[nodiscard]] std::byte* data() const noexcept { return block_.data; }
    [[nodiscard]] std::size_t size() const noexcept { return block_.size; }
    /// [offset, offset + len) for local reads and writes (the caller keeps it in range).
    [[nodiscard]] local_buffer<rights::local_write> local(std::size_t offset,
                                                          std::size_t len) const noexcept {
        return {block_.data + offset, static_cast<std::uint32_t>(len), block_.lkey};
    }

private:
    registered_arena* arena_ = nullptr;
    registered_arena::block block_{};
};

} // namespace rdmax::rpc::detail
