#pragma once
// rail_local / rail_remote: one range of memory registered on several devices
// (rails), with the key each device issued for it. A key means something only
// to the device that issued it, so a transfer cut across rails needs, for
// each piece, the keys of the rail that carries it: on(k) is the plain
// buffer view for rail k. Rights are in the type, as for local_buffer and
// remote_buffer; rail_remote is a token of plain bytes that can cross the wire.

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <type_traits>

#include <rdmax/mem/buffer.hpp>

namespace rdmax {

/// Rails one transfer can use at most (a server's NICs near one socket).
inline constexpr std::size_t max_rails = 4;

namespace detail {
/// One range's registrations on rails 0, 1, ... joined into `out` (a
/// rail_local or rail_remote): false unless they all name the same bytes
/// and there are 1 to max_rails of them. `key` is the buffers' key member.
template <class Joined, class Buffer, class Key>
constexpr bool join_rails(std::initializer_list<Buffer> per_rail, Joined& out,
                          std::array<std::uint32_t, max_rails>& keys, Key key) noexcept {
    if (per_rail.size() == 0 || per_rail.size() > max_rails)
        return false;
    out.addr = per_rail.begin()->addr;
    out.length = per_rail.begin()->length;
    out.rails = static_cast<std::uint32_t>(per_rail.size());
    std::size_t k = 0;
    for (const Buffer& b : per_rail) {
        if (b.addr != out.addr || b.length != out.length)
            return false;
        keys[k++] = b.*key;
    }
    return true;
}
} // namespace detail

/// This process's memory, registered on each rail.
template <rights Rights>
struct rail_local {
    static constexpr rights granted = Rights;
    std::byte* addr = nullptr;
    std::uint64_t length = 0;
    std::array<std::uint32_t, max_rails> lkey{};
    std::uint32_t rails = 0; ///< keys given: rails 0 .. rails - 1 (a striper uses no other)

    /// [offset, offset + len) with rail k's key. The caller keeps it inside.
    [[nodiscard]] constexpr local_buffer<Rights> on(std::size_t k, std::uint64_t offset,
                                                    std::uint32_t len) const noexcept {
        return {addr + offset, len, lkey[k]};
    }
    /// The registrations of one range on rails 0, 1, ...: nullopt unless they
    /// all name the same bytes (and there are at most max_rails).
    [[nodiscard]] static constexpr std::optional<rail_local>
    of(std::initializer_list<local_buffer<Rights>> per_rail) noexcept {
        rail_local r;
        if (!detail::join_rails(per_rail, r, r.lkey, &local_buffer<Rights>::lkey))
            return std::nullopt;
        return r;
    }
};

/// A peer's memory, registered on each of its rails.
template <rights Rights>
struct rail_remote {
    static constexpr rights granted = Rights;
    std::uint64_t addr = 0;
    std::uint64_t length = 0;
    std::array<std::uint32_t, max_rails> rkey{};
    std::uint32_t rails = 0;    ///< keys given: rails 0 .. rails - 1 (a striper uses no other)
    std::uint32_t reserved = 0; ///< named padding, always zero (the token crosses the wire)

    /// True when [offset, offset + len) lies inside, and inside the address space.
    [[nodiscard]] constexpr bool contains(std::uint64_t offset, std::uint64_t len) const noexcept {
        return offset <= length && len <= length - offset && addr + length >= addr;
    }
    /// The whole range with rail k's key (offsets go with each request).
    [[nodiscard]] constexpr remote_buffer<Rights> on(std::size_t k) const noexcept {
        return {addr, length, rkey[k], 0};
    }
    /// The registrations of one range on the peer's rails 0, 1, ...: nullopt
    /// unless they all name the same bytes (and there are at most max_rails).
    [[nodiscard]] static constexpr std::optional<rail_remote>
    of(std::initializer_list<remote_buffer<Rights>> per_rail) noexcept {
        rail_remote r;
        if (!detail::join_rails(per_rail, r, r.rkey, &remote_buffer<Rights>::rkey))
            return std::nullopt;
        return r;
    }
};

static_assert(std::is_trivially_copyable_v<rail_remote<rights::remote_read>>);
static_assert(std::has_unique_object_representations_v<rail_remote<rights::remote_read>>,
              "no padding: every byte of a token on the wire is defined");

} // namespace rdmax
