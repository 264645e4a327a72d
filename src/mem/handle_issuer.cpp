#include <atomic>
#include <cerrno>
#include <chrono>
#include <sys/random.h>
#include <unistd.h>

#include <rdmax/mem/handle_issuer.hpp>

namespace rdmax {

std::uint64_t new_epoch() noexcept {
    std::uint64_t e = 0;
    for (;;) {
        const ssize_t n = getrandom(&e, sizeof e, 0);
        if (n == static_cast<ssize_t>(sizeof e)) {
            if (e != 0)
                return e;
            continue; // 0 means "none": draw again
        }
        if (n < 0 && errno == EINTR)
            continue;
        break;
    }
    // No getrandom (a kernel before 3.17, a seccomp filter): the time, the
    // process and a counter, mixed (splitmix64's finaliser). Distinct across
    // restarts and issuers, though not secret.
    static std::atomic<std::uint64_t> drawn{0};
    std::uint64_t z =
        static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) ^
        (static_cast<std::uint64_t>(getpid()) << 40) ^
        (drawn.fetch_add(1, std::memory_order_relaxed) * 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    z ^= z >> 31;
    return z != 0 ? z : 1;
}

namespace {

constexpr const char* who = "handle_issuer";

/// The rights a handle grants: the remote ones asked for. Local rights in the
/// request are ignored, as before; a request with no remote right is an error.
rights granted_rights(const void* addr, std::size_t len, rights asked) {
    if (len == 0 || addr == nullptr)
        throw_error("handle_issuer::issue", EINVAL, len == 0 ? "zero length" : "null address");
    const int granted = to_ibv(asked) & to_ibv(remote_rights);
    if (granted == 0)
        throw_error("handle_issuer::issue", EINVAL,
                    "grant at least one remote right (read, write or atomic)");
    return static_cast<rights>(granted);
}

bool writes(rights granted) noexcept {
    return has(granted, rights::remote_write) || has(granted, rights::remote_atomic);
}

[[noreturn]] void refuse_windows(const char* why) {
    throw_error(who, EINVAL,
                fmt::format("memory windows asked for (handle_options::revoke = mw, or "
                            "RDMAX_HANDLE_REVOKE=mw), but {}",
                            why));
}

} // namespace

handle_issuer::handle_issuer(const verbs::protection_domain& pd, handle_options opt)
    : pd_(&pd)
    , opt_(opt)
    , why_not_(why_no_window(pd.device().limits().memory_windows, false, true, true, false)) {
    if (opt_.revoke == revoke_by::memory_window)
        refuse_windows(why_not_);
    if (opt_.revoke == revoke_by::memory_region)
        why_not_ = "the options ask for registrations (mr)";
}

handle_issuer::handle_issuer(const verbs::protection_domain& pd, verbs::queue_pair<verbs::rc>& qp,
                             handle_options opt)
    : pd_(&pd)
    , qp_(&qp)
    , opt_(opt)
    , why_not_(why_no_window(pd.device().limits().memory_windows, true, true, true, false)) {
    if (qp.get() == nullptr || qp.get()->pd != pd.get())
        throw_error(who, EINVAL,
                    "the queue pair must be one of this protection domain (windows bind "
                    "through it)");
    if (opt_.revoke == revoke_by::memory_window && why_not_ != nullptr)
        refuse_windows(why_not_);
    if (opt_.revoke == revoke_by::memory_region)
        why_not_ = "the options ask for registrations (mr)";
}

handle_issuer::handle_issuer() noexcept
    : why_not_("no device") {}

handle_issuer::~handle_issuer() {
    // Deallocating a bound window invalidates it: no post, no wait, and it
    // works whatever state the queue pair is in.
    for (auto& [key, h] : issued_) {
        if (h.by == revoke_by::memory_window)
            ibv_dealloc_mw(h.mw);
        else
            ibv_dereg_mr(h.mr);
    }
    for (ibv_mw* mw : free_windows_)
        ibv_dealloc_mw(mw);
}

remote_handle handle_issuer::issue(const void* addr, std::size_t len, rights asked) {
    const rights granted = granted_rights(addr, len, asked);
    if (opt_.revoke == revoke_by::memory_window)
        refuse_windows("no registration to bind a window to was given: use issue(region, ...) "
                       "or issue(arena, ...)");
    return issue_mr(addr, len, granted, opt_.revoke == revoke_by::automatic);
}

remote_handle handle_issuer::issue(bind_target parent, const void* addr, std::size_t len,
                                   rights asked) {
    const rights granted = granted_rights(addr, len, asked);
    const char* why =
        why_not_ != nullptr
            ? why_not_
            : why_no_window(true, true,
                            parent.mr != nullptr && has(parent.granted, rights::mw_bind),
                            has(parent.granted, rights::local_write), writes(granted));
    const mechanism_choice c = choose_mechanism(opt_.revoke, why);
    if (c.refused)
        refuse_windows(why);
    if (c.by == revoke_by::memory_region)
        return issue_mr(addr, len, granted, opt_.revoke == revoke_by::automatic);
    return issue_mw(parent, addr, len, granted);
}

remote_handle handle_issuer::issue_mr(const void* addr, std::size_t len, rights granted,
                                      bool fallback) {
    // Remote write and atomic need local write to be registered (verbs).
    const rights reg = valid(granted) ? granted : granted | rights::local_write;
    if (pd_ == nullptr)
        throw_error("ibv_reg_mr", ENODEV, "a handle issuer with no device");
    ibv_mr* mr = ibv_reg_mr(pd_->get(), const_cast<void*>(addr), len, to_ibv(reg));
    if (mr == nullptr)
        throw_error("ibv_reg_mr", errno, fmt::format("a handle's window of {} bytes", len));
    std::lock_guard g(mutex_);
    try {
        issued_.emplace(mr->rkey, issued{revoke_by::memory_region, mr, nullptr});
    } catch (...) {
        ibv_dereg_mr(mr);
        throw;
    }
    ++counters_.issued_mr;
    if (fallback)
        ++counters_.fallbacks;
    return {reinterpret_cast<std::uintptr_t>(addr), len, mr->rkey,
            static_cast<std::uint32_t>(granted), epoch_};
}

ibv_mw* handle_issuer::take_window() {
    std::lock_guard g(mutex_);
    if (!free_windows_.empty()) {
        ibv_mw* mw = free_windows_.back();
        free_windows_.pop_back();
        ++counters_.windows_reused;
        return mw;
    }
    // Room for every window to come back: revoke() then never allocates.
    free_windows_.reserve(counters_.windows_allocated + 1);
    ibv_mw* mw = ibv_alloc_mw(pd_->get(), IBV_MW_TYPE_2);
    if (mw == nullptr)
        throw_error("ibv_alloc_mw", errno, fmt::format("type 2 on {}", pd_->device().name()));
    ++counters_.windows_allocated;
    return mw;
}

std::uint64_t handle_issuer::next_wr_id() noexcept {
    return (std::uint64_t{0x4d57} << 48) | (wr_seq_++ & 0xffff'ffff'ffffu);
}

remote_handle handle_issuer::issue_mw(bind_target parent, const void* addr, std::size_t len,
                                      rights granted) {
    std::lock_guard post(post_mutex_);
    ibv_mw* mw = take_window();
    // A new key for every binding: a handle of an earlier one never matches.
    const std::uint32_t rkey = ibv_inc_rkey(mw->rkey);
    const auto at = reinterpret_cast<std::uintptr_t>(addr);
    const std::uint64_t id = next_wr_id();
    if (const status s = qp_->bind_mw(mw, rkey, parent.mr, at, len, granted, id); s != status::ok) {
        {
            std::lock_guard g(mutex_);
            free_windows_.push_back(mw); // never bound: as good as new (room reserved)
        }
        throw_error("ibv_post_send", s == status::post_failed ? qp_->last_errno() : EINVAL,
                    fmt::format("IBV_WR_BIND_MW of {} bytes at {} on QP {:#x}: {}", len, addr,
                                qp_->qp_num(), to_string(s)));
    }
    std::optional<verbs::completion> done;
    try {
        done = qp_->wait_send_for(id, opt_.deadline);
    } catch (...) {
        ibv_dealloc_mw(mw); // bound or not, nobody will ever hold its key
        throw;
    }
    if (!done || !done->ok()) {
        // Bound late or not at all: deallocating settles it either way.
        ibv_dealloc_mw(mw);
        if (!done)
            throw_error("IBV_WR_BIND_MW", ETIMEDOUT,
                        fmt::format("no completion on QP {:#x} within {} ms", qp_->qp_num(),
                                    opt_.deadline.count()));
        throw_error(
            "IBV_WR_BIND_MW", EIO,
            fmt::format("completed with '{}' on QP {:#x}", done->status_name(), qp_->qp_num()));
    }
    mw->rkey = rkey; // the provider names the window by mw->rkey in the next bind
    std::lock_guard g(mutex_);
    try {
        issued_.emplace(rkey, issued{revoke_by::memory_window, nullptr, mw});
    } catch (...) {
        ibv_dealloc_mw(mw);
        throw;
    }
    ++counters_.issued_mw;
    return {at, len, rkey, static_cast<std::uint32_t>(granted), epoch_};
}

void handle_issuer::unbind(ibv_mw* mw, std::uint32_t rkey) noexcept {
    bool invalidated = false;
    try {
        const std::uint64_t id = next_wr_id();
        if (qp_->local_invalidate(rkey, id) == status::ok) {
            const auto done = qp_->wait_send_for(id, opt_.deadline);
            invalidated = done && done->ok();
        }
    } catch (...) {
        // No room to keep the application's completions: deallocate instead.
    }
    std::lock_guard g(mutex_);
    if (invalidated) {
        free_windows_.push_back(mw); // room reserved in take_window()
        ++counters_.revoked_mw;
    } else {
        // The queue pair cannot invalidate (error state after a peer's access
        // error, full, or slow): deallocation revokes the key all the same.
        ibv_dealloc_mw(mw);
        ++counters_.revoked_mw_dealloc;
    }
}

bool handle_issuer::revoke(const remote_handle& h) noexcept {
    if (h.epoch != epoch_)
        return false; // another incarnation's: its key may repeat one of ours
    issued it{};
    {
        std::lock_guard g(mutex_);
        auto found = issued_.find(h.rkey);
        if (found == issued_.end())
            return false;
        it = found->second;
        issued_.erase(found);
    }
    if (it.by == revoke_by::memory_region) {
        ibv_dereg_mr(it.mr);
        std::lock_guard g(mutex_);
        ++counters_.revoked_mr;
        return true;
    }
    std::lock_guard post(post_mutex_);
    unbind(it.mw, h.rkey);
    return true;
}

std::optional<revoke_by> handle_issuer::mechanism_of(const remote_handle& h) const noexcept {
    if (h.epoch != epoch_)
        return std::nullopt;
    std::lock_guard g(mutex_);
    const auto found = issued_.find(h.rkey);
    if (found == issued_.end())
        return std::nullopt;
    return found->second.by;
}

std::size_t handle_issuer::live() const noexcept {
    std::lock_guard g(mutex_);
    return issued_.size();
}

handle_counters handle_issuer::counters() const noexcept {
    std::lock_guard g(mutex_);
    handle_counters c = counters_;
    c.live = issued_.size();
    return c;
}

} // namespace rdmax
