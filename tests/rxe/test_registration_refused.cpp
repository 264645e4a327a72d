// A registration the kernel refuses says why and what to do instead (issue
// 23, item 9). On 7.x, ibv_reg_mr of a MAP_SHARED mapping of a file on ext4
// fails with EFAULT: Linux will not pin such pages for as long as a
// registration lives. The test makes an ext4 file system on a loop device
// (root, mkfs.ext4 and the loop driver: the VM has them; SKIP elsewhere),
// maps a file on it MAP_SHARED and registers it through memory_region and
// through the cache.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <optional>
#include <string>
#include <sys/mman.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

#include "../support/catch.hpp"
#include "../support/skip_reason.hpp"
#include "../support/test_device.hpp"

using namespace rdmax;
using namespace rdmax::test;

namespace {

const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));

/// An ext4 file system on a loop device, mounted in a scratch directory.
struct ext4_mount {
    std::string dir, image, mnt;
    bool mounted = false;
    ext4_mount() {
        std::string tmpl = "/tmp/rdmax-ext4-XXXXXX";
        REQUIRE(mkdtemp(tmpl.data()) != nullptr);
        dir = tmpl;
        image = dir + "/image";
        mnt = dir + "/mnt";
        const std::string cmd = fmt::format(
            "(modprobe loop 2>/dev/null; true) && truncate -s 32M {0} && mkfs.ext4 -q -F {0} && "
            "mkdir {1} && mount -o loop {0} {1}",
            image, mnt);
        INFO(cmd);
        REQUIRE(std::system(cmd.c_str()) == 0);
        mounted = true;
    }
    ext4_mount(const ext4_mount&) = delete;
    ext4_mount& operator=(const ext4_mount&) = delete;
    ~ext4_mount() {
        const std::string cmd =
            fmt::format("{}rm -rf {}", mounted ? fmt::format("umount {} && ", mnt) : "", dir);
        if (std::system(cmd.c_str()) != 0)
            std::fprintf(stderr, "cleanup failed: %s\n", cmd.c_str());
    }
};

/// The message a refused registration must carry.
void check_says_why(const rdmax::error& e, const std::string& path) {
    INFO(e.what());
    CHECK(e.code().value() == EFAULT);
    CHECK_THAT(e.what(), Catch::Matchers::Contains("MAP_SHARED) of " + path));
    CHECK_THAT(e.what(), Catch::Matchers::Contains("a file on ext4"));
    CHECK_THAT(e.what(), Catch::Matchers::Contains("anonymous memory"));
    CHECK_THAT(e.what(), Catch::Matchers::Contains("memfd_create"));
    CHECK_THAT(e.what(), Catch::Matchers::Contains("RDMAX_RCACHE_ODP=1"));
}

} // namespace

std::optional<std::string> rdmax::test::skip_reason() {
    if (auto why = device_unavailable())
        return why;
    if (geteuid() != 0)
        return std::string("mounting an ext4 loop device needs root");
    if (std::system("command -v mkfs.ext4 >/dev/null 2>&1") != 0)
        return std::string("mkfs.ext4 is not installed");
    return std::nullopt;
}

TEST_CASE("a MAP_SHARED mapping of an ext4 file: the refusal names it and what to use") {
    ext4_mount fs;
    const std::string path = fs.mnt + "/data";
    const int fd = open(path.c_str(), O_RDWR | O_CREAT, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(ftruncate(fd, static_cast<off_t>(4 * page)) == 0);
    void* p = mmap(nullptr, 4 * page, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    REQUIRE(p != MAP_FAILED);
    static_cast<std::byte*>(p)[0] = std::byte{1}; // a dirty page, as an application has

    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    utsname u{};
    uname(&u);
    bool refused = false;
    try {
        memory_region<rights::local_write | rights::remote_write> mr(pd, p, 4 * page);
        // Older kernels pin such pages (6.1 here): nothing is refused.
        WARN("Linux " << u.release << " registers a MAP_SHARED ext4 file: nothing to check");
        CHECK(mr.size() == 4 * page);
    } catch (const rdmax::error& e) {
        refused = true;
        check_says_why(e, path);
    }
    if (refused) {
        // The cache registers through the verbs registrar: the same words.
        rcache_options opt;
        opt.monitor = monitor_kind::manual;
        auto cache = make_verbs_cache(pd, opt);
        try {
            auto h = cache.local<rights::local_write>(p, 4 * page);
            FAIL("the cache's registration was not refused");
        } catch (const rdmax::error& e) {
            check_says_why(e, path);
        }
    }
    munmap(p, 4 * page);
    close(fd);
}
