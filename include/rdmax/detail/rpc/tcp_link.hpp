#pragma once
// tcp_link: an RPC connection over one TCP socket, for peers with no RDMA
// path between them (no device on one side, different fabrics) and not on
// one node. The wire format of the slots is the same (wire.hpp); what the
// device does by itself is done here in frames on the byte stream:
//
//   slot        the immediate, then the slot's bytes: the peer copies them
//               into its own slot s (as a WRITE_WITH_IMM would), then hands
//               the immediate to its endpoint;
//   read_req    "send me [addr, addr+len) under key": a READ of a request
//               body over a slot; answered by read_data chunks, then
//               read_end (ok, or failed: a key no longer granted);
//   write_data  a chunk of a reply body over a slot, for [addr, addr+len)
//               under key: a WRITE;
//   abandon     the caller gave the call in slot s up: the server flips the
//               slot's epoch, as the node-local path does in shared memory.
//
// Keys are this link's own: grant_access hands out one per buffer, checked
// against the granted range for every read_req and write_data; a key that
// is no longer granted (the call ended) gets a failed read_end, its write_data
// is read and dropped. A peer reaches the call's buffers and nothing else,
// and only while the call lasts, as under memory windows.
//
// Priorities: frames queue per level, FIFO within one (a reply's body before
// the reply, as on a queue pair); bodies go in chunks of chunk_bytes, and a
// more urgent frame goes at the next chunk's boundary. Bodies are read from
// the socket straight into their destination (the caller's reply buffer, the
// server's block) and sent straight from their source: no copy but the
// socket's own. The hot path allocates nothing: the queue's entries and the
// read buffer are made with the link, for the slots' worth of traffic.
//
// Hostile peers: every frame is checked before it is used (its type, its
// slot, its length against the slot or the chunk limit, a read answer's wr_id
// and offset); a frame that breaks the rules makes poll() say -1 and the
// endpoint drops this connection alone. Reads are bounded by the read buffer
// and the frame's checked length.

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <sys/uio.h>
#include <vector>

#include <rdmax/detail/rpc/link.hpp>
#include <rdmax/sched/coarse_clock.hpp>

namespace rdmax::rpc {

/// The client's first message on a TCP connection (length-prefixed, as on
/// the node-local path's Unix socket).
struct tcp_hello {
    std::uint32_t magic = protocol_magic;
    std::uint16_t version = protocol_version;
    std::uint16_t slots = 0;
    std::uint32_t slot_bytes = 0;
    std::uint32_t reserved = 0;
    std::uint64_t incarnation = 0; ///< the client's (ring_offer::incarnation)
    std::uint64_t first_call = 0;  ///< ring_offer::first_call
};
/// The server's answer.
struct tcp_welcome {
    std::uint32_t magic = protocol_magic;
    std::uint16_t version = protocol_version;
    std::uint16_t slots = 0;
    std::uint32_t slot_bytes = 0;
    std::uint32_t status = 0; ///< tcp_ok, else tcp_refused
    std::uint64_t incarnation = 0;
};
inline constexpr std::uint32_t tcp_ok = 0, tcp_refused = 2;

/// A non-blocking TCP listener on addr:port (port 0: the kernel picks one,
/// written back). Throws rdmax::error naming the call and the address.
[[nodiscard]] int tcp_listen(std::string_view addr, std::uint16_t& port);
/// A server's (`who`'s) TCP listener: tcp_listen's, or where it is not
/// `needed` (another transport listens), -1 and a notice saying who cannot connect.
[[nodiscard]] int tcp_listen_for(std::string_view who, std::string_view addr, std::uint16_t& port,
                                 bool needed);
/// Refuses a server (`who`) left with no transport; `rdma`: why not that one.
[[noreturn]] void throw_no_transport(std::string_view who, std::string_view addr,
                                     std::uint16_t port, std::string_view rdma);
/// A connected TCP socket to addr:port within `timeout` (non-blocking, with
/// TCP_NODELAY). Throws rdmax::error.
[[nodiscard]] int tcp_connect(std::string_view addr, std::uint16_t port,
                              std::chrono::milliseconds timeout);
/// TCP_NODELAY and O_NONBLOCK on an accepted socket; false if refused.
[[nodiscard]] bool tcp_tune(int fd) noexcept;

namespace detail {

class tcp_link final : public link {
public:
    /// Payload bytes of one body chunk: a more urgent frame waits at most this long.
    static constexpr std::uint32_t chunk_bytes = 512 * 1024;

