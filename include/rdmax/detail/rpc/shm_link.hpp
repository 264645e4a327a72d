#pragma once
// shm_link: an RPC connection between two processes on one node, through
// their shared memory instead of the RDMA device. The wire format is the
// same (wire.hpp); what changes is how it moves:
//
//   one shared segment per connection (a memfd the server makes and hands
//   the client over a Unix socket):
//     [header][client->server immediates][server->client immediates]
//     [request ring: slots x slot_bytes][reply ring: slots x slot_bytes]
//   a message is built in place in the peer's ring slot (one copy in; the
//   handler reads it where it is), then its immediate goes into the message
//   ring; bodies over a slot go by CMA (process_vm_readv / _writev) from or
//   into the caller's own buffer, one copy, no registration.
//
// A peer can write into this connection's segment and nothing else; what it
// writes there is checked as on the device path (immediates, headers), and
// the message ring checks its own positions. No priority: the immediates are
// taken in order (nothing on this path waits behind a large transfer on a
// wire: CMA copies are the server's own work, in the order calls arrive).

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <sys/types.h>

#include <rdmax/detail/local/spsc_ring.hpp>
#include <rdmax/detail/rpc/link.hpp>
#include <rdmax/local/descriptor_passing.hpp>
#include <rdmax/local/shared_segment.hpp>

namespace rdmax::rpc {

/// The client's first message on the Unix socket.
struct local_hello {
    std::uint32_t magic = protocol_magic;
    std::uint16_t version = protocol_version;
    std::uint16_t slots = 0;
    std::uint32_t slot_bytes = 0;
    std::uint32_t reserved = 0;
    std::uint64_t probe_addr = 0;  ///< 8 bytes the server reads by CMA, to see that it may
    std::uint64_t probe_value = 0; ///< what it must find there
    std::uint64_t incarnation = 0; ///< the client's (ring_offer::incarnation)
    std::uint64_t first_call = 0;  ///< ring_offer::first_call
};

/// The server's answer; the segment's descriptor comes beside it when ok.
struct local_welcome {
    std::uint32_t magic = protocol_magic;
    std::uint16_t version = protocol_version;
    std::uint16_t slots = 0;
    std::uint32_t slot_bytes = 0;
    std::uint32_t status = 0; ///< 0 ok; 1 CMA refused (take the device); 2 refused
    std::uint64_t segment_bytes = 0;
    std::uint64_t incarnation = 0; ///< the server's (ring_offer::incarnation)
};
inline constexpr std::uint32_t local_ok = 0, local_no_cma = 1, local_refused = 2;

/// The abstract Unix name a server listening on addr:port also answers on.
[[nodiscard]] std::string local_name(std::string_view addr, std::uint16_t port);
/// The node-local listener of a server (or group) with no rdma_cm listener:
/// on local_name(addr, port), port 0 taking a free port (written back; one
/// the kernel's TCP would hand out, whose name is free here). Throws
/// rdmax::error: addr not this node's (nor a wildcard), the name taken.
[[nodiscard]] local::unix_listener listen_without_device(std::string_view addr,
                                                         std::uint16_t& port);

namespace detail {

class shm_link final : public link {
public:
    enum class side : std::uint8_t { server, client };

    /// Server: makes the segment for `slots` x `slot_bytes` and the two
    /// wake-up eventfds; `peer` is the client's pid (for CMA).
    shm_link(local::unix_channel channel, pid_t peer, std::uint16_t slots,
             std::uint32_t slot_bytes);
    /// Client: maps the server's segment; takes the eventfds that wake the
    /// server and this side (it owns them from now on).
    shm_link(local::unix_channel channel, local::shared_segment segment, pid_t peer,
             std::uint16_t slots, std::uint32_t slot_bytes, int wake_server, int wake_client);
    ~shm_link() override;
    /// The eventfds, for the welcome message: {wake the server, wake the client}.
    [[nodiscard]] std::array<int, 2> wake_fds() const noexcept {
        return {wake_server_, wake_client_};
    }

    /// Bytes of a segment for this geometry.
    [[nodiscard]] static std::size_t segment_bytes(std::uint16_t slots,
                                                   std::uint32_t slot_bytes) noexcept;
    [[nodiscard]] const local::shared_segment& segment() const noexcept { return seg_; }
    /// A message on the connection's Unix socket, with a descriptor beside it.
    void send(std::span<const std::byte> bytes, std::span<const int> fds) {
        channel_.send(bytes, fds);
    }
    /// The segment was not laid out as this geometry says (client side).
    [[nodiscard]] bool corrupt() const noexcept { return corrupt_; }

    /// Pushes the immediate into the message ring; wakes a peer that sleeps.
    [[nodiscard]] status send_slot(message_kind k, std::uint32_t s, std::uint32_t bytes,
                                   sched::priority p, bool epoch) noexcept override;
    /// By CMA: done when it returns.
    [[nodiscard]] transfer move_body(body_way way, sched::priority p,
                                     local_buffer<rights::local_write> local,
                                     const buffer_descriptor& remote, std::uint64_t wr_id,
                                     std::span<const std::uint32_t> rail_rkeys) noexcept override;
    /// Nothing to withdraw: a CMA copy is over when move_body returns.
    [[nodiscard]] bool cancel(std::uint64_t) noexcept override { return false; }
    /// The immediates in the message ring (no priority: in order).
    [[nodiscard]] int poll(std::span<link_event> out, bool thorough) noexcept override;
    [[nodiscard]] std::optional<link_end> ended(look what) noexcept override;
    [[nodiscard]] bool sleep(bool going) noexcept override;
    void close() noexcept override;
    /// The segment came with the welcome: up from the start.
    [[nodiscard]] bool established(bool) noexcept override { return true; }
    /// No keys: the server reads and writes the caller's memory by CMA.
    [[nodiscard]] access grant_access(std::uint32_t slot, const call_ranges& r,
                                      buffer_descriptor& body,
                                      buffer_descriptor& reply) noexcept override;
    /// A call given up (abandon) flips the epoch of its request in the
    /// server's ring, which the server checks before it reads the body or
    /// writes the reply by CMA (a copy that cannot be revoked once under
    /// way). Nothing to fence.
    bool end_access(std::uint32_t slot, access_end how) noexcept override;

private:
    void lay_out(side who) noexcept;
    [[nodiscard]] bool peer_gone() noexcept;

    local::unix_channel channel_;
    local::shared_segment seg_;
    pid_t peer_;
    local::spsc_ring in_, out_;
    bool corrupt_ = false;
    bool ring_bad_ = false; ///< the message ring held nonsense: poll() says so
    side who_ = side::server;
    int wake_server_ = -1, wake_client_ = -1;
    std::atomic<std::uint32_t>* my_sleep_ = nullptr;   ///< set while this side sleeps
    std::atomic<std::uint32_t>* peer_sleep_ = nullptr; ///< set while the peer sleeps
};

} // namespace detail

} // namespace rdmax::rpc
