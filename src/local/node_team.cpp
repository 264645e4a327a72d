#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <ctime>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <thread>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/local/descriptor_passing.hpp>
#include <rdmax/local/node_team.hpp>

namespace rdmax::local {

team_options team_options::with_env() const {
    return config::apply_env(*this, team_knobs, "team_options::with_env");
}

namespace {

using clock = std::chrono::steady_clock;

constexpr std::uint32_t team_magic = 0x4d415452; // "RTAM"
constexpr std::size_t fds_per_message = 16;      // unix_channel's limit

/// A member's first message, with its window's read-only descriptor.
struct hello {
    std::uint32_t magic = team_magic;
    std::int32_t rank = 0;
    std::int32_t size = 0;
    std::uint32_t reserved = 0;
    std::uint64_t window_bytes = 0;
};
/// Rank 0's answer: refused (error), or the windows to come, in parts.
struct welcome {
    std::uint32_t magic = team_magic;
    std::int32_t error = 0;
    std::uint32_t windows = 0;
    std::uint32_t reserved = 0;
};
/// One part of the windows: ranks [first, first + count), a descriptor each.
struct part {
    std::uint32_t magic = team_magic;
    std::uint32_t first = 0;
    std::uint32_t count = 0;
    std::uint32_t reserved = 0;
};

/// Descriptors this side owns until it gives them away or goes.
struct owned_fds {
    std::vector<int> fds;
    explicit owned_fds(std::size_t n)
        : fds(n, -1) {}
    owned_fds(const owned_fds&) = delete;
    owned_fds& operator=(const owned_fds&) = delete;
    ~owned_fds() { close_all(); }
    /// Owns `v` from now on (what it owned before is closed).
    void adopt(std::vector<int> v) noexcept {
        close_all();
        fds = std::move(v);
    }
    void close_all() noexcept {
        for (int& fd : fds)
            if (fd >= 0)
                ::close(std::exchange(fd, -1));
    }
};

template <class T>
std::span<const std::byte> bytes_of(const T& v) {
    return std::as_bytes(std::span(&v, 1));
}

/// What is left of the time to `deadline` (0 or less: none).
std::chrono::milliseconds left_until(clock::time_point deadline) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
}

/// Receives exactly one T; the descriptors that came with it are `fds`'
/// (closed with it, whatever happens). Throws rdmax::error.
template <class T>
T receive_one(unix_channel& ch, owned_fds& fds, clock::time_point deadline, std::string_view what) {
    T v{};
    std::array<std::byte, sizeof(T)> buf{};
    std::vector<int> got;
    const std::size_t n =
        ch.receive(buf, got, std::max(left_until(deadline), std::chrono::milliseconds(1)));
    fds.adopt(std::move(got));
    if (n != sizeof(T))
        throw_error("node_team", EPROTO,
                    fmt::format("{}: {} bytes, expected {}", what, n, sizeof(T)));
    std::memcpy(&v, buf.data(), sizeof(T));
    if (v.magic != team_magic)
        throw_error("node_team", EPROTO, fmt::format("{}: not a team message", what));
    return v;
}

void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

std::string listen_name(std::string_view team) {
    return fmt::format("rdmax-team/{}", team);
}

[[noreturn]] void timed_out(std::string_view team, int rank, std::string_view why) {
    throw_error("node_team", ETIMEDOUT, fmt::format("team {} rank {}: {}", team, rank, why));
}

/// Every window to every member, 16 at a time, each part acknowledged before
/// the next: descriptors in flight count against this user's limit of open
/// files (ETOOMANYREFS past it, for a user without CAP_SYS_RESOURCE), so at
/// most one part is ever in flight, whatever the team's size.
void hand_out(std::vector<unix_channel>& members, const owned_fds& fds,
              clock::time_point deadline) {
    const std::size_t n = fds.fds.size();
    for (std::size_t r = 1; r < n; ++r) {
        const welcome w{.windows = static_cast<std::uint32_t>(n)};
        members[r].send(bytes_of(w));
        for (std::size_t first = 0; first < n; first += fds_per_message) {
            const std::size_t count = std::min(fds_per_message, n - first);
            const part p{.first = static_cast<std::uint32_t>(first),
                         .count = static_cast<std::uint32_t>(count)};
            members[r].send(bytes_of(p), std::span<const int>(fds.fds).subspan(first, count));
            owned_fds none(0);
            const auto ack = receive_one<part>(members[r], none, deadline, "a rank's receipt");
            if (ack.first != p.first || ack.count != p.count || !none.fds.empty())
                throw_error("node_team", EPROTO, "a rank acknowledged another part");
        }
    }
}

/// Rank 0's side of joining: every other rank's window descriptor into
/// `fds` (by rank), then every window to every rank.
void gather_as_root(std::string_view name, std::size_t n, std::uint64_t window_bytes,
                    std::size_t total, clock::time_point deadline, owned_fds& fds,
                    std::vector<shared_segment>& windows) {
    unix_listener l(listen_name(name));
    std::vector<unix_channel> members(n);
    for (std::size_t joined = 1; joined < n;) {
        const auto left = left_until(deadline);
        if (left.count() <= 0)
            timed_out(name, 0, fmt::format("{} of {} ranks joined in time", joined, n));
        unix_channel ch = l.accept(left);
        if (ch.fd() < 0)
            continue;
        try {
            if (ch.peer().uid != ::geteuid())
                continue; // another user's process: not one of ours
            // A second for a hello: one that says nothing holds up the others
            // that long at most, not the whole join.
            owned_fds keep(0);
            const auto h = receive_one<hello>(
                ch, keep, std::min(deadline, clock::now() + std::chrono::seconds(1)),
                "a rank's hello");
            welcome refuse{};
            if (static_cast<std::size_t>(h.size) != n || h.window_bytes != window_bytes ||
                keep.fds.size() != 1)
                refuse.error = EPROTO;
            else if (h.rank <= 0 || static_cast<std::size_t>(h.rank) >= n ||
                     members[static_cast<std::size_t>(h.rank)].fd() >= 0)
                refuse.error = EEXIST;
            const auto r = static_cast<std::size_t>(h.rank);
            if (refuse.error == 0) {
                // Its window checked here (sealed, the team's size), so that
                // a bad one is refused, not handed to every rank.
                try {
                    windows[r] = shared_segment::attach(keep.fds[0], total, false, true);
                } catch (const rdmax::error&) {
                    refuse.error = EPROTO;
                }
            }
            if (refuse.error != 0) {
                ch.send(bytes_of(refuse));
                continue;
            }
            fds.fds[r] = std::exchange(keep.fds[0], -1);
            members[r] = std::move(ch);
            ++joined;
        } catch (const rdmax::error&) {
            // A connection that broke or spoke nonsense: not a rank.
        }
    }
    hand_out(members, fds, deadline);
}

/// Rank 0 of `name`, once it listens (it may start after this rank).
unix_channel connect_to_root(std::string_view name, int rank, clock::time_point deadline) {
    for (;;) {
        try {
            return unix_channel::connect(listen_name(name), false);
        } catch (const rdmax::error& e) {
            const int err = e.code().value();
            if (err != ECONNREFUSED && err != ENOENT && err != EAGAIN)
                throw;
        }
        if (clock::now() > deadline)
            timed_out(name, rank, "rank 0 did not listen in time");
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
}

/// Any other rank's side: its window to rank 0, every window back into `fds`.
void join_as_member(std::string_view name, int rank, std::size_t n, std::uint64_t window_bytes,
                    int own_read_only, clock::time_point deadline, owned_fds& fds) {
    unix_channel ch = connect_to_root(name, rank, deadline);
    if (const uid_t uid = ch.peer().uid; uid != ::geteuid())
        throw_error(
            "node_team", EPERM,
            fmt::format("team {}: rank 0's name is held by another user (uid {})", name, uid));
    const hello h{.rank = rank, .size = static_cast<std::int32_t>(n), .window_bytes = window_bytes};
    const std::array<int, 1> mine{own_read_only};
    ch.send(bytes_of(h), mine);
    owned_fds keep(0);
    const auto w = receive_one<welcome>(ch, keep, deadline, "rank 0's welcome");
    if (w.error != 0 || w.windows != n || !keep.fds.empty())
        throw_error("node_team", w.error != 0 ? w.error : EPROTO,
                    fmt::format("team {}: rank 0 refused rank {} of {} with a window of {} bytes "
                                "(another team size or window, or the rank taken)",
                                name, rank, n, window_bytes));
    for (std::size_t first = 0; first < n;) {
        const auto p = receive_one<part>(ch, keep, deadline, "rank 0's windows");
        if (p.first != first || p.count == 0 || p.count > n - first || keep.fds.size() != p.count)
            throw_error("node_team", EPROTO,
                        fmt::format("team {}: rank 0 sent ranks {}+{}, "
                                    "expected {}",
                                    name, p.first, p.count, first));
        // Its own window's copy is closed with `keep`: this rank has its own.
        for (std::size_t i = 0; i < p.count; ++i)
            if (first + i != static_cast<std::size_t>(rank))
                fds.fds[first + i] = std::exchange(keep.fds[i], -1);
        keep.close_all();
        ch.send(bytes_of(p)); // received: rank 0 sends the next part
        first += p.count;
    }
}

} // namespace

node_team::node_team(std::string_view name, int rank, int size, team_options o)
    : opts_(o)
    , rank_(rank)
    , name_(name) {
    if (size < 1 || rank < 0 || rank >= size)
        throw_error("node_team", EINVAL, fmt::format("team {}: rank {} of {}", name, rank, size));
    if (name.empty() || name.size() > 80)
        throw_error("node_team", EINVAL, "a team's name: 1 to 80 characters, one per job");
    if (opts_.window_bytes == 0 || opts_.window_bytes % 64 != 0)
        throw_error("node_team", EINVAL,
                    fmt::format("a window of {} bytes: a multiple of 64", opts_.window_bytes));
    spin_ = opts_.spin;
    if (spin_ == 0) {
        // The node's, not this process's (a launcher binds each rank to one).
        const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
        spin_ = cpus < 1 || size <= cpus ? 4096 : 16;
    }
    windows_.resize(static_cast<std::size_t>(size));
    windows_[static_cast<std::size_t>(rank)] = shared_segment::create(
        fmt::format("rdmax-team {} rank {}", name, rank), segment_bytes(),
        true); // only this rank writes its window, whoever holds its descriptor
    if (size > 1)
        join(name, size);
}

void node_team::join(std::string_view name, int size) {
    const clock::time_point deadline = clock::now() + opts_.timeout;
    const auto n = static_cast<std::size_t>(size);
    const auto me = static_cast<std::size_t>(rank_);
    owned_fds fds(n);
    fds.fds[me] = shared_segment::reopen_read_only(windows_[me].fd());
    if (rank_ == 0)
        gather_as_root(name, n, opts_.window_bytes, segment_bytes(), deadline, fds, windows_);
    else
        join_as_member(name, rank_, n, opts_.window_bytes, fds.fds[me], deadline, fds);
    // Read-only, and only a window sealed at the team's size: a peer can
    // neither be written through it nor cut its pages from under this rank.
    for (std::size_t r = 0; r < n; ++r)
        if (r != me && !windows_[r]) { // rank 0 attached the others' as they came
            windows_[r] = shared_segment::attach(fds.fds[r], segment_bytes(), false, true);
            ::close(std::exchange(fds.fds[r], -1)); // the mapping keeps its own: n, not 2n, open
        }
}

void node_team::barrier() {
    check_usable("a barrier");
    wait_all(step(), "a barrier");
}

void node_team::begin_call(team_call& c) {
    check_usable("a collective");
    c.ready = steps_ + 1;
    header& h = head(rank_);
    // Published by the step that follows (its release store).
    h.count.store(c.count, std::memory_order_relaxed);
    h.offset.store(c.offset, std::memory_order_relaxed);
    h.element.store(c.element, std::memory_order_relaxed);
    h.kind.store(c.kind, std::memory_order_relaxed);
    h.ready.store(c.ready, std::memory_order_relaxed);
    h.whole.store(c.whole, std::memory_order_relaxed);
    h.at.store(c.at, std::memory_order_relaxed);
}

std::uint64_t node_team::step() noexcept {
    std::atomic<std::uint64_t>& mine = progress(rank_);
    mine.store(++steps_, std::memory_order_seq_cst);
    // Only a peer that said it sleeps on this rank costs a system call.
    const auto me = static_cast<std::uint32_t>(rank_) + 1;
    for (int p = 0; p < size(); ++p)
        if (p != rank_ && head(p).sleeping_on.load(std::memory_order_seq_cst) == me) {
            (void)::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&mine), FUTEX_WAKE,
                            INT32_MAX, nullptr, nullptr, 0);
            break;
        }
    return steps_;
}

