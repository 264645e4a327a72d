#include "test_device.hpp"

#include <cstdlib>

#include <fmt/format.h>

#include <rdmax/error.hpp>

namespace rdmax::test {

namespace {
std::optional<std::string> env(const char* name) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0')
        return std::nullopt;
    return std::string(v);
}
} // namespace

std::optional<std::string> test_address() {
    return env("RDMAX_TEST_ADDR");
}

verbs::context open_test_device() {
    if (auto name = env("RDMAX_TEST_DEVICE"))
        return verbs::context::open(*name);
    return verbs::context::open_first_active();
}

std::optional<std::string> device_unavailable() {
    try {
        verbs::context ctx = open_test_device();
        (void)ctx;
        return std::nullopt;
    } catch (const rdmax::error& e) {
        return fmt::format(
            "no usable RDMA device: {} (run the rxe suite in the VM: tests/vm/run --suite rxe)",
            e.what());
    }
}

} // namespace rdmax::test
