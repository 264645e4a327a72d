#pragma once
// udmabuf_provider: an accelerator_provider over host memory exported by the
// kernel's udmabuf (memfd pages as a dma-buf; CONFIG_UDMABUF, on in Debian's
// 7.x kernels), mapped in the process so that the CPU can fill and check it.
// It stands in for a GPU runtime where there is none: allocate() gives a
// "device pointer" whose bytes reach the NIC only as a dma-buf.

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

#include <rdmax/mem/accelerator_provider.hpp>

namespace rdmax {

class udmabuf_provider {
public:
    udmabuf_provider() = default;
    udmabuf_provider(const udmabuf_provider&) = delete;
    udmabuf_provider& operator=(const udmabuf_provider&) = delete;
    ~udmabuf_provider(); ///< frees what was not deallocated

    /// `bytes` (rounded up to a page) of memfd pages, a dma-buf of them, and
    /// their mapping here, which is returned. Throws rdmax::error naming the
    /// step (memfd_create, /dev/udmabuf, UDMABUF_CREATE: above the module's
    /// udmabuf.size_limit_mb is EINVAL).
    [[nodiscard]] void* allocate(std::size_t bytes);
    /// Frees an allocation; EINVAL for a pointer allocate() did not return.
    void deallocate(void* ptr);

    [[nodiscard]] dmabuf_export export_range(const void* ptr, std::size_t len) const;

private:
    struct allocation {
        std::size_t bytes = 0;
        int memfd = -1;
        int dmabuf = -1;
        std::uint64_t id = 0;
    };
    mutable std::mutex mutex_;
    std::map<std::uintptr_t, allocation> by_start_;
    std::uint64_t next_id_ = 1;
};
static_assert(accelerator_provider<udmabuf_provider>);

} // namespace rdmax
