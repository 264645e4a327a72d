// The dma-buf probe (issue 30, step 1), before any library code: the device
// registers a udmabuf (memfd pages exported as a dma-buf) through
// ibv_reg_dmabuf_mr, and RDMA WRITE and READ move bytes into and out of it
// in both roles (remote target, local source and sink). Every byte is checked
// through the memfd's own mapping, i.e. the pages the exporter hands out.
// Needs /dev/udmabuf and a device with dma-buf MRs (tests/vm: soft-RoCE with
// tests/vm/patches/rxe-dmabuf.patch and the provider of tests/vm/rdma-core).
#include <cerrno>
#include <cstring>
#include <memory>

#include "../support/loopback.hpp"
#include "../support/udmabuf.hpp"

using namespace rdmax;
using namespace rdmax::test;

namespace {

/// An MR over [offset, offset + length) of a dma-buf, its bytes at `iova`.
struct dmabuf_mr {
    ibv_mr* mr = nullptr;
    std::uint64_t iova;
    dmabuf_mr(const verbs::protection_domain& pd, const udmabuf& buf, std::uint64_t offset,
              std::size_t length, std::uint64_t at, int access)
        : iova(at) {
        mr = ::ibv_reg_dmabuf_mr(pd.get(), offset, length, at, buf.fd, access);
        INFO("ibv_reg_dmabuf_mr: " << std::strerror(errno));
        REQUIRE(mr != nullptr);
    }
    dmabuf_mr(const dmabuf_mr&) = delete;
    dmabuf_mr& operator=(const dmabuf_mr&) = delete;
    ~dmabuf_mr() {
        if (mr != nullptr)
            CHECK(::ibv_dereg_mr(mr) == 0);
    }
    // The MR's bytes as the verbs see them: addresses in its iova space.
    [[nodiscard]] local_buffer<all_rights> local(std::uint32_t n) const {
        return {reinterpret_cast<std::byte*>(iova), n, mr->lkey};
    }
    [[nodiscard]] remote_buffer<all_rights> remote(std::uint64_t n) const {
        return {iova, n, mr->rkey};
    }
};

constexpr int every_access =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

} // namespace

TEST_CASE("a udmabuf registers, and RDMA WRITE lands in its pages") {
    loopback lp;
    udmabuf buf(1 << 20);
    dmabuf_mr dm(lp.pd, buf, 0, buf.size, 0, every_access);
    CHECK(dm.mr->length == buf.size);
    registered src(lp.pd, 256 * 1024);
    fill_pattern(src.bytes, 5);
    std::memset(buf.cpu, 0xee, buf.size);
    REQUIRE(lp.a.write(src.mr.local(), dm.remote(buf.size), 4096 + 100, 1) == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(buf.bytes(4096 + 100, src.bytes.size()), 5));
    CHECK(buf.cpu[4096 + 99] == std::byte{0xee});
    CHECK(buf.cpu[4096 + 100 + src.bytes.size()] == std::byte{0xee});
}

TEST_CASE("RDMA READ brings a udmabuf's bytes, and it is a local source and sink") {
    loopback lp;
    udmabuf buf(1 << 20);
    dmabuf_mr dm(lp.pd, buf, 0, buf.size, 0x7f0000000000, every_access);
    fill_pattern(buf.bytes(0, buf.size), 9);
    registered host(lp.pd, buf.size);
    // The dma-buf as the remote side of a READ.
    REQUIRE(lp.a.read(host.mr.local(), dm.remote(buf.size), 0, 2) == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(host.bytes, 9));
    // As the local source of a WRITE into host memory.
    std::memset(host.bytes.data(), 0, host.bytes.size());
    REQUIRE(lp.a.write(dm.local(65536), host.mr.remote(), 0, 3) == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(std::span(host.bytes).first(65536), 9));
    // As the local sink of a READ from host memory.
    fill_pattern(host.bytes, 21);
    REQUIRE(lp.a.read(dm.local(65536), host.mr.remote(), 0, 4) == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(buf.bytes(0, 65536), 21));
}

TEST_CASE("a range of a udmabuf: offset and iova share their place in a page") {
    loopback lp;
    udmabuf buf(256 * 1024);
    constexpr std::uint64_t offset = 3 * 4096 + 100;
    dmabuf_mr dm(lp.pd, buf, offset, 64 * 1024, 0x10000000 + 100, every_access);
    registered src(lp.pd, 64 * 1024);
    fill_pattern(src.bytes, 13);
    REQUIRE(lp.a.write(src.mr.local(), dm.remote(64 * 1024), 0, 5) == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(buf.bytes(offset, 64 * 1024), 13));
    // Beyond the range: refused by the device, not written.
    std::memset(buf.cpu + offset + 64 * 1024, 0xee, 16);
    remote_buffer<all_rights> past{dm.iova + 64 * 1024, 16, dm.mr->rkey};
    REQUIRE(lp.a.write(src.mr.local(0, 16), past, 0, 6) == status::ok);
    CHECK_FALSE(wait_send(lp.a).ok());
    CHECK(buf.cpu[offset + 64 * 1024] == std::byte{0xee});
    // An iova in another place of its page than the offset: refused.
    errno = 0;
    ibv_mr* odd = ::ibv_reg_dmabuf_mr(lp.pd.get(), offset, 4096, 0x10000000, buf.fd, every_access);
    CHECK(odd == nullptr);
    if (odd != nullptr)
        ::ibv_dereg_mr(odd);
}

TEST_CASE("the MR holds the dma-buf: its fd closed, the bytes still move") {
    loopback lp;
    auto buf = std::make_unique<udmabuf>(128 * 1024);
    dmabuf_mr dm(lp.pd, *buf, 0, buf->size, 0, every_access);
    ::close(buf->fd);
    buf->fd = -1;
    registered src(lp.pd, 128 * 1024);
    fill_pattern(src.bytes, 17);
    REQUIRE(lp.a.write(src.mr.local(), dm.remote(buf->size), 0, 7) == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(buf->bytes(0, buf->size), 17));
}

TEST_CASE("rights: a udmabuf registered without remote write refuses a peer's WRITE") {
    loopback lp;
    udmabuf buf(64 * 1024);
    dmabuf_mr dm(lp.pd, buf, 0, buf.size, 0, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
    std::memset(buf.cpu, 0xee, buf.size);
    registered src(lp.pd, 4096);
    fill_pattern(src.bytes, 1);
    REQUIRE(lp.a.write(src.mr.local(), dm.remote(buf.size), 0, 8) == status::ok);
    const auto c = wait_send(lp.a);
    CHECK_FALSE(c.ok());
    CHECK(buf.cpu[0] == std::byte{0xee});
}
