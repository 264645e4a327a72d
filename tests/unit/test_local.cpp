// The node-local building blocks: shared segments, the message ring (also
// between two processes), cross-memory attach, and the mapping cache (with a
// randomized export/revoke/republish test against a plain model).
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include <rdmax/detail/local/export_table.hpp>
#include <rdmax/detail/local/spsc_ring.hpp>
#include <rdmax/local/cma.hpp>
#include <rdmax/local/descriptor_passing.hpp>
#include <rdmax/local/mapping_cache.hpp>
#include <rdmax/local/node_address.hpp>
#include <rdmax/local/shared_segment.hpp>

#include "../support/catch.hpp"
#include "../support/child_process.hpp"
#include "../support/descriptors.hpp"

using namespace rdmax::local;
using rdmax::test::open_fds;
using rdmax::test::reap;
using rdmax::test::send_raw;

namespace {

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
    std::vector<std::byte> v(n);
    for (std::size_t i = 0; i < n; ++i)
        v[i] = static_cast<std::byte>((i * 7 + seed) % 251);
    return v;
}

} // namespace

TEST_CASE("a shared segment's size is sealed; attach can refuse a memfd that is not") {
    // A peer given the descriptor cannot cut the pages under the owner's
    // mapping (its next access would be SIGBUS), nor grow the file.
    shared_segment a = shared_segment::create("sealed", 8192);
    const int seals = fcntl(a.fd(), F_GET_SEALS);
    CHECK((seals & F_SEAL_SHRINK) != 0);
    CHECK((seals & F_SEAL_GROW) != 0);
    CHECK((seals & F_SEAL_SEAL) != 0);
    // As the peer would: its own descriptor of the same file.
    const int theirs = open(fmt::format("/proc/self/fd/{}", a.fd()).c_str(), O_RDWR | O_CLOEXEC);
    REQUIRE(theirs >= 0);
    errno = 0;
    CHECK(ftruncate(theirs, 0) == -1);
    CHECK(errno == EPERM);
    CHECK(ftruncate(theirs, 1 << 20) == -1);
    CHECK(fcntl(theirs, F_ADD_SEALS, F_SEAL_WRITE) == -1); // the seals are sealed too
    close(theirs);
    a.data()[8191] = std::byte{7}; // still mapped whole
    CHECK(shared_segment::attach(a.fd(), a.size(), false, true).data()[8191] == std::byte{7});
    // A memfd its sender may still shrink: refused where seals are required.
    const int loose = memfd_create("loose", MFD_CLOEXEC);
    REQUIRE(loose >= 0);
    REQUIRE(ftruncate(loose, 8192) == 0);
    CHECK_NOTHROW(shared_segment::attach(loose, 8192, true));
    CHECK_THROWS_WITH(shared_segment::attach(loose, 8192, true, true),
                      Catch::Matchers::Contains("not sealed"));
    close(loose);
}

TEST_CASE("a message that ends in a timeout or a reset leaves none of its descriptors open") {
    // A local peer sends 1 byte (a length prefix cut short) and 16
    // descriptors, then goes silent or closes: 200 times, no descriptor kept.
    const int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
    REQUIRE(devnull >= 0);
    std::array<int, 16> sixteen{};
    sixteen.fill(devnull);
    std::array<std::byte, 64> msg{};
    const std::size_t before = open_fds();
    for (int i = 0; i < 100; ++i) {
        auto [mine, theirs] = unix_channel::pair();
        send_raw(theirs.fd(), 1, sixteen);
        std::vector<int> fds;
        CHECK_THROWS_WITH(mine.receive(msg, fds, std::chrono::milliseconds(1)),
                          Catch::Matchers::Contains("deadline"));
        CHECK(fds.empty());
    }
    for (int i = 0; i < 100; ++i) {
        auto [mine, theirs] = unix_channel::pair();
        send_raw(theirs.fd(), 1, sixteen);
        theirs = unix_channel();
        std::vector<int> fds;
        CHECK_THROWS_WITH(mine.receive(msg, fds, std::chrono::seconds(5)),
                          Catch::Matchers::Contains("closed"));
        CHECK(fds.empty());
    }
    CHECK(open_fds() == before);
    // The same, a piece at a time without blocking (a server's handshake).
    {
        auto [mine, theirs] = unix_channel::pair();
        const std::size_t here = open_fds();
        {
            message_reader r(64);
            CHECK(r.read_some(mine.fd()) == message_reader::state::more);
            send_raw(theirs.fd(), 1, sixteen);
            CHECK(r.read_some(mine.fd()) == message_reader::state::more);
            CHECK(open_fds() == here + 16);
        }
        CHECK(open_fds() == here); // dropped unfinished: closed with it
    }
    {
        auto [mine, theirs] = unix_channel::pair();
        const std::size_t here = open_fds();
        message_reader r(64);
        const std::array<std::byte, 5> five{};
        theirs.send(five, std::span(&devnull, 1));
        CHECK(r.read_some(mine.fd()) == message_reader::state::done);
        CHECK(r.message().size() == 5);
        std::vector<int> got = r.take_fds();
        REQUIRE(got.size() == 1);
        close(got[0]);
        // Too long for its room: failed, its descriptor closed at once.
        message_reader small(4);
        theirs.send(five, std::span(&devnull, 1));
        CHECK(small.read_some(mine.fd()) == message_reader::state::failed);
        CHECK(small.error() == EMSGSIZE);
        CHECK(open_fds() == here);
    }
    close(devnull);
}

