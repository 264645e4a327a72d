// A device without dma-buf MRs (issue 30, item 2) is refused with the reason
// at its first dma-buf registration, and from then on without being asked
// again. Debian 12's rxe provider has no reg_dmabuf_mr: libibverbs answers
// EOPNOTSUPP (the dmabuf suite runs with tests/vm/rdma-core's provider
// instead). On a device that has them, a memfd (no dma-buf) is refused as such.
#include <cerrno>
#include <string>
#include <sys/mman.h>
#include <unistd.h>

#include "../support/loopback.hpp"

using namespace rdmax;
using namespace rdmax::test;

TEST_CASE("a dma-buf registration on a device without them says why, once asked") {
    loopback lp;
    const int memfd = ::memfd_create("rdmax-not-a-dmabuf", MFD_CLOEXEC);
    REQUIRE(memfd >= 0);
    REQUIRE(::ftruncate(memfd, 4096) == 0);
    int err = 0;
    std::string why;
    try {
        dmabuf_region<all_rights> r(lp.pd, memfd, 0, 4096);
    } catch (const rdmax::error& e) {
        err = e.code().value();
        why = e.what();
    }
    ::close(memfd);
    INFO(why);
    REQUIRE(err != 0);
    if (err == EOPNOTSUPP) {
        CHECK(why.find("has no dma-buf memory regions") != std::string::npos);
        const auto remembered = dmabuf_unsupported(lp.ctx.get());
        REQUIRE(remembered.has_value());
        CHECK(remembered->find("has no dma-buf memory regions") != std::string::npos);
        // The next attempt is refused with the same reason, the fd not even looked at.
        try {
            dmabuf_region<all_rights> again(lp.pd, 12345, 0, 4096);
            FAIL("registered on a device without dma-buf MRs");
        } catch (const rdmax::error& e) {
            CHECK(e.code().value() == EOPNOTSUPP);
            CHECK(std::string(e.what()).find("fd 12345") == std::string::npos);
        }
    } else {
        CHECK(err == EINVAL);
        CHECK(why.find("is not a dma-buf") != std::string::npos);
        CHECK_FALSE(dmabuf_unsupported(lp.ctx.get()).has_value());
    }
}
