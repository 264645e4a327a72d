#pragma once
// Whether a stat segment's process still lives, told by the file itself: its
// writer holds a shared flock on it for as long as it runs (the kernel drops
// the lock when the process dies, however it dies). Unlike a pid, this holds
// across pid namespaces sharing /dev/shm (containers) and across pid reuse.
// Private to src/stats.

#include <fcntl.h>
#include <string>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

namespace rdmax::stats::detail {

/// Unlinks `path` if no process holds its lock, and only the file that was
/// checked (its inode still at the path, held exclusively meanwhile): true
/// when it went. A file that cannot be opened is left alone.
inline bool unlink_if_unused(const std::string& path) noexcept {
    const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return false;
    bool gone = false;
    struct stat held {
    }, now{};
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && ::fstat(fd, &held) == 0 &&
        ::lstat(path.c_str(), &now) == 0 && held.st_dev == now.st_dev && held.st_ino == now.st_ino)
        gone = ::unlink(path.c_str()) == 0;
    ::close(fd); // drops the lock
    return gone;
}

/// Whether a process holds `fd`'s file's lock (a live writer).
inline bool in_use(int fd) noexcept {
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0)
        return true;
    (void)::flock(fd, LOCK_UN);
    return false;
}

} // namespace rdmax::stats::detail
