#pragma once
// Descriptors between two processes on one node: a Unix-domain socket
// carries a small message and, beside it, file descriptors (SCM_RIGHTS), and
// says who is at the other end (SO_PEERCRED: the pid CMA needs, the uid).
// This is how an owner hands a peer its control segment and its exports'
// memfds; abstract names (no file in the file system) are per network
// namespace, so reaching one means being on the same node.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <sys/types.h>
#include <vector>

namespace rdmax::local {

/// Who is at the other end of a connected Unix socket.
struct peer_credentials {
    pid_t pid = 0;
    uid_t uid = 0;
    gid_t gid = 0;
};

/// A connected Unix stream socket (move-only).
class unix_channel {
public:
    /// Connects to the abstract name `name` (no leading NUL). Throws
    /// rdmax::error (ECONNREFUSED when nobody listens: not on this node).
    [[nodiscard]] static unix_channel connect(std::string_view name);
    /// A connected pair, for tests and for a parent and its child (whose
    /// peer() is the pair's creator on both ends: SO_PEERCRED's rule).
    [[nodiscard]] static std::pair<unix_channel, unix_channel> pair();

    unix_channel() = default;
    explicit unix_channel(int fd) noexcept
        : fd_(fd) {}
    unix_channel(unix_channel&& o) noexcept;
    unix_channel& operator=(unix_channel&& o) noexcept;
    unix_channel(const unix_channel&) = delete;
    unix_channel& operator=(const unix_channel&) = delete;
    ~unix_channel();

    /// Sends `bytes` (at most 4 KiB) with `fds` beside them (at most 16).
    /// Throws rdmax::error.
    void send(std::span<const std::byte> bytes, std::span<const int> fds = {});
    /// Receives one message into `bytes` (returns its length) and the
    /// descriptors that came with it into `fds` (owned by the caller now),
    /// waiting up to `timeout`. Throws rdmax::error at the deadline, when
    /// the peer closed, or when more descriptors came than asked for (they
    /// are closed).
    std::size_t receive(std::span<std::byte> bytes, std::vector<int>& fds,
                        std::chrono::milliseconds timeout);
    [[nodiscard]] peer_credentials peer() const;
    [[nodiscard]] int fd() const noexcept { return fd_; }

private:
    int fd_ = -1;
};

/// Listens on an abstract Unix name.
class unix_listener {
public:
    explicit unix_listener(std::string_view name);
    unix_listener(unix_listener&& o) noexcept;
    unix_listener& operator=(unix_listener&&) = delete;
    unix_listener(const unix_listener&) = delete;
    unix_listener& operator=(const unix_listener&) = delete;
    ~unix_listener();

    /// The next connection, waiting up to `timeout`; nullopt-like empty
    /// channel (fd() < 0) at the deadline.
    [[nodiscard]] unix_channel accept(std::chrono::milliseconds timeout);
    [[nodiscard]] int fd() const noexcept { return fd_; }

private:
    int fd_ = -1;
};

} // namespace rdmax::local
