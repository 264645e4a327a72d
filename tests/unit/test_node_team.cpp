// rdmax::local::node_team and its allreduce between real processes on this
// node (forked ranks): every element of every result checked, a vector staged
// and one in the window, in pieces past the window, many calls in a row; and
// the failures: a peer that never comes, one that leaves, one in another call,
// one that lies about where its data is, one of another team shape.

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/local/descriptor_passing.hpp>
#include <rdmax/local/node_team.hpp>
#include <rdmax/local/team_allreduce.hpp>
#include <rdmax/local/team_broadcast.hpp>

#include "../support/catch.hpp"
#include "../support/child_process.hpp"

using namespace rdmax;
using namespace rdmax::local;
using rdmax::test::reap;

namespace {

/// A team name no other test run uses.
std::string fresh_name() {
    static int n = 0;
    return fmt::format("unit-{}-{}", ::getpid(), ++n);
}

team_options small(std::size_t window = 4096, int timeout_ms = 10'000) {
    team_options o;
    o.window_bytes = window;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    o.spin = 64;
    return o;
}

/// Runs `body(rank)` in `size` forked ranks; each rank's exit status (0: it
/// returned true). A rank that throws prints why and exits 1.
std::vector<int> run_ranks(int size, const std::function<bool(int)>& body) {
    std::vector<pid_t> pids;
    for (int r = 0; r < size; ++r) {
        const pid_t pid = rdmax::test::spawn([&body, r] {
            int code = 1;
            try {
                code = body(r) ? 0 : 2;
            } catch (const std::exception& e) {
                std::fprintf(stderr, "rank %d: %s\n", r, e.what());
            }
            std::fflush(stderr);
            return code;
        });
        REQUIRE(pid >= 0);
        pids.push_back(pid);
    }
    std::vector<int> codes;
    codes.reserve(pids.size());
    for (const pid_t p : pids)
        codes.push_back(reap(p, std::chrono::seconds(60)));
    return codes;
}

/// Rank r's element i: integers, so every order of summing gives the same float.
float value(int r, std::size_t i) {
    return static_cast<float>((r + 1) * 1000 + i % 997);
}

bool sums_right(std::span<const float> v, int size) {
    for (std::size_t i = 0; i < v.size(); ++i) {
        float want = 0;
        for (int r = 0; r < size; ++r)
            want += value(r, i);
        if (v[i] != want) {
            std::fprintf(stderr, "element %zu: %g, expected %g\n", i, double(v[i]), double(want));
            return false;
        }
    }
    return true;
}

/// Expects `f` to throw rdmax::error with errno `err`; true if it did.
bool throws_errno(const std::function<void()>& f, int err) {
    try {
        f();
    } catch (const rdmax::error& e) {
        if (e.code().value() == err)
            return true;
        std::fprintf(stderr, "errno %d, expected %d: %s\n", e.code().value(), err, e.what());
        return false;
    }
    std::fprintf(stderr, "no error, expected errno %d\n", err);
    return false;
}

} // namespace

TEST_CASE("node_team allreduce: 1 to 4 ranks, staged sizes up to pieces past the window") {
    for (const int size : {1, 2, 3, 4}) {
        const std::string name = fresh_name();
        const auto codes = run_ranks(size, [&](int r) {
            node_team t(name, r, size, small(4096));
            // 4096-byte windows: 1024 floats; 2500 goes in three pieces.
            for (const std::size_t n : {0UL, 1UL, 7UL, 16UL, 17UL, 1000UL, 1024UL, 2500UL}) {
                std::vector<float> v(n);
                for (std::size_t i = 0; i < n; ++i)
                    v[i] = value(r, i);
                allreduce(t, std::span(v));
                if (!sums_right(v, size))
                    return false;
            }
            return true;
        });
        INFO("ranks " << size);
        CHECK(codes == std::vector<int>(static_cast<std::size_t>(size), 0));
    }
}

