#pragma once
// The RPC wire format (LITE, seed 001: RPC by RDMA write-with-immediate into
// the callee's memory).
//
// Each connection has two rings of `slots` slots of `slot_bytes` each: the
// server's request ring and the client's reply ring, both in registered
// memory, each exposed to the peer under a key that covers that ring alone
// (so a peer can write nowhere else). A call on slot s writes the request
// into the server's slot s with WRITE_WITH_IMM; the reply comes back into the
// client's slot s the same way. The 32-bit immediate names the kind, the
// slot and the bytes written; the receive that takes the immediate is
// zero-length, from a shared receive queue.
//
// Credits: a slot is the caller's credit. The client uses slot s again only
// after the reply for s arrived, which the server sends only after it is done
// with the request in s: so no side ever overwrites a slot the other has not
// read. A request that arrives for a slot whose reply is not yet sent is a
// credit violation, unless it carries the slot's other epoch: its caller
// gave up on the call in s (its deadline passed) and took the slot back; the
// server then drops that call unanswered and serves the new one, and the
// caller drops a late reply of the old epoch unread.
//
// A slot holds a message_header, then (requests) up to two descriptors of
// the caller's own registered buffers, then the inline body:
//   request: header | [request body descriptor] | [reply buffer descriptor] | [inline body]
//   reply:   header | [inline body]
// A request body larger than the slot stays in the caller's buffer, which
// the server reads with RDMA READ (zero-copy on the caller's side). A reply
// larger than the slot is written by the server into the buffer the caller
// offered, then announced in the slot.
//
// Control messages carry no bytes: a write-with-immediate of length 0 whose
// immediate names a control code where a slot goes (keepalive probes and
// their answers, the server's goaway and the client's acknowledgement, the
// client's goodbye). They take no slot and no credit.
//
// Every request carries the client's call id (per client incarnation, which
// the handshake names, as the server's incarnation travels back): a call
// re-sent on a new connection after its link broke keeps its id, and the
// server answers a duplicate from its reply cache instead of running it
// again (docs/rpc.md, "Failures and retries").
//
// Everything a peer sends is checked here before it is used: these functions
// are pure, so the unit tests and the fuzzer hit them without a device.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>

#include <rdmax/rpc/call_status.hpp>