TEST_CASE("a reader that expects no descriptors installs none a peer sends",
          "[hostile-local][no-fds]") {
    // A node-local peer sends the 36 bytes of a hello (prefix and all) one
    // byte at a time, each with 16 descriptors: a reader that kept them held
    // 576 of the server's descriptors per connection until its deadline.
    const int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
    REQUIRE(devnull >= 0);
    std::array<int, 16> sixteen{};
    sixteen.fill(devnull);
    auto [mine, theirs] = unix_channel::pair();
    const std::size_t here = open_fds();
    std::size_t most = here;
    message_reader r(32, 0);
    message_reader::state st = message_reader::state::more;
    for (int i = 0; i < 36 && st == message_reader::state::more; ++i) {
        send_raw(theirs.fd(), 1, sixteen);
        st = r.read_some(mine.fd());
        most = std::max(most, open_fds());
    }
    CHECK(most == here);
    CHECK(st == message_reader::state::failed);
    CHECK(r.error() == EPROTO);
    // At most `most_fds`: one more fails the message, the ones kept are closed.
    {
        auto [a, b] = unix_channel::pair();
        const std::size_t at = open_fds();
        message_reader two(64, 2);
        const std::array<std::byte, 5> five{};
        b.send(five, std::span(sixteen.data(), 3));
        CHECK(two.read_some(a.fd()) == message_reader::state::failed);
        CHECK(two.error() == EPROTO);
        CHECK(open_fds() == at);
        auto [c, d] = unix_channel::pair(); // a fresh stream: the bad one is half read
        message_reader fine(64, 2);
        d.send(five, std::span(sixteen.data(), 2));
        CHECK(fine.read_some(c.fd()) == message_reader::state::done);
        std::vector<int> got = fine.take_fds();
        CHECK(got.size() == 2);
        for (int fd : got)
            close(fd);
    }
    close(devnull);
}

TEST_CASE("a shared segment maps again from its descriptor, the same bytes") {
    shared_segment a = shared_segment::create("test", 10000);
    CHECK(a.size() >= 10000);
    std::memset(a.data(), 0x5a, a.size());
    shared_segment b = shared_segment::attach(a.fd(), a.size(), false);
    CHECK(b.data() != a.data());
    CHECK(b.data()[9999] == std::byte{0x5a});
    a.data()[5] = std::byte{1};
    CHECK(b.data()[5] == std::byte{1});
    CHECK_THROWS(shared_segment::attach(a.fd(), a.size() * 2, false)); // longer than the file
    CHECK_THROWS(shared_segment::create("zero", 0));
}

