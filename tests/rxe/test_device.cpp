// The harness's first proof: a real RDMA device is there and usable.
#include "../support/test_device.hpp"

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include <rdmax/rdmax.hpp>

#include "../support/catch.hpp"

using namespace rdmax;

TEST_CASE("the test device opens and reports its limits") {
    verbs::context ctx = test::open_test_device();
    CHECK(!ctx.name().empty());
    CHECK(ctx.limits().phys_port_cnt >= 1);
    CHECK(ctx.limits().max_qp > 0);
    CHECK(ctx.limits().max_cqe > 0);
    CHECK(ctx.limits().max_mr_size > 0);
    const std::vector<std::string> names = verbs::device_names();
    CHECK(std::find(names.begin(), names.end(), ctx.name()) != names.end());
}

TEST_CASE("port 1 is ACTIVE and carries the GID connections will use") {
    verbs::context ctx = test::open_test_device();
    const verbs::port_info port = ctx.port(1);
    CHECK(port.active());
    if (auto addr = test::test_address()) {
        // In the VM: rxe0 on a dummy netdev with 192.0.2.1/24.
        auto wanted = verbs::gid::parse(*addr);
        REQUIRE(wanted.has_value());
        CHECK(port.is_roce());
        auto entry = ctx.find_gid(1, *wanted, verbs::gid_type::roce_v2);
        REQUIRE(entry.has_value());
        auto preferred = ctx.preferred_gid(1);
        REQUIRE(preferred.has_value());
        CHECK(preferred->value == *wanted);
        CHECK(preferred->type == verbs::gid_type::roce_v2);
    } else if (port.is_roce()) {
        auto preferred = ctx.preferred_gid(1);
        REQUIRE(preferred.has_value());
        CHECK(preferred->type == verbs::gid_type::roce_v2);
    } else {
        CHECK(port.lid != 0); // InfiniBand addresses by LID
    }
}

TEST_CASE("asking for a port the device lacks is an error that says so") {
    verbs::context ctx = test::open_test_device();
    CHECK_THROWS_WITH(ctx.port(0), Catch::Matchers::Contains("ibv_query_port"));
    CHECK_THROWS_AS(ctx.port(static_cast<std::uint8_t>(ctx.limits().phys_port_cnt + 1)),
                    rdmax::error);
}

TEST_CASE("opening a device that does not exist names the devices that do") {
    CHECK_THROWS_WITH(verbs::context::open("no_such_dev0"),
                      Catch::Matchers::Contains("no_such_dev0") &&
                          Catch::Matchers::Contains("ibv_open_device"));
}

TEST_CASE("a protection domain, a completion queue and a registered buffer can be created") {
    verbs::context ctx = test::open_test_device();
    verbs::protection_domain pd(ctx);
    CHECK(pd.get() != nullptr);

    verbs::completion_queue cq(ctx, 64);
    CHECK(cq.capacity() >= 64);
    std::vector<ibv_wc> wcs(8);
    CHECK(cq.poll(wcs) == 0); // nothing posted, nothing completed

    std::vector<std::byte> buf(64 * 1024, std::byte{0x5a});
    memory_region<rights::local_write | rights::remote_read | rights::remote_write> mr(pd, buf);
    CHECK(mr.data() == buf.data());
    CHECK(mr.size() == buf.size());
    CHECK(mr.lkey() != 0);
    CHECK(mr.rkey() != 0);
    CHECK(mr.data()[100] == std::byte{0x5a}); // registration leaves the bytes alone

    // Moving transfers ownership; the moved-from region no longer owns the MR.
    auto moved = std::move(mr);
    CHECK(moved.get() != nullptr);
    // NOLINTNEXTLINE(bugprone-use-after-move): the moved-from state is the point
    CHECK(mr.get() == nullptr);
}

TEST_CASE("bad requests are refused with the verb's name") {
    verbs::context ctx = test::open_test_device();
    verbs::protection_domain pd(ctx);
    CHECK_THROWS_WITH(verbs::completion_queue(ctx, 0), Catch::Matchers::Contains("ibv_create_cq"));
    CHECK_THROWS_WITH(verbs::completion_queue(ctx, ctx.limits().max_cqe + 1),
                      Catch::Matchers::Contains("at most"));
    std::byte b{};
    CHECK_THROWS_WITH((memory_region<rights::local_write>(pd, &b, 0)),
                      Catch::Matchers::Contains("ibv_reg_mr") &&
                          Catch::Matchers::Contains("zero length"));
}