namespace rdmax::rpc {

inline constexpr std::uint32_t protocol_magic = 0x52505831; // "RPX1"
/// 4: flag_reply_in_buffer (dma-buf replies); 3: call ids, incarnations and
/// control messages (2: the immediate carries the slot's epoch; version 1
/// had 4096 slots and no epoch).
inline constexpr std::uint16_t protocol_version = 4;

/// Immediate layout: bit 31 the kind, bits 30..20 the slot, bit 19 the slot's
/// epoch, bits 18..0 the bytes.
inline constexpr unsigned imm_slot_bits = 11;
inline constexpr unsigned imm_bytes_bits = 19;
inline constexpr unsigned imm_epoch_shift = imm_bytes_bits;
inline constexpr unsigned imm_slot_shift = imm_bytes_bits + 1;
inline constexpr std::uint32_t max_slots = 1U << imm_slot_bits;             // 2048
inline constexpr std::uint32_t max_slot_bytes = 1U << (imm_bytes_bits - 1); // 256 KiB

enum class message_kind : std::uint8_t { request = 0, reply = 1 };

struct imm_fields {
    message_kind kind = message_kind::request;
    std::uint32_t slot = 0;
    std::uint32_t bytes = 0;
    /// The slot's epoch: the caller flips it at each call in the slot, the
    /// reply echoes it. A caller whose call timed out may use the slot again
    /// at once: a reply of the earlier epoch is then told apart without
    /// reading the slot, and the server drops the call it supersedes.
    bool epoch = false;
    friend constexpr bool operator==(const imm_fields&, const imm_fields&) = default;
};

[[nodiscard]] constexpr std::uint32_t encode_imm(message_kind k, std::uint32_t slot,
                                                 std::uint32_t bytes, bool epoch = false) noexcept {
    return (static_cast<std::uint32_t>(k) << 31) | ((slot & (max_slots - 1)) << imm_slot_shift) |
           (static_cast<std::uint32_t>(epoch) << imm_epoch_shift) |
           (bytes & ((1U << imm_bytes_bits) - 1));
}
[[nodiscard]] constexpr imm_fields decode_imm(std::uint32_t imm) noexcept {
    return {static_cast<message_kind>(imm >> 31), (imm >> imm_slot_shift) & (max_slots - 1),
            imm & ((1U << imm_bytes_bits) - 1), ((imm >> imm_epoch_shift) & 1U) != 0};
}

/// A control message: no bytes, a code where the slot goes. Requests-kind
/// controls go from client to server, reply-kind from server to client.
enum class control : std::uint8_t {
    ping = 0,       ///< keepalive probe: answer pong
    pong = 1,       ///< keepalive answer
    goaway = 2,     ///< server: draining; send nothing new here, reconnect
    goaway_ack = 3, ///< client: nothing more comes on this connection
    bye = 4,        ///< client: closing for good (its reply cache may go at once)
};
inline constexpr std::uint32_t control_codes = 5;
[[nodiscard]] constexpr bool is_control(const imm_fields& f) noexcept {
    return f.bytes == 0;
}

/// Request flags (message_header::flags).
inline constexpr std::uint8_t flag_external_body = 1; ///< the body is in the caller's buffer
inline constexpr std::uint8_t flag_reply_buffer = 2;  ///< the caller offers a reply buffer
/// Reply flag: the body went into the caller's reply buffer.
inline constexpr std::uint8_t flag_external_reply = 4;
/// Request flag: the slot's epoch, as in the immediate. A server that finds
/// the other one took the immediate late: the slot holds the caller's next
/// call already (or the caller gave the call up), and the immediate is dropped.
inline constexpr std::uint8_t flag_epoch = 8;
/// Request flag: running the call twice does no harm (the server keeps no reply of it).
inline constexpr std::uint8_t flag_idempotent = 16;
/// Request flag: sent before on an earlier connection of the same client
/// incarnation; the server looks its call id up before running it.
inline constexpr std::uint8_t flag_retry = 32;
/// Request flag (with flag_reply_buffer): every reply body goes into the
/// reply buffer, however small, never inline in the slot: the buffer is
/// memory the caller's CPU does not touch (a dma-buf).
inline constexpr std::uint8_t flag_reply_in_buffer = 64;
/// Request flag (with an external body or a reply buffer): a rail_keys
/// follows the descriptors. The call's buffers are shown on the link's
/// other rails too, and the server may cut their READ and WRITE across them.
/// Sent only on a link whose other rails joined (rail_join).
inline constexpr std::uint8_t flag_rail_keys = 128;
inline constexpr std::uint8_t request_flags = flag_external_body | flag_reply_buffer | flag_epoch |
                                              flag_idempotent | flag_retry | flag_reply_in_buffer |
                                              flag_rail_keys;

/// Rails an RPC link uses at most: its own (rail 0) and three more.
inline constexpr std::uint32_t max_link_rails = 4;

/// What follows a request's descriptors under flag_rail_keys: the keys of
/// its body and reply buffer on rails 1 .. rails - 1 (rail 0's are in the
/// descriptors). Rail k of a link is the connection that joined as rail k.
struct rail_keys {
    std::uint32_t rails = 0;    ///< rails keyed, rail 0 included: 2 .. max_link_rails
    std::uint32_t reserved = 0; ///< zero
    /// Rail k's key at [k - 1]; zero past `rails`, and all zero for a
    /// buffer the call does not have.
    std::uint32_t body[max_link_rails - 1]{};
    std::uint32_t reply[max_link_rails - 1]{};
};
static_assert(sizeof(rail_keys) == 32 && std::has_unique_object_representations_v<rail_keys>);

/// The first bytes of every slot.
struct message_header {
    std::uint32_t call_seq = 0; ///< the client's number for the call; the reply echoes it
    std::uint16_t method = 0;   ///< requests: the handler's id (0 is reserved)
    std::uint8_t flags = 0;
    std::uint8_t priority = 0; ///< requests: 0 (urgent) .. 7; replies go at the same level
    std::uint32_t status = 0;  ///< replies: a call_status the server may say
    std::uint32_t body_bytes = 0;
    /// The client's id for the call, unique within its incarnation and kept
    /// when the call is re-sent; the reply echoes it.
    std::uint64_t call_id = 0;
};
static_assert(sizeof(message_header) == 24 && std::is_trivially_copyable_v<message_header>);
static_assert(std::has_unique_object_representations_v<message_header>);

/// A caller's registered buffer, for the peer's READ or WRITE.
struct buffer_descriptor {
    std::uint64_t addr = 0;
    std::uint32_t rkey = 0;
    std::uint32_t length = 0;
};
static_assert(sizeof(buffer_descriptor) == 16);
static_assert(std::has_unique_object_representations_v<buffer_descriptor>);

/// What each side offers in the connection's private data: its ring (the
/// client's reply ring in the request, the server's request ring in the
/// reply) and its geometry. The server may grant fewer or smaller slots than
/// the client asked for, never more.
struct ring_offer {
    std::uint32_t magic = protocol_magic;
    std::uint16_t version = protocol_version;
    std::uint16_t slots = 0;
    std::uint32_t slot_bytes = 0;
    std::uint32_t rkey = 0;
    std::uint64_t addr = 0;
    /// The sender's incarnation: random, never 0, one per client or server
    /// object. A client that reconnects learns whether its server restarted.
    std::uint64_t incarnation = 0;
    /// Client: the first call id it sends on this connection. Its copies of
    /// earlier calls (flag_retry) have lower ids; a server with no record of
    /// the client vouches for none of those (unknown_outcome).
    /// Server: the link's join key, random (0: it takes no rails). The
    /// client's other rails join the link with it (rail_join).
    std::uint64_t first_call = 0;
};
static_assert(sizeof(ring_offer) == 40 && sizeof(ring_offer) <= 55);
static_assert(std::has_unique_object_representations_v<ring_offer>);

/// "RJON": a connection that joins a link as one of its other rails.
inline constexpr std::uint32_t rail_join_magic = 0x4e4f4a52;

/// The private data of a rail's connection (the client's, and the server's
/// answer, which echoes it): which link (the server's join key and the
/// client's incarnation, both random) and which rail of it.
struct rail_join {
    std::uint32_t magic = rail_join_magic;
    std::uint16_t version = protocol_version;
    std::uint16_t rail = 0; ///< 1 .. max_link_rails - 1
    std::uint64_t incarnation = 0;
    std::uint64_t link_key = 0;
};
static_assert(sizeof(rail_join) == 24 && std::has_unique_object_representations_v<rail_join>);

/// Why a join was refused, or nullptr.
[[nodiscard]] constexpr const char* check_join(const rail_join& j) noexcept {
    if (j.magic != rail_join_magic)
        return "not an rdmax rail join (magic)";
    if (j.version != protocol_version)
        return "another protocol version";
    if (j.rail == 0 || j.rail >= max_link_rails)
        return "rail out of range";
    if (j.incarnation == 0 || j.link_key == 0)
        return "no link named";
    return nullptr;
}

/// The smallest slot: a header, two descriptors and some inline body.
inline constexpr std::uint32_t min_slot_bytes = 64;

/// Why an offer was refused, or nullptr.
[[nodiscard]] constexpr const char* check_offer(const ring_offer& o) noexcept {
    if (o.magic != protocol_magic)
        return "not an rdmax RPC peer (magic)";
    if (o.version != protocol_version)
        return "another protocol version";
    if (o.slots == 0 || o.slots > max_slots)
        return "slot count out of range";
    if (o.slot_bytes < min_slot_bytes || o.slot_bytes > max_slot_bytes || o.slot_bytes % 8 != 0)
        return "slot size out of range";
    const std::uint64_t ring = std::uint64_t{o.slots} * o.slot_bytes;
    if (o.addr == 0 || o.addr > UINT64_MAX - ring)
        return "ring address wraps";
    if (o.incarnation == 0)
        return "no incarnation";
    return nullptr;
}

/// What a peer's message broke.
enum class violation : std::uint8_t {
    none = 0,
    wrong_kind, ///< a reply where a request belongs, or the reverse
    bad_slot,   ///< slot index outside the ring
    bad_length, ///< shorter than a header, or longer than the slot
    malformed,  ///< the header disagrees with the length, or with itself
    credit,     ///< a request for a slot whose previous call was not answered
    bad_opcode, ///< not a WRITE_WITH_IMM, or a completion in error
};

[[nodiscard]] constexpr std::string_view to_string(violation v) noexcept {
    switch (v) {
    case violation::none: return "none";
    case violation::wrong_kind: return "wrong message kind";
    case violation::bad_slot: return "slot out of range";
    case violation::bad_length: return "length out of range";
    case violation::malformed: return "malformed header";
    case violation::credit: return "credit violation";
    case violation::bad_opcode: return "not a write-with-immediate";
    }
    return "unknown";
}

/// A request, checked; spans point into the slot.
struct parsed_request {
    message_header header;
    std::optional<buffer_descriptor> external_body;
    std::optional<buffer_descriptor> reply_buffer;
    std::optional<rail_keys> rails; ///< flag_rail_keys
    std::span<const std::byte> inline_body;
};

/// A reply, checked.
struct parsed_reply {
    message_header header;
    std::span<const std::byte> inline_body;
};

namespace detail {
template <class T>
[[nodiscard]] T load(const std::byte* p) noexcept {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
}
} // namespace detail

/// Checks the immediate against the ring's geometry: its kind, slot and
/// length (a control message: its code).
[[nodiscard]] constexpr violation check_imm(const imm_fields& f, message_kind expected,
                                            std::uint32_t slots,
                                            std::uint32_t slot_bytes) noexcept {
    if (f.kind != expected)
        return violation::wrong_kind;
    if (is_control(f))
        return f.slot < control_codes && !f.epoch ? violation::none : violation::malformed;
    if (f.slot >= slots)
        return violation::bad_slot;
    if (f.bytes < sizeof(message_header) || f.bytes > slot_bytes)
        return violation::bad_length;
    return violation::none;
}

/// The bytes a request with header `h` takes in its slot (what its own
/// immediate says), by the header's flags and body length.
[[nodiscard]] constexpr std::uint64_t request_bytes(const message_header& h) noexcept {
    std::uint64_t n = sizeof(message_header);
    if ((h.flags & flag_reply_buffer) != 0)
        n += sizeof(buffer_descriptor);
    if ((h.flags & flag_external_body) != 0)
        n += sizeof(buffer_descriptor);
    else
        n += h.body_bytes;
    if ((h.flags & flag_rail_keys) != 0)
        n += sizeof(rail_keys);
    return n;
}

/// A rail_keys is whole: 2 .. max_link_rails rails, a key for each of them
/// (past rail 0) for each buffer the request has, and zeros everywhere else.
[[nodiscard]] constexpr bool rail_keys_valid(const rail_keys& k, bool body, bool reply) noexcept {
    if (k.rails < 2 || k.rails > max_link_rails || k.reserved != 0)
        return false;
    for (std::uint32_t i = 0; i + 1 < max_link_rails; ++i) {
        const bool keyed = i + 1 < k.rails;
        if ((k.body[i] != 0) != (keyed && body) || (k.reply[i] != 0) != (keyed && reply))
            return false;
    }
    return true;
}

/// Parses the `bytes` (from the immediate, already checked) written at the
/// start of a request slot.
[[nodiscard]] inline violation parse_request(std::span<const std::byte> bytes,
                                             parsed_request& out) noexcept {
    if (bytes.size() < sizeof(message_header))
        return violation::bad_length;
    out = {};
    out.header = detail::load<message_header>(bytes.data());
    const message_header& h = out.header;
    std::size_t at = sizeof(message_header);
    if ((h.flags & ~request_flags) != 0 || h.method == 0 || h.priority > 7 || h.status != 0)
        return violation::malformed;
    if ((h.flags & flag_external_body) != 0) {
        if (bytes.size() < at + sizeof(buffer_descriptor))
            return violation::malformed;
        out.external_body = detail::load<buffer_descriptor>(bytes.data() + at);
        at += sizeof(buffer_descriptor);
        if (out.external_body->length != h.body_bytes || h.body_bytes == 0 ||
            out.external_body->addr > UINT64_MAX - out.external_body->length)
            return violation::malformed;
    }
    if ((h.flags & flag_reply_in_buffer) != 0 && (h.flags & flag_reply_buffer) == 0)
        return violation::malformed;
    if ((h.flags & flag_reply_buffer) != 0) {
        if (bytes.size() < at + sizeof(buffer_descriptor))
            return violation::malformed;
        out.reply_buffer = detail::load<buffer_descriptor>(bytes.data() + at);
        at += sizeof(buffer_descriptor);
        if (out.reply_buffer->length == 0 ||
            out.reply_buffer->addr > UINT64_MAX - out.reply_buffer->length)
            return violation::malformed;
    }
    if ((h.flags & flag_rail_keys) != 0) {
        if (!out.external_body && !out.reply_buffer)
            return violation::malformed;
        if (bytes.size() < at + sizeof(rail_keys))
            return violation::malformed;
        out.rails = detail::load<rail_keys>(bytes.data() + at);
        at += sizeof(rail_keys);
        if (!rail_keys_valid(*out.rails, out.external_body.has_value(),
                             out.reply_buffer.has_value()))
            return violation::malformed;
    }
    const std::size_t inline_bytes = bytes.size() - at;
    if (out.external_body) {
        if (inline_bytes != 0)
            return violation::malformed;
    } else if (inline_bytes != h.body_bytes) {
        return violation::malformed;
    }
    out.inline_body = bytes.subspan(at);
    return violation::none;
}

/// Parses a reply slot's `bytes`; `offered` is the reply buffer's length the
/// call offered (0: none); `buffer_only`: the call asked for every reply body
/// in that buffer (flag_reply_in_buffer), so an inline one breaks the protocol.
[[nodiscard]] inline violation parse_reply(std::span<const std::byte> bytes, std::uint32_t offered,
                                           parsed_reply& out, bool buffer_only = false) noexcept {
    if (bytes.size() < sizeof(message_header))
        return violation::bad_length;
    out = {};
    out.header = detail::load<message_header>(bytes.data());
    const message_header& h = out.header;
    if ((h.flags & ~flag_external_reply) != 0 || h.method != 0 || h.priority > 7 ||
        !server_status(h.status))
        return violation::malformed;
    const std::size_t inline_bytes = bytes.size() - sizeof(message_header);
    if ((h.flags & flag_external_reply) != 0) {
        if (inline_bytes != 0 || h.body_bytes > offered)
            return violation::malformed;
    } else if (inline_bytes != h.body_bytes || (buffer_only && inline_bytes != 0)) {
        return violation::malformed;
    }
    out.inline_body = bytes.subspan(sizeof(message_header));
    return violation::none;
}

} // namespace rdmax::rpc
