#pragma once
// shared_segment: memory two processes on one node share, backed by a memfd
// (an anonymous file) so that its descriptor can be passed to the peer
// (SCM_RIGHTS) and mapped there. Move-only; unmapped and closed when it goes.
//
// Nobody can shrink the file: create() seals its size (F_SEAL_SHRINK,
// F_SEAL_GROW, F_SEAL_SEAL), so a peer that maps it keeps valid pages for as
// long as its mapping lives, and a peer given the descriptor cannot cut the
// owner's pages either (no SIGBUS on either side; revocation is a generation
// in a control segment, see detail/local/export_table.hpp). attach(..., require_sealed)
// refuses a descriptor whose size its sender could still cut.

#include <cstddef>
#include <span>
#include <string_view>

namespace rdmax::local {

class shared_segment {
public:
    /// A new segment of `bytes` (rounded up to pages), zero-filled, mapped
    /// read-write, its size sealed, its mode 0600. `name` shows in
    /// /proc/PID/maps. With `only_here_writes`, sealed against any other
    /// write too (F_SEAL_FUTURE_WRITE): only this mapping writes it, so a
    /// peer given even a writable descriptor (or one it reopened writable
    /// through /proc) can only read. Throws rdmax::error.
    [[nodiscard]] static shared_segment create(std::string_view name, std::size_t bytes,
                                               bool only_here_writes = false);
    /// Maps the segment behind `fd` (the descriptor is duplicated: the caller
    /// keeps its own). Refuses (throws) a file shorter than `bytes`, and,
    /// with `require_sealed`, one not sealed against shrinking (EPERM).
    [[nodiscard]] static shared_segment attach(int fd, std::size_t bytes, bool writable,
                                               bool require_sealed = false);

    shared_segment() = default;
    shared_segment(shared_segment&& o) noexcept;
    shared_segment& operator=(shared_segment&& o) noexcept;
    shared_segment(const shared_segment&) = delete;
    shared_segment& operator=(const shared_segment&) = delete;
    ~shared_segment();

    [[nodiscard]] int fd() const noexcept { return fd_; }
    /// A new descriptor of the same file, opened read-only (the caller owns
    /// it): a peer given it cannot map the file writable (mmap checks the
    /// descriptor's mode). Throws rdmax::error.
    [[nodiscard]] static int reopen_read_only(int fd);
    [[nodiscard]] std::byte* data() const noexcept { return base_; }
    [[nodiscard]] std::size_t size() const noexcept { return bytes_; }
    [[nodiscard]] std::span<std::byte> bytes() const noexcept { return {base_, bytes_}; }
    [[nodiscard]] bool writable() const noexcept { return writable_; }
    [[nodiscard]] explicit operator bool() const noexcept { return base_ != nullptr; }

private:
    shared_segment(int fd, std::byte* base, std::size_t bytes, bool writable) noexcept
        : fd_(fd)
        , base_(base)
        , bytes_(bytes)
        , writable_(writable) {}
    void release() noexcept;

    int fd_ = -1;
    std::byte* base_ = nullptr;
    std::size_t bytes_ = 0;
    bool writable_ = false;
};

} // namespace rdmax::local
