#include <cerrno>
#include <fcntl.h>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/local/shared_segment.hpp>

namespace rdmax::local {

namespace {
std::size_t page_round(std::size_t n) {
    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    return (n + page - 1) / page * page;
}
} // namespace

shared_segment shared_segment::create(std::string_view name, std::size_t bytes,
                                      bool only_here_writes) {
    if (bytes == 0)
        throw_error("memfd_create", EINVAL, "a shared segment of 0 bytes");
    const std::size_t n = page_round(bytes);
    const std::string label = fmt::format("rdmax-{}", name);
    const int fd = memfd_create(label.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        throw_error("memfd_create", errno, label);
    const auto fail = [&](const char* verb, const std::string& what) {
        const int err = errno;
        close(fd);
        throw_error(verb, err, fmt::format("{}: {}", label, what));
    };
    // A memfd's mode is 0777: another user who gets at it through
    // /proc/PID/fd could open it for writing. Owner only.
    if (fchmod(fd, 0600) != 0)
        fail("fchmod", "0600");
    if (ftruncate(fd, static_cast<off_t>(n)) != 0)
        fail("ftruncate", fmt::format("{} bytes", n));
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        fail("mmap", fmt::format("{} bytes", n));
    // Its size for good: a peer that holds the descriptor cannot cut the
    // pages from under this side's mapping (SIGBUS at the next access). And,
    // asked, no write but through the mapping made above: a read-only
    // descriptor reopened writable (/proc/PID/fd) still cannot map it so.
    const int seals =
        F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL | (only_here_writes ? F_SEAL_FUTURE_WRITE : 0);
    if (fcntl(fd, F_ADD_SEALS, seals) != 0) {
        munmap(p, n);
        fail("fcntl(F_ADD_SEALS)",
             only_here_writes ? "shrink, grow, future write, seal" : "shrink, grow, seal");
    }
    return {fd, static_cast<std::byte*>(p), n, true};
}

int shared_segment::reopen_read_only(int fd) {
    const std::string path = fmt::format("/proc/self/fd/{}", fd);
    const int ro = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (ro < 0)
        throw_error("open", errno,
                    fmt::format("{} read-only, for a peer that may only read", path));
    return ro;
}

shared_segment shared_segment::attach(int fd, std::size_t bytes, bool writable,
                                      bool require_sealed) {
    // Before the size: once sealed against shrinking, the size seen below holds.
    if (require_sealed) {
        const int seals = fcntl(fd, F_GET_SEALS);
        if (seals < 0 || (seals & F_SEAL_SHRINK) == 0)
            throw_error("mmap", EPERM,
                        fmt::format("shared segment descriptor {}: not sealed against shrinking "
                                    "(its owner could cut the pages under this mapping)",
                                    fd));
    }
    struct stat st {};
    if (fstat(fd, &st) != 0)
        throw_error("fstat", errno, fmt::format("shared segment descriptor {}", fd));
    const std::size_t n = page_round(bytes);
    if (bytes == 0 || static_cast<std::size_t>(st.st_size) < n)
        throw_error("mmap", EINVAL,
                    fmt::format("the segment has {} bytes, {} were announced", st.st_size, bytes));
    const int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (mine < 0)
        throw_error("fcntl(F_DUPFD_CLOEXEC)", errno, "shared segment");
    void* p = mmap(nullptr, n, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, mine, 0);
    if (p == MAP_FAILED) {
        const int err = errno;
        close(mine);
        throw_error("mmap", err, fmt::format("a shared segment of {} bytes", n));
    }
    return {mine, static_cast<std::byte*>(p), n, writable};
}

shared_segment::shared_segment(shared_segment&& o) noexcept
    : fd_(std::exchange(o.fd_, -1))
    , base_(std::exchange(o.base_, nullptr))
    , bytes_(std::exchange(o.bytes_, 0))
    , writable_(std::exchange(o.writable_, false)) {}

shared_segment& shared_segment::operator=(shared_segment&& o) noexcept {
    if (this != &o) {
        release();
        fd_ = std::exchange(o.fd_, -1);
        base_ = std::exchange(o.base_, nullptr);
        bytes_ = std::exchange(o.bytes_, 0);
        writable_ = std::exchange(o.writable_, false);
    }
    return *this;
}

shared_segment::~shared_segment() {
    release();
}

void shared_segment::release() noexcept {
    if (base_ != nullptr)
        munmap(base_, bytes_);
    if (fd_ >= 0)
        close(fd_);
    base_ = nullptr;
    fd_ = -1;
    bytes_ = 0;
    writable_ = false;
}

} // namespace rdmax::local
