#pragma once
// One line on stderr, once per process and message: how the library says it
// fell back to something (another monitor, registration per use). Private to src/.

#include <cstdio>
#include <mutex>
#include <string_view>

namespace rdmax::detail {

inline void notice_once(std::once_flag& once, std::string_view line) {
    std::call_once(once, [&] {
        std::fprintf(stderr, "rdmax: %.*s\n", static_cast<int>(line.size()), line.data());
    });
}

} // namespace rdmax::detail
