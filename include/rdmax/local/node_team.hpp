#pragma once
// node_team: the ranks of one job that share a node, as a team whose
// collectives go through memory (seed 003's one-copy path, for collectives:
// local/team_allreduce.hpp). Each rank owns a window, a sealed memfd segment
// that the other ranks map read-only: a rank writes only its own memory and
// reads its peers'. Its progress is a counter in its window's first cache
// line, which the others poll: no lock, no shared writable memory, and no
// system call while the ranks keep pace.
//
//     local::node_team team("job-42", local_rank, local_size);
//     std::span<float> v = team.window_as<float>(n); // or any memory (staged)
//     local::allreduce(team, v);                     // sum, on every rank
//
// Joining: rank 0 listens on an abstract Unix name made from the team's name
// (one per job: mpirun's or Slurm's job id, or the caller's); the others
// connect and send a read-only descriptor of their window, rank 0 hands every
// window to every rank. A peer of another user is refused (SO_PEERCRED), on
// either side, as is a window whose size is not sealed or not the team's.
//
// Steps: every collective is a sequence of steps that every rank makes in the
// same order; a step is a number, published by a rank in its counter once its
// part is done, and waited for in its peers'. A wait spins `spin` polls, then
// sleeps on a futex on the peer's counter, having said so in its own window
// (the peer's next step wakes it: a system call then, and only then); past
// `timeout` it throws rdmax::error naming the peer and the step, and the
// team is broken: every later step throws at once. A peer that lies in its window can make this
// rank's results wrong or its waits time out, never read or write outside the windows.
//
// One thread per rank uses its team. Not copyable; movable (a moved-from
// team may only be destroyed or assigned to).

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <rdmax/local/shared_segment.hpp>
#include <rdmax/local/team_options.hpp>

namespace rdmax::local {

/// What a rank says of the call it is in, in its window, before its step
/// `ready`: its peers check that it is the call they are in.
struct team_call {
    std::uint64_t count = 0;  ///< elements
    std::uint64_t offset = 0; ///< bytes into the window where the rank's data is
    std::uint32_t element = 0;
    std::uint32_t kind = 0;  ///< the collective, the operation, the type
    std::uint64_t whole = 0; ///< elements of the whole call, of which this is a piece
    std::uint64_t at = 0;    ///< where the piece starts in it
    std::uint64_t ready = 0; ///< the call's first step: set by begin_call
    friend bool operator==(const team_call&, const team_call&) = default;
};

/// FNV-1a of `text`, from `h` on: a collective's kind from type names.
[[nodiscard]] constexpr std::uint32_t type_hash(const char* text,
                                                std::uint32_t h = 2166136261U) noexcept {
    for (; *text != '\0'; ++text)
        h = (h ^ static_cast<unsigned char>(*text)) * 16777619U;
    return h;
}

class node_team {
public:
    /// Joins the team `name` as `rank` of `size` ranks on this node, waiting
    /// up to o.timeout for the others. Throws rdmax::error (a peer that did
    /// not come, or that was refused: another user, another team size or
    /// window, a rank twice).
    node_team(std::string_view name, int rank, int size,
              team_options o = team_options{}.with_env());
    node_team(node_team&&) noexcept = default;
    node_team& operator=(node_team&&) noexcept = default;
    node_team(const node_team&) = delete;
    node_team& operator=(const node_team&) = delete;
    ~node_team() = default;

    [[nodiscard]] int rank() const noexcept { return rank_; }
    [[nodiscard]] int size() const noexcept { return static_cast<int>(windows_.size()); }
    [[nodiscard]] const team_options& options() const noexcept { return opts_; }
    /// This rank's window: data placed here is not copied by a collective.
    [[nodiscard]] std::span<std::byte> window() const noexcept {
        return {own_data(), opts_.window_bytes};
    }
    /// The first `n` objects of type T of the window. Throws rdmax::error
    /// when they do not fit.
    template <class T>
        requires std::is_trivially_copyable_v<T>
    [[nodiscard]] std::span<T> window_as(std::size_t n) const {
        if (n > opts_.window_bytes / sizeof(T))
            refuse_window(n * sizeof(T));
        return {reinterpret_cast<T*>(own_data()), n};
    }
    /// Every rank has come here, or at least to a step as far: a barrier
    /// notes no call, so a peer in a collective passes it (that collective
    /// then finds this rank's note is not its call).
    void barrier();
    /// A wait timed out or a peer disagreed: every later step throws.
    [[nodiscard]] bool broken() const noexcept { return broken_; }

    // The steps collectives are made of (local/team_allreduce.hpp).

