#pragma once
// Two connected RC queue pairs on the test device, with registered memory on
// each side: the fixture of the data-path tests.

#include <chrono>
#include <cstddef>
#include <vector>

#include <rdmax/rdmax.hpp>

#include "catch.hpp"
#include "test_device.hpp"

namespace rdmax::test {

using namespace std::chrono_literals;

using region = memory_region<all_rights>;

/// Memory with a registration over it; the bytes live in a vector.
struct registered {
    std::vector<std::byte> bytes;
    region mr;
    registered(const verbs::protection_domain& pd, std::size_t n, std::byte fill = std::byte{0})
        : bytes(n, fill)
        , mr(pd, bytes.data(), bytes.size()) {}
};

struct loopback {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd{ctx};
    verbs::queue_pair<verbs::rc> a;
    verbs::queue_pair<verbs::rc> b;

    explicit loopback(const verbs::qp_config& cfg = {})
        : a(pd, cfg)
        , b(pd, cfg) {
        verbs::connect_pair(a, b);
    }
};

/// Waits for one send completion the caller asked for; fails the test at the deadline.
inline verbs::completion wait_send(verbs::queue_pair_base& qp, std::chrono::milliseconds t = 5s) {
    verbs::completion c[1];
    const int n = qp.wait_send(c, t);
    REQUIRE(n == 1);
    return c[0];
}

inline verbs::completion wait_recv(verbs::queue_pair_base& qp, std::chrono::milliseconds t = 5s) {
    verbs::completion c[1];
    const int n = qp.wait_recv(c, t);
    REQUIRE(n == 1);
    return c[0];
}

/// Bytes 0, 1, 2, ... (mod 251, so that no period divides a power of two).
inline void fill_pattern(std::span<std::byte> out, unsigned seed) {
    for (std::size_t i = 0; i < out.size(); ++i)
        out[i] = static_cast<std::byte>((i + seed) % 251);
}

inline bool has_pattern(std::span<const std::byte> in, unsigned seed) {
    for (std::size_t i = 0; i < in.size(); ++i)
        if (in[i] != static_cast<std::byte>((i + seed) % 251))
            return false;
    return true;
}

} // namespace rdmax::test
