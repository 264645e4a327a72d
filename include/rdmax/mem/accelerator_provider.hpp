#pragma once
// The seam between rdmax and an accelerator runtime (CUDA, ROCm, Level Zero):
// what a provider answers for a pointer into the accelerator's memory, so that
// accelerator_cache can register it as a dma-buf.
//
// A runtime exports its allocations as dma-bufs (CUDA:
// cuMemGetHandleForAddressRange with CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD; ROCm:
// hsa_amd_portable_export_dmabuf; Level Zero: zeMemGetIpcHandle with the
// dma-buf extension). A provider keeps one export per allocation (exporting
// is a system call and a new fd each time) and says which allocation a
// pointer is in by an id that is never reused within the process (CUDA's
// CU_POINTER_ATTRIBUTE_BUFFER_ID; a counter), so that an address freed and
// allocated again is a different buffer to the cache.
//
// rdmax ships one provider, udmabuf_provider (host memfd pages exported by
// the kernel's udmabuf), the one this project can test; a GPU provider is a
// class with these two members.

#include <concepts>
#include <cstddef>
#include <cstdint>

namespace rdmax {

/// Where [ptr, ptr + len) is in its allocation's dma-buf.
struct dmabuf_export {
    int fd = -1;                 ///< the allocation's dma-buf, the provider's to close
    std::uint64_t offset = 0;    ///< of ptr in it
    std::uint64_t buffer_id = 0; ///< the allocation's, never reused in this process
};

/// export_range(ptr, len): the export of the allocation holding all of
/// [ptr, ptr + len); throws rdmax::error (EINVAL) when no allocation of the
/// provider holds it. Called on every cache lookup: no system call there.
template <class P>
concept accelerator_provider = requires(const P& p, const void* ptr, std::size_t len) {
    { p.export_range(ptr, len) } -> std::same_as<dmabuf_export>;
};

} // namespace rdmax
