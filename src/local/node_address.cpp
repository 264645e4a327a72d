#include <netdb.h>
#include <string>
#include <sys/socket.h>
#include <unistd.h>

#include <rdmax/local/node_address.hpp>

namespace rdmax::local {

bool is_node_address(std::string_view addr) noexcept {
    if (addr.empty())
        return false;
    std::string host;
    try {
        host.assign(addr);
    } catch (...) {
        return false;
    }
    addrinfo hints{};
    hints.ai_socktype = SOCK_DGRAM;
    addrinfo* res = nullptr;
    if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0)
        return false;
    bool here = false;
    // The kernel binds a socket only to an address of this node (port 0:
    // any; nothing is sent, and the socket is closed at once).
    for (const addrinfo* a = res; a != nullptr && !here; a = a->ai_next) {
        const int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        if (fd < 0)
            continue;
        here = bind(fd, a->ai_addr, a->ai_addrlen) == 0;
        close(fd);
    }
    freeaddrinfo(res);
    return here;
}

} // namespace rdmax::local
