#pragma once
// rail_registrar<Inner>: a registrar that registers each range once per
// protection domain of a set of rails (a device each), so that one lookup
// hands back every rail's key. It is a `registrar` itself: the registration
// cache and arenas take it unchanged, and keys(h) is rail 0's; keys(h, k),
// local() and remote() give the others. A range one rail refuses is
// registered on none: the ones done are deregistered before the error (the
// inner registrar's, naming its verb) goes on.
//
// The pages are pinned once per device: each rail's registration counts
// against RLIMIT_MEMLOCK (a cache over it wants its byte limit divided by
// the domains: make_rail_cache does so).

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
    /// A range's registrations, held by value: one per protection domain
    /// (two rails on ports of one device share a domain, so one memory
    /// region and one key), and which of them each rail uses.
    struct handle {
        std::array<typename Inner::handle, max_rails> per_domain{};
        std::array<std::uint8_t, max_rails> domain_of{}; ///< rail k's entry of per_domain
        std::uint8_t rails = 0;
        std::uint8_t domains = 0; ///< registrations made (rolled back on failure)
    };

    /// One inner registrar per rail, rail 0 first (1 to max_rails): each in
    /// its own protection domain.
    explicit rail_registrar(std::vector<Inner> per_rail)
        : inner_(std::move(per_rail)) {
        map_rails(identity(inner_.size()));
    }
    /// One inner registrar per protection domain, and rail k's domain in
    /// domain_of[k] (1 to max_rails rails, every domain used by one).
    rail_registrar(std::vector<Inner> per_domain, const std::vector<std::uint8_t>& domain_of)
        : inner_(std::move(per_domain)) {
        map_rails(domain_of);
    }

    [[nodiscard]] handle reg(void* addr, std::size_t len, rights granted) {
        handle h;
        h.domain_of = domain_of_;
        h.rails = rails_;
        try {
            for (; h.domains < inner_.size(); ++h.domains)
                h.per_domain[h.domains] = inner_[h.domains].reg(addr, len, granted);
        } catch (...) {
            dereg(h); // the domains done so far
            throw;
        }
        return h;
    }
    void dereg(handle h) noexcept {
        for (std::uint8_t d = 0; d < h.domains; ++d)
            inner_[d].dereg(h.per_domain[d]);
    }
    /// Rail 0's keys: what a single-rail user of the cache sees.
    [[nodiscard]] static mr_keys keys(handle h) noexcept { return keys(h, 0); }
    /// Rail k's keys; {0, 0} for a rail the handle has none for.
    [[nodiscard]] static mr_keys keys(handle h, std::size_t k) noexcept {
        if (k >= h.rails)
            return {};
        return Inner::keys(h.per_domain[h.domain_of[k]]);
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
    [[nodiscard]] std::size_t rails() const noexcept { return rails_; }
    [[nodiscard]] std::size_t domains() const noexcept { return inner_.size(); }
    /// The inner registrar rail k registers with.
    [[nodiscard]] Inner& rail(std::size_t k) noexcept { return inner_[domain_of_[k]]; }

private:
    void map_rails(const std::vector<std::uint8_t>& domain_of) {
        if (domain_of.empty() || domain_of.size() > max_rails || inner_.empty() ||
            inner_.size() > domain_of.size())
            throw_error("rail_registrar", EINVAL, "1 to 4 rails, a domain for each");
        std::array<bool, max_rails> used{};
        for (std::size_t k = 0; k < domain_of.size(); ++k) {
            if (domain_of[k] >= inner_.size())
                throw_error("rail_registrar", EINVAL, "a rail's domain out of range");
            domain_of_[k] = domain_of[k];
            used[domain_of[k]] = true;
        }
        for (std::size_t d = 0; d < inner_.size(); ++d)
            if (!used[d])
                throw_error("rail_registrar", EINVAL, "a domain no rail uses");
        rails_ = static_cast<std::uint8_t>(domain_of.size());
    }
    static std::vector<std::uint8_t> identity(std::size_t n) {
        std::vector<std::uint8_t> v(n);
        for (std::size_t k = 0; k < n; ++k)
            v[k] = static_cast<std::uint8_t>(k);
        return v;
    }

    std::vector<Inner> inner_;
    std::array<std::uint8_t, max_rails> domain_of_{};
    std::uint8_t rails_ = 0;
};

static_assert(registrar<rail_registrar<verbs_registrar>>);

} // namespace rdmax
