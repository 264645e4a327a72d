// TCP sockets for the RPC's tcp transport: a listener beside the server's
// rdma_cm one (the same port number), and a client's connect with a deadline.

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/detail/rpc/tcp_link.hpp>
#include <rdmax/error.hpp>

#include "../notice.hpp"

namespace rdmax::rpc {

namespace {
struct addr_list {
    addrinfo* list = nullptr;
    addr_list(const addr_list&) = delete;
    addr_list& operator=(const addr_list&) = delete;
    addr_list(std::string_view addr, std::uint16_t port, bool passive, const char* who) {
        addrinfo hints{};
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
        const std::string host(addr);
        const std::string service = std::to_string(port);
        if (const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &list); rc != 0)
            throw_error(who, EINVAL, fmt::format("getaddrinfo '{}': {}", addr, gai_strerror(rc)));
    }
    ~addr_list() {
        if (list != nullptr)
            freeaddrinfo(list);
    }
};
} // namespace

bool tcp_tune(int fd) noexcept {
    const int one = 1;
    const int flags = fcntl(fd, F_GETFL);
    return flags >= 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0 &&
           setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0;
}

int tcp_listen(std::string_view addr, std::uint16_t& port) {
    const addr_list a(addr, port, true, "rpc::server (tcp)");
    int err = EADDRNOTAVAIL;
    for (const addrinfo* ai = a.list; ai != nullptr; ai = ai->ai_next) {
        const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) {
            err = errno;
            continue;
        }
        const int one = 1;
        // A restarted server takes its port back at once (TIME_WAIT's
        // connections are the old one's).
        (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        sockaddr_storage bound{};
        socklen_t len = sizeof bound;
        if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 128) == 0 &&
            getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
            port = ntohs(bound.ss_family == AF_INET6
                             ? reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port
                             : reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
            return fd;
        }
        err = errno;
        ::close(fd);
    }
    throw_error("bind(tcp)", err, fmt::format("{}:{}", addr, port));
}

int tcp_connect(std::string_view addr, std::uint16_t port, std::chrono::milliseconds timeout) {
    const addr_list a(addr, port, false, "rpc::client::connect (tcp)");
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int err = EHOSTUNREACH;
    for (const addrinfo* ai = a.list; ai != nullptr; ai = ai->ai_next) {
        const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
            // Waited for up to the deadline, not the kernel's minutes of SYN retries.
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                deadline - std::chrono::steady_clock::now());
            pollfd p{fd, POLLOUT, 0};
            int so = ETIMEDOUT;
            socklen_t len = sizeof so;
            if (left.count() > 0 && ::poll(&p, 1, static_cast<int>(left.count())) == 1)
                (void)getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &len);
            rc = so == 0 ? 0 : -1;
            errno = so;
        }
        if (rc == 0 && tcp_tune(fd))
            return fd;
        err = errno;
        ::close(fd);
    }
    throw_error("connect(tcp)", err, fmt::format("{}:{}", addr, port));
}

int tcp_listen_for(std::string_view who, std::string_view addr, std::uint16_t& port, bool needed) {
    try {
        return tcp_listen(addr, port);
    } catch (const error& e) {
        if (needed)
            throw;
        rdmax::detail::notice(fmt::format("{} on {}:{}: no TCP listener ({}); peers with "
                                          "neither rdma nor shm to it cannot connect",
                                          who, addr, port, e.what()));
        return -1;
    }
}

void throw_no_transport(std::string_view who, std::string_view addr, std::uint16_t port,
                        std::string_view rdma) {
    throw_error(who, EINVAL,
                fmt::format("{}:{}: no transport: shm and tcp are left out "
                            "(RDMAX_RPC_TRANSPORTS or RDMAX_RPC_LOCAL), and {}",
                            addr, port, rdma));
}

} // namespace rdmax::rpc
