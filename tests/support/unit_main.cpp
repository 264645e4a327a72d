// main() of the unit tests: they need nothing but the CPU.
#include "catch_runner.hpp"

int main(int argc, char** argv) {
    return rdmax::test::run_catch(argc, argv);
}
