// The rights type: what the compiler enforces is checked where the compiler
// checks it. This file also shows that the whole library can be pulled in with
// `using namespace rdmax;` beside POSIX's <unistd.h>: the type used to be
// called `access`, which collided with access(2) as soon as both were visible.
#include <unistd.h>

#include <rdmax/rdmax.hpp>

#include "../support/catch.hpp"

using namespace rdmax;

static_assert(has(rights::local_write | rights::remote_read, rights::remote_read));
static_assert(!has(rights::local_write, rights::remote_write));
static_assert(valid(rights::local_write | rights::remote_write));
static_assert(!valid(rights::remote_write));
static_assert(!valid(rights::remote_atomic));
static_assert(valid(rights::remote_read));
static_assert(memory_region<rights::local_write | rights::remote_read>::granted ==
              (rights::local_write | rights::remote_read));

TEST_CASE("rights map onto the verbs flags") {
    CHECK(to_ibv(rights::local_write | rights::remote_write) ==
          (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE));
    CHECK(to_ibv(all_rights) == (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                 IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC));
}

TEST_CASE("using namespace rdmax beside <unistd.h>: access(2) is still POSIX's") {
    // Unqualified, as a user who wrote `using namespace rdmax;` would call it.
    CHECK(access("/", F_OK) == 0);
    CHECK(access("/nonexistent-rdmax-path", F_OK) == -1);
    const rights r = rights::remote_read;
    CHECK(to_ibv(r) == IBV_ACCESS_REMOTE_READ);
}
