#pragma once
// Descriptors between two processes on one node: a Unix-domain socket
// carries a small message and, beside it, file descriptors (SCM_RIGHTS), and
// says who is at the other end (SO_PEERCRED: the pid CMA needs, the uid).
// This is how an owner hands a peer its control segment and its exports'
// memfds; abstract names (no file in the file system) are per network
// namespace, so reaching one means being on the same node.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <sys/types.h>
#include <utility>
#include <vector>

struct msghdr; // <sys/socket.h>

namespace rdmax::local {

/// Who is at the other end of a connected Unix socket.
struct peer_credentials {
    pid_t pid = 0;
    uid_t uid = 0;
    gid_t gid = 0;
};

/// One message of a unix_channel, read a piece at a time without blocking:
/// for an event loop that must not wait on a peer (a server's handshakes).
/// The descriptors that came with it belong to the reader until taken, and
/// are closed with it: a message that never ends, or ends in an error,
/// leaves no descriptor behind.
class message_reader {
public:
    enum class state : std::uint8_t { more, done, failed };

    /// A message of at most `room` bytes (and 4 KiB) is expected, with at
    /// most `most_fds` descriptors (and 16) beside it. With 0 none is ever
    /// installed in this process (recvmsg without control space: the kernel
    /// drops what a peer sent); a peer that sends more than `most_fds`
    /// fails the message with EPROTO.
    explicit message_reader(std::size_t room, std::size_t most_fds = 16) noexcept
        : room_(room)
        , most_fds_(std::min<std::size_t>(most_fds, 16)) {}
    message_reader(message_reader&& o) noexcept;
    message_reader& operator=(message_reader&& o) noexcept;
    message_reader(const message_reader&) = delete;
    message_reader& operator=(const message_reader&) = delete;
    ~message_reader() { close_fds(); }

    /// Reads what `fd` has now (never waits, never reads past the message):
    /// more (wait for readability and call again), done (message() and
    /// take_fds()), failed (error() says why; the descriptors are closed).
    [[nodiscard]] state read_some(int fd) noexcept;
    [[nodiscard]] state current() const noexcept { return state_; }
    /// The message's bytes, when done.
    [[nodiscard]] std::span<const std::byte> message() const noexcept;
    /// The descriptors that came with it; the caller owns them from now on.
    [[nodiscard]] std::vector<int> take_fds() noexcept { return std::exchange(fds_, {}); }
    /// errno of a failure: ECONNRESET (the peer closed), EMSGSIZE, EPROTO
    /// (descriptors over most_fds), ENOMEM, or recvmsg's.
    [[nodiscard]] int error() const noexcept { return error_; }

private:
    state fail(int err) noexcept;
    void close_fds() noexcept;
    /// Keeps the descriptors `m` brought, closing any past most_fds_ (then false).
    bool keep_fds(msghdr& m) noexcept;
    /// Counts `bytes` more read: the prefix once whole (checked), then done.
    void took(std::size_t bytes) noexcept;

    std::size_t room_;
    std::size_t most_fds_;
    std::uint32_t want_ = UINT32_MAX; ///< the length prefix, once read
    std::size_t got_ = 0;             ///< bytes of prefix and message read
    std::array<std::byte, 4096 + 4> buf_{};
    std::vector<int> fds_;
    state state_ = state::more;
    int error_ = 0;
};

/// A connected Unix stream socket (move-only).
class unix_channel {
public:
    /// Connects to the abstract name `name` (no leading NUL). Throws
    /// rdmax::error (ECONNREFUSED when nobody listens: not on this node;
    /// EAGAIN, without `wait_for_room`, when the listener's backlog is full,
    /// where a connect would otherwise wait for as long as it stays full).
    [[nodiscard]] static unix_channel connect(std::string_view name, bool wait_for_room = true);
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
    /// the peer closed, or when the message is over `bytes`; then every
    /// descriptor that came with it is closed.
    std::size_t receive(std::span<std::byte> bytes, std::vector<int>& fds,
                        std::chrono::milliseconds timeout);
    [[nodiscard]] peer_credentials peer() const;
    [[nodiscard]] int fd() const noexcept { return fd_; }
    /// The descriptor, now the caller's (this channel holds none).
    [[nodiscard]] int release() noexcept { return std::exchange(fd_, -1); }

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
