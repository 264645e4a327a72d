// main() of the tests that SKIP (exit 77) when they lack what they need, so
// that a machine without it never counts them as passed. The program defines
// rdmax::test::skip_reason().
#include <fmt/format.h>

#include "catch_runner.hpp"
#include "skip_reason.hpp"

int main(int argc, char** argv) {
    if (auto why = rdmax::test::skip_reason()) {
        fmt::print("SKIP: {}\n", *why);
        return 77;
    }
    return rdmax::test::run_catch(argc, argv);
}
