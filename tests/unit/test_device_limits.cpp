#include <string>

#include <fmt/format.h>

#include <rdmax/verbs/device_limits.hpp>
#include <rdmax/verbs/port.hpp>

#include "../support/catch.hpp"

TEST_CASE("device limits print one aligned row per limit") {
    rdmax::verbs::device_limits l;
    l.name = "rxe0";
    l.max_qp = 1048576;
    l.max_cqe = 32767;
    l.max_mr_size = 1ull << 40;
    l.atomics = true;
    const std::string text = fmt::format("{}", l);
    CHECK(text.find("  device                 rxe0\n") != std::string::npos);
    CHECK(text.find("  max_qp                 1048576\n") != std::string::npos);
    CHECK(text.find("  max_cqe                32767\n") != std::string::npos);
    CHECK(text.find("  atomics                yes\n") != std::string::npos);
    CHECK(text.find("  on-demand paging       no\n") != std::string::npos);
}

TEST_CASE("port states and MTUs print as users know them") {
    CHECK(rdmax::verbs::to_string(IBV_PORT_ACTIVE) == "ACTIVE");
    CHECK(rdmax::verbs::to_string(IBV_PORT_DOWN) == "DOWN");
    CHECK(rdmax::verbs::mtu_bytes(IBV_MTU_1024) == 1024);
    CHECK(rdmax::verbs::mtu_bytes(IBV_MTU_4096) == 4096);
    CHECK(fmt::format("{}", rdmax::verbs::link_layer::ethernet) == "Ethernet");
}
