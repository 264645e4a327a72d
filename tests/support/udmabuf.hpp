#pragma once
// A dma-buf for the dmabuf suite: memfd pages exported by /dev/udmabuf, the
// kernel's own exporter (CONFIG_UDMABUF, on in Debian's 7.x), and mapped here
// so that a test checks the very pages the device reached.

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <fcntl.h>
#include <linux/udmabuf.h>
#include <span>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "catch.hpp"

namespace rdmax::test {

/// A memfd of `size` bytes mapped here, and a dma-buf of it from /dev/udmabuf.
struct udmabuf {
    int memfd = -1;
    int fd = -1;
    std::byte* cpu = nullptr;
    std::size_t size;

    explicit udmabuf(std::size_t n)
        : size(n) {
        memfd = ::memfd_create("rdmax-dmabuf-probe", MFD_ALLOW_SEALING | MFD_CLOEXEC);
        REQUIRE(memfd >= 0);
        REQUIRE(::ftruncate(memfd, static_cast<off_t>(n)) == 0);
        // udmabuf refuses a memfd that could shrink under the dma-buf.
        REQUIRE(::fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
        void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
        REQUIRE(p != MAP_FAILED);
        cpu = static_cast<std::byte*>(p);
        const int dev = ::open("/dev/udmabuf", O_RDWR | O_CLOEXEC);
        INFO("open /dev/udmabuf: " << std::strerror(errno));
        REQUIRE(dev >= 0);
        udmabuf_create create{};
        create.memfd = static_cast<__u32>(memfd);
        create.flags = UDMABUF_FLAGS_CLOEXEC;
        create.offset = 0;
        create.size = n;
        fd = ::ioctl(dev, UDMABUF_CREATE, &create);
        const int err = errno;
        ::close(dev);
        INFO("UDMABUF_CREATE: " << std::strerror(err));
        REQUIRE(fd >= 0);
    }
    udmabuf(const udmabuf&) = delete;
    udmabuf& operator=(const udmabuf&) = delete;
    ~udmabuf() {
        if (cpu != nullptr)
            ::munmap(cpu, size);
        if (fd >= 0)
            ::close(fd);
        if (memfd >= 0)
            ::close(memfd);
    }
    std::span<std::byte> bytes(std::size_t off, std::size_t n) const { return {cpu + off, n}; }
};

} // namespace rdmax::test
