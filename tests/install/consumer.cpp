// A program outside the project, as a user would write it after
// `meson install`: it finds rdmax through pkg-config alone, pulls in every
// header through the umbrella one, and calls into the compiled library.
#include <cstdio>
#include <cstring>
#include <unistd.h>

#include <rdmax/rdmax.hpp>

using namespace rdmax;

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: consumer EXPECTED-VERSION\n");
        return 2;
    }
    // The installed version.hpp is the one meson.build describes.
    if (std::strcmp(version_string, argv[1]) != 0) {
        std::fprintf(stderr, "installed rdmax says %s, expected %s\n", version_string, argv[1]);
        return 1;
    }
    // Header-only parts: the rights are the verbs flags.
    static_assert(to_ibv(rights::local_write) == IBV_ACCESS_LOCAL_WRITE);
    // Compiled parts: an error names the verb and the reason; the device
    // list comes from libibverbs (empty on a machine without a device).
    const error e("ibv_reg_mr", ENOMEM, "consumer check");
    if (std::strstr(e.what(), "ibv_reg_mr") == nullptr) {
        std::fprintf(stderr, "rdmax::error lost its verb: %s\n", e.what());
        return 1;
    }
    const auto names = verbs::device_names();
    std::printf("rdmax %s linked: %zu RDMA device(s); access(2) still POSIX's: %d\n",
                version_string, names.size(), access("/", F_OK));
    return 0;
}
