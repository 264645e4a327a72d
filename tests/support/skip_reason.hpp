#pragma once
// For a test program that may lack what it needs (a device, a kernel
// feature): it defines skip_reason(), and skip_main.cpp's main() reports
// SKIP (exit 77) with that reason instead of running the test cases.

#include <optional>
#include <string>

namespace rdmax::test {

/// Why this program cannot test here, or nullopt when it can.
[[nodiscard]] std::optional<std::string> skip_reason();

} // namespace rdmax::test