void node_team::wait_all(std::uint64_t s, std::string_view what) {
    for (int p = 0; p < size(); ++p)
        if (p != rank_)
            wait(p, s, what);
}

const std::byte* node_team::peer_data(int peer, const team_call& mine) {
    const header& h = head(peer);
    // Each field read once: the peer may change them under this rank.
    const team_call theirs{.count = h.count.load(std::memory_order_relaxed),
                           .offset = h.offset.load(std::memory_order_relaxed),
                           .element = h.element.load(std::memory_order_relaxed),
                           .kind = h.kind.load(std::memory_order_relaxed),
                           .whole = h.whole.load(std::memory_order_relaxed),
                           .at = h.at.load(std::memory_order_relaxed),
                           .ready = h.ready.load(std::memory_order_relaxed)};
    if (theirs.count != mine.count || theirs.element != mine.element || theirs.kind != mine.kind ||
        theirs.ready != mine.ready || theirs.whole != mine.whole || theirs.at != mine.at)
        fail(peer, "its call", EPROTO,
             fmt::format("it is in a call of {} elements of {} bytes (kind {:#x}; from {} of "
                         "{}) from step {}, this rank in one of {} of {} (kind {:#x}; from {} "
                         "of {}) from step {}",
                         theirs.count, theirs.element, theirs.kind, theirs.at, theirs.whole,
                         theirs.ready, mine.count, mine.element, mine.kind, mine.at, mine.whole,
                         mine.ready));
    const std::uint64_t room = opts_.window_bytes;
    if (theirs.offset > room || theirs.offset % mine.element != 0 ||
        mine.count > (room - theirs.offset) / mine.element)
        fail(peer, "its call", EPROTO,
             fmt::format("its data at {} does not lie in its window of {} bytes", theirs.offset,
                         room));
    return windows_[static_cast<std::size_t>(peer)].data() + header_bytes + theirs.offset;
}

