// Process identity from /proc (proc_identity.hpp).

#include <cstdio>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include <rdmax/stats/proc_identity.hpp>

namespace rdmax::stats {

std::uint64_t start_ticks_of(pid_t pid) noexcept {
    char path[64];
    std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
    std::FILE* f = std::fopen(path, "re");
    if (f == nullptr)
        return 0;
    char buf[1024];
    const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    buf[n] = '\0';
    // The name (field 2) is in parentheses and may hold spaces and ')':
    // fields are counted after its last ')'.
    const char* p = std::strrchr(buf, ')');
    if (p == nullptr)
        return 0;
    int field = 2;
    for (++p; *p != '\0'; ++p) {
        if (*p != ' ')
            continue;
        if (++field == 22) {
            unsigned long long v = 0;
            return std::sscanf(p + 1, "%llu", &v) == 1 ? v : 0;
        }
    }
    return 0;
}

std::string comm_of(pid_t pid) {
    char path[64];
    std::snprintf(path, sizeof path, "/proc/%d/comm", static_cast<int>(pid));
    std::FILE* f = std::fopen(path, "re");
    if (f == nullptr)
        return {};
    char buf[64] = {};
    const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    std::string s(buf, n);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\0'))
        s.pop_back();
    return s;
}

} // namespace rdmax::stats
