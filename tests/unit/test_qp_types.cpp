// What the compiler refuses: operations on buffers whose access rights do not
// allow them. Checked with concepts, so a refusal is a test result here
// rather than a broken build.
#include <rdmax/mem/buffer.hpp>
#include <rdmax/verbs/domain_per_device.hpp>
#include <rdmax/verbs/listener.hpp>
#include <rdmax/verbs/queue_pair.hpp>

#include "../support/catch.hpp"

using namespace rdmax;
using qp = verbs::queue_pair<verbs::rc>;

template <rdmax::rights A>
using local = local_buffer<A>;
template <rdmax::rights A>
using remote = remote_buffer<A>;

constexpr rdmax::rights lw = rights::local_write;
constexpr rdmax::rights rw = rights::local_write | rights::remote_write;
constexpr rdmax::rights rr = rights::remote_read;
constexpr rdmax::rights ra = rights::local_write | rights::remote_atomic;

template <class L, class R>
concept can_write = requires(qp& q, L l, R r) { q.write(l, r, 0, 0); };
template <class L, class R>
concept can_read = requires(qp& q, L l, R r) { q.read(l, r, 0, 0); };
template <class L, class R>
concept can_faa = requires(qp& q, L l, R r) { q.fetch_add(l, r, 0, 1, 0); };
template <class L>
concept can_recv = requires(qp& q, L l) { q.post_recv(l, 0); };

// RDMA write needs remote write on the target; any local buffer may be the source.
static_assert(can_write<local<rights::local_read>, remote<rw>>);
static_assert(!can_write<local<lw>, remote<rr>>);
static_assert(!can_write<local<lw>, remote<ra>>);
// RDMA read needs remote read there and local write here.
static_assert(can_read<local<lw>, remote<rr>>);
static_assert(!can_read<local<rights::remote_read>, remote<rr>>);
static_assert(!can_read<local<lw>, remote<rw>>);
// Atomics need remote atomic there and a writable 8-byte result here.
static_assert(can_faa<local<lw>, remote<ra>>);
static_assert(!can_faa<local<lw>, remote<rw>>);
// Receives land in locally writable memory only.
static_assert(can_recv<local<lw>>);
static_assert(!can_recv<local<rights::remote_read>>);

// Rights can be narrowed implicitly, never widened.
static_assert(std::is_convertible_v<remote<rw | rights::remote_read>, remote<rr>>);
static_assert(!std::is_convertible_v<remote<rr>, remote<rw>>);
static_assert(std::is_convertible_v<local<rw>, local<lw>>);
static_assert(!std::is_convertible_v<local<lw>, local<rw>>);

// A wildcard listener's accept takes a chooser of the request's device's
// protection domain that returns a reference to one that lives on; one that
// returns a domain by value (gone before the connection) is refused.
using verbs::context;
using verbs::domain_chooser;
using verbs::protection_domain;
static_assert(domain_chooser<verbs::domain_per_device>);
static_assert(domain_chooser<const protection_domain& (*)(const context&)>);
static_assert(domain_chooser<protection_domain& (*)(const context&)>);
static_assert(!domain_chooser<protection_domain (*)(const context&)>);
static_assert(!domain_chooser<const protection_domain& (*)(int)>);
static_assert(!domain_chooser<protection_domain>);
static_assert(!std::is_copy_constructible_v<verbs::connection_request>);
static_assert(std::is_nothrow_move_constructible_v<verbs::connection_request>);

TEST_CASE("buffer sub-ranges are bounds-checked") {
    std::byte bytes[64];
    const local<lw> l{bytes, 64, 7};
    CHECK(l.sub(0, 64).has_value());
    CHECK(l.sub(60, 4)->addr == bytes + 60);
    CHECK(!l.sub(60, 5).has_value());
    CHECK(!l.sub(65, 0).has_value());
    CHECK(l.sub(64, 0).has_value());

    const remote<rr> r{0x1000, 4096, 9};
    CHECK(r.contains(0, 4096));
    CHECK(!r.contains(1, 4096));
    CHECK(!r.contains(~0ull, 2)); // no wrap-around
    CHECK(r.sub(4000, 96)->addr == 0x1000 + 4000);
    CHECK(r.sub(4000, 96)->rkey == 9);
    CHECK(!r.sub(4000, 97).has_value());
}

TEST_CASE("a remote token is plain bytes") {
    const remote<rr> r{0xabcdef, 123, 0x55};
    std::byte wire[sizeof r];
    std::memcpy(wire, &r, sizeof r);
    remote<rr> back;
    std::memcpy(&back, wire, sizeof back);
    CHECK(back.addr == r.addr);
    CHECK(back.length == r.length);
    CHECK(back.rkey == r.rkey);
}

TEST_CASE("every status has a message") {
    for (int i = 0; i <= static_cast<int>(status::unknown_epoch); ++i)
        CHECK(to_string(static_cast<status>(i)) != "unknown status");
}
