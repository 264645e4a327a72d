#include <arpa/inet.h>
#include <array>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <netinet/in.h>
#include <new>
#include <string>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/detail/rpc/shm_link.hpp>
#include <rdmax/error.hpp>
#include <rdmax/local/cma.hpp>
#include <rdmax/local/node_address.hpp>

namespace rdmax::rpc {

namespace {
constexpr std::size_t page = 4096;
constexpr std::uint32_t segment_magic = 0x4c4f4331; // "LOC1"

struct segment_header {
    std::uint32_t magic;
    std::uint16_t slots;
    std::uint16_t reserved;
    std::uint32_t slot_bytes;
    std::uint32_t ring_capacity;
    /// Each side sets its flag before it sleeps; a sender that finds the
    /// peer's set writes its eventfd (the only system call of this path).
    alignas(64) std::atomic<std::uint32_t> server_sleeping;
    alignas(64) std::atomic<std::uint32_t> client_sleeping;
};
static_assert(sizeof(segment_header) <= 4096);

/// Each direction's message ring: room for twice the slots' immediates.
std::size_t ring_capacity(std::uint16_t slots) noexcept {
    std::size_t cap = 256;
    while (cap < std::size_t{slots} * 16 * 2)
        cap *= 2;
    return cap;
}
std::size_t round_page(std::size_t n) noexcept {
    return (n + page - 1) / page * page;
}
/// A port the kernel's TCP would hand out now (what rdma_cm does for port 0).
std::uint16_t ephemeral_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        throw_error("socket(AF_INET)", errno, "a free port for an rpc server");
    sockaddr_in a{};
    a.sin_family = AF_INET;
    socklen_t len = sizeof a;
    const bool ok = ::bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0 &&
                    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
    const int err = errno;
    ::close(fd);
    if (!ok)
        throw_error("bind(AF_INET, port 0)", err, "a free port for an rpc server");
    return ntohs(a.sin_port);
}

/// With no rdma_cm listener to pick the port: a free one whose node-local
/// name no other server here holds.
local::unix_listener listen_any_port(std::string_view addr, std::uint16_t& port) {
    for (int attempt = 1;; ++attempt) {
        const std::uint16_t p = ephemeral_port();
        try {
            local::unix_listener l(local_name(addr, p));
            port = p;
            return l;
        } catch (const error& e) {
            if (e.code().value() != EADDRINUSE || attempt == 16)
                throw;
        }
    }
}
} // namespace

std::string local_name(std::string_view addr, std::uint16_t port) {
    return fmt::format("rdmax-rpc/{}:{}", addr, port);
}

local::unix_listener listen_without_device(std::string_view addr, std::uint16_t& port) {
    if (!local::is_node_address(addr))
        throw_error("rpc::server", EADDRNOTAVAIL,
                    fmt::format("{}: not an address of this node (without rdma, only peers on "
                                "this node are served)",
                                addr));
    if (port == 0)
        return listen_any_port(addr, port);
    const std::string name = local_name(addr, port);
    try {
        return local::unix_listener(name);
    } catch (const error& e) {
        if (e.code().value() != EADDRINUSE)
            throw;
        // Say who holds it: another server of this user, or a process of
        // another user that took the name first (abstract names have no owner).
        std::string who = "a process that no longer answers";
        try {
            const local::unix_channel ch = local::unix_channel::connect(name, false);
            const local::peer_credentials c = ch.peer();
            who = fmt::format("pid {} of uid {}", c.pid, c.uid);
        } catch (const error&) {
        }
        throw_error(
            "rpc::server", EADDRINUSE,
            fmt::format("{}:{}: its node-local name @{} is held by {}", addr, port, name, who));
    }
}

