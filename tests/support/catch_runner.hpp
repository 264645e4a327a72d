#pragma once
// Catch2's runner, compiled once (catch_runner.cpp): its implementation is the
// slowest unit of the test build (over 30 s, 2 minutes under ASan), and the
// test mains (unit_main.cpp, skip_main.cpp) would otherwise each compile it.

namespace rdmax::test {

// Catch::Session().run(argc, argv): runs the tests the command line selects.
int run_catch(int argc, char** argv);

} // namespace rdmax::test
