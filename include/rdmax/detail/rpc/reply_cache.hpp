#pragma once
// rpc::detail::reply_cache: the server's memory of the calls it ran, per
// client incarnation, so that a call re-sent after a reconnect (same client
// incarnation, same call id, flag_retry) is answered from here instead of
// running again. Calls marked idempotent never come here.
//
// Each client incarnation has a ring of the last `calls` calls it sent (a
// fixed array: recording a call allocates nothing once the ring has been
// round, as each entry keeps its reply buffer's capacity), each answered
// from here for `ttl` after it ran; the replies of every client together
// hold at most `bytes` (capacity counted: a reply over it is not kept). What
// the ring let go is remembered as a bound: a re-sent call at or under the
// highest id let go, and not in the ring, may have run (its reply is gone),
// so it is answered unknown_outcome rather than run again. A call with an id
// over that bound not in the ring never arrived: it runs.
//
// A record starts with the bound at the first call id the client says it
// will send on the connection that made it: a record made while the client
// was resuming (this server restarted, or forgot the client: its record
// lingered out, or was evicted) answers its re-sent calls unknown_outcome.
// The record of a client outlives its last connection by `linger` (the
// client may be reconnecting), and goes at once when the client said
// goodbye; at most `records` are kept (the longest gone go first). Pure
// bookkeeping, no device: the unit tests drive it with a virtual clock.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include <rdmax/rpc/call_status.hpp>
#include <rdmax/rpc/peer_id.hpp>
#include <rdmax/sched/coarse_clock.hpp>

namespace rdmax::rpc::detail {

struct reply_cache_limits {
    std::uint32_t calls = 1024;
    std::size_t bytes = std::size_t{64} << 20; ///< over every client
    std::size_t records = 512;
    std::chrono::nanoseconds ttl = std::chrono::seconds(60);
    std::chrono::nanoseconds linger = std::chrono::seconds(5);
};

class reply_cache {
public:
    using time_point = sched::coarse_clock::time_point;

    /// Where a recorded call's entry is: checked on every use (the ring may
    /// have let it go since).
    struct entry_ref {
        std::uint64_t client = 0;
        std::uint64_t call_id = 0;
        std::uint32_t at = 0;
    };
    /// Who waits for a call still running: a duplicate that came on another
    /// connection while the first was being answered (a deferred handler).
    struct waiter {
        peer_id peer;
        std::uint32_t slot = 0;
        std::uint32_t call_seq = 0;
    };
    /// What to do with a request that came.
    enum class verdict : std::uint8_t {
        run,     ///< run it (recorded when `at` is set)
        cached,  ///< answer with the reply kept (reply())
        running, ///< the first copy is still running: wait for it (set_waiter)
        unknown, ///< it may have run and its reply is gone: answer unknown_outcome
    };

    explicit reply_cache(reply_cache_limits limits) noexcept
        : limits_(limits) {}

    /// A connection of `client` starts: its record is made (or kept), a new
    /// one vouching for no call under `first_call` (the first id the client
    /// sends on it). Throws std::bad_alloc (at connect, never on the call path).
    void attach(std::uint64_t client, std::uint64_t first_call);
    /// A connection of `client` ended; its last one starts the linger
    /// (`bye`: the client left for good, the record goes now).
    void detach(std::uint64_t client, bool bye, time_point now) noexcept;
    /// Records whose linger is over go.
    void expire(time_point now) noexcept;

    /// A request of `client` not marked idempotent arrived. `retry`: sent
    /// before on an earlier connection.
    verdict admit(std::uint64_t client, std::uint64_t call_id, bool retry, time_point now,
                  std::optional<entry_ref>& recorded) noexcept;
    /// The status and body a cached verdict answers with (valid until the
    /// next call into the cache).
    [[nodiscard]] call_status reply(const entry_ref& e, std::span<const std::byte>& body) const;
    /// The first copy of `e` waits for the answer to go to `w` too.
    void set_waiter(const entry_ref& e, const waiter& w) noexcept;
    /// The call `e` was answered (status, body): kept, within the byte budget
    /// (over it: kept as unknown). Returns who else waits for the answer.
    std::optional<waiter> done(const entry_ref& e, call_status st, std::span<const std::byte> body,
                               time_point now) noexcept;
    /// The call never ran (its body could not be read, its connection went
    /// before): forgotten, so that a re-sent copy runs. Returns the copy that
    /// waited for it, which must now run in its stead.
    std::optional<waiter> forget(const entry_ref& e) noexcept;
    /// The entry of call `call_id` of `client`, if the ring still has it.
    [[nodiscard]] std::optional<entry_ref> find(std::uint64_t client,
                                                std::uint64_t call_id) const noexcept;

    [[nodiscard]] std::size_t clients() const noexcept { return records_.size(); }
    /// Calls kept (running or answered) over every client.
    [[nodiscard]] std::size_t entries() const noexcept;
    /// Reply bytes held over every client (capacity).
    [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

private:
    enum class state : std::uint8_t { empty, running, done, lost };
    struct entry {
        std::uint64_t call_id = 0;
        state st = state::empty;
        call_status status = call_status::ok;
        time_point when{};
        std::vector<std::byte> body; ///< its capacity kept for the next call in this entry
        std::optional<waiter> wants;
    };
    struct record {
        std::vector<entry> ring;
        std::uint32_t next = 0;         ///< where the next call goes
        std::uint64_t let_go = 0;       ///< the highest id the ring let go (0: none)
        std::uint32_t connections = 0;  ///< live connections of this client
        std::optional<time_point> gone; ///< no connection since: goes after the linger
    };
    [[nodiscard]] entry* at(const entry_ref& e) noexcept;
    [[nodiscard]] const entry* at(const entry_ref& e) const noexcept;
    void record_call(record& r, std::uint64_t call_id, time_point now, std::uint64_t client,
                     std::optional<entry_ref>& recorded) noexcept;
    /// Keeps `body` in `x` within the byte budget (false: not kept).
    bool keep_body(entry& x, std::span<const std::byte> body) noexcept;
    /// Room for one more record: the one gone longest goes (none gone: none).
    void make_room() noexcept;
    void release(const record& r) noexcept;

    reply_cache_limits limits_;
    std::size_t bytes_ = 0; ///< the capacity of every entry's reply buffer
    std::unordered_map<std::uint64_t, record> records_;
};

} // namespace rdmax::rpc::detail
