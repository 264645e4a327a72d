#pragma once
// Descriptors in tests: how many this process has open (to show that none
// leaked), and a message with descriptors sent by hand, as a hostile local
// peer would (SCM_RIGHTS beside a few bytes, by a sendmsg of its own).

#include <array>
#include <cstddef>
#include <cstring>
#include <dirent.h>
#include <span>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "catch.hpp"

namespace rdmax::test {

/// Descriptors this process has open (with those of /proc/self/fd's own listing).
inline std::size_t open_fds() {
    std::size_t n = 0;
    if (DIR* d = opendir("/proc/self/fd")) {
        while (readdir(d) != nullptr)
            ++n;
        closedir(d);
    }
    return n;
}

/// Sends `bytes` zero bytes (at most 4: a length prefix cut short, or one
/// piece of a message) and `fds` (at most 16) beside them on the Unix socket
/// `sock`; what sendmsg returned (the peer may have closed: -1).
inline ssize_t send_with_fds(int sock, std::size_t bytes, std::span<const int> fds) {
    constexpr std::size_t most_fds = 16;
    std::array<char, 4> data{};
    REQUIRE(bytes <= data.size());
    REQUIRE(fds.size() <= most_fds);
    iovec iov{data.data(), bytes};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * most_fds)] = {};
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = control;
    m.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    if (c == nullptr)
        return -1; // never: the control buffer holds a header (GCC cannot tell)
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    return sendmsg(sock, &m, MSG_NOSIGNAL);
}

/// send_with_fds, which must send every byte.
inline void send_raw(int sock, std::size_t bytes, std::span<const int> fds) {
    REQUIRE(send_with_fds(sock, bytes, fds) == static_cast<ssize_t>(bytes));
}

} // namespace rdmax::test