TEST_CASE("ring: messages in order, wrap, full, too long, and a corrupt peer detected") {
    std::vector<std::byte> block(spsc_ring::bytes_for(1024));
    spsc_ring::format(block, 1024);
    spsc_ring r(block);
    REQUIRE(r.valid());
    std::array<std::byte, 256> out{};
    std::size_t n = 0;
    CHECK(r.try_pop(out, n) == ring_status::empty);
    CHECK(r.try_push(pattern(r.max_message() + 1, 0)) == ring_status::too_long);
    // Many rounds of odd sizes: every wrap position is crossed.
    for (unsigned i = 0; i < 2000; ++i) {
        const auto m = pattern(1 + (i * 37) % 200, i);
        REQUIRE(r.try_push(m) == ring_status::ok);
        if (i % 3 == 0)
            REQUIRE(r.try_push(m) == ring_status::ok);
        REQUIRE(r.try_pop(out, n) == ring_status::ok);
        REQUIRE(n == m.size());
        REQUIRE(std::memcmp(out.data(), m.data(), n) == 0);
        if (i % 3 == 0) {
            REQUIRE(r.try_pop(out, n) == ring_status::ok);
            REQUIRE(std::memcmp(out.data(), m.data(), n) == 0);
        }
    }
    // Full: pushes stop, nothing is lost.
    int pushed = 0;
    while (r.try_push(pattern(100, 1)) == ring_status::ok)
        ++pushed;
    CHECK(r.try_push(pattern(100, 1)) == ring_status::full);
    CHECK(pushed >= 7);
    std::array<std::byte, 50> small{};
    CHECK(r.try_pop(small, n) == ring_status::too_long); // stays queued
    CHECK(n == 100);
    for (int i = 0; i < pushed; ++i)
        REQUIRE(r.try_pop(out, n) == ring_status::ok);
    CHECK(r.try_pop(out, n) == ring_status::empty);
    // A peer that writes nonsense: a length past the capacity, a tail past the head.
    REQUIRE(r.try_push(pattern(8, 2)) == ring_status::ok);
    auto* h = reinterpret_cast<spsc_ring::header*>(block.data());
    const std::uint64_t head = h->head.load();
    const std::uint32_t huge = 100000;
    std::memcpy(block.data() + sizeof(spsc_ring::header) + (head & 1023), &huge, 4);
    CHECK(r.try_pop(out, n) == ring_status::corrupt);
    h->tail.store(head + 5000);
    CHECK(r.try_pop(out, n) == ring_status::corrupt);
    CHECK(r.try_push(pattern(8, 2)) == ring_status::corrupt);
    // Not a ring at all.
    std::vector<std::byte> junk(4096, std::byte{0x11});
    CHECK_FALSE(spsc_ring(junk).valid());
}

TEST_CASE("ring between two processes: 100 000 messages, each checked") {
    shared_segment seg = shared_segment::create("ring", spsc_ring::bytes_for(1 << 16));
    spsc_ring::format(seg.bytes(), 1 << 16);
    constexpr unsigned count = 100000;
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
        spsc_ring w(seg.bytes());
        for (unsigned i = 0; i < count;) {
            const auto m = pattern(8 + i % 120, i);
            const ring_status s = w.try_push(m);
            if (s == ring_status::ok)
                ++i;
            else if (s != ring_status::full)
                _exit(2);
        }
        _exit(0);
    }
    spsc_ring r(seg.bytes());
    std::array<std::byte, 256> out{};
    unsigned got = 0, wrong = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (got < count && std::chrono::steady_clock::now() < deadline) {
        std::size_t n = 0;
        const ring_status s = r.try_pop(out, n);
        if (s == ring_status::empty)
            continue;
        REQUIRE(s == ring_status::ok);
        const auto want = pattern(8 + got % 120, got);
        if (n != want.size() || std::memcmp(out.data(), want.data(), n) != 0)
            ++wrong;
        ++got;
    }
    CHECK(reap(child) == 0);
    CHECK(got == count);
    CHECK(wrong == 0);
}

TEST_CASE("cross-memory attach: one copy each way with a child; refusals named") {
    auto data = pattern(1 << 20, 9);
    std::vector<std::byte> back(data.size());
    int to_child[2], to_parent[2];
    REQUIRE(pipe(to_child) == 0);
    REQUIRE(pipe(to_parent) == 0);
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
        // The child's copy of `data` is at the same address; it changes it,
        // says so, and waits for the parent's write into `back`.
        for (auto& b : data)
            b = static_cast<std::byte>(static_cast<unsigned>(b) ^ 0xffU);
        char c = 1;
        if (write(to_parent[1], &c, 1) != 1 || read(to_child[0], &c, 1) != 1)
            _exit(2);
        _exit(std::memcmp(back.data(), pattern(back.size(), 4).data(), back.size()) == 0 ? 0 : 3);
    }
    char c = 0;
    REQUIRE(read(to_parent[0], &c, 1) == 1);
    std::vector<std::byte> got(data.size());
    const cma_status r = cma_read(child, reinterpret_cast<std::uint64_t>(data.data()), got);
    if (r == cma_status::not_permitted) {
        INFO(why_not_permitted(child));
        kill(child, SIGKILL);
        reap(child);
        FAIL("CMA refused between a parent and its child");
    }
    REQUIRE(r == cma_status::ok);
    bool flipped = true;
    for (std::size_t i = 0; i < got.size(); ++i)
        flipped =
            flipped && got[i] == static_cast<std::byte>(static_cast<unsigned>(data[i]) ^ 0xffU);
    CHECK(flipped);
    const auto fill = pattern(back.size(), 4);
    CHECK(cma_write(child, reinterpret_cast<std::uint64_t>(back.data()), fill) == cma_status::ok);
    // A range the child does not map.
    std::array<std::byte, 16> tiny{};
    CHECK(cma_read(child, 0x10, tiny) == cma_status::bad_address);
    c = 1;
    REQUIRE(write(to_child[1], &c, 1) == 1);
    CHECK(reap(child) == 0);
    // The child is gone now.
    CHECK(cma_read(child, reinterpret_cast<std::uint64_t>(data.data()), tiny) ==
          cma_status::no_process);
    CHECK_FALSE(why_not_permitted(child).empty());
    for (int fd : {to_child[0], to_child[1], to_parent[0], to_parent[1]})
        close(fd);
}

