#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <poll.h>
#include <string>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <utility>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/local/descriptor_passing.hpp>

namespace rdmax::local {

namespace {
constexpr std::size_t most_fds = 16;
constexpr std::size_t most_bytes = 4096;

socklen_t abstract_address(std::string_view name, sockaddr_un& a) {
    if (name.empty() || name.size() + 1 > sizeof(a.sun_path))
        throw_error("unix socket", EINVAL,
                    fmt::format("name '{}': 1 to {} bytes", name, sizeof(a.sun_path) - 1));
    a = {};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path + 1, name.data(), name.size()); // sun_path[0] = 0: abstract
    return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}
} // namespace

unix_channel unix_channel::connect(std::string_view name, bool wait_for_room) {
    sockaddr_un a{};
    const socklen_t len = abstract_address(name, a);
    const int fd =
        socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | (wait_for_room ? 0 : SOCK_NONBLOCK), 0);
    if (fd < 0)
        throw_error("socket(AF_UNIX)", errno, std::string(name));
    // Without waiting, a listener's full backlog is EAGAIN at once, not a
    // wait with no end (a Unix connect has no timeout of its own).
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 ||
        (!wait_for_room && fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0)) {
        const int err = errno;
        close(fd);
        throw_error("connect(AF_UNIX)", err, fmt::format("@{}", name));
    }
    return unix_channel(fd);
}

std::pair<unix_channel, unix_channel> unix_channel::pair() {
    int fds[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0)
        throw_error("socketpair(AF_UNIX)", errno);
    return {unix_channel(fds[0]), unix_channel(fds[1])};
}

unix_channel::unix_channel(unix_channel&& o) noexcept
    : fd_(std::exchange(o.fd_, -1)) {}

unix_channel& unix_channel::operator=(unix_channel&& o) noexcept {
    if (this != &o) {
        if (fd_ >= 0)
            close(fd_);
        fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
}

unix_channel::~unix_channel() {
    if (fd_ >= 0)
        close(fd_);
}

void unix_channel::send(std::span<const std::byte> bytes, std::span<const int> fds) {
    if (bytes.empty() || bytes.size() > most_bytes || fds.size() > most_fds)
        throw_error(
            "sendmsg", EINVAL,
            fmt::format("{} bytes and {} descriptors: 1 to {} bytes, at most {} descriptors",
                        bytes.size(), fds.size(), most_bytes, most_fds));
    // Length-prefixed, so that the receiver takes one message whole.
    const auto n = static_cast<std::uint32_t>(bytes.size());
    iovec iov[2] = {{const_cast<std::uint32_t*>(&n), sizeof n},
                    {const_cast<std::byte*>(bytes.data()), bytes.size()}};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * most_fds)] = {};
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = 2;
    if (!fds.empty()) {
        m.msg_control = control;
        m.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
        cmsghdr* c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
        std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    const std::size_t total = sizeof n + bytes.size();
    const ssize_t sent = sendmsg(fd_, &m, MSG_NOSIGNAL);
    if (sent < 0)
        throw_error("sendmsg", errno, "unix channel");
    // A stream socket may take part of it: send the rest (the descriptors went with the first
    // part).
    auto done = static_cast<std::size_t>(sent);
    std::vector<std::byte> all(total);
    std::memcpy(all.data(), &n, sizeof n);
    std::memcpy(all.data() + sizeof n, bytes.data(), bytes.size());
    while (done < total) {
        const ssize_t w = ::send(fd_, all.data() + done, total - done, MSG_NOSIGNAL);
        if (w < 0 && errno != EINTR)
            throw_error("send", errno, "unix channel");
        if (w > 0)
            done += static_cast<std::size_t>(w);
    }
}

message_reader::message_reader(message_reader&& o) noexcept
    : room_(o.room_)
    , most_fds_(o.most_fds_)
    , want_(o.want_)
    , got_(o.got_)
    , buf_(o.buf_)
    , fds_(std::exchange(o.fds_, {}))
    , state_(o.state_)
    , error_(o.error_) {}

message_reader& message_reader::operator=(message_reader&& o) noexcept {
    if (this != &o) {
        close_fds();
        room_ = o.room_;
        most_fds_ = o.most_fds_;
        want_ = o.want_;
        got_ = o.got_;
        buf_ = o.buf_;
        fds_ = std::exchange(o.fds_, {});
        state_ = o.state_;
        error_ = o.error_;
    }
    return *this;
}

void message_reader::close_fds() noexcept {
    for (int fd : fds_)
        close(fd);
    fds_.clear();
}

message_reader::state message_reader::fail(int err) noexcept {
    close_fds();
    error_ = err;
    state_ = state::failed;
    return state_;
}

std::span<const std::byte> message_reader::message() const noexcept {
    if (state_ != state::done)
        return {};
    return {buf_.data() + sizeof want_, want_};
}

