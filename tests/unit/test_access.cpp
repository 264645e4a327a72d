#include <rdmax/mem/access.hpp>
#include <rdmax/mem/memory_region.hpp>

#include "../support/catch.hpp"

using rdmax::access;

// What the compiler enforces is checked where the compiler checks it.
static_assert(rdmax::has(access::local_write | access::remote_read, access::remote_read));
static_assert(!rdmax::has(access::local_write, access::remote_write));
static_assert(rdmax::valid(access::local_write | access::remote_write));
static_assert(!rdmax::valid(access::remote_write));
static_assert(!rdmax::valid(access::remote_atomic));
static_assert(rdmax::valid(access::remote_read));
static_assert(rdmax::memory_region<access::local_write | access::remote_read>::rights ==
              (access::local_write | access::remote_read));

TEST_CASE("access rights map onto the verbs flags") {
    CHECK(rdmax::to_ibv(access::local_write | access::remote_write) ==
          (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE));
    CHECK(rdmax::to_ibv(rdmax::access_all) == (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                               IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC));
}
