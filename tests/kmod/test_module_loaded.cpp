// The kmod suite's harness check: /dev/rdmax is there when the VM loaded the
// module. Without the module this reports SKIP (77), never a pass.
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

int main() {
    if (access("/dev/rdmax", F_OK) != 0) {
        fmt::print("SKIP: /dev/rdmax is absent: the rdmax module is not loaded (build it and run "
                   "tests/vm/run --suite kmod)\n");
        return 77;
    }
    int fd = open("/dev/rdmax", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        fmt::print("FAIL: open /dev/rdmax: {}\n", std::strerror(errno));
        return 1;
    }
    close(fd);
    fmt::print("ok: /dev/rdmax opens\n");
    return 0;
}