TEST_CASE("node_team allreduce: in the window, staged, and another operation, 300 calls") {
    const std::string name = fresh_name();
    constexpr int size = 3;
    const auto codes = run_ranks(size, [&](int r) {
        node_team t(name, r, size, small(64 * 1024));
        for (int call = 0; call < 300; ++call) {
            const std::size_t n = 1 + static_cast<std::size_t>(call * 37) % 5000;
            if (call % 3 == 0) { // the largest element of every rank's
                std::vector<std::int64_t> v(n);
                for (std::size_t i = 0; i < n; ++i)
                    v[i] = (i + static_cast<std::size_t>(r)) % size == 0 ? call : -r;
                allreduce(t, std::span(v),
                          [](std::int64_t a, std::int64_t b) { return a > b ? a : b; });
                for (std::size_t i = 0; i < n; ++i)
                    if (v[i] != call) {
                        std::fprintf(stderr, "call %d element %zu of %zu: %lld\n", call, i, n,
                                     static_cast<long long>(v[i]));
                        return false;
                    }
                continue;
            }
            // In the window at an offset, or staged: the same answer.
            std::span<float> v =
                call % 3 == 1 ? t.window_as<float>(n + 16).subspan(16) : std::span<float>();
            std::vector<float> own;
            if (v.empty()) {
                own.resize(n);
                v = own;
            }
            for (std::size_t i = 0; i < n; ++i)
                v[i] = value(r, i + static_cast<std::size_t>(call));
            allreduce(t, v);
            for (std::size_t i = 0; i < n; ++i) {
                float want = 0;
                for (int q = 0; q < size; ++q)
                    want += value(q, i + static_cast<std::size_t>(call));
                if (v[i] != want)
                    return false;
            }
        }
        t.barrier();
        return true;
    });
    CHECK(codes == std::vector<int>(3, 0));
}

TEST_CASE("node_team broadcast: from every root, staged and in the window, in pieces") {
    const std::string name = fresh_name();
    constexpr int size = 3;
    const auto codes = run_ranks(size, [&](int r) {
        node_team t(name, r, size, small(4096, 1000));
        int call = 0;
        for (const std::size_t n : {0UL, 1UL, 100UL, 1024UL, 3000UL})
            for (int root = 0; root < size; ++root, ++call) {
                const bool in_window = n <= 1024 && call % 2 == 0;
                std::vector<std::int32_t> own(in_window ? 0 : n);
                std::span<std::int32_t> v =
                    in_window ? t.window_as<std::int32_t>(n) : std::span<std::int32_t>(own);
                for (std::size_t i = 0; i < n; ++i)
                    v[i] = r == root ? static_cast<std::int32_t>(i) * 7 + call : -1;
                broadcast(t, v, root);
                for (std::size_t i = 0; i < n; ++i)
                    if (v[i] != static_cast<std::int32_t>(i) * 7 + call) {
                        std::fprintf(stderr, "n %zu root %d element %zu: %d\n", n, root, i, v[i]);
                        return false;
                    }
            }
        // Rank 0 names itself the root, the others rank 1: both roots see a
        // rank that names another and refuse; rank 2 copies rank 1's and
        // then waits in vain for rank 0.
        std::vector<std::int32_t> v(10, r);
        if (r == 2) {
            try {
                broadcast(t, std::span(v), 1);
            } catch (const rdmax::error&) {
            }
            return true;
        }
        return throws_errno([&] { broadcast(t, std::span(v), r == 0 ? 0 : 1); }, EPROTO) &&
               v == std::vector<std::int32_t>(10, r);
    });
    CHECK(codes == std::vector<int>(3, 0));
}

