#pragma once
// rdmax::status: what a data-path call returns. Those calls are noexcept and
// never allocate; a refused request has posted nothing.

#include <cstdint>
#include <string_view>

namespace rdmax {

enum class [[nodiscard]] status : std::uint8_t {
    ok = 0,
    zero_length,       ///< a transfer of 0 bytes
    too_long,          ///< longer than the port's max message size
    out_of_range,      ///< [offset, offset + length) is not inside the buffer, or the
                       ///< buffer runs past the end of the address space (a forged token)
    misaligned_atomic, ///< atomic target not 8-byte aligned, or not 8 bytes long
    too_many_sge,      ///< more scatter/gather entries than the queue pair allows
    inline_too_large,  ///< inline asked for more bytes than the queue pair's limit
    not_connected,     ///< the queue pair is not ready to send (RTS) or receive (RTR)
    queue_full,        ///< no send-queue slot free: poll completions first
    batch_full,        ///< a chain holds as many work requests as it can
    post_failed,       ///< ibv_post_send / ibv_post_recv refused (see the QP's last_errno)
    not_permitted,     ///< the remote handle does not grant this access
    qp_failed,         ///< an earlier request failed: the queue pair is in the error state
    /// A memory window bind the device would fail (and so break the queue
    /// pair): not a type-2 window, a window or region of another protection
    /// domain, a key that is not the window's, rights that are not remote
    /// ones, or a queue pair that is not RC.
    bad_window,
    /// The remote handle names an incarnation of its issuer (remote_handle::
    /// epoch) other than the one the queue pair knows (peer_epoch()): the
    /// issuer restarted, or the handle is not from the peer's current issuer.
    stale_handle,
    /// The queue pair does not know its peer's incarnation (peer_epoch() is
    /// 0) and the handle names one: learn it from the peer, set_peer_epoch().
    unknown_epoch,
};

[[nodiscard]] constexpr std::string_view to_string(status s) noexcept {
    switch (s) {
    case status::ok: return "ok";
    case status::zero_length: return "zero-length transfer";
    case status::too_long: return "longer than the port's maximum message size";
    case status::out_of_range: return "range outside the buffer";
    case status::misaligned_atomic: return "atomic target not 8-byte aligned or not 8 bytes";
    case status::too_many_sge: return "more scatter/gather entries than the queue pair allows";
    case status::inline_too_large: return "inline data over the queue pair's limit";
    case status::not_connected: return "queue pair not connected";
    case status::queue_full: return "send queue full: poll completions first";
    case status::batch_full: return "work-request chain full";
    case status::post_failed: return "the device refused the post";
    case status::not_permitted: return "the handle does not grant this access";
    case status::qp_failed:
        return "an earlier request failed: the queue pair is in the error state";
    case status::bad_window:
        return "memory window bind: not a type-2 window of this protection domain and RC "
               "queue pair, a key not the window's, or rights other than remote ones";
    case status::stale_handle:
        return "the handle's issuer restarted: it names another incarnation than the one the "
               "queue pair knows";
    case status::unknown_epoch:
        return "the queue pair does not know the incarnation of the handle's issuer: "
               "set_peer_epoch() with what the peer sent";
    }
    return "unknown status";
}

} // namespace rdmax