    /// Starts a call: sets `c.ready`, the step its data will be ready at (a
    /// peer whose note names another step is in another call: a barrier,
    /// say), and notes `c` for the peers to check, published by that step.
    /// Every peer must be done with the previous call's note and data: a
    /// collective's last step waits for it.
    void begin_call(team_call& c);
    /// Publishes this rank's next step (waking the peers that sleep on
    /// this rank); its number.
    std::uint64_t step() noexcept;
    /// Waits until `peer` has made step `s`.
    void wait(int peer, std::uint64_t s, std::string_view what) {
        if (progress(peer).load(std::memory_order_acquire) < s)
            wait_slowly(peer, s, what);
    }
    /// Waits until every peer has made step `s`.
    void wait_all(std::uint64_t s, std::string_view what);
    /// Peer `peer`'s data of the call both are in (after its `ready` step):
    /// `bytes` long, checked against this rank's own call. Throws
    /// rdmax::error (and breaks the team) when the peer is in another call.
    [[nodiscard]] const std::byte* peer_data(int peer, const team_call& mine);
    /// The note of a collective of `kind` on `data` (at its offset in the
    /// window when it lies there, else staged at the window's start).
    /// `data` is the piece of `whole` the collective moves now.
    template <class T>
    [[nodiscard]] team_call call_for(std::span<T> data, std::span<T> whole, bool in_window,
                                     std::uint32_t kind) const noexcept {
        const auto* p = reinterpret_cast<const std::byte*>(data.data());
        return {.count = data.size(),
                .offset = in_window ? static_cast<std::uint64_t>(p - own_data()) : 0,
                .element = sizeof(T),
                .kind = kind,
                .whole = whole.size(),
                .at = whole.empty() ? 0 : static_cast<std::uint64_t>(data.data() - whole.data())};
    }
    /// Runs `piece(part, in_window)` over `data`: whole when it lies in the
    /// window (or is empty), else in parts of the window's size, staged.
    /// Throws rdmax::error for data that straddles the window, or elements
    /// larger than it. The frame of every collective.
    template <class T, class Piece>
    void in_pieces(std::span<T> data, Piece&& piece) {
        if (sizeof(T) > opts_.window_bytes)
            refuse_data(sizeof(T), "one element is larger than the window (RDMAX_TEAM_WINDOW)");
        const bool whole = in_window(std::as_bytes(data), sizeof(T));
        if (whole || data.empty()) {
            piece(data, whole);
            return;
        }
        const std::size_t per = opts_.window_bytes / sizeof(T);
        for (std::size_t at = 0; at < data.size(); at += per)
            piece(data.subspan(at, std::min(per, data.size() - at)), false);
    }
    /// Whether `data` lies in this rank's window (whole, a whole number of
    /// `element`s from its start: no copy in) or apart from it (staged).
    /// Throws rdmax::error for data that straddles it.
    [[nodiscard]] bool in_window(std::span<const std::byte> data, std::size_t element) const;
    /// Throws rdmax::error: data of `bytes` that a collective cannot take, and why.
    [[noreturn]] void refuse_data(std::size_t bytes, std::string_view why) const;
    /// A collective failed in this rank (its operation threw, say): its
    /// peers' steps and its own no longer match, so every later step throws.
    void mark_broken() noexcept { broken_ = true; }

private:
    /// A window's first page: the counter, then the call's note, each on
    /// lines of its own (128 bytes: the adjacent-line prefetcher pairs 64s).
    struct alignas(128) header {
        std::atomic<std::uint64_t> progress{0};
        /// 1 + the rank this one sleeps on (its futex), 0: none.
        alignas(128) std::atomic<std::uint32_t> sleeping_on{0};
        alignas(128) std::atomic<std::uint64_t> count{0};
        std::atomic<std::uint64_t> offset{0};
        std::atomic<std::uint64_t> ready{0};
        std::atomic<std::uint64_t> whole{0};
        std::atomic<std::uint64_t> at{0};
        std::atomic<std::uint32_t> element{0};
        std::atomic<std::uint32_t> kind{0};
    };
    static constexpr std::size_t header_bytes = 4096;
    static_assert(sizeof(header) <= header_bytes);
    static_assert(std::endian::native == std::endian::little, "a futex on a counter's low half");
    // Between processes only lock-free atomics work (no lock to share).
    static_assert(std::atomic<std::uint64_t>::is_always_lock_free);
    static_assert(std::atomic<std::uint32_t>::is_always_lock_free);

    [[nodiscard]] header& head(int r) const noexcept {
        return *reinterpret_cast<header*>(windows_[static_cast<std::size_t>(r)].data());
    }
    [[nodiscard]] std::atomic<std::uint64_t>& progress(int r) const noexcept {
        return head(r).progress;
    }
    /// A window's segment: its header page and its data.
    [[nodiscard]] std::size_t segment_bytes() const noexcept {
        return header_bytes + opts_.window_bytes;
    }
    [[nodiscard]] std::byte* own_data() const noexcept {
        return windows_[static_cast<std::size_t>(rank_)].data() + header_bytes;
    }
    void wait_slowly(int peer, std::uint64_t s, std::string_view what);
    /// Sleeps until `peer`'s counter moves from `seen` (or up to `most`).
    void sleep_on(int peer, std::uint64_t seen, std::chrono::milliseconds most) noexcept;
    void check_usable(std::string_view what) const;
    [[noreturn]] void refuse_window(std::size_t bytes) const;
    [[noreturn]] void fail(int peer, std::string_view what, int err, std::string_view why);
    void join(std::string_view name, int size);

    team_options opts_;
    int rank_ = 0;
    std::string name_;
    /// By rank: this rank's read-write, the others' read-only.
    std::vector<shared_segment> windows_;
    std::uint64_t steps_ = 0; ///< the last step this rank published
    std::uint32_t spin_ = 0;  ///< opts_.spin, or what 0 (auto) came to
    bool broken_ = false;
};

} // namespace rdmax::local