    /// Takes the connected socket `fd` (closed with the link); `server`:
    /// this side answers requests. Throws rdmax::error (no memory, no epoll).
    tcp_link(int fd, bool server, std::uint16_t slots, std::uint32_t slot_bytes);
    ~tcp_link() override;
    /// The connection's socket (for the handshake's last message).
    [[nodiscard]] int socket() const noexcept { return fd_; }
    /// A server's transfers with a peer must move, both ways: a body read
    /// with no chunk for `limit` (at least 512 KiB per `limit`), or frames
    /// queued and not one byte taken by the peer for `limit`, end the link.
    /// Otherwise a peer that stops answering or reading holds the server's
    /// blocks for as long as it keeps the connection. 0: never.
    void set_stall(std::chrono::nanoseconds limit) noexcept { stall_ = limit; }

    [[nodiscard]] status send_slot(message_kind k, std::uint32_t s, std::uint32_t bytes,
                                   sched::priority p, bool epoch) noexcept override;
    [[nodiscard]] transfer move_body(body_way way, sched::priority p,
                                     local_buffer<rights::local_write> local,
                                     const buffer_descriptor& remote, std::uint64_t wr_id,
                                     std::span<const std::uint32_t> rail_rkeys) noexcept override;
    [[nodiscard]] bool cancel(std::uint64_t wr_id) noexcept override;
    [[nodiscard]] int poll(std::span<link_event> out, bool thorough) noexcept override;
    [[nodiscard]] std::optional<link_end> ended(look what) noexcept override;
    [[nodiscard]] bool sleep(bool going) noexcept override;
    void close() noexcept override;
    [[nodiscard]] bool established(bool) noexcept override { return true; }
    [[nodiscard]] access grant_access(std::uint32_t slot, const call_ranges& r,
                                      buffer_descriptor& body,
                                      buffer_descriptor& reply) noexcept override;
    bool end_access(std::uint32_t slot, access_end how) noexcept override;

    /// Frame types on the stream.
    enum class frame : std::uint8_t {
        slot = 1,
        read_req = 2,
        read_data = 3,
        read_end = 4,
        write_data = 5,
        abandon = 6
    };

    /// Every frame's first 8 bytes; all but slot and abandon carry an
    /// extension after it.
    struct head {
        frame type;
        std::uint8_t prio;      ///< read_req: the level its answer goes at
        std::uint16_t reserved; ///< 0
        std::uint32_t value;    ///< slot: the immediate; abandon: the slot; else payload bytes
    };
    struct ext {
        std::uint64_t wr_id; ///< read_req, read_data, read_end: the reader's
        std::uint64_t addr;  ///< read_req, write_data: where; read_data: the offset
        std::uint32_t key;   ///< read_req, write_data
        std::uint32_t last;  ///< read_end: 1 ok, 0 failed; else 0
    };
    static constexpr std::size_t full_head = sizeof(head) + sizeof(ext);

private:
    /// What waits to go: a frame (header and payload) or a body in chunks.
    struct entry {
        std::array<std::byte, full_head> hdr;
        std::uint8_t hdr_len = 0;
        bool stream = false;       ///< a body in chunks (answer or write)
        bool answer = false;       ///< a read answer (client side), from a granted buffer
        bool failing = false;      ///< answer revoked: its end (next) says failed
        bool dead = false;         ///< withdrawn: skipped
        bool revoke_after = false; ///< revoked mid-chunk: failing after this chunk
        bool slot_msg = false;     ///< a request in `slot` (abandon withdraws it)
        std::uint16_t slot = 0;
        const std::byte* src = nullptr; ///< payload (or the body's start)
        std::uint32_t len = 0;          ///< payload (or the body's) bytes
        std::uint32_t done = 0;         ///< stream: body bytes before the current chunk
        std::uint64_t wr_id = 0;
        std::uint64_t addr = 0; ///< write: the peer's address of the body's start
        std::uint32_t key = 0;
        std::int32_t next = -1;
    };
    /// A body read under way (server side).
    struct pending_read {
        std::uint64_t wr_id = 0;
        std::byte* dst = nullptr;
        std::uint32_t len = 0;
        std::uint32_t got = 0;
        std::int32_t queued = -1; ///< its read_req while still queued whole
        bool used = false;
    };
    struct grant {
        const std::byte* body = nullptr;
        std::uint32_t body_len = 0, body_key = 0;
        std::byte* reply = nullptr;
        std::uint32_t reply_len = 0, reply_key = 0;
    };

