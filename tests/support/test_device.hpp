#pragma once
// The RDMA device the rxe tests run on. In the VM, tests/vm sets
// RDMAX_TEST_DEVICE=rxe0 and RDMAX_TEST_ADDR=192.0.2.1; on a machine with its
// own device, set them to pick one, or let the first ACTIVE device be taken.

#include <optional>
#include <string>

#include <rdmax/verbs/context.hpp>

namespace rdmax::test {

/// Why the rxe tests cannot run here, or nullopt when a device is usable.
[[nodiscard]] std::optional<std::string> device_unavailable();

/// Opens the device the tests use (RDMAX_TEST_DEVICE, else the first active one).
[[nodiscard]] verbs::context open_test_device();

/// RDMAX_TEST_ADDR: the IPv4 address whose RoCE v2 GID the device must carry, if set.
[[nodiscard]] std::optional<std::string> test_address();

/// Exit code meson treats as "skipped".
inline constexpr int exit_skip = 77;

} // namespace rdmax::test
