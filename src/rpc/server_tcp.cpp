// rpc::server over TCP: a listener beside the rdma_cm one (the same port
// number) for peers that reach this server neither through a device nor
// through this node's memory; their hellos are read a piece at a time with
// the node-local ones (server_connect.cpp), never waited on.

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/detail/rpc/tcp_link.hpp>
#include <rdmax/error.hpp>
#include <rdmax/local/node_address.hpp>
#include <rdmax/rpc/server.hpp>

#include "../notice.hpp"

namespace rdmax::rpc {

void server::listen_tcp(std::string_view addr, bool needed) {
    if (!opts_.transports.has(transport::tcp)) {
        if (needed)
            throw_no_transport("rpc::server", addr, port_,
                               ep_.pd != nullptr ? "so is rdma" : "there is no device");
        return;
    }
    const int fd = tcp_listen_for("rpc::server", addr, port_, needed);
    if (fd < 0)
        return;
    try {
        ep_.in.watch(fd);
    } catch (...) {
        ::close(fd);
        throw;
    }
    tcp_listener_ = fd;
}

void server::listen_without_rdma(std::string_view addr) {
    if (!local::is_node_address(addr))
        throw_error("rpc::server", EADDRNOTAVAIL,
                    fmt::format("{}: not an address of this node (without rdma, a server "
                                "listens on this node's addresses)",
                                addr));
    // TCP takes the port (a free one for port 0: reserved, unlike a name),
    // the node-local name its number. A name that cannot be had is refused
    // where shm is wanted (it may be another user's, taken first): a server
    // that went on without it would leave this node's clients to whoever
    // holds it.
    listen_tcp(addr, !opts_.node_local());
    listen_local(addr, opts_.node_local() || tcp_listener_ < 0);
}

void server::accept_tcp_pending() noexcept {
    // At most a round's worth, as for node-local connections.
    for (int k = 0; k < 64 && tcp_listener_ >= 0 && !listener_paused_; ++k) {
        const int fd = accept4(tcp_listener_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            const int err = errno;
            if (err == EINTR || err == ECONNABORTED)
                continue;
            if (err == EAGAIN || err == EWOULDBLOCK)
                break;
            refuse(err, "tcp connection: accept");
            if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM)
                pause_listener();
            break;
        }
        if (!tcp_tune(fd)) {
            refuse(errno, "tcp connection: TCP_NODELAY");
            ::close(fd);
            continue;
        }
        start_handshake(local::unix_channel(fd), true);
    }
}

void server::accept_tcp(local::unix_channel ch, std::span<const std::byte> hello_bytes) {
    tcp_hello hello;
    std::memcpy(&hello, hello_bytes.data(), std::min(hello_bytes.size(), sizeof hello));
    const bool whole = hello_bytes.size() == sizeof hello;
    if (group_ != nullptr && whole && forward_local(ch, hello_bytes, hello.incarnation, true))
        return;
    tcp_welcome w;
    w.status = tcp_refused;
    if (!whole || hello.magic != protocol_magic || hello.version != protocol_version ||
        hello.slots == 0 || hello.slots > max_slots || hello.slot_bytes < min_slot_bytes ||
        hello.slot_bytes > max_slot_bytes || hello.slot_bytes % 8 != 0 || hello.incarnation == 0)
        refuse(EPROTO, "tcp handshake: a hello that is not an rdmax client's");
    else if (draining_)
        refuse(EAGAIN, "tcp handshake: draining");
    else if (live_ >= opts_.max_peers)
        ep_.counters.count_refusal_fmt(EBUSY, "tcp handshake: {} peers already (max_peers)", live_);
    else
        w.status = tcp_ok;
    if (w.status != tcp_ok) {
        ch.send(std::as_bytes(std::span(&w, 1)));
        return;
    }
    w.slots = std::min<std::uint16_t>(hello.slots, opts_.slots);
    w.slot_bytes = std::min(hello.slot_bytes, opts_.slot_bytes);
    w.incarnation = ep_.incarnation;
    // The link is made before the welcome goes: a server out of memory
    // closes the connection, and the client is not told it is connected.
    auto wire = std::make_unique<detail::tcp_link>(ch.fd(), true, w.slots, w.slot_bytes);
    (void)ch.release(); // the link's now
    wire->set_stall(opts_.keepalive_timeout);
    const std::span<const std::byte> welcome = std::as_bytes(std::span(&w, 1));
    const auto n = static_cast<std::uint32_t>(welcome.size());
    std::array<std::byte, sizeof n + sizeof w> framed{};
    std::memcpy(framed.data(), &n, sizeof n);
    std::memcpy(framed.data() + sizeof n, welcome.data(), welcome.size());
    // A new socket's send buffer is empty: the welcome goes whole or the
    // connection is refused.
    if (::send(wire->socket(), framed.data(), framed.size(), MSG_DONTWAIT | MSG_NOSIGNAL) !=
        static_cast<ssize_t>(framed.size()))
        throw_error("send", errno == 0 ? EAGAIN : errno, "tcp handshake: the welcome");
    (void)add_link(std::move(wire), w.slots, hello.incarnation, hello.first_call);
}

} // namespace rdmax::rpc
