// dma-buf registrations: the verb, its errors in words, and the devices found
// without dma-buf MRs (include/rdmax/mem/dmabuf_region.hpp).
#include <cerrno>
#include <linux/magic.h>
#include <mutex>
#include <string>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/dmabuf_region.hpp>

namespace rdmax {

namespace {

// Devices whose first dma-buf registration was refused as unsupported, by
// name and GUID (a context's address can be reused by another device).
struct refusal {
    std::string device;
    __be64 guid;
    std::string why;
};

std::mutex refusals_mutex;
std::vector<refusal>& refusals() {
    static std::vector<refusal> all;
    return all;
}

std::string device_name(ibv_context* ctx) {
    const char* name = ibv_get_device_name(ctx->device);
    return name != nullptr ? name : "?";
}

bool device_refuses_any(const verbs::protection_domain& pd) {
    ibv_mr* mr =
        ::ibv_reg_dmabuf_mr(pd.get(), 0, 4096, dmabuf_iova_base, -1, IBV_ACCESS_LOCAL_WRITE);
    if (mr != nullptr) { // cannot be, with no buffer; give it back all the same
        ::ibv_dereg_mr(mr);
        return false;
    }
    return errno == EOPNOTSUPP;
}

std::string refusal_detail(int err, int fd, std::uint64_t offset, std::size_t length,
                           const std::string& device) {
    std::string range = fmt::format("[{}, +{}) of dma-buf fd {}", offset, length, fd);
    switch (err) {
    case EOPNOTSUPP:
        return fmt::format("{}: device {} has no dma-buf memory regions (its provider or driver "
                           "lacks reg_dmabuf_mr; soft-RoCE needs tests/vm/patches)",
                           range, device);
    case EBADF: return fmt::format("{}: fd {} is not open", range, fd);
    case EINVAL: {
        const long long size = dmabuf_size(fd);
        if (size >= 0 && (offset > static_cast<unsigned long long>(size) ||
                          length > static_cast<unsigned long long>(size) - offset))
            return fmt::format("{}: the range is not inside the buffer ({} bytes)", range, size);
        return fmt::format("{}: fd {} is not a dma-buf, or the device refused the range", range,
                           fd);
    }
    default: return range;
    }
}

} // namespace

long long dmabuf_size(int fd) noexcept {
    struct statfs fs {};
    if (::fstatfs(fd, &fs) != 0 || static_cast<unsigned long>(fs.f_type) != DMA_BUF_MAGIC)
        return -1;
    const off_t end = ::lseek(fd, 0, SEEK_END);
    return end < 0 ? -1 : end;
}

std::optional<std::string> dmabuf_unsupported(ibv_context* ctx) {
    const std::string name = device_name(ctx);
    const __be64 guid = ibv_get_device_guid(ctx->device);
    const std::scoped_lock lock(refusals_mutex);
    for (const auto& r : refusals())
        if (r.device == name && r.guid == guid)
            return r.why;
    return std::nullopt;
}

ibv_mr* register_dmabuf(const verbs::protection_domain& pd, int fd, std::uint64_t offset,
                        std::size_t length, std::uint64_t iova, rights granted) {
    constexpr std::string_view verb = "ibv_reg_dmabuf_mr";
    if (length == 0)
        throw_error(verb, EINVAL, "zero length");
    if (fd < 0)
        throw_error(verb, EBADF, fmt::format("fd {}", fd));
    ibv_context* ctx = pd.get()->context;
    if (auto why = dmabuf_unsupported(ctx))
        throw_error(verb, EOPNOTSUPP, *why);
    ibv_mr* mr = ::ibv_reg_dmabuf_mr(pd.get(), offset, length, iova, fd, to_ibv(granted));
    if (mr != nullptr)
        return mr;
    const int err = errno;
    std::string detail = refusal_detail(err, fd, offset, length, device_name(ctx));
    // Remembered only when the device refuses any dma-buf, not this one (an
    // exporter's memory it cannot map, some rights): asked with no buffer at
    // all (fd -1), a device with dma-buf MRs says EBADF, one without EOPNOTSUPP.
    if (err == EOPNOTSUPP && device_refuses_any(pd)) {
        const std::scoped_lock lock(refusals_mutex);
        refusals().push_back({device_name(ctx), ibv_get_device_guid(ctx->device), detail});
    }
    throw_error(verb, err, detail);
}

} // namespace rdmax