namespace detail {

std::size_t shm_link::segment_bytes(std::uint16_t slots, std::uint32_t slot_bytes) noexcept {
    const std::size_t ring = round_page(local::spsc_ring::bytes_for(ring_capacity(slots)));
    return page + 2 * ring + 2 * round_page(std::size_t{slots} * slot_bytes);
}

shm_link::shm_link(local::unix_channel channel, pid_t peer, std::uint16_t slots,
                   std::uint32_t slot_bytes)
    : link(slots, slot_bytes, transport::shm)
    , channel_(std::move(channel))
    , seg_(local::shared_segment::create("rpc", segment_bytes(slots, slot_bytes)))
    , peer_(peer) {
    wake_server_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    wake_client_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_server_ < 0 || wake_client_ < 0) {
        const int err = errno;
        if (wake_server_ >= 0)
            ::close(wake_server_);
        if (wake_client_ >= 0)
            ::close(wake_client_);
        throw_error("eventfd", err, "a node-local RPC connection");
    }
    auto* h = new (seg_.data()) segment_header{};
    h->slots = slots;
    h->slot_bytes = slot_bytes;
    h->ring_capacity = static_cast<std::uint32_t>(ring_capacity(slots));
    const std::size_t ring = round_page(local::spsc_ring::bytes_for(h->ring_capacity));
    local::spsc_ring::format(seg_.bytes().subspan(page, ring), h->ring_capacity);
    local::spsc_ring::format(seg_.bytes().subspan(page + ring, ring), h->ring_capacity);
    h->magic = segment_magic;
    lay_out(side::server);
}

shm_link::shm_link(local::unix_channel channel, local::shared_segment segment, pid_t peer,
                   std::uint16_t slots, std::uint32_t slot_bytes, int wake_server, int wake_client)
    : link(slots, slot_bytes, transport::shm)
    , channel_(std::move(channel))
    , seg_(std::move(segment))
    , peer_(peer)
    , who_(side::client)
    , wake_server_(wake_server)
    , wake_client_(wake_client) {
    const auto* h = reinterpret_cast<const segment_header*>(seg_.data());
    if (seg_.size() < segment_bytes(slots, slot_bytes) || h->magic != segment_magic ||
        h->slots != slots || h->slot_bytes != slot_bytes ||
        h->ring_capacity != ring_capacity(slots)) {
        corrupt_ = true;
        return;
    }
    lay_out(side::client);
}

void shm_link::lay_out(side who) noexcept {
    const std::size_t ring = round_page(local::spsc_ring::bytes_for(ring_capacity(slots())));
    const std::size_t ring_bytes = round_page(std::size_t{slots()} * slot_bytes());
    local::spsc_ring c2s(seg_.bytes().subspan(page, ring));
    local::spsc_ring s2c(seg_.bytes().subspan(page + ring, ring));
    std::byte* requests = seg_.data() + page + 2 * ring;
    std::byte* replies = requests + ring_bytes;
    if (!c2s.valid() || !s2c.valid()) {
        corrupt_ = true;
        return;
    }
    auto* h = reinterpret_cast<segment_header*>(seg_.data());
    my_sleep_ = who == side::server ? &h->server_sleeping : &h->client_sleeping;
    peer_sleep_ = who == side::server ? &h->client_sleeping : &h->server_sleeping;
    if (who == side::server) {
        in_ = c2s;
        out_ = s2c;
        link::lay_out(requests, replies);
    } else {
        in_ = s2c;
        out_ = c2s;
        link::lay_out(replies, requests);
    }
    set_fds(channel_.fd(), who == side::server ? wake_server_ : wake_client_);
}

status shm_link::send_slot(message_kind k, std::uint32_t s, std::uint32_t bytes, sched::priority,
                           bool epoch) noexcept {
    if (corrupt_)
        return status::qp_failed;
    const std::uint32_t imm = encode_imm(k, s, bytes, epoch);
    switch (out_.try_push(std::as_bytes(std::span(&imm, 1)))) {
    case local::ring_status::ok:
        // A read-modify-write, not a load: ordered after the push for a
        // peer that set its flag and then looked at the ring.
        if (peer_sleep_->fetch_or(0, std::memory_order_seq_cst) != 0) {
            const std::uint64_t one = 1;
            (void)!::write(who_ == side::server ? wake_client_ : wake_server_, &one, sizeof one);
        }
        return status::ok;
    case local::ring_status::full: return status::queue_full;
    default: corrupt_ = true; return status::qp_failed;
    }
}