    /// One sendmsg's worth: the frames in order and their iovecs.
    struct batch {
        struct frame_sent {
            std::uint8_t level;
            std::int32_t entry;
            std::size_t bytes; ///< of this frame in this batch
            std::size_t chunk; ///< its payload bytes
        };
        std::array<iovec, 64> iov{};
        std::array<frame_sent, 64> frames{};
        std::size_t n = 0, count = 0;
    };

    [[nodiscard]] std::int32_t take_entry(sched::priority p) noexcept;
    void link_entry(std::int32_t i, std::uint8_t level) noexcept;
    [[nodiscard]] std::int32_t first_live(std::uint8_t level) noexcept;
    [[nodiscard]] bool queued() const noexcept;
    void build_frame(entry& e, std::size_t chunk) noexcept;
    [[nodiscard]] std::size_t current_chunk(const entry& e) const noexcept;
    [[nodiscard]] std::size_t gather(batch& b) noexcept;
    void flush() noexcept;
    void after_send(const batch& b, std::size_t sent) noexcept;
    void frame_done(std::uint8_t level, std::int32_t i, std::size_t chunk) noexcept;
    void spill_partial() noexcept;
    [[nodiscard]] bool answer_faulted(const batch& b) noexcept;
    static bool hold_of(link* self, bool on) noexcept;
    [[nodiscard]] bool read_in() noexcept;
    [[nodiscard]] bool parse() noexcept;
    [[nodiscard]] bool start_payload(const head& h, const ext& x) noexcept;
    [[nodiscard]] bool start_slot(const head& h) noexcept;
    [[nodiscard]] bool start_read_data(const head& h, const ext& x) noexcept;
    [[nodiscard]] bool end_read(const ext& x) noexcept;
    [[nodiscard]] bool start_write(const head& h, const ext& x) noexcept;
    [[nodiscard]] bool answer_read(const head& h, const ext& x) noexcept;
    [[nodiscard]] pending_read* find_read(std::uint64_t wr_id) noexcept;
    void event(link_event e) noexcept;
    void finish_payload() noexcept;
    void want_out(bool on) noexcept;
    void fail_io(int err) noexcept;
    /// Has the peer stopped moving a transfer for longer than the stall limit?
    [[nodiscard]] bool stalled(bool drained) const noexcept;

    int fd_ = -1;
    int epoll_fd_ = -1;
    bool server_;
    bool corrupt_ = false;
    bool closed_ = false; ///< the peer closed, or the socket failed
    int io_error_ = 0;    ///< the socket's error, if it failed
    bool held_ = false;
    bool out_armed_ = false;
    std::vector<std::byte> in_, out_; ///< the slots: this side's, the staging
    std::vector<std::byte> rbuf_;     ///< bytes read, not yet parsed
    std::size_t rpos_ = 0, rend_ = 0;
    // The payload being received: where it goes (null: dropped) and what is left.
    std::byte* pay_dst_ = nullptr;
    std::uint32_t pay_left_ = 0;
    enum class pay : std::uint8_t { none, slot, read, write, drop } pay_kind_ = pay::none;
    std::uint32_t pay_imm_ = 0;
    std::uint32_t pay_slot_ = UINT32_MAX; ///< write: the call whose reply buffer it lands in
    bool full_ = false; ///< parse stopped for want of room for events (whole frames wait)
    std::vector<entry> pool_;
    std::int32_t free_ = -1;
    std::array<std::int32_t, sched::priority_levels> q_head_{}, q_tail_{};
    /// The frame partly on the wire (its entry, level and payload bytes), and
    /// its bytes sent: it goes on before anything else.
    std::int32_t partial_entry_ = -1;
    std::uint8_t partial_level_ = 0;
    std::size_t partial_chunk_ = 0;
    std::size_t partial_sent_ = 0;
    std::vector<std::byte> spill_; ///< a partial frame's rest, when its source goes
    bool spilled_ = false;         ///< the partial frame's payload is in spill_
    std::vector<pending_read> reads_;
    std::vector<grant> grants_;
    std::uint32_t key_gen_ = 0;
    std::vector<link_event> events_; ///< made by the stream, handed out by poll()
    std::size_t taken_ = 0;          ///< bytes read in this poll
    std::uint32_t reads_out_ = 0;    ///< read_req on the wire, not yet ended
    std::chrono::nanoseconds stall_{0};
    sched::coarse_clock::time_point read_moved_{}; ///< when a read last moved
    sched::coarse_clock::time_point sent_moved_{}; ///< when the peer last took bytes
};

} // namespace detail
} // namespace rdmax::rpc
