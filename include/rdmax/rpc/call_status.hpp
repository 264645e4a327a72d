#pragma once
// How an RPC ended, as the caller sees it. The first values travel in a
// reply's header (the server says them); the rest the client decides.

#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

namespace rdmax::rpc {

enum class [[nodiscard]] call_status : std::uint32_t {
    ok = 0,
    // Said by the server, in the reply.
    unknown_method = 1,    ///< no handler for the method id
    handler_failed = 2,    ///< the handler threw or refused the request
    request_too_large = 3, ///< the request's body is over the server's max_message
    reply_too_large = 4,   ///< the reply fits neither the slot nor the buffer the caller offered
    read_failed = 5,       ///< the server could not read the request's body from the caller
    /// A call re-sent after its link broke (or waiting while it was down)
    /// that may or may not have run, and whose reply is lost: the server
    /// restarted, or no longer keeps the call's reply. Never run twice.
    unknown_outcome = 6,
    // Decided by the client.
    timed_out = 16, ///< no reply before the call's deadline
    /// The connection failed or the peer left, and the call never went (or,
    /// idempotent, may have run): no reconnect, or it gave up.
    peer_gone = 17,
    no_credit = 18,      ///< every slot of the connection holds a call: poll, then call again
    too_large = 19,      ///< the request is over max_message, or its body does not fit the slot
    bad_peer = 20,       ///< no such peer (never connected, or disconnected)
    bad_reply = 21,      ///< the reply broke the protocol (its header or length)
    invalid_method = 22, ///< method id 0 is reserved
    /// A body or reply buffer over a slot needs a registration the device (or
    /// the registration cache) refused: memory it cannot pin, a limit reached.
    registration_failed = 23,
    /// The caller cancelled the call (rpc::client::cancel, or an Asio
    /// cancellation slot): it may have run at the server; its reply, if one
    /// comes, is dropped, and its buffers are fenced from the peer as a
    /// timed-out call's are.
    cancelled = 24,
    /// The call names dma-buf memory (call_options::body_dmabuf, reply_dmabuf)
    /// and its connection is node-local or TCP, which could only move those
    /// bytes with the CPU: refused, nothing registered or sent.
    dmabuf_unreachable = 25,
    /// call_options that contradict themselves: a dma-buf body beside a
    /// request in host memory, reply_dmabuf beside reply_into, a dma-buf range
    /// without its cache or whose cache is in another protection domain.
    bad_options = 26,
};

[[nodiscard]] constexpr std::string_view to_string(call_status s) noexcept {
    switch (s) {
    case call_status::ok: return "ok";
    case call_status::unknown_method: return "the server has no handler for this method";
    case call_status::handler_failed: return "the server's handler failed";
    case call_status::request_too_large: return "request over the server's max_message";
    case call_status::reply_too_large:
        return "reply fits neither the slot nor the caller's reply buffer";
    case call_status::read_failed: return "the server could not read the request body";
    case call_status::unknown_outcome:
        return "the call may have run once, but its reply was lost with the connection";
    case call_status::timed_out: return "no reply before the deadline";
    case call_status::peer_gone: return "the peer disconnected or its connection failed";
    case call_status::no_credit: return "every slot of the connection holds a call";
    case call_status::too_large: return "request too large to send";
    case call_status::bad_peer: return "no such peer";
    case call_status::bad_reply: return "the reply broke the protocol";
    case call_status::invalid_method: return "method id 0 is reserved";
    case call_status::registration_failed:
        return "a buffer of the call could not be registered for the peer";
    case call_status::cancelled: return "the caller cancelled the call";
    case call_status::dmabuf_unreachable:
        return "dma-buf memory goes only over RDMA: this connection is node-local or TCP, "
               "which would move it with the CPU";
    case call_status::bad_options:
        return "call options contradict themselves (a dma-buf range beside host memory for the "
               "same body or reply, or without its cache, or its cache in another protection "
               "domain)";
    }
    return "unknown call status";
}

/// A status the server may put in a reply (anything else there is a protocol error).
[[nodiscard]] constexpr bool server_status(std::uint32_t s) noexcept {
    return s <= static_cast<std::uint32_t>(call_status::unknown_outcome);
}

/// The error category of call_status (ok is no error): for std::error_code
/// and the Asio adapters' completions. Its conditions: timed_out is
/// std::errc::timed_out, cancelled std::errc::operation_canceled, peer_gone
/// and bad_peer std::errc::not_connected, no_credit
/// std::errc::resource_unavailable_try_again.
[[nodiscard]] inline const std::error_category& call_category() noexcept {
    struct category final : std::error_category {
        [[nodiscard]] const char* name() const noexcept override { return "rdmax.rpc"; }
        [[nodiscard]] std::string message(int v) const override {
            return std::string(to_string(static_cast<call_status>(v)));
        }
        [[nodiscard]] std::error_condition default_error_condition(int v) const noexcept override {
            switch (static_cast<call_status>(v)) {
            case call_status::timed_out: return std::errc::timed_out;
            case call_status::cancelled: return std::errc::operation_canceled;
            case call_status::peer_gone:
            case call_status::bad_peer: return std::errc::not_connected;
            case call_status::no_credit: return std::errc::resource_unavailable_try_again;
            case call_status::dmabuf_unreachable: return std::errc::operation_not_supported;
            case call_status::bad_options: return std::errc::invalid_argument;
            default: return {v, *this};
            }
        }
    };
    static const category c;
    return c;
}

[[nodiscard]] inline std::error_code make_error_code(call_status s) noexcept {
    return {static_cast<int>(s), call_category()};
}

} // namespace rdmax::rpc

template <>
struct std::is_error_code_enum<rdmax::rpc::call_status> : std::true_type {};

template <>
struct fmt::formatter<rdmax::rpc::call_status> : fmt::formatter<std::string_view> {
    auto format(rdmax::rpc::call_status s, fmt::format_context& ctx) const {
        return fmt::formatter<std::string_view>::format(rdmax::rpc::to_string(s), ctx);
    }
};
