#pragma once
// The owner's side of LITE-style remote handles: handle_issuer issues
// remote_handles over registered memory and revokes them. After revocation a
// peer's use of the handle completes with an error at the peer (remote
// access error), never a hang.
//
// Two mechanisms (handle_options::revoke, RDMAX_HANDLE_REVOKE):
//
// - Memory windows (type 2). A window is bound over the memory's existing
//   registration by a work request (IBV_WR_BIND_MW) posted on a queue pair,
//   with a fresh key each time (ibv_inc_rkey), and revoked by a local
//   invalidation (IBV_WR_LOCAL_INV) on the same queue pair; the window is
//   then bound again for a later handle, under another key, so that no stale
//   handle matches. Nothing is registered per handle. A type-2 window answers
//   only to requests that arrive on the queue pair it was bound through: give
//   the issuer the queue pair connected to the peer that will use the
//   handles (one issuer per peer). The memory's registration must allow
//   binding (rights::mw_bind; a registered_arena with that right in
//   arena_options::rights).
// - A registration of the handle's own (ibv_reg_mr over the handle's bytes,
//   with only the rights granted); revoked by deregistering it. Works on every
//   device and needs no queue pair; costs a registration (tens of us) each.
//
// automatic (the default) takes windows where the device has type 2, a queue
// pair was given and the memory's registration allows binding, else
// registrations; mw insists (and throws where windows cannot be had), mr
// never binds windows.
//
// Rules a user must keep:
// - issue() and revoke() of windows post on the queue pair and wait (up to
//   handle_options::deadline) for their completion, keeping any completion
//   of the application's own requests for its next poll_send / wait_send. A
//   queue pair is used by one thread at a time: call them from the thread
//   that uses it. Work requests whose wr_id has the top 16 bits 0x4d57 are
//   the issuer's.
// - Destroy the issuer before the queue pair and before the memory its
//   handles cover (the arena, the memory_region): a registration with a window
//   bound to it cannot be deregistered, and a window holds on to its queue
//   pair. The destructor deallocates every window, bound or not.
// - Revoke a handle before giving its memory back to the arena.
// - A peer's use of a revoked handle is a remote access error, which on RC
//   takes both queue pairs of the connection to the error state (as any
//   access error does). Later revocations then cannot post their local
//   invalidation: the window is deallocated instead, which revokes it as well
//   (counter revoked_mw_dealloc).
// - A window's key has 8 bits of its own: after 256 bindings of one window a
//   key comes back. A handle stale by that many re-issues could match again.
//
// Incarnations (epochs). Each issuer draws a random 64-bit epoch() when it is
// made (getrandom; never 0), fixed for its life, and stamps it on every handle
// it issues. A new issuer (a restarted process) has another, though its keys
// may repeat: a peer whose queue pair knows the new epoch
// (queue_pair<rc>::set_peer_epoch) refuses the old handles before posting
// (status::stale_handle; see remote_handle.hpp). Give the peer epoch() (or a
// handle, which carries it) on each connection. revoke() and mechanism_of()
// ignore handles of another epoch, so an old handle whose key repeats cannot
// revoke a new one. One queue pair knows one epoch: a peer uses handles of
// one issuer per connection (as windows require anyway).

#include <cerrno>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include <fmt/format.h>
#include <infiniband/verbs.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/handle_options.hpp>
#include <rdmax/mem/memory_region.hpp>
#include <rdmax/mem/registered_arena.hpp>
#include <rdmax/mem/registrar.hpp>
#include <rdmax/mem/remote_handle.hpp>
#include <rdmax/mem/rights.hpp>
#include <rdmax/verbs/protection_domain.hpp>
#include <rdmax/verbs/queue_pair.hpp>

namespace rdmax {

/// A fresh incarnation: 64 random bits (getrandom), never 0. What each
/// handle_issuer draws; an application may use it for incarnations of its own.
[[nodiscard]] std::uint64_t new_epoch() noexcept;

/// A registration a memory window may be bound to, and the rights it was
/// registered with (ibv_mr does not record them; a bind the registration does
/// not allow would fail on the device and break the queue pair).
struct bind_target {
    ibv_mr* mr = nullptr;
    rights granted = rights::local_read;
};

class handle_issuer {
public:
    /// Handles by registrations only: windows need a queue pair. Throws
    /// rdmax::error if the options insist on windows.
    explicit handle_issuer(const verbs::protection_domain& pd,
                           handle_options opt = handle_options{}.with_env());
    /// Handles by windows bound through `qp` where possible: the queue pair,
    /// connected, that the peer's requests arrive on. Throws rdmax::error if
    /// the options insist on windows and the device has no type 2, or `qp`
    /// is in another protection domain.
    handle_issuer(const verbs::protection_domain& pd, verbs::queue_pair<verbs::rc>& qp,
                  handle_options opt = handle_options{}.with_env());
    /// No device: issues nothing (issue() throws ENODEV). For an RPC
    /// endpoint built without a device in tests.
    handle_issuer() noexcept;
    handle_issuer(const handle_issuer&) = delete;
    handle_issuer& operator=(const handle_issuer&) = delete;
    ~handle_issuer();

