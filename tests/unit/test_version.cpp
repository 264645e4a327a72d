// rdmax/version.hpp is generated from meson.build: its macros must say what
// meson.build's project(version : ...) says, read here from the file itself
// rather than from the build (which made the header and would agree with it).
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include <fmt/format.h>

#include <rdmax/version.hpp>

#include "../support/catch.hpp"

namespace {

std::string project_version_in_meson_build() {
    const char* root = std::getenv("RDMAX_SOURCE_ROOT");
    REQUIRE(root != nullptr);
    std::ifstream in(std::string(root) + "/meson.build");
    REQUIRE(in.good());
    std::stringstream text;
    text << in.rdbuf();
    // The first `version : '...'` is project()'s: it is the file's first call.
    static const std::regex version_arg(R"(version\s*:\s*'([^']*)')");
    std::smatch m;
    const std::string s = text.str();
    REQUIRE(std::regex_search(s, m, version_arg));
    return m[1].str();
}

} // namespace

TEST_CASE("RDMAX_VERSION_* match meson.build's project version") {
    const std::string expected = project_version_in_meson_build();
    CHECK(std::string(RDMAX_VERSION_STRING) == expected);
    CHECK(fmt::format("{}.{}.{}", RDMAX_VERSION_MAJOR, RDMAX_VERSION_MINOR, RDMAX_VERSION_PATCH) ==
          expected);
    CHECK(std::string(rdmax::version_string) == expected);
    STATIC_REQUIRE(RDMAX_VERSION ==
                   RDMAX_VERSION_MAJOR * 10000 + RDMAX_VERSION_MINOR * 100 + RDMAX_VERSION_PATCH);
    STATIC_REQUIRE(rdmax::version_major == RDMAX_VERSION_MAJOR);
}
