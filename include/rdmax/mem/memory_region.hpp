#pragma once
// A registered memory region whose access rights are part of its type.

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include <fmt/format.h>
#include <infiniband/verbs.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/buffer.hpp>
#include <rdmax/mem/registration_error.hpp>
#include <rdmax/mem/rights.hpp>
#include <rdmax/verbs/protection_domain.hpp>

namespace rdmax {

/// Move-only owner of an ibv_mr registered with rights `Rights`.
template <rights Rights>
class memory_region {
    static_assert(valid(Rights), "remote write and remote atomic access need local_write too");

public:
    static constexpr rights granted = Rights;

    /// Registers [addr, addr + length). Registration pins the pages and is
    /// slow (tens of microseconds to milliseconds): do it at set-up, or go
    /// through the registration cache.
    memory_region(const verbs::protection_domain& pd, void* addr, std::size_t length)
        : mr_(checked_reg(pd, addr, length)) {}
    memory_region(const verbs::protection_domain& pd, std::span<std::byte> bytes)
        : memory_region(pd, bytes.data(), bytes.size()) {}

    memory_region(memory_region&& other) noexcept
        : mr_(std::exchange(other.mr_, nullptr)) {}
    memory_region& operator=(memory_region&& other) noexcept {
        if (this != &other) {
            reset();
            mr_ = std::exchange(other.mr_, nullptr);
        }
        return *this;
    }
    memory_region(const memory_region&) = delete;
    memory_region& operator=(const memory_region&) = delete;
    ~memory_region() { reset(); }

    [[nodiscard]] ibv_mr* get() const noexcept { return mr_; }
    [[nodiscard]] std::byte* data() const noexcept { return static_cast<std::byte*>(mr_->addr); }
    [[nodiscard]] std::size_t size() const noexcept { return mr_->length; }
    [[nodiscard]] std::uint32_t lkey() const noexcept { return mr_->lkey; }
    [[nodiscard]] std::uint32_t rkey() const noexcept { return mr_->rkey; }

    /// The whole region as a local buffer (regions over 4 GiB: take sub-ranges
    /// with local(offset, length); one work request moves at most the port's
    /// max_message(), 2 GiB on most NICs, 8 MiB on soft-RoCE).
    [[nodiscard]] local_buffer<Rights> local() const noexcept {
        return {data(), static_cast<std::uint32_t>(std::min<std::size_t>(size(), UINT32_MAX)),
                lkey()};
    }
    /// [offset, offset + length) of the region; throws if it does not fit.
    [[nodiscard]] local_buffer<Rights> local(std::size_t offset, std::size_t length) const {
        if (offset > size() || length > size() - offset || length > UINT32_MAX)
            throw_error("memory_region::local", ERANGE,
                        fmt::format("[{}, +{}) of a {}-byte region", offset, length, size()));
        return {data() + offset, static_cast<std::uint32_t>(length), lkey()};
    }
    /// The token a peer needs to address this region (see remote_buffer).
    [[nodiscard]] remote_buffer<Rights> remote() const noexcept {
        return {reinterpret_cast<std::uint64_t>(mr_->addr), size(), rkey(), 0};
    }

private:
    static ibv_mr* checked_reg(const verbs::protection_domain& pd, void* addr, std::size_t length) {
        if (length == 0 || addr == nullptr)
            throw_error("ibv_reg_mr", EINVAL, length == 0 ? "zero length" : "null address");
        ibv_mr* mr = ibv_reg_mr(pd.get(), addr, length, to_ibv(Rights));
        if (mr == nullptr)
            throw_registration_error("ibv_reg_mr", errno, addr, length, Rights);
        return mr;
    }
    void reset() noexcept {
        if (mr_ != nullptr)
            ibv_dereg_mr(mr_); // fails only for an MR still bound to a memory window
        mr_ = nullptr;
    }
    ibv_mr* mr_;
};

} // namespace rdmax