    /// A handle granting `rights` (remote read, write and/or atomic) over
    /// [addr, addr + len), backed by a registration of its own (no
    /// registration to bind a window to is known). Throws rdmax::error if the
    /// device refuses, or if the options insist on windows.
    [[nodiscard]] remote_handle issue(const void* addr, std::size_t len, rights asked);
    /// The same over memory registered as `parent`: by a window bound to it
    /// where the options and the device allow, else as above. Throws
    /// rdmax::error naming the verb if a bind is refused, fails or does not
    /// complete within the deadline.
    [[nodiscard]] remote_handle issue(bind_target parent, const void* addr, std::size_t len,
                                      rights asked);
    template <rights R>
    [[nodiscard]] remote_handle issue(const memory_region<R>& parent, const void* addr,
                                      std::size_t len, rights asked) {
        return issue(bind_target{parent.get(), R}, addr, len, asked);
    }
    /// Over memory of an arena of verbs registrations (one area).
    template <registrar Reg>
        requires std::same_as<typename Reg::handle, ibv_mr*>
    [[nodiscard]] remote_handle issue(const basic_registered_arena<Reg>& arena, const void* addr,
                                      std::size_t len, rights asked) {
        const auto mr = arena.registration_of(addr);
        if (!mr)
            throw_error("handle_issuer::issue", ERANGE,
                        fmt::format("{} is not in the arena", addr));
        return issue(bind_target{*mr, arena.options().area_rights}, addr, len, asked);
    }

    /// Revokes h: from now on the device refuses its key. Returns false if h
    /// was not issued here (another epoch included) or was revoked already.
    bool revoke(const remote_handle& h) noexcept;

    /// How a live handle is backed; nullopt if it is not live (or of another epoch).
    [[nodiscard]] std::optional<revoke_by> mechanism_of(const remote_handle& h) const noexcept;
    /// This issuer's incarnation, on every handle it issues: random, never 0,
    /// fixed for its life. Tell it to the peer (set_peer_epoch on its side).
    [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }
    /// True when this issuer can back handles by windows (device, queue pair, options).
    [[nodiscard]] bool memory_windows() const noexcept { return why_not_ == nullptr; }
    [[nodiscard]] std::size_t live() const noexcept;
    [[nodiscard]] handle_counters counters() const noexcept;
    [[nodiscard]] const handle_options& options() const noexcept { return opt_; }

private:
    struct issued {
        revoke_by by;
        ibv_mr* mr = nullptr; ///< memory_region
        ibv_mw* mw = nullptr; ///< memory_window
    };

    remote_handle issue_mr(const void* addr, std::size_t len, rights asked, bool fallback);
    remote_handle issue_mw(bind_target parent, const void* addr, std::size_t len, rights asked);
    ibv_mw* take_window();
    /// Invalidates mw's binding (key rkey) and keeps it for reuse, or, if that
    /// cannot be done, deallocates it. Under post_mutex_.
    void unbind(ibv_mw* mw, std::uint32_t rkey) noexcept;
    std::uint64_t next_wr_id() noexcept;

    const verbs::protection_domain* pd_ = nullptr;
    verbs::queue_pair<verbs::rc>* qp_ = nullptr;
    handle_options opt_;
    const char* why_not_ = nullptr; ///< why this issuer binds no windows (issuer-wide reasons)
    const std::uint64_t epoch_ = new_epoch();

    std::mutex post_mutex_; ///< one bind or invalidation at a time on qp_ (taken first)
    mutable std::mutex mutex_;
    std::map<std::uint32_t, issued> issued_; ///< by rkey
    std::vector<ibv_mw*> free_windows_;      ///< allocated, unbound: reused with a new key
    handle_counters counters_;               ///< under mutex_ (live is issued_.size())
    std::uint64_t wr_seq_ = 0;               ///< under post_mutex_
};

} // namespace rdmax
