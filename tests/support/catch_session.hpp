#pragma once
// Catch::Session for a test main of our own (Catch2 2 and 3 alike).

#if __has_include(<catch2/catch_session.hpp>)
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif
