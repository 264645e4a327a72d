// main() of the unit tests: they need nothing but the CPU.
#include "catch_session.hpp"

int main(int argc, char** argv) {
    return Catch::Session().run(argc, argv);
}