TEST_CASE("node_team: 20 ranks join as a user with few descriptors, and reduce") {
    // Descriptors in flight count against the sender's RLIMIT_NOFILE for a
    // user without CAP_SYS_RESOURCE (ETOOMANYREFS): 19 members x 20 windows
    // sent at once were far over 64. As root the test drops to nobody.
    const std::string name = fresh_name();
    constexpr int size = 20;
    const auto codes = run_ranks(size, [&](int r) {
        const rlimit few{64, 64};
        if (::setrlimit(RLIMIT_NOFILE, &few) != 0)
            return false;
        if (::geteuid() == 0 && ::setresgid(65534, 65534, 65534) != 0)
            return false;
        if (::geteuid() == 0 && ::setresuid(65534, 65534, 65534) != 0)
            return false;
        node_team t(name, r, size, small(4096, 20'000));
        std::vector<float> v(1000);
        for (std::size_t i = 0; i < v.size(); ++i)
            v[i] = value(r, i);
        allreduce(t, std::span(v));
        return sums_right(v, size);
    });
    CHECK(codes == std::vector<int>(static_cast<std::size_t>(size), 0));
}

TEST_CASE("node_team: one call in two pieces is not two calls of a piece each") {
    const std::string name = fresh_name();
    const auto codes = run_ranks(2, [&](int r) {
        node_team t(name, r, 2, small(4096, 2000)); // 1024 floats a piece
        if (r == 0) {
            std::vector<float> v(2048, 1.0F);
            return throws_errno([&] { allreduce(t, std::span(v)); }, EPROTO);
        }
        std::vector<float> x(1024, 1.0F);
        return throws_errno(
            [&] {
                allreduce(t, std::span(x));
                allreduce(t, std::span(x));
            },
            EPROTO);
    });
    CHECK(codes == std::vector<int>{0, 0});
}

TEST_CASE("node_team: a rank that never joins times out, naming the ranks that came") {
    const std::string name = fresh_name();
    const auto codes = run_ranks(1, [&](int) {
        return throws_errno([&] { node_team t(name, 0, 3, small(4096, 300)); }, ETIMEDOUT);
    });
    CHECK(codes == std::vector<int>{0});
}

TEST_CASE("node_team: a rank that leaves breaks the team; later steps fail at once") {
    const std::string name = fresh_name();
    const auto codes = run_ranks(2, [&](int r) {
        node_team t(name, r, 2, small(4096, 300));
        t.barrier();
        if (r == 1)
            return true; // gone before the allreduce
        std::vector<float> v(100, 1.0F);
        if (!throws_errno([&] { allreduce(t, std::span(v)); }, ETIMEDOUT))
            return false;
        return t.broken() && throws_errno([&] { t.barrier(); }, ECANCELED);
    });
    CHECK(codes == std::vector<int>{0, 0});
}

TEST_CASE("node_team: ranks in different calls break the team, nothing mixed") {
    const std::string name = fresh_name();
    const auto codes = run_ranks(2, [&](int r) {
        node_team t(name, r, 2, small(4096, 2000));
        std::vector<float> v(r == 0 ? 100 : 101, 1.0F);
        const std::vector<float> before = v;
        if (!throws_errno([&] { allreduce(t, std::span(v)); }, EPROTO))
            return false;
        return v == before; // the mismatch is seen before anything is folded in
    });
    CHECK(codes == std::vector<int>{0, 0});
}

TEST_CASE("node_team: a peer that says its data lies past its window is refused") {
    const std::string name = fresh_name();
    const auto codes = run_ranks(2, [&](int r) {
        node_team t(name, r, 2, small(4096, 2000));
        const team_call honest{.count = 100, .offset = 0, .element = 4, .kind = 1};
        if (r == 1) {
            team_call lie = honest;
            lie.offset = 4096 - 4 * 50; // 100 floats from here run past the window
            t.begin_call(lie);
            (void)t.step();
            t.wait(0, 2, "the end");
            return true;
        }
        std::vector<float> v(100, 1.0F);
        const bool refused = throws_errno([&] { allreduce(t, std::span(v)); }, EPROTO);
        (void)t.step(); // let rank 1 go
        (void)t.step();
        return refused;
    });
    CHECK(codes == std::vector<int>{0, 0});
}

TEST_CASE("node_team: a rank of another window size is refused when it joins") {
    const std::string name = fresh_name();
    const auto codes = run_ranks(2, [&](int r) {
        if (r == 0)
            return throws_errno([&] { node_team t(name, 0, 2, small(4096, 1500)); }, ETIMEDOUT);
        return throws_errno([&] { node_team t(name, 1, 2, small(8192, 1500)); }, EPROTO);
    });
    CHECK(codes == std::vector<int>{0, 0});
}

TEST_CASE("node_team: bad arguments and data that straddles the window") {
    CHECK_THROWS_AS(node_team("x", 2, 2, small()), rdmax::error);
    CHECK_THROWS_AS(node_team("", 0, 1, small()), rdmax::error);
    CHECK_THROWS_AS(node_team("x", 0, 1, small(100)), rdmax::error);
    node_team t(fresh_name(), 0, 1, small(4096));
    CHECK_THROWS_AS(t.window_as<float>(1025), rdmax::error);
    std::span<float> w = t.window_as<float>(1024);
    std::vector<float> v(10, 2.0F);
    allreduce(t, std::span(v)); // one rank: itself
    CHECK(v == std::vector<float>(10, 2.0F));
    // Misaligned inside the window, and crossing its end: refused, not staged over itself.
    auto* bytes = reinterpret_cast<std::byte*>(w.data()) + 2;
    CHECK_THROWS_AS(allreduce(t, std::span(reinterpret_cast<float*>(bytes), 4)), rdmax::error);
    CHECK_FALSE(t.broken());
}

TEST_CASE("shared_segment: only the owner's mapping writes a segment created so") {
    shared_segment seg = shared_segment::create("only-here", 4096, true);
    seg.data()[0] = std::byte{1}; // the owner's own mapping still writes
    // A peer that reopens its read-only descriptor writable through /proc
    // (as any process of the owner's user could): no writable mapping, no write.
    const int ro = shared_segment::reopen_read_only(seg.fd());
    const int rw = ::open(fmt::format("/proc/self/fd/{}", ro).c_str(), O_RDWR | O_CLOEXEC);
    REQUIRE(rw >= 0);
    errno = 0;
    CHECK(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, rw, 0) == MAP_FAILED);
    CHECK(errno == EPERM);
    const char x = 'x';
    CHECK(::write(rw, &x, 1) < 0);
    void* r = ::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, rw, 0);
    REQUIRE(r != MAP_FAILED);
    CHECK(static_cast<const std::byte*>(r)[0] == std::byte{1});
    ::munmap(r, 4096);
    ::close(rw);
    ::close(ro);
    struct stat st {};
    REQUIRE(::fstat(seg.fd(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0600); // no other user opens it by its /proc path
}

TEST_CASE("shared_segment::reopen_read_only: a peer given it cannot map the segment writable") {
    shared_segment seg = shared_segment::create("ro", 4096);
    const int ro = shared_segment::reopen_read_only(seg.fd());
    REQUIRE(ro >= 0);
    void* w = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, ro, 0);
    CHECK(w == MAP_FAILED);
    CHECK(errno == EACCES);
    void* r = ::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, ro, 0);
    REQUIRE(r != MAP_FAILED);
    CHECK(::mprotect(r, 4096, PROT_READ | PROT_WRITE) != 0);
    ::munmap(r, 4096);
    ::close(ro);
}

