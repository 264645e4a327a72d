// udmabuf_provider (include/rdmax/mem/udmabuf_provider.hpp).
#include <cerrno>
#include <fcntl.h>
#include <linux/udmabuf.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/udmabuf_provider.hpp>

namespace rdmax {

namespace {

void free_allocation(void* at, std::size_t bytes, int memfd, int dmabuf) noexcept {
    if (at != nullptr)
        ::munmap(at, bytes);
    if (dmabuf >= 0)
        ::close(dmabuf);
    if (memfd >= 0)
        ::close(memfd);
}

} // namespace

udmabuf_provider::~udmabuf_provider() {
    for (auto& [start, a] : by_start_)
        free_allocation(reinterpret_cast<void*>(start), a.bytes, a.memfd, a.dmabuf);
}

void* udmabuf_provider::allocate(std::size_t bytes) {
    constexpr std::string_view verb = "udmabuf_provider::allocate";
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    if (bytes == 0 || bytes > (std::size_t{1} << 40))
        throw_error(verb, EINVAL, fmt::format("{} bytes: 1 byte to 1 TiB", bytes));
    bytes = (bytes + page - 1) / page * page;
    allocation a;
    a.bytes = bytes;
    void* at = nullptr;
    const auto fail = [&](std::string_view step, int err) {
        free_allocation(at, bytes, a.memfd, a.dmabuf);
        throw_error(verb, err, fmt::format("{} of {} bytes", step, bytes));
    };
    a.memfd = ::memfd_create("rdmax-udmabuf", MFD_ALLOW_SEALING | MFD_CLOEXEC);
    if (a.memfd < 0)
        fail("memfd_create", errno);
    // udmabuf takes only a memfd that cannot shrink under the dma-buf.
    if (::ftruncate(a.memfd, static_cast<off_t>(bytes)) != 0 ||
        ::fcntl(a.memfd, F_ADD_SEALS, F_SEAL_SHRINK) != 0)
        fail("sizing and sealing the memfd", errno);
    const int dev = ::open("/dev/udmabuf", O_RDWR | O_CLOEXEC);
    if (dev < 0)
        fail("/dev/udmabuf (a kernel with CONFIG_UDMABUF)", errno);
    udmabuf_create create{};
    create.memfd = static_cast<__u32>(a.memfd);
    create.flags = UDMABUF_FLAGS_CLOEXEC;
    create.size = bytes;
    a.dmabuf = ::ioctl(dev, UDMABUF_CREATE, &create);
    const int err = errno;
    ::close(dev);
    if (a.dmabuf < 0)
        fail(err == EINVAL ? "UDMABUF_CREATE (above the module's udmabuf.size_limit_mb?)"
                           : "UDMABUF_CREATE",
             err);
    at = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, a.memfd, 0);
    if (at == MAP_FAILED) {
        at = nullptr;
        fail("mmap", errno);
    }
    const std::scoped_lock lock(mutex_);
    a.id = next_id_++;
    by_start_.emplace(reinterpret_cast<std::uintptr_t>(at), a);
    return at;
}

void udmabuf_provider::deallocate(void* ptr) {
    allocation a;
    {
        const std::scoped_lock lock(mutex_);
        const auto it = by_start_.find(reinterpret_cast<std::uintptr_t>(ptr));
        if (it == by_start_.end())
            throw_error("udmabuf_provider::deallocate", EINVAL,
                        fmt::format("{} was not allocated here", ptr));
        a = it->second;
        by_start_.erase(it);
    }
    free_allocation(ptr, a.bytes, a.memfd, a.dmabuf);
}

dmabuf_export udmabuf_provider::export_range(const void* ptr, std::size_t len) const {
    const auto at = reinterpret_cast<std::uintptr_t>(ptr);
    const std::scoped_lock lock(mutex_);
    auto it = by_start_.upper_bound(at);
    if (it != by_start_.begin()) {
        --it;
        const std::uintptr_t offset = at - it->first;
        if (offset < it->second.bytes && len <= it->second.bytes - offset)
            return {it->second.dmabuf, offset, it->second.id};
    }
    throw_error("udmabuf_provider::export_range", EINVAL,
                fmt::format("[{}, +{}) is in no allocation of this provider", ptr, len));
}

} // namespace rdmax
