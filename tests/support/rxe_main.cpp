// What the rxe tests need: an RDMA device that opens (see skip_main.cpp).
#include "skip_reason.hpp"
#include "test_device.hpp"

std::optional<std::string> rdmax::test::skip_reason() {
    return device_unavailable();
}
