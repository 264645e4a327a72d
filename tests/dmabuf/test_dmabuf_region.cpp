// dmabuf_region (issue 30, item 2): a dma-buf range registered with its rights
// in its type, addressed through the same local() / remote() views as host
// memory, bytes checked in the exporter's pages; refusals say why.
#include <cerrno>
#include <cstring>
#include <string>
#include <sys/mman.h>
#include <unistd.h>

#include "../support/loopback.hpp"
#include "../support/udmabuf.hpp"

using namespace rdmax;
using namespace rdmax::test;

namespace {

template <typename Qp, typename Src, typename Dst>
concept can_write = requires(Qp& qp, Src src, Dst dst) { qp.write(src, dst, 0, 0); };

using read_only_region = dmabuf_region<rights::local_write | rights::remote_read>;
static_assert(!can_write<verbs::queue_pair<verbs::rc>, local_buffer<all_rights>,
                         decltype(std::declval<read_only_region&>().remote())>,
              "a region without remote_write is no target of an RDMA WRITE");
static_assert(can_write<verbs::queue_pair<verbs::rc>, local_buffer<all_rights>,
                        decltype(std::declval<dmabuf_region<all_rights>&>().remote())>);

std::string refusal(const verbs::protection_domain& pd, int fd, std::uint64_t offset,
                    std::size_t length, int& err) {
    try {
        dmabuf_region<all_rights> r(pd, fd, offset, length);
    } catch (const rdmax::error& e) {
        err = e.code().value();
        return e.what();
    }
    return {};
}

} // namespace

TEST_CASE("a dmabuf_region moves bytes through its views, addressed at its iova") {
    loopback lp;
    udmabuf buf(1 << 20);
    dmabuf_region<all_rights> region(lp.pd, buf.fd, 0, buf.size);
    CHECK(region.offset() == 0);
    CHECK(region.size() == buf.size);
    CHECK(region.remote().addr == dmabuf_iova_base);
    CHECK(reinterpret_cast<std::uint64_t>(region.local().addr) == dmabuf_iova_base);

    registered host(lp.pd, 256 * 1024);
    fill_pattern(host.bytes, 3);
    std::memset(buf.cpu, 0xee, buf.size);
    REQUIRE(lp.a.write(host.mr.local(), region.remote(), 100, 1) == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(buf.bytes(100, host.bytes.size()), 3));
    CHECK(buf.cpu[99] == std::byte{0xee});

    // A sub-range of the region as the local sink of a READ from host memory.
    fill_pattern(host.bytes, 8);
    const auto sink = region.local(512 * 1024, 4096);
    REQUIRE(sink.has_value());
    REQUIRE(lp.a.read(*sink, host.mr.remote(), 0, 2) == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(buf.bytes(512 * 1024, 4096), 8));
    CHECK_FALSE(region.local(buf.size - 10, 11).has_value());

    // The region as the local source of a WRITE, and the remote side of a READ.
    fill_pattern(buf.bytes(0, buf.size), 12);
    REQUIRE(lp.a.write(*region.local(0, 65536), host.mr.remote(), 0, 3) == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(std::span(host.bytes).first(65536), 12));
    std::memset(host.bytes.data(), 0, host.bytes.size());
    REQUIRE(lp.a.read(host.mr.local(), region.remote(), 4096, 4) == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(host.bytes, 12 + 4096));
}

TEST_CASE("a dmabuf_region over part of a buffer keeps it when all else is closed") {
    loopback lp;
    udmabuf buf(256 * 1024);
    constexpr std::uint64_t at = 2 * 4096 + 100;
    dmabuf_region<all_rights> region(lp.pd, buf.fd, at, 64 * 1024);
    CHECK(region.offset() == at);
    CHECK(region.remote().addr == dmabuf_iova_base + at);
    registered host(lp.pd, 64 * 1024);
    fill_pattern(host.bytes, 21);
    REQUIRE(lp.a.write(host.mr.local(), region.remote(), 0, 1) == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(buf.bytes(at, 64 * 1024), 21));

    // The dma-buf's fd, the memfd and its mapping all gone: only the
    // registration holds the pages, and they still take and give bytes.
    ::munmap(buf.cpu, buf.size);
    buf.cpu = nullptr;
    ::close(buf.fd);
    buf.fd = -1;
    ::close(buf.memfd);
    buf.memfd = -1;
    fill_pattern(host.bytes, 22);
    REQUIRE(lp.a.write(host.mr.local(), region.remote(), 0, 2) == status::ok);
    CHECK(wait_send(lp.a).ok());
    registered back(lp.pd, 64 * 1024);
    REQUIRE(lp.a.read(back.mr.local(), region.remote(), 0, 3) == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(back.bytes, 22));

    // Moved: the new owner holds it, the old one is empty.
    dmabuf_region<all_rights> moved = std::move(region);
    CHECK(moved.get() != nullptr);
    CHECK(region.get() == nullptr); // NOLINT(bugprone-use-after-move): moved-from state
}

TEST_CASE("the device enforces a dmabuf_region's rights") {
    loopback lp;
    udmabuf buf(64 * 1024);
    read_only_region region(lp.pd, buf.fd, 0, buf.size);
    std::memset(buf.cpu, 0xee, buf.size);
    registered host(lp.pd, 4096);
    // A peer that claims remote write anyway is refused by the device.
    const remote_buffer<all_rights> forged{region.remote().addr, buf.size, region.rkey(), 0};
    REQUIRE(lp.a.write(host.mr.local(), forged, 0, 1) == status::ok);
    CHECK_FALSE(wait_send(lp.a).ok());
    CHECK(buf.cpu[0] == std::byte{0xee});
}

TEST_CASE("a refused dma-buf registration says why") {
    loopback lp;
    udmabuf buf(64 * 1024);
    int err = 0;
    std::string why = refusal(lp.pd, buf.fd, 60 * 1024, 8192, err);
    CHECK(err == EINVAL);
    CHECK(why.find("not inside the buffer (65536 bytes)") != std::string::npos);

    why = refusal(lp.pd, buf.memfd, 0, 4096, err); // a memfd is no dma-buf
    CHECK(err == EINVAL);
    CHECK(why.find("is not a dma-buf") != std::string::npos);

    why = refusal(lp.pd, buf.fd, 0, 0, err);
    CHECK(err == EINVAL);
    CHECK(why.find("zero length") != std::string::npos);
    CHECK_FALSE(dmabuf_unsupported(lp.ctx.get()).has_value());
}