namespace {

/// The owner's side for the cache tests: segments by (id, generation), each
/// filled with its generation's byte.
struct owner {
    export_table table{64};
    std::map<std::pair<std::uint32_t, std::uint64_t>, shared_segment> segs;
    std::size_t attaches = 0;

    export_notice publish(std::size_t bytes) {
        shared_segment s = shared_segment::create("export", bytes);
        export_notice n = table.publish(s);
        std::memset(s.data(), static_cast<int>(n.generation & 0xff), s.size());
        segs.emplace(std::pair{n.id, n.generation}, std::move(s));
        return n;
    }
    void revoke(const export_notice& n) {
        REQUIRE(table.revoke(n));
        segs.erase({n.id, n.generation}); // the owner lets go of its own mapping too
    }
    mapping_cache::attach_fn attacher() {
        return [this](const export_notice& n) {
            ++attaches;
            return shared_segment::attach(segs.at({n.id, n.generation}).fd(), n.bytes, true);
        };
    }
};

} // namespace

TEST_CASE("mapping cache: mapped once, hits after, revocation refused, limits evict") {
    owner o;
    shared_segment control =
        shared_segment::attach(o.table.control().fd(), o.table.control().size(), false);
    const auto table = export_table::view(control.bytes(), o.table.slots());
    mapping_options opt;
    opt.max_count = 3;
    mapping_cache cache(table, o.attacher(), opt);
    const export_notice a = o.publish(8192);
    std::array<std::byte, 64> out{};
    REQUIRE(cache.copy_out(a, 100, out) == map_status::ok);
    CHECK(out[0] == static_cast<std::byte>(a.generation));
    for (int i = 0; i < 100; ++i)
        REQUIRE(cache.copy_out(a, 0, out) == map_status::ok);
    CHECK(o.attaches == 1);
    CHECK(cache.counters().hits == 100);
    CHECK(cache.counters().misses == 1);
    CHECK(cache.copy_out(a, 8192 - 63, out) == map_status::out_of_range);
    // Written through the mapping, seen by the owner.
    const std::array<std::byte, 4> in{std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
    REQUIRE(cache.copy_in(a, 10, in) == map_status::ok);
    CHECK(o.segs.at({a.id, a.generation}).data()[12] == std::byte{3});
    // Revoked: refused, and the mapping dropped.
    o.revoke(a);
    CHECK(cache.copy_out(a, 0, out) == map_status::revoked);
    CHECK(cache.counters().invalidations == 1);
    CHECK(cache.counters().mapped_count == 0);
    // Republished in the same slot: a new generation, new bytes, never the old mapping.
    const export_notice b = o.publish(8192);
    CHECK(b.id == a.id);
    REQUIRE(cache.copy_out(b, 0, out) == map_status::ok);
    CHECK(out[0] == static_cast<std::byte>(b.generation));
    CHECK(cache.copy_out(a, 0, out) == map_status::revoked); // the old notice stays dead
    // Limits: four exports, three mappings at most.
    std::vector<export_notice> more;
    more.reserve(3);
    for (int i = 0; i < 3; ++i)
        more.push_back(o.publish(4096));
    for (const auto& n : more)
        REQUIRE(cache.copy_out(n, 0, out) == map_status::ok);
    CHECK(cache.counters().mapped_count == 3);
    CHECK(cache.counters().evictions == 1);
    INFO(fmt::format("{}", cache.counters()));
}

TEST_CASE("mapping cache: 100 000 random publishes, revocations and uses, never a stale byte") {
    owner o;
    shared_segment control =
        shared_segment::attach(o.table.control().fd(), o.table.control().size(), false);
    const auto table = export_table::view(control.bytes(), o.table.slots());
    mapping_options opt;
    opt.max_count = 16;
    mapping_cache cache(table, o.attacher(), opt);
    std::mt19937_64 rng(42);
    std::vector<export_notice> live, dead;
    std::array<std::byte, 32> out{};
    std::uint64_t ok = 0, refused = 0, stale = 0;
    for (int op = 0; op < 100000; ++op) {
        const auto k = rng() % 10;
        if (k == 0 && live.size() < 60) {
            live.push_back(o.publish(4096 * (1 + rng() % 4)));
        } else if (k == 1 && !live.empty()) {
            const std::size_t i = rng() % live.size();
            o.revoke(live[i]);
            dead.push_back(live[i]);
            live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        } else if (k < 8 && !live.empty()) {
            const export_notice& n = live[rng() % live.size()];
            const std::uint64_t off = rng() % (n.bytes - out.size());
            if (cache.copy_out(n, off, out) != map_status::ok ||
                out[out.size() - 1] != static_cast<std::byte>(n.generation & 0xff))
                ++stale;
            else
                ++ok;
        } else if (!dead.empty()) {
            const export_notice& n = dead[rng() % dead.size()];
            if (cache.copy_out(n, 0, out) == map_status::revoked)
                ++refused;
            else
                ++stale;
        }
    }
    CHECK(stale == 0);
    CHECK(ok > 10000);
    CHECK(refused > 1000);
    CHECK(cache.counters().mapped_count <= 16);
    INFO(fmt::format("{}", cache.counters()));
}

TEST_CASE("descriptors over a Unix channel: a segment handed to a child, mapped there") {
    shared_segment seg = shared_segment::create("handed", 4096);
    auto [mine, theirs] = unix_channel::pair();
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
        // The child learns of the segment only through the channel.
        std::array<std::byte, 64> msg{};
        std::vector<int> fds;
        try {
            const std::size_t n = theirs.receive(msg, fds, std::chrono::seconds(10));
            if (n != 8 || fds.size() != 1)
                _exit(2);
            std::uint64_t bytes = 0;
            std::memcpy(&bytes, msg.data(), 8);
            shared_segment s = shared_segment::attach(fds[0], bytes, true);
            close(fds[0]);
            std::memset(s.data(), 0x7e, 100);
            const std::byte done{1};
            theirs.send({&done, 1});
        } catch (...) {
            _exit(3);
        }
        _exit(0);
    }
    const std::uint64_t bytes = seg.size();
    const int fd = seg.fd();
    mine.send(std::as_bytes(std::span(&bytes, 1)), std::span(&fd, 1));
    std::array<std::byte, 8> ack{};
    std::vector<int> none;
    REQUIRE(mine.receive(ack, none, std::chrono::seconds(10)) == 1);
    CHECK(none.empty());
    CHECK(seg.data()[99] == std::byte{0x7e});
    // A socketpair's credentials are its creator's, whoever holds the other end.
    CHECK(mine.peer().pid == getpid());
    CHECK(reap(child) == 0);
    // The child is gone: a receive ends at once, not at the deadline.
    CHECK_THROWS(mine.receive(ack, none, std::chrono::seconds(5)));
}

