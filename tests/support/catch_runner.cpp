// The one unit that holds Catch2's implementation (Catch2 2 and 3 alike).
#include "catch_runner.hpp"

#if __has_include(<catch2/catch_session.hpp>)
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

int rdmax::test::run_catch(int argc, char** argv) {
    return Catch::Session().run(argc, argv);
}