void node_team::wait_slowly(int peer, std::uint64_t s, std::string_view what) {
    check_usable(what);
    const std::atomic<std::uint64_t>& c = progress(peer);
    for (std::uint32_t i = 0; i < spin_; ++i) {
        cpu_relax();
        if (c.load(std::memory_order_acquire) >= s)
            return;
    }
    // Then yield a while: a peer that shares this CPU runs at once.
    const clock::time_point deadline = clock::now() + opts_.timeout;
    const clock::time_point yield_until = clock::now() + std::chrono::milliseconds(1);
    for (std::uint32_t i = 1;; ++i) {
        ::sched_yield();
        if (c.load(std::memory_order_acquire) >= s)
            return;
        if (i % 16 == 0 && clock::now() > yield_until)
            break;
    }
    // Then sleep: the peer may be a while. Said in this rank's window before
    // the last look (the peer's step publishes, then looks: one of the two
    // sees the other's store), so no wake-up is lost.
    std::atomic<std::uint32_t>& sleeping = head(rank_).sleeping_on;
    for (;;) {
        sleeping.store(static_cast<std::uint32_t>(peer) + 1, std::memory_order_seq_cst);
        const std::uint64_t seen = c.load(std::memory_order_seq_cst);
        if (seen >= s)
            break;
        const auto left = left_until(deadline);
        if (left.count() <= 0) {
            sleeping.store(0, std::memory_order_relaxed);
            fail(peer, what, ETIMEDOUT,
                 fmt::format("waited {} ms for its step {}; it is at {}", opts_.timeout.count(), s,
                             seen));
        }
        sleep_on(peer, seen, std::min(left, std::chrono::milliseconds(100)));
    }
    sleeping.store(0, std::memory_order_relaxed);
}

