#pragma once
// Views of registered memory: local_buffer (address, length, lkey) for this
// process, remote_buffer (address, length, rkey) for a peer's. Both carry the
// registration's access rights in their type, so a queue pair can refuse at
// compile time to, say, RDMA-write into memory not registered for remote write.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <type_traits>

#include <rdmax/mem/rights.hpp>

namespace rdmax {

/// Bytes of this process's registered memory.
template <rights Rights>
struct local_buffer {
    static constexpr rights granted = Rights;

    std::byte* addr = nullptr;
    std::uint32_t length = 0;
    std::uint32_t lkey = 0;

    /// [offset, offset + len) of this buffer; nullopt if it does not fit.
    [[nodiscard]] constexpr std::optional<local_buffer> sub(std::uint64_t offset,
                                                            std::uint64_t len) const noexcept {
        if (offset > length || len > length - offset)
            return std::nullopt;
        return local_buffer{addr + offset, static_cast<std::uint32_t>(len), lkey};
    }

    /// The same bytes with fewer rights: always allowed.
    template <rights Fewer>
        requires(has(Rights, Fewer))
    constexpr operator local_buffer<Fewer>() const noexcept {
        return {addr, length, lkey};
    }
};

/// A peer's registered memory: a token of plain bytes that crosses the wire as
/// is (in connection private data, a send, ...). The receiver names the rights
/// it was told, and the type then decides which operations compile.
template <rights Rights>
struct remote_buffer {
    static constexpr rights granted = Rights;

    std::uint64_t addr = 0;
    std::uint64_t length = 0;
    std::uint32_t rkey = 0;
    /// Named padding, always zero: the token goes over the wire as bytes, and
    /// unnamed padding would carry whatever the stack held.
    std::uint32_t reserved = 0;

    /// True when [offset, offset + len) lies inside this buffer.
    [[nodiscard]] constexpr bool contains(std::uint64_t offset, std::uint64_t len) const noexcept {
        return offset <= length && len <= length - offset;
    }

    /// [offset, offset + len) of this buffer; nullopt if it does not fit.
    [[nodiscard]] constexpr std::optional<remote_buffer> sub(std::uint64_t offset,
                                                             std::uint64_t len) const noexcept {
        if (!contains(offset, len))
            return std::nullopt;
        return remote_buffer{addr + offset, len, rkey, 0};
    }

    template <rights Fewer>
        requires(has(Rights, Fewer))
    constexpr operator remote_buffer<Fewer>() const noexcept {
        return {addr, length, rkey};
    }
};

static_assert(std::is_trivially_copyable_v<remote_buffer<rights::remote_read>>);
static_assert(sizeof(remote_buffer<rights::remote_read>) == 24);
static_assert(std::has_unique_object_representations_v<remote_buffer<rights::remote_read>>,
              "no padding: every byte of a token on the wire is defined");

} // namespace rdmax
