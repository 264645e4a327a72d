#pragma once
// A registered range of a dma-buf (accelerator or exporter memory) whose
// access rights are part of its type.
//
// The kernel's way to let a NIC reach memory that is not this process's own
// pages (a GPU's, a DMA heap's, udmabuf's memfd pages) is the dma-buf: its
// exporter hands out a file descriptor, and ibv_reg_dmabuf_mr registers
// [offset, offset + length) of it. The registration holds its own reference
// on the buffer (the kernel's umem keeps the dma-buf), so the descriptor may
// be closed once registered, and the exporter's memory stays until the region
// is gone.
//
// Addresses: a region's bytes are addressed at dmabuf_iova_base + their offset
// in the buffer (its iova), so local() and remote() carry those: local().addr
// is an address in the region's space for the verbs, never one to dereference
// (the memory may not be mapped in this process at all). The base (2^48, past
// every user address) keeps them apart from host pointers and never null, so
// slicing a buffer (addr + n) stays defined. ibv_mr::addr is the offset.
//
// A device without dma-buf MRs (a provider or driver without reg_dmabuf_mr)
// is found out by its first refusal and refused from then on without asking
// it again, with that reason (dmabuf_unsupported()).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include <infiniband/verbs.h>

#include <rdmax/mem/buffer.hpp>
#include <rdmax/mem/rights.hpp>
#include <rdmax/verbs/protection_domain.hpp>

namespace rdmax {

/// Where a dma-buf region's offset 0 is for the verbs (see above).
inline constexpr std::uint64_t dmabuf_iova_base = std::uint64_t{1} << 48;

/// Registers [offset, offset + length) of the dma-buf `fd` with `granted`,
/// its bytes at `iova` for the verbs (same place in a page as offset);
/// throws rdmax::error naming ibv_reg_dmabuf_mr and why.
[[nodiscard]] ibv_mr* register_dmabuf(const verbs::protection_domain& pd, int fd,
                                      std::uint64_t offset, std::size_t length, std::uint64_t iova,
                                      rights granted);

/// The size of the dma-buf `fd` (its llseek(SEEK_END), which moves no
/// offset); -1 when `fd` is no dma-buf (its file system is not dma-buf's).
[[nodiscard]] long long dmabuf_size(int fd) noexcept;

/// nullopt when `ctx`'s device registered a dma-buf before or was not asked
/// yet; else why it cannot (its first refusal, said once per device).
[[nodiscard]] std::optional<std::string> dmabuf_unsupported(ibv_context* ctx);

/// Move-only owner of an ibv_mr over a dma-buf range, registered with `Rights`.
template <rights Rights>
class dmabuf_region {
    static_assert(valid(Rights), "remote write and remote atomic access need local_write too");

public:
    static constexpr rights granted = Rights;

    /// Registers [offset, offset + length) of the dma-buf `fd` (not taken:
    /// the caller may close it once this returns). Slow, as ibv_reg_mr is.
    dmabuf_region(const verbs::protection_domain& pd, int fd, std::uint64_t offset,
                  std::size_t length)
        : mr_(register_dmabuf(pd, fd, offset, length, dmabuf_iova_base + offset, Rights)) {}

    dmabuf_region(dmabuf_region&& other) noexcept
        : mr_(std::exchange(other.mr_, nullptr)) {}
    dmabuf_region& operator=(dmabuf_region&& other) noexcept {
        if (this != &other) {
            reset();
            mr_ = std::exchange(other.mr_, nullptr);
        }
        return *this;
    }
    dmabuf_region(const dmabuf_region&) = delete;
    dmabuf_region& operator=(const dmabuf_region&) = delete;
    ~dmabuf_region() { reset(); }

    [[nodiscard]] ibv_mr* get() const noexcept { return mr_; }
    /// Where the region starts in its buffer.
    [[nodiscard]] std::uint64_t offset() const noexcept {
        return reinterpret_cast<std::uint64_t>(mr_->addr);
    }
    /// Where it starts for the verbs: dmabuf_iova_base + offset().
    [[nodiscard]] std::uint64_t iova() const noexcept { return dmabuf_iova_base + offset(); }
    [[nodiscard]] std::size_t size() const noexcept { return mr_->length; }
    [[nodiscard]] std::uint32_t lkey() const noexcept { return mr_->lkey; }
    [[nodiscard]] std::uint32_t rkey() const noexcept { return mr_->rkey; }

    /// The region (its first 4 GiB) as a local buffer, at its iova.
    [[nodiscard]] local_buffer<Rights> local() const noexcept {
        return {address(0), static_cast<std::uint32_t>(std::min<std::size_t>(size(), UINT32_MAX)),
                lkey()};
    }
    /// [at, at + length) of the region; nullopt if it does not fit.
    [[nodiscard]] std::optional<local_buffer<Rights>> local(std::size_t at,
                                                            std::size_t length) const noexcept {
        if (at > size() || length > size() - at || length > UINT32_MAX)
            return std::nullopt;
        return local_buffer<Rights>{address(at), static_cast<std::uint32_t>(length), lkey()};
    }
    /// The token a peer needs to address this region (see remote_buffer).
    [[nodiscard]] remote_buffer<Rights> remote() const noexcept {
        return {iova(), size(), rkey(), 0};
    }

private:
    // An address in the region's iova space, for a work request's SGE only.
    [[nodiscard]] std::byte* address(std::size_t at) const noexcept {
        return reinterpret_cast<std::byte*>(iova() + at);
    }
    void reset() noexcept {
        if (mr_ != nullptr)
            ibv_dereg_mr(mr_);
        mr_ = nullptr;
    }
    ibv_mr* mr_;
};

} // namespace rdmax
