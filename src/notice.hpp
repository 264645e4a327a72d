#pragma once
// One line on stderr: how the library says it fell back to something
// (another monitor, registration per use, the device instead of the node's
// memory). notice_once: once per process and message. Meant as the one way
// the library writes to stderr; registration_cache.hpp still prints one
// message with fmt::print(stderr) of its own. Private to src/.

#include <cstdio>
#include <mutex>
#include <string_view>

namespace rdmax::detail {

inline void notice(std::string_view line) noexcept {
    std::fprintf(stderr, "rdmax: %.*s\n", static_cast<int>(line.size()), line.data());
}

inline void notice_once(std::once_flag& once, std::string_view line) {
    std::call_once(once, [&] { notice(line); });
}

} // namespace rdmax::detail