message_reader::state message_reader::read_some(int fd) noexcept {
    // Room for every descriptor it may keep, before any comes: none is ever
    // received that could not be kept (push_back below cannot throw).
    if (fds_.capacity() < most_fds_) {
        try {
            fds_.reserve(most_fds_);
        } catch (...) {
            return fail(ENOMEM);
        }
    }
    while (state_ == state::more) {
        // Never past this message: the prefix first, then exactly its length.
        const std::size_t end = want_ == UINT32_MAX ? sizeof want_ : sizeof want_ + want_;
        alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * most_fds)] = {};
        iovec iov{buf_.data() + got_, end - got_};
        msghdr m{};
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        // Control space for what may still come, no more: the kernel installs
        // only as many descriptors as fit (with none, not one), drops the
        // rest and says so (MSG_CTRUNC).
        const std::size_t may = most_fds_ - std::min(fds_.size(), most_fds_);
        if (may != 0) {
            m.msg_control = control;
            m.msg_controllen = CMSG_LEN(sizeof(int) * may);
        }
        const ssize_t r = recvmsg(fd, &m, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return state_;
        if (r < 0)
            return fail(errno);
        // Taken before anything else can fail, so that they are closed with the rest.
        if (!keep_fds(m) || (m.msg_flags & MSG_CTRUNC) != 0)
            return fail(EPROTO); // more descriptors than this message may carry
        if (r == 0)
            return fail(ECONNRESET);
        took(static_cast<std::size_t>(r));
    }
    return state_;
}

bool message_reader::keep_fds(msghdr& m) noexcept {
    bool over = false;
    for (cmsghdr* c = m.msg_control != nullptr ? CMSG_FIRSTHDR(&m) : nullptr; c != nullptr;
         c = CMSG_NXTHDR(&m, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        const std::size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < k; ++i) {
            int got = -1;
            std::memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof got);
            if (fds_.size() < most_fds_) {
                fds_.push_back(got); // within the capacity reserved: no throw
            } else {
                close(got);
                over = true;
            }
        }
    }
    return !over;
}

void message_reader::took(std::size_t bytes) noexcept {
    got_ += bytes;
    if (want_ == UINT32_MAX && got_ == sizeof want_) {
        std::memcpy(&want_, buf_.data(), sizeof want_);
        if (want_ == 0 || want_ > most_bytes || want_ > room_)
            (void)fail(EMSGSIZE);
    } else if (want_ != UINT32_MAX && got_ == sizeof want_ + want_) {
        state_ = state::done;
    }
}

std::size_t unix_channel::receive(std::span<std::byte> bytes, std::vector<int>& fds,
                                  std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    // Owns what came until the message is whole: a throw below closes it all.
    message_reader reader(bytes.size());
    while (reader.read_some(fd_) == message_reader::state::more) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        pollfd p{fd_, POLLIN, 0};
        if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) != 1)
            throw_error("recvmsg", ETIMEDOUT, "unix channel: no message before the deadline");
    }
    if (reader.current() == message_reader::state::failed) {
        switch (reader.error()) {
        case ECONNRESET: throw_error("recvmsg", ECONNRESET, "unix channel: the peer closed it");
        case EMSGSIZE:
            throw_error("recvmsg", EMSGSIZE,
                        fmt::format("unix channel: a message over the {} bytes of room",
                                    std::min(bytes.size(), most_bytes)));
        default: throw_error("recvmsg", reader.error(), "unix channel");
        }
    }
    const std::span<const std::byte> msg = reader.message();
    std::memcpy(bytes.data(), msg.data(), msg.size());
    std::vector<int> got = reader.take_fds();
    try {
        fds.insert(fds.end(), got.begin(), got.end());
    } catch (...) {
        for (int fd : got)
            close(fd);
        throw;
    }
    return msg.size();
}

peer_credentials unix_channel::peer() const {
    ucred c{};
    socklen_t len = sizeof c;
    if (getsockopt(fd_, SOL_SOCKET, SO_PEERCRED, &c, &len) != 0)
        throw_error("getsockopt(SO_PEERCRED)", errno, "unix channel");
    return {c.pid, c.uid, c.gid};
}

unix_listener::unix_listener(std::string_view name) {
    sockaddr_un a{};
    const socklen_t len = abstract_address(name, a);
    fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd_ < 0)
        throw_error("socket(AF_UNIX)", errno, std::string(name));
    if (bind(fd_, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(fd_, 64) != 0) {
        const int err = errno;
        close(fd_);
        fd_ = -1;
        throw_error("bind(AF_UNIX)", err, fmt::format("@{}", name));
    }
}

unix_listener::unix_listener(unix_listener&& o) noexcept
    : fd_(std::exchange(o.fd_, -1)) {}

unix_listener::~unix_listener() {
    if (fd_ >= 0)
        close(fd_);
}

unix_channel unix_listener::accept(std::chrono::milliseconds timeout) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(timeout.count())) != 1)
        return unix_channel();
    const int fd = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
            return unix_channel();
        throw_error("accept4(AF_UNIX)", errno, "unix listener");
    }
    return unix_channel(fd);
}

} // namespace rdmax::local