// ---- what a hostile or confused rank cannot do ------------------------------

namespace {
int open_fds() {
    int n = 0;
    for (int fd = 0; fd < 4096; ++fd)
        if (::fcntl(fd, F_GETFD) >= 0)
            ++n;
    return n;
}
} // namespace

TEST_CASE("node_team: a member leaks no descriptor (nor its window) per team") {
    const std::string base = fresh_name();
    const auto codes = run_ranks(2, [&](int r) {
        // One team first: whatever the library opens once is open by then.
        {
            node_team t(base + "-0", r, 2, small(4096, 5000));
            t.barrier();
        }
        const int before = open_fds();
        for (int i = 1; i <= 5; ++i) {
            node_team t(fmt::format("{}-{}", base, i), r, 2, small(4096, 5000));
            t.barrier();
        }
        const int after = open_fds();
        if (after != before)
            std::fprintf(stderr, "rank %d: %d descriptors before 5 teams, %d after\n", r, before,
                         after);
        return after == before;
    });
    CHECK(codes == std::vector<int>{0, 0});
}

TEST_CASE("node_team: an element larger than the window is refused, not looped on") {
    struct big {
        std::array<char, 8192> b;
    };
    const auto codes = run_ranks(1, [&](int) {
        node_team t(fresh_name(), 0, 1, small(4096));
        std::vector<big> v(2);
        return throws_errno([&] { allreduce(t, std::span(v), [](big a, big) { return a; }); },
                            EINVAL);
    });
    CHECK(codes == std::vector<int>{0}); // -1: killed after 60 s in the loop
}

