#pragma once
// rail_registrar<Inner>: a registrar that registers each range once per rail
// (one Inner per protection domain: a device each), so that one cache lookup
// hands back every rail's key. It is a `registrar` itself: the registration
// cache and arenas take it unchanged, and keys(h) is rail 0's; keys(h, k),
// local() and remote() give the others. A range one rail refuses is
// registered on none: the ones done are deregistered before the error (the
// inner registrar's, naming its verb) goes on.
//
// The pages are pinned once per device: each rail's registration counts
// against RLIMIT_MEMLOCK (a cache over it wants its byte limit divided by
// the rails).

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <rdmax/mem/rail_buffer.hpp>
#include <rdmax/mem/registrar.hpp>

namespace rdmax {

template <registrar Inner>
class rail_registrar {
public:
    /// Every rail's registration of one range, held by value.
    struct handle {
        std::array<typename Inner::handle, max_rails> per_rail{};
        std::uint8_t rails = 0;
    };

    /// One inner registrar per rail, rail 0 first (1 to max_rails).
    explicit rail_registrar(std::vector<Inner> per_rail)
        : inner_(std::move(per_rail)) {
        if (inner_.empty() || inner_.size() > max_rails)
            throw_error("rail_registrar", EINVAL, "1 to 4 rails");
    }

    [[nodiscard]] handle reg(void* addr, std::size_t len, rights granted) {
        handle h;
        try {
            for (; h.rails < inner_.size(); ++h.rails)
                h.per_rail[h.rails] = inner_[h.rails].reg(addr, len, granted);
        } catch (...) {
            dereg(h); // the rails done so far
            throw;
        }
        return h;
    }
    void dereg(handle h) noexcept {
        for (std::uint8_t k = 0; k < h.rails; ++k)
            inner_[k].dereg(h.per_rail[k]);
    }
    /// Rail 0's keys: what a single-rail user of the cache sees.
    [[nodiscard]] static mr_keys keys(handle h) noexcept { return Inner::keys(h.per_rail[0]); }
    [[nodiscard]] static mr_keys keys(handle h, std::size_t k) noexcept {
        return Inner::keys(h.per_rail[k]);
    }
    /// [addr, addr + len) of a registration, with every rail's lkey.
    template <rights R>
    [[nodiscard]] static rail_local<R> local(handle h, std::byte* addr,
                                             std::uint64_t len) noexcept {
        rail_local<R> b{addr, len, {}, h.rails};
        for (std::uint8_t k = 0; k < h.rails; ++k)
            b.lkey[k] = keys(h, k).lkey;
        return b;
    }
    /// The same range as a token for a peer, with every rail's rkey.
    template <rights R>
    [[nodiscard]] static rail_remote<R> remote(handle h, const std::byte* addr,
                                               std::uint64_t len) noexcept {
        rail_remote<R> b{reinterpret_cast<std::uintptr_t>(addr), len, {}, h.rails, 0};
        for (std::uint8_t k = 0; k < h.rails; ++k)
            b.rkey[k] = keys(h, k).rkey;
        return b;
    }
    [[nodiscard]] std::size_t rails() const noexcept { return inner_.size(); }
    [[nodiscard]] Inner& rail(std::size_t k) noexcept { return inner_[k]; }

private:
    std::vector<Inner> inner_;
};

static_assert(registrar<rail_registrar<verbs_registrar>>);

} // namespace rdmax
