#pragma once
// Registrar: what the registration cache registers memory with. A C++20
// concept, so that production plugs in verbs and tests plug in a counter.

#include <atomic>
#include <cerrno>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <utility>

#include <infiniband/verbs.h>

#include <rdmax/detail/no_device.hpp>
#include <rdmax/error.hpp>
#include <rdmax/mem/registration_error.hpp>
#include <rdmax/mem/rights.hpp>
#include <rdmax/verbs/protection_domain.hpp>

namespace rdmax {

struct mr_keys {
    std::uint32_t lkey = 0;
    std::uint32_t rkey = 0;
};

/// reg() registers [addr, addr + len) with `rights` and returns a handle, or
/// throws rdmax::error whose code says why (ENOMEM, EAGAIN: the cache evicts
/// idle registrations and tries once more); dereg() never fails.
template <class R>
concept registrar =
    requires(R& r, void* addr, std::size_t len, rights granted, typename R::handle h) {
        typename R::handle;
        { r.reg(addr, len, granted) } -> std::same_as<typename R::handle>;
        { r.dereg(h) } noexcept;
        { R::keys(h) } noexcept -> std::same_as<mr_keys>;
    };

/// Registers with ibv_reg_mr in one protection domain; with `on_demand`,
/// adds IBV_ACCESS_ON_DEMAND (the device must have on-demand paging).
class verbs_registrar {
public:
    using handle = ibv_mr*;

    explicit verbs_registrar(const verbs::protection_domain& pd, bool on_demand = false) noexcept
        : pd_(&pd)
        , extra_(on_demand ? IBV_ACCESS_ON_DEMAND : 0) {}
    /// No device: registers nothing, every handle has keys 0 (an arena of
    /// plain memory, for an RPC endpoint built without a device in tests).
    explicit verbs_registrar(detail::no_device_t) noexcept {}

    [[nodiscard]] handle reg(void* addr, std::size_t len, rights granted) {
        if (pd_ == nullptr)
            return &unregistered_;
        ibv_mr* mr = ibv_reg_mr(pd_->get(), addr, len, to_ibv(granted) | extra_);
        if (mr == nullptr)
            throw_registration_error("ibv_reg_mr", errno, addr, len, granted);
        return mr;
    }
    /// A failed ibv_dereg_mr (e.g. rxe's EINVAL while a memory window is
    /// still bound to the region) leaks the registration: counted here
    /// (process-wide), and the first one said on stderr.
    void dereg(handle mr) noexcept {
        if (mr == &unregistered_)
            return;
        const int rc = ibv_dereg_mr(mr);
        if (rc != 0 && failed_deregs_.fetch_add(1, std::memory_order_relaxed) == 0)
            std::fprintf(stderr, "rdmax: ibv_dereg_mr failed (%d): a registration leaks\n", rc);
    }
    /// Deregistrations that failed in this process so far.
    [[nodiscard]] static std::uint64_t failed_deregs() noexcept {
        return failed_deregs_.load(std::memory_order_relaxed);
    }
    [[nodiscard]] static mr_keys keys(handle mr) noexcept { return {mr->lkey, mr->rkey}; }

private:
    inline static std::atomic<std::uint64_t> failed_deregs_{0};
    inline static ibv_mr unregistered_{}; ///< what reg() gives with no device
    const verbs::protection_domain* pd_ = nullptr;
    int extra_ = 0;
};

/// Registers nothing; counts calls and can be told to fail. For unit tests.
class counting_registrar {
public:
    struct record {
        std::uintptr_t addr;
        std::size_t len;
        rights granted;
        std::uint32_t key;
    };
    using handle = record*;

    std::size_t regs = 0;
    std::size_t deregs = 0;
    std::size_t live = 0;
    std::size_t live_bytes = 0;
    /// The next `fail_next` registrations throw with this errno.
    int fail_errno = ENOMEM;
    std::size_t fail_next = 0;

    [[nodiscard]] handle reg(void* addr, std::size_t len, rights granted) {
        if (fail_next > 0) {
            --fail_next;
            throw_error("counting_registrar", fail_errno);
        }
        ++regs;
        ++live;
        live_bytes += len;
        return new record{reinterpret_cast<std::uintptr_t>(addr), len, granted,
                          static_cast<std::uint32_t>(regs)};
    }
    void dereg(handle h) noexcept {
        ++deregs;
        --live;
        live_bytes -= h->len;
        delete h;
    }
    [[nodiscard]] static mr_keys keys(handle h) noexcept { return {h->key, h->key}; }
};

static_assert(registrar<verbs_registrar>);
static_assert(registrar<counting_registrar>);

} // namespace rdmax
