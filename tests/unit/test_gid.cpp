#include <fmt/format.h>

#include <rdmax/verbs/gid.hpp>

#include "../support/catch.hpp"

using rdmax::verbs::gid;
using rdmax::verbs::gid_type;

TEST_CASE("an IPv4 address maps to its RoCE v2 GID") {
    const gid g = gid::ipv4_mapped(0xC0000201); // 192.0.2.1
    CHECK(g.is_ipv4_mapped());
    CHECK(g.to_string() == "::ffff:192.0.2.1");
    CHECK(fmt::format("{}", g) == "::ffff:192.0.2.1");
    CHECK(g.raw[10] == 0xff);
    CHECK(g.raw[12] == 192);
    CHECK(g.raw[15] == 1);
}

TEST_CASE("gid::parse reads IPv4 (mapped) and IPv6 text and refuses the rest") {
    auto v4 = gid::parse("192.0.2.1");
    REQUIRE(v4.has_value());
    CHECK(*v4 == gid::ipv4_mapped(0xC0000201));

    auto v6 = gid::parse("fe80::1");
    REQUIRE(v6.has_value());
    CHECK(!v6->is_ipv4_mapped());
    CHECK(v6->raw[0] == 0xfe);
    CHECK(v6->raw[15] == 1);

    CHECK(!gid::parse("").has_value());
    CHECK(!gid::parse("rxe0").has_value());
    CHECK(!gid::parse("192.0.2.256").has_value());
}

TEST_CASE("gid round-trips through ibv_gid") {
    const gid g = *gid::parse("2001:db8::42");
    CHECK(gid::from(g.to_ibv()) == g);
    CHECK(!g.is_zero());
    CHECK(gid{}.is_zero());
}

TEST_CASE("gid types print their names") {
    CHECK(fmt::format("{}", gid_type::roce_v2) == "RoCE v2");
    CHECK(fmt::format("{}", gid_type::ib) == "IB");
}
