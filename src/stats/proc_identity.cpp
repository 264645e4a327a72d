// Process identity from /proc (proc_identity.hpp).

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include <rdmax/stats/proc_identity.hpp>

namespace rdmax::stats {

std::uint64_t start_ticks_of(pid_t pid) noexcept {
    char path[32];
    std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
    std::FILE* f = std::fopen(path, "re");
    if (f == nullptr)
        return 0;
    std::array<char, 1024> buf{};
    const std::size_t n = std::fread(buf.data(), 1, buf.size() - 1, f);
    std::fclose(f);
    buf[n] = '\0';
    // The fields after the command's last ')' (a command may hold spaces and
    // parentheses): the state is field 3, the start time field 22.
    const char* p = std::strrchr(buf.data(), ')');
    if (p == nullptr)
        return 0;
    ++p;
    while (*p == ' ')
        ++p;
    if (*p == 'Z' || *p == 'X')
        return 0; // exited: its grant goes with it
    for (int field = 3; field < 22; ++field) {
        while (*p == ' ')
            ++p;
        while (*p != ' ' && *p != '\0')
            ++p;
    }
    char* end = nullptr;
    const std::uint64_t t = std::strtoull(p, &end, 10);
    return end != p ? t : 0;
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
