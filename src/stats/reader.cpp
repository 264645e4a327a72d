// Reading stat segments (reader.hpp).

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <ctime>
#include <dirent.h>
#include <fcntl.h>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/stats/reader.hpp>

#include "segment_lock.hpp"

namespace rdmax::stats {

namespace {

constexpr int seqlock_tries = 1000;

std::string bounded(const char* s, std::size_t cap) {
    return {s, ::strnlen(s, cap)};
}

std::string path_of(std::string_view dir, uid_t uid, pid_t pid) {
    return fmt::format("{}/{}{}.{}", dir, segment_prefix, uid, pid);
}

/// An open segment file checked to be what a segment must be; -1 and errno,
/// `why` set, otherwise.
int open_checked(const std::string& path, uid_t uid, std::string& why) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        why = std::strerror(errno);
        return -1;
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        why = std::strerror(errno);
    } else if (!S_ISREG(st.st_mode)) {
        why = "not a regular file";
    } else if (st.st_uid != uid) {
        why = fmt::format("owned by uid {}, not {}", st.st_uid, uid);
    } else if ((st.st_mode & 077) != 0) {
        why = fmt::format("mode {:o}: others may read or write it", st.st_mode & 0777);
    } else if (static_cast<std::uint64_t>(st.st_size) != sizeof(segment)) {
        why = fmt::format("{} bytes, where a segment of version {} has {}", st.st_size,
                          segment_version, sizeof(segment));
    } else {
        return fd;
    }
    ::close(fd);
    errno = EINVAL;
    return -1;
}

bool header_ok(const segment_header& h, std::string& why) {
    if (std::memcmp(h.magic, segment_magic, sizeof h.magic) != 0)
        why = "no rdmax stat magic (not a segment, or still being made)";
    else if (h.version != segment_version)
        why = fmt::format("version {}, this reader knows {}", h.version, segment_version);
    else if (h.records != max_records || h.bytes != sizeof(segment))
        why = "a table of another size than its version's";
    else
        return true;
    return false;
}

/// One record's copy under its seqlock; false when it is free or never
/// settled within the tries.
bool copy_record(const record& r, object_snapshot& out, bool& unsettled) {
    unsettled = false;
    for (int i = 0; i < seqlock_tries; ++i) {
        const std::uint32_t s1 = r.seq.load(std::memory_order_acquire);
        if (r.live.load(std::memory_order_acquire) != 1)
            return false;
        if ((s1 & 1) != 0)
            continue;
        const std::size_t n = std::min<std::size_t>(r.fields, max_fields);
        out.kind = bounded(r.kind, kind_bytes);
        out.name = bounded(r.name, object_name_bytes);
        out.fields.resize(n);
        for (std::size_t f = 0; f < n; ++f) {
            out.fields[f].name = bounded(r.field_names[f], field_name_bytes);
            out.fields[f].type =
                r.types[f] == field_type::gauge ? field_type::gauge : field_type::counter;
            out.fields[f].value = r.values[f].load(std::memory_order_relaxed);
        }
        seqlock_fence(std::memory_order_acquire);
        if (r.seq.load(std::memory_order_relaxed) == s1 &&
            r.live.load(std::memory_order_relaxed) == 1)
            return true;
    }
    unsettled = true;
    return false;
}

} // namespace

std::vector<segment_entry> list_segments(uid_t uid, std::string_view dir) {
    std::vector<segment_entry> out;
    const std::string d(dir);
    DIR* dp = ::opendir(d.c_str());
    if (dp == nullptr)
        return out;
    const std::string prefix = fmt::format("{}{}.", segment_prefix, uid);
    while (const dirent* e = ::readdir(dp)) {
        const std::string_view name = e->d_name;
        if (!name.starts_with(prefix))
            continue;
        const std::string_view digits = name.substr(prefix.size());
        int pid = 0;
        const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
        if (ec != std::errc{} || end != digits.data() + digits.size() || pid <= 0)
            continue;
        segment_entry s{.pid = pid, .path = fmt::format("{}/{}", d, name)};
        std::string why;
        const int fd = open_checked(s.path, uid, why);
        if (fd < 0)
            continue; // not a segment of this user's: not listed, never removed
        segment_header h{};
        const bool made =
            ::pread(fd, &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h) && header_ok(h, why);
        struct stat st {};
        const bool old = ::fstat(fd, &st) == 0 && st.st_mtime + 10 < ::time(nullptr);
        // Its writer holds the file's lock while it lives (segment_lock.hpp);
        // a header not written yet is a segment being made, unless it is old.
        s.stale = !detail::in_use(fd) && (made || old);
        ::close(fd);
        out.push_back(std::move(s));
    }
    ::closedir(dp);
    std::sort(out.begin(), out.end(),
              [](const segment_entry& a, const segment_entry& b) { return a.pid < b.pid; });
    return out;
}

process_snapshot read_segment(pid_t pid, uid_t uid, std::string_view dir) {
    const std::string path = path_of(dir, uid, pid);
    std::string why;
    const int fd = open_checked(path, uid, why);
    if (fd < 0)
        throw_error("stats::read_segment", errno == 0 ? EINVAL : errno,
                    fmt::format("{}: {}", path, why));
    void* p = ::mmap(nullptr, sizeof(segment), PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    if (p == MAP_FAILED)
        throw_error("stats::read_segment", err, fmt::format("mmap {}", path));
    struct unmap {
        void* p;
        ~unmap() { ::munmap(p, sizeof(segment)); }
    } guard{p};
    const auto* seg = static_cast<const segment*>(p);
    if (!header_ok(seg->header, why))
        throw_error("stats::read_segment", EINVAL, fmt::format("{}: {}", path, why));
    process_snapshot snap;
    snap.pid = pid;
    snap.comm = bounded(seg->header.comm, sizeof seg->header.comm);
    snap.interval_ms = seg->header.interval_ms;
    snap.unpublished = seg->header.unpublished.load(std::memory_order_relaxed);
    for (const record& r : seg->records) {
        object_snapshot o;
        bool unsettled = false;
        if (copy_record(r, o, unsettled))
            snap.objects.push_back(std::move(o));
        else if (unsettled)
            ++snap.unsettled;
    }
    return snap;
}

bool remove_stale(const segment_entry& e) noexcept {
    // Checked again, under the file's lock: it may have a writer by now.
    return e.stale && detail::unlink_if_unused(e.path);
}

} // namespace rdmax::stats