TEST_CASE("a Unix listener by abstract name: reached from this node, silent past its deadline") {
    const std::string name = fmt::format("rdmax-test-{}", getpid());
    unix_listener l(name);
    CHECK(l.accept(std::chrono::milliseconds(10)).fd() < 0); // nobody yet
    unix_channel c = unix_channel::connect(name);
    unix_channel s = l.accept(std::chrono::seconds(5));
    REQUIRE(s.fd() >= 0);
    CHECK(s.peer().pid == getpid());
    const std::array<std::byte, 3> hi{std::byte{1}, std::byte{2}, std::byte{3}};
    c.send(hi);
    std::array<std::byte, 8> got{};
    std::vector<int> fds;
    CHECK(s.receive(got, fds, std::chrono::seconds(5)) == 3);
    CHECK(got[2] == std::byte{3});
    CHECK_THROWS(s.receive(got, fds, std::chrono::milliseconds(50))); // nothing more: deadline
    CHECK_THROWS(unix_channel::connect("rdmax-nobody-listens-here"));
}

TEST_CASE("node addresses: this node's are, another's and nonsense are not") {
    CHECK(is_node_address("127.0.0.1"));
    CHECK(is_node_address("127.0.0.2"));          // all of 127/8 is the loopback's
    CHECK_FALSE(is_node_address("203.0.113.77")); // TEST-NET-3 (the VM uses TEST-NET-1)
    CHECK_FALSE(is_node_address(""));
    CHECK_FALSE(is_node_address("300.1.1.1"));
}
