#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <sys/vfs.h>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/registration_error.hpp>

namespace rdmax {

namespace {

// statfs(2) f_type values (linux/magic.h), for the file systems named here.
constexpr unsigned long tmpfs_magic = 0x01021994;
constexpr unsigned long hugetlbfs_magic = 0x958458f6;
constexpr unsigned long ramfs_magic = 0x858458f6;

std::string file_system_name(unsigned long magic) {
    switch (magic) {
    case 0xef53: return "ext4"; // ext2, ext3 and ext4 share it
    case 0x58465342: return "xfs";
    case 0x9123683e: return "btrfs";
    case 0xf2f52010: return "f2fs";
    case 0x794c7630: return "overlayfs";
    case 0x01021997: return "9p";
    case 0x6969: return "nfs";
    case 0xff534d42: return "cifs";
    case 0x65735546: return "fuse";
    default: return fmt::format("a file system of type {:#x}", magic);
    }
}

/// Whether pages of this file can be pinned for long in a shared mapping:
/// yes on file systems without writeback. `dev_major` (from the maps line)
/// decides where the file is gone (deleted): block devices have writeback.
bool pinnable_file(const std::string& path, unsigned dev_major, std::string& fs_name) {
    if (path.starts_with("/memfd:") || path.starts_with("/SYSV") || path.starts_with("/dev/zero"))
        return true; // shmem
    std::string p = path;
    constexpr std::string_view deleted = " (deleted)";
    if (p.ends_with(deleted))
        p.resize(p.size() - deleted.size());
    struct statfs fs {};
    if (statfs(p.c_str(), &fs) != 0) {
        fs_name = "a file system on a block device";
        return dev_major == 0;
    }
    const auto magic = static_cast<unsigned long>(fs.f_type);
    if (magic == tmpfs_magic || magic == hugetlbfs_magic || magic == ramfs_magic)
        return true;
    fs_name = file_system_name(magic);
    return false;
}

} // namespace

mapping_facts mapping_facts_of(const void* addr, std::size_t len) {
    mapping_facts f;
    const auto lo = reinterpret_cast<std::uintptr_t>(addr);
    const std::uintptr_t hi = lo + len < lo ? UINTPTR_MAX : lo + len;
    std::FILE* maps = std::fopen("/proc/self/maps", "re");
    if (maps == nullptr)
        return f;
    std::uintptr_t covered_to = lo; // mapped without a gap from lo up to here
    char line[4096 + 128];
    while (std::fgets(line, sizeof line, maps) != nullptr) {
        std::uintptr_t start = 0, end = 0;
        char perms[5] = {};
        unsigned long long offset = 0, inode = 0;
        unsigned major = 0, minor = 0;
        int path_at = 0;
        if (std::sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %4s %llx %x:%x %llu %n", &start, &end,
                        perms, &offset, &major, &minor, &inode, &path_at) < 7)
            continue;
        if (end <= lo || start >= hi)
            continue;
        if (start <= covered_to && end > covered_to)
            covered_to = end;
        if (perms[1] != 'w')
            f.read_only = true;
        std::string path(line + path_at);
        while (!path.empty() && (path.back() == '\n' || path.back() == ' '))
            path.pop_back();
        if (perms[3] == 's' && inode != 0 && path.starts_with('/') && !f.shared_file) {
            std::string fs_name;
            if (!pinnable_file(path, major, fs_name)) {
                f.shared_file = true;
                f.file = path;
                f.file_system = fs_name;
            }
        }
    }
    std::fclose(maps);
    f.fully_mapped = covered_to >= hi;
    return f;
}

std::string registration_failure_detail(int err, const void* addr, std::size_t len,
                                        rights granted) {
    std::string d = fmt::format("{} bytes at {}", len, addr);
    if (err != EFAULT)
        return d;
    const mapping_facts f = mapping_facts_of(addr, len);
    const bool writes = has(granted, rights::local_write) || has(granted, rights::remote_write) ||
                        has(granted, rights::remote_atomic);
    if (!f.fully_mapped)
        d += ": part of the range is not mapped";
    else if (f.shared_file)
        d += fmt::format(
            ": they are a shared mapping (MAP_SHARED) of {}, a file on {}, whose pages Linux "
            "refuses to pin for as long as a registration lives (the file system must see every "
            "write to them); register anonymous memory (MAP_PRIVATE | MAP_ANONYMOUS) or shmem "
            "(memfd_create, /dev/shm, MAP_SHARED | MAP_ANONYMOUS) instead, or register on "
            "demand (RDMAX_RCACHE_ODP=1, where the device has on-demand paging)",
            f.file, f.file_system);
    else if (f.read_only && writes)
        d += ": part of the range is mapped read-only and the registration asks for write "
             "access: ask for local_read / remote_read only, or map it writable";
    return d;
}

namespace {

/// A refused registration whose explanation (from /proc/self/maps and
/// statfs, which can block on a hung network file system) is looked up when
/// what() is first read, not when it is thrown: registrars throw under the
/// cache's mutex, and the cache swallows some refusals (a merged union it
/// then registers alone, per use) whose message no one reads.
class registration_refused final : public error {
public:
    registration_refused(std::string_view verb, int err, const void* addr, std::size_t len,
                         rights granted)
        : error(verb, err, fmt::format("{} bytes at {}", len, addr))
        , lazy_(std::make_shared<lazy>(addr, len, granted)) {}

    [[nodiscard]] const char* what() const noexcept override {
        std::call_once(lazy_->once, [this] {
            try {
                lazy_->text = error(verb(), code().value(),
                                    registration_failure_detail(code().value(), lazy_->addr,
                                                                lazy_->len, lazy_->granted))
                                  .what();
            } catch (...) { // out of memory: the short message
            }
        });
        return lazy_->text.empty() ? error::what() : lazy_->text.c_str();
    }

private:
    struct lazy {
        lazy(const void* a, std::size_t n, rights g) noexcept
            : addr(a)
            , len(n)
            , granted(g) {}
        const void* addr;
        std::size_t len;
        rights granted;
        std::once_flag once;
        std::string text;
    };
    std::shared_ptr<lazy> lazy_; ///< shared by the copies the exception is thrown as
};

} // namespace

void throw_registration_error(std::string_view verb, int err, const void* addr, std::size_t len,
                              rights granted) {
    if (err != EFAULT) // nothing to look up
        throw_error(verb, err, registration_failure_detail(err, addr, len, granted));
    throw registration_refused(verb, err, addr, len, granted);
}

} // namespace rdmax