void node_team::sleep_on(int peer, std::uint64_t seen, std::chrono::milliseconds most) noexcept {
    // The counter's low 32 bits (little-endian): they change at every step,
    // and a futex is 32 bits. Not FUTEX_PRIVATE: the word is in another
    // process's file, mapped here read-only.
    const auto* word = reinterpret_cast<const std::uint32_t*>(&progress(peer));
    const timespec ts{.tv_sec = most.count() / 1000, .tv_nsec = (most.count() % 1000) * 1'000'000};
    // Woken, moved already, interrupted or out of time: the caller looks again.
    (void)::syscall(SYS_futex, word, FUTEX_WAIT, static_cast<std::uint32_t>(seen), &ts, nullptr, 0);
}

void node_team::check_usable(std::string_view what) const {
    if (windows_.empty())
        throw_error("node_team", EINVAL, fmt::format("{} on a moved-from team", what));
    if (broken_)
        throw_error("node_team", ECANCELED,
                    fmt::format("team {} rank {}: {} on a team broken by an earlier failure", name_,
                                rank_, what));
}

void node_team::refuse_window(std::size_t bytes) const {
    throw_error("node_team", EINVAL,
                fmt::format("team {}: {} bytes do not fit the window of {} (RDMAX_TEAM_WINDOW)",
                            name_, bytes, opts_.window_bytes));
}

bool node_team::in_window(std::span<const std::byte> data, std::size_t element) const {
    const std::span<std::byte> win = window();
    const std::byte* p = data.data();
    const bool overlaps =
        !data.empty() && p < win.data() + win.size() && win.data() < p + data.size();
    if (!overlaps)
        return false;
    if (p >= win.data() && p + data.size() <= win.data() + win.size() &&
        static_cast<std::size_t>(p - win.data()) % element == 0)
        return true;
    refuse_data(data.size(), "it overlaps the window without lying whole in it, at a whole "
                             "number of elements from its start");
}

void node_team::refuse_data(std::size_t bytes, std::string_view why) const {
    throw_error("node_team", EINVAL,
                fmt::format("team {}: data of {} bytes: {}", name_, bytes, why));
}

void node_team::fail(int peer, std::string_view what, int err, std::string_view why) {
    broken_ = true;
    throw_error("node_team", err,
                fmt::format("team {} rank {}: rank {} ({}): {}", name_, rank_, peer, what, why));
}

} // namespace rdmax::local