TEST_CASE("node_team: a silent connection to rank 0 does not stop the team joining") {
    const std::string name = fresh_name();
    const auto codes = run_ranks(3, [&](int r) {
        if (r == 2) { // connects as soon as rank 0 listens, then says nothing
            for (int i = 0; i < 400; ++i) {
                try {
                    unix_channel ch = unix_channel::connect("rdmax-team/" + name);
                    ::sleep(5);
                    return true;
                } catch (const rdmax::error&) {
                    ::usleep(5000);
                }
            }
            return false;
        }
        if (r == 1)
            ::usleep(200'000); // comes after the silent one
        node_team t(name, r, 2, small(4096, 3000));
        t.barrier();
        return true;
    });
    CHECK(codes == std::vector<int>{0, 0, 0});
}

TEST_CASE("node_team: a rank in a barrier while its peer is in an allreduce is caught") {
    const std::string name = fresh_name();
    const auto codes = run_ranks(2, [&](int r) {
        node_team t(name, r, 2, small(4096, 2000));
        std::vector<float> v(100);
        const auto fill = [&](int call) {
            for (std::size_t i = 0; i < v.size(); ++i)
                v[i] = value(r, i + static_cast<std::size_t>(call));
        };
        fill(0);
        allreduce(t, std::span(v));
        bool ok = true;
        try {
            // Rank 0: barrier then allreduce; rank 1: allreduce then barrier.
            if (r == 0)
                t.barrier();
            fill(1);
            allreduce(t, std::span(v));
            if (r == 1)
                t.barrier();
        } catch (const rdmax::error& e) {
            std::fprintf(stderr, "rank %d caught it: %s\n", r, e.what());
            return true; // the mix was seen
        }
        for (std::size_t i = 0; i < v.size(); ++i)
            if (v[i] != value(0, i + 1) + value(1, i + 1)) {
                std::fprintf(stderr, "rank %d: element %zu is %g, want %g: mixed silently\n", r, i,
                             double(v[i]), double(value(0, i + 1) + value(1, i + 1)));
                ok = false;
                break;
            }
        if (ok)
            std::fprintf(stderr, "rank %d: no error and the right sum\n", r);
        return false; // neither rank threw: calls were mixed
    });
    CHECK(codes != std::vector<int>{2, 2});
}

TEST_CASE("node_team: a rank asleep on a peer's futex is woken by its step, not its timeout") {
    // Shared between the forked ranks: when rank 1 stepped, and how late rank 0 saw it.
    auto* shared = static_cast<std::atomic<std::int64_t>*>(
        ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
    REQUIRE(shared != MAP_FAILED);
    const std::string name = fresh_name();
    constexpr int rounds = 10;
    const auto now_us = [] {
        return std::chrono::duration_cast<std::chrono::microseconds>(
                   std::chrono::steady_clock::now().time_since_epoch())
            .count();
    };
    const auto codes = run_ranks(2, [&](int r) {
        node_team t(name, r, 2, small(4096, 5000));
        for (int i = 0; i < rounds; ++i) {
            t.barrier();
            if (r == 1) {
                ::usleep(30'000); // rank 0 is asleep on the futex by now (spin + 1 ms yield)
                shared[0].store(now_us());
                (void)t.step();
            } else {
                const std::uint64_t s = t.step();
                t.wait(1, s, "the late step");
                shared[1 + i].store(now_us() - shared[0].load());
            }
        }
        return true;
    });
    CHECK(codes == std::vector<int>{0, 0});
    std::int64_t worst = 0;
    for (int i = 0; i < rounds; ++i)
        worst = std::max<std::int64_t>(worst, shared[1 + i].load());
    INFO("worst wake-up latency " << worst << " us");
    // A lost wake-up waits out the 100 ms futex slice (about 70 ms here); a
    // loaded host's scheduling delay stays well under 50.
    CHECK(worst < 50'000);
    ::munmap(shared, 4096);
}

TEST_CASE("node_team: rank 0 keeps no descriptor a malformed hello brought") {
    const std::string name = fresh_name();
    const auto codes = run_ranks(3, [&](int r) {
        if (r == 2) { // three short messages, each with a descriptor beside it
            for (int sent = 0, i = 0; sent < 3 && i < 400; ++i) {
                try {
                    unix_channel ch = unix_channel::connect("rdmax-team/" + name);
                    const std::uint32_t junk = 0;
                    const std::array<int, 1> fd{::memfd_create("junk", MFD_CLOEXEC)};
                    ch.send(std::as_bytes(std::span(&junk, 1)), fd);
                    ::close(fd[0]);
                    ++sent;
                } catch (const rdmax::error&) {
                    ::usleep(5000);
                }
            }
            return true;
        }
        if (r == 1)
            ::usleep(300'000); // after the junk
        const int before = open_fds();
        {
            node_team t(name, r, 2, small(4096, 5000));
            t.barrier();
        }
        const int after = open_fds();
        if (r == 0 && after != before)
            std::fprintf(stderr, "rank 0: %d descriptors before the team, %d after\n", before,
                         after);
        return r != 0 || after == before;
    });
    CHECK(codes == std::vector<int>{0, 0, 0});
}

TEST_CASE("node_team: members give up at their deadline on a name whose holder never accepts") {
    const std::string name = fresh_name();
    // The name's holder (a squatter, or a rank 0 that stopped): a backlog of
    // one connection, never accepted.
    const int l = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(l >= 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    const std::string path = "rdmax-team/" + name;
    std::memcpy(a.sun_path + 1, path.data(), path.size());
    REQUIRE(::bind(l, reinterpret_cast<sockaddr*>(&a),
                   static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + path.size())) == 0);
    REQUIRE(::listen(l, 0) == 0);
    std::vector<pid_t> pids;
    for (int r = 1; r <= 3; ++r)
        pids.push_back(rdmax::test::spawn([&] {
            return throws_errno([&] { node_team t(name, r, 4, small(4096, 1000)); }, ETIMEDOUT) ? 0
                                                                                                : 2;
        }));
    std::vector<int> codes;
    codes.reserve(pids.size());
    for (const pid_t p : pids)
        codes.push_back(reap(p, std::chrono::seconds(8))); // -1: still in connect() at 8 s
    ::close(l);
    CHECK(codes == std::vector<int>{0, 0, 0});
}

TEST_CASE("node_team: an operation that throws leaves the team broken") {
    const std::string name = fresh_name();
    const auto codes = run_ranks(2, [&](int r) {
        node_team t(name, r, 2, small(4096, 500));
        std::vector<float> v(100, 1.0F);
        try {
            allreduce(t, std::span(v), [](float x, float y) -> float {
                if (x > -1)
                    throw std::runtime_error("op");
                return x + y;
            });
        } catch (const std::exception&) {
        }
        if (!t.broken())
            std::fprintf(stderr, "rank %d: not broken, %s\n", r,
                         "its steps now differ from its peer's");
        return t.broken();
    });
    CHECK(codes == std::vector<int>{0, 0});
}

TEST_CASE("node_team: ranks summing floats and ints of one size are told apart") {
    const std::string name = fresh_name();
    const auto codes = run_ranks(2, [&](int r) {
        node_team t(name, r, 2, small(4096, 1000));
        std::vector<float> f(64, 1.0F);
        std::vector<std::int32_t> i(64, 1);
        const bool caught = r == 0 ? throws_errno([&] { allreduce(t, std::span(f)); }, EPROTO)
                                   : throws_errno([&] { allreduce(t, std::span(i)); }, EPROTO);
        if (!caught)
            std::fprintf(stderr, "rank %d: float %g, int %d: mixed silently\n", r, double(f[0]),
                         i[0]);
        return caught;
    });
    CHECK(codes == std::vector<int>{0, 0});
}