int shm_link::poll(std::span<link_event> out, bool) noexcept {
    if (corrupt_ || ring_bad_)
        return -1;
    int n = 0;
    for (; static_cast<std::size_t>(n) < out.size(); ++n) {
        std::uint32_t imm = 0;
        std::size_t got = 0;
        const local::ring_status st = in_.try_pop(std::as_writable_bytes(std::span(&imm, 1)), got);
        if (st == local::ring_status::empty)
            break;
        if (st != local::ring_status::ok || got != sizeof imm) {
            // The peer wrote nonsense into the message ring: what came
            // before it is handed out, the next poll says so.
            ring_bad_ = true;
            return n > 0 ? n : -1;
        }
        out[static_cast<std::size_t>(n)] = link_event::of_imm(imm);
    }
    return n;
}

transfer shm_link::move_body(body_way way, sched::priority, local_buffer<rights::local_write> local,
                             const buffer_descriptor& remote, std::uint64_t,
                             std::span<const std::uint32_t>) noexcept {
    const std::span<std::byte> mine{static_cast<std::byte*>(local.addr), local.length};
    if (way == body_way::read)
        return local::cma_read(peer_, remote.addr, mine) == local::cma_status::ok
                   ? transfer::done
                   : transfer::failed;
    if (local.length > remote.length)
        return transfer::failed;
    return local::cma_write(peer_, remote.addr, mine) == local::cma_status::ok ? transfer::done
                                                                               : transfer::failed;
}

access shm_link::grant_access(std::uint32_t, const call_ranges& r, buffer_descriptor& body,
                              buffer_descriptor& reply) noexcept {
    // CMA reaches the caller's host memory by address; a dma-buf it could
    // only reach with the CPU.
    return describe_host(r, body, reply);
}

bool shm_link::end_access(std::uint32_t slot, access_end how) noexcept {
    if (how == access_end::fence)
        return false;
    if (how == access_end::abandon && slot < slots()) {
        // The request is in the server's ring, in shared memory: its epoch
        // flips there.
        std::byte* flags = staging(slot) + offsetof(message_header, flags);
        *flags ^= std::byte{flag_epoch};
    }
    return true;
}

std::optional<link_end> shm_link::ended(look what) noexcept {
    // Nothing more is known of why than that it ended: no completion
    // status, no rdma_cm event.
    if (what == look::cause || corrupt_ || (what == look::events && peer_gone()))
        return link_end{};
    return std::nullopt;
}

shm_link::~shm_link() {
    if (wake_server_ >= 0)
        ::close(wake_server_);
    if (wake_client_ >= 0)
        ::close(wake_client_);
}

bool shm_link::sleep(bool going) noexcept {
    if (my_sleep_ == nullptr)
        return true;
    if (going) {
        (void)my_sleep_->exchange(1, std::memory_order_seq_cst);
        return in_.queued() == 0;
    }
    my_sleep_->store(0, std::memory_order_relaxed);
    std::uint64_t n = 0;
    (void)!::read(wake_fd(), &n, sizeof n);
    return true;
}

bool shm_link::peer_gone() noexcept {
    // Nothing comes on the socket after the handshake but its end. Bytes
    // there (descriptors with them are dropped by the kernel) are the peer
    // breaking the protocol; left unread, they would keep the endpoint's
    // level-triggered epoll readable for good, and it would never sleep
    // again. Taken, and the connection ends.
    std::array<char, 64> junk{};
    const ssize_t r = recv(channel_.fd(), junk.data(), junk.size(), MSG_DONTWAIT);
    if (r > 0) {
        corrupt_ = true;
        return true;
    }
    // 0: the peer closed its end (or its process ended).
    return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

void shm_link::close() noexcept {
    if (channel_.fd() >= 0)
        shutdown(channel_.fd(), SHUT_RDWR);
}

} // namespace detail
} // namespace rdmax::rpc
