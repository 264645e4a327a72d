#pragma once
// The tests build against Debian's Catch2 2.13 and, where the wrap fallback
// was used, Catch2 3: include this instead of either's header.

#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#else
#include <catch2/catch.hpp>
#endif
