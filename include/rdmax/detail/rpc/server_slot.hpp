#pragma once
// rpc::server's record of one slot of a connection: the call in it, from its
// request to its answer (deferred or not), and what replays and the reply
// cache need of it. Machinery of server.hpp, kept apart so that the server's
// header stays its contract.

#include <cstdint>
#include <optional>
#include <span>

#include <rdmax/detail/rpc/reply_cache.hpp>
#include <rdmax/detail/rpc/wire.hpp>

namespace rdmax::rpc::detail {

/// No body block (server_slot::body_at).
inline constexpr std::uint16_t no_block = 0xffff;

struct server_slot {
    bool busy = false; ///< a request arrived, its answer is not yet sent
    std::uint32_t seq = 0;
    std::uint8_t prio = 0;
    std::uint16_t method = 0;
    std::optional<buffer_descriptor> reply_buffer;
    /// flag_rail_keys: the body's and reply buffer's keys on the link's
    /// other rails (rails 0: none).
    rail_keys rails{};
    std::uint32_t rail_epoch = 0; ///< the link's link::rail_epoch() when it came
    /// The keys of the body (`body`) or of the reply buffer on rails 1..,
    /// for link::move_body; none once a rail joined since the request came
    /// (`link_epoch`: the link's now): its keys name the rails of then.
    [[nodiscard]] std::span<const std::uint32_t>
    rail_rkeys(bool body, std::uint32_t link_epoch) const noexcept {
        if (rails.rails < 2 || link_epoch != rail_epoch)
            return {};
        return {body ? rails.body : rails.reply, rails.rails - 1};
    }
    /// flag_reply_in_buffer: every reply body goes there, never inline.
    bool reply_in_buffer = false;
    /// The block (in peer::blocks) its request body is read into, or no_block.
    std::uint16_t body_at = no_block;
    /// The epoch of the call in the slot, as its immediate said.
    bool epoch = false;
    /// The call_seq of the last request accepted into the slot (valid
    /// once accepted_any): a request not newer is a replay of one taken
    /// already (a late immediate against its bytes), dropped.
    std::uint32_t last_seq = 0;
    bool accepted_any = false;
    /// The handler ran (the answer may be deferred); until then a call
    /// whose connection goes never ran.
    bool ran = false;
    bool idempotent = false;
    std::uint32_t bytes = 0; ///< the request's, in the ring (a waiting copy runs from there)
    std::uint64_t call_id = 0;
    /// Its entry in the reply cache (calls not idempotent).
    std::optional<reply_cache::entry_ref> kept;
};

} // namespace rdmax::rpc::detail
