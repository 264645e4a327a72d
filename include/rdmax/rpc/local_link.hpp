#pragma once
// local_link: an RPC connection between two processes on one node, through
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
#include <string>
#include <string_view>
#include <sys/types.h>

#include <rdmax/local/descriptor_passing.hpp>
#include <rdmax/local/shared_segment.hpp>
#include <rdmax/local/spsc_ring.hpp>
#include <rdmax/rpc/link_wire.hpp>

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
};

/// The server's answer; the segment's descriptor comes beside it when ok.
struct local_welcome {
    std::uint32_t magic = protocol_magic;
    std::uint16_t version = protocol_version;
    std::uint16_t slots = 0;
    std::uint32_t slot_bytes = 0;
    std::uint32_t status = 0; ///< 0 ok; 1 CMA refused (take the device); 2 refused
    std::uint64_t segment_bytes = 0;
};
inline constexpr std::uint32_t local_ok = 0, local_no_cma = 1, local_refused = 2;

/// The abstract Unix name a server listening on addr:port also answers on.
[[nodiscard]] std::string local_name(std::string_view addr, std::uint16_t port);

class local_link final : public link_wire {
public:
    enum class side : std::uint8_t { server, client };

    /// Server: makes the segment for `slots` x `slot_bytes` and the two
    /// wake-up eventfds; `peer` is the client's pid (for CMA).
    local_link(local::unix_channel channel, pid_t peer, std::uint16_t slots,
               std::uint32_t slot_bytes);
    /// Client: maps the server's segment; takes the eventfds that wake the
    /// server and this side (it owns them from now on).
    local_link(local::unix_channel channel, local::shared_segment segment, pid_t peer,
               std::uint16_t slots, std::uint32_t slot_bytes, int wake_server, int wake_client);
    ~local_link() override;
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

    [[nodiscard]] std::span<const std::byte> inbound(std::uint32_t s,
                                                     std::uint32_t bytes) const noexcept override {
        return {in_slots_ + std::size_t{s} * slot_bytes(), bytes};
    }
    [[nodiscard]] std::byte* staging(std::uint32_t s) const noexcept override {
        return out_slots_ + std::size_t{s} * slot_bytes();
    }
    [[nodiscard]] status send_slot(message_kind k, std::uint32_t s, std::uint32_t bytes,
                                   sched::priority p, bool epoch) noexcept override;
    [[nodiscard]] transfer read_body(sched::priority p, local_buffer<rights::local_write> dst,
                                     const buffer_descriptor& src,
                                     std::uint64_t wr_id) noexcept override;
    [[nodiscard]] transfer write_body(sched::priority p, local_buffer<rights::local_write> src,
                                      const buffer_descriptor& dst,
                                      std::uint64_t wr_id) noexcept override;
    [[nodiscard]] int poll_transfers(std::span<verbs::completion>) noexcept override { return 0; }
    [[nodiscard]] bool needs_progress() const noexcept override { return false; }
    [[nodiscard]] bool has_outstanding() const noexcept override { return false; }
    [[nodiscard]] bool failed() const noexcept override { return corrupt_; }
    [[nodiscard]] bool peer_gone() noexcept override;
    [[nodiscard]] int event_fd() const noexcept override { return channel_.fd(); }
    [[nodiscard]] local::ring_status next_imm(std::uint32_t& imm) noexcept override;
    void close() noexcept override;
    [[nodiscard]] bool is_local() const noexcept override { return true; }
    [[nodiscard]] int wake_fd() const noexcept override {
        return who_ == side::server ? wake_server_ : wake_client_;
    }
    [[nodiscard]] bool prepare_sleep() noexcept override;
    void woke() noexcept override;
    [[nodiscard]] bool needs_registration() const noexcept override { return false; }

private:
    void lay_out(side who) noexcept;

    local::unix_channel channel_;
    local::shared_segment seg_;
    pid_t peer_;
    local::spsc_ring in_, out_;
    std::byte* in_slots_ = nullptr;
    std::byte* out_slots_ = nullptr;
    bool corrupt_ = false;
    side who_ = side::server;
    int wake_server_ = -1, wake_client_ = -1;
    std::atomic<std::uint32_t>* my_sleep_ = nullptr;   ///< set while this side sleeps
    std::atomic<std::uint32_t>* peer_sleep_ = nullptr; ///< set while the peer sleeps
};

} // namespace rdmax::rpc
