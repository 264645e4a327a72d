#pragma once
// accelerator_cache<Provider>: registrations of accelerator memory by pointer,
// as registration_cache is for host memory. The provider (an
// accelerator_provider) says which allocation's dma-buf a pointer is in; the
// allocation's id finds the buffer the cache added for it (an add(), fstat and
// dup, once per allocation), and a dmabuf_cache serves the range.
//
// Freed memory: an allocation freed and its address allocated again has a new
// id, so it is a new buffer, never served an old registration. The old
// buffer's registrations (and its memory: they hold it) stay until
// forget(ptr), which a program calls before it frees, or until the cache goes;
// runtimes give no event for a free that this could hook (UCX intercepts
// cudaFree for that; rdmax does not).
//
// A lookup is the provider's export_range, this cache's id table (a mutex
// held for a hash lookup) and a dmabuf_cache hit: no system call, no
// allocation but the first time an allocation is seen.

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>

#include <rdmax/mem/accelerator_provider.hpp>
#include <rdmax/mem/dmabuf_cache.hpp>
#include <rdmax/mem/rights.hpp>

namespace rdmax {

template <accelerator_provider Provider>
class accelerator_cache {
public:
    template <class Buffer>
    using held = dmabuf_cache::held<Buffer>;

    /// `provider` must outlive the cache.
    accelerator_cache(const verbs::protection_domain& pd, const Provider& provider,
                      rcache_options opt = rcache_options{}.with_env())
        : provider_(&provider)
        , cache_(pd, opt) {}
    accelerator_cache(const accelerator_cache&) = delete;
    accelerator_cache& operator=(const accelerator_cache&) = delete;
    ~accelerator_cache() {
        for (auto& [id, b] : buffers_)
            cache_.forget(b);
    }

    /// [ptr, ptr + len) of accelerator memory, registered with at least rights A.
    template <rights A>
    [[nodiscard]] held<local_buffer<A>> local(const void* ptr, std::size_t len) {
        const auto [b, offset] = find(ptr, len);
        return cache_.local<A>(b, offset, len);
    }
    template <rights A>
    [[nodiscard]] held<remote_buffer<A>> remote(const void* ptr, std::size_t len) {
        const auto [b, offset] = find(ptr, len);
        return cache_.remote<A>(b, offset, len);
    }

    /// Forgets the allocation holding `ptr`: call it before freeing the
    /// allocation, so that its memory is not kept by the cache.
    void forget(const void* ptr) {
        const dmabuf_export e = provider_->export_range(ptr, 1);
        const std::scoped_lock lock(mutex_);
        if (auto it = buffers_.find(e.buffer_id); it != buffers_.end()) {
            cache_.forget(it->second);
            buffers_.erase(it);
        }
    }

    [[nodiscard]] rcache_counters counters() const noexcept { return cache_.counters(); }
    [[nodiscard]] std::size_t buffers() const {
        const std::scoped_lock lock(mutex_);
        return buffers_.size();
    }

private:
    std::pair<dmabuf_cache::buffer, std::uint64_t> find(const void* ptr, std::size_t len) {
        const dmabuf_export e = provider_->export_range(ptr, len);
        const std::scoped_lock lock(mutex_);
        auto it = buffers_.find(e.buffer_id);
        if (it == buffers_.end())
            it = buffers_.emplace(e.buffer_id, cache_.add(e.fd)).first;
        return {it->second, e.offset};
    }

    const Provider* provider_;
    dmabuf_cache cache_;
    mutable std::mutex mutex_; ///< buffers_
    std::unordered_map<std::uint64_t, dmabuf_cache::buffer> buffers_;
};

} // namespace rdmax
