// main() of the rxe tests: SKIP (exit 77) when no RDMA device can be opened,
// so that a machine without one never counts these tests as passed.
#include <fmt/format.h>

#include "catch_session.hpp"
#include "test_device.hpp"

int main(int argc, char** argv) {
    if (auto why = rdmax::test::device_unavailable()) {
        fmt::print("SKIP: {}\n", *why);
        return rdmax::test::exit_skip;
    }
    return Catch::Session().run(argc, argv);
}
