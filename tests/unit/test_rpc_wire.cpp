// The RPC wire format: immediates, ring offers, and the checks every message
// from a peer passes before it is used (no device needed).
#include <array>
#include <cstring>
#include <random>
#include <vector>

#include <rdmax/detail/rpc/wire.hpp>
#include <rdmax/rpc/rpc_counters.hpp>
#include <rdmax/rpc/rpc_options.hpp>

#include "../support/catch.hpp"

using namespace rdmax::rpc;

namespace {

/// A slot's bytes: a header, optional descriptors, a body.
struct message {
    std::vector<std::byte> bytes;
    explicit message(const message_header& h)
        : bytes(sizeof h) {
        std::memcpy(bytes.data(), &h, sizeof h);
    }
    message& add(const buffer_descriptor& d) {
        const std::size_t at = bytes.size();
        bytes.resize(at + sizeof d);
        std::memcpy(bytes.data() + at, &d, sizeof d);
        return *this;
    }
    message& add(const rail_keys& k) {
        const std::size_t at = bytes.size();
        bytes.resize(at + sizeof k);
        std::memcpy(bytes.data() + at, &k, sizeof k);
        return *this;
    }
    message& add(std::size_t n, std::byte fill) {
        bytes.insert(bytes.end(), n, fill);
        return *this;
    }
};

message_header request(std::uint16_t method, std::uint32_t body, std::uint8_t flags = 0) {
    message_header h;
    h.call_seq = 7;
    h.method = method;
    h.flags = flags;
    h.priority = 3;
    h.body_bytes = body;
    return h;
}

} // namespace

TEST_CASE("the immediate carries kind, slot, epoch and length, each in its own bits") {
    for (const message_kind k : {message_kind::request, message_kind::reply})
        for (const std::uint32_t slot : {0U, 1U, 63U, max_slots - 1})
            for (const std::uint32_t bytes : {16U, 64U, 4096U, max_slot_bytes})
                for (const bool epoch : {false, true}) {
                    const imm_fields f = decode_imm(encode_imm(k, slot, bytes, epoch));
                    CHECK(f == imm_fields{k, slot, bytes, epoch});
                }
    // The epoch is one bit of its own: flipping it changes nothing else.
    const std::uint32_t a = encode_imm(message_kind::reply, 5, 100, false);
    const std::uint32_t b = encode_imm(message_kind::reply, 5, 100, true);
    CHECK((a ^ b) == (1U << imm_epoch_shift));
    CHECK(max_slots == 2048);
    // Every 32-bit value decodes to something check_imm can judge.
    std::mt19937 rng(1);
    for (int i = 0; i < 10000; ++i) {
        const imm_fields f = decode_imm(static_cast<std::uint32_t>(rng()));
        CHECK(f.slot < max_slots);
        CHECK(f.bytes < 2 * max_slot_bytes);
    }
}

TEST_CASE("check_imm refuses the wrong kind, a slot past the ring and lengths out of range") {
    const auto req = [](std::uint32_t slot, std::uint32_t bytes) {
        return decode_imm(encode_imm(message_kind::request, slot, bytes));
    };
    CHECK(check_imm(req(0, 24), message_kind::request, 64, 4096) == violation::none);
    CHECK(check_imm(req(63, 4096), message_kind::request, 64, 4096) == violation::none);
    CHECK(check_imm(req(64, 24), message_kind::request, 64, 4096) == violation::bad_slot);
    CHECK(check_imm(req(4095, 24), message_kind::request, 64, 4096) == violation::bad_slot);
    CHECK(check_imm(req(0, 23), message_kind::request, 64, 4096) == violation::bad_length);
    CHECK(check_imm(req(0, 1), message_kind::request, 64, 4096) == violation::bad_length);
    CHECK(check_imm(req(0, 4097), message_kind::request, 64, 4096) == violation::bad_length);
    CHECK(check_imm(req(0, 24), message_kind::reply, 64, 4096) == violation::wrong_kind);
}

TEST_CASE("control messages: no bytes, a known code where the slot goes, no epoch") {
    for (std::uint32_t c = 0; c < control_codes; ++c) {
        const imm_fields f = decode_imm(encode_imm(message_kind::request, c, 0));
        CHECK(is_control(f));
        // Whatever the ring's geometry: a code is not a slot.
        CHECK(check_imm(f, message_kind::request, 1, 64) == violation::none);
        CHECK(check_imm(f, message_kind::reply, 1, 64) == violation::wrong_kind);
    }
    CHECK(check_imm(decode_imm(encode_imm(message_kind::request, control_codes, 0)),
                    message_kind::request, 64, 4096) == violation::malformed);
    CHECK(check_imm(decode_imm(encode_imm(message_kind::reply, 0, 0, true)), message_kind::reply,
                    64, 4096) == violation::malformed);
    CHECK_FALSE(is_control(decode_imm(encode_imm(message_kind::request, 0, 24))));
}

TEST_CASE("ring offers: the magic, the version and the geometry are checked") {
    ring_offer o;
    o.slots = 64;
    o.slot_bytes = 4096;
    o.addr = 0x10000;
    o.rkey = 5;
    o.incarnation = 77;
    CHECK(check_offer(o) == nullptr);
    ring_offer none = o;
    none.incarnation = 0; // every peer names its incarnation
    CHECK(check_offer(none) != nullptr);
    ring_offer bad = o;
    bad.magic = 0;
    CHECK(check_offer(bad) != nullptr);
    bad = o;
    bad.version = 1; // no slot epochs: refused
    CHECK(check_offer(bad) != nullptr);
    bad = o;
    bad.version = protocol_version + 1;
    CHECK(check_offer(bad) != nullptr);
    bad = o;
    bad.slots = max_slots + 1;
    CHECK(check_offer(bad) != nullptr);
    bad = o;
    bad.slots = 0;
    CHECK(check_offer(bad) != nullptr);
    bad = o;
    bad.slot_bytes = 100; // not a multiple of 8
    CHECK(check_offer(bad) != nullptr);
    bad = o;
    bad.slot_bytes = max_slot_bytes * 2;
    CHECK(check_offer(bad) != nullptr);
    bad = o;
    bad.addr = UINT64_MAX - 100; // the ring would wrap
    CHECK(check_offer(bad) != nullptr);
    bad = o;
    bad.addr = 0;
    CHECK(check_offer(bad) != nullptr);
}

TEST_CASE("rail joins: the magic, the version, the rail and the link are checked") {
    rail_join j;
    j.rail = 1;
    j.incarnation = 5;
    j.link_key = 9;
    CHECK(check_join(j) == nullptr);
    rail_join bad = j;
    bad.magic = protocol_magic; // a ring offer's magic
    CHECK(check_join(bad) != nullptr);
    bad = j;
    bad.version = protocol_version + 1;
    CHECK(check_join(bad) != nullptr);
    for (std::uint32_t rail : {0U, max_link_rails}) {
        bad = j;
        bad.rail = static_cast<std::uint16_t>(rail);
        CHECK(check_join(bad) != nullptr);
    }
    bad = j;
    bad.link_key = 0;
    CHECK(check_join(bad) != nullptr);
    bad = j;
    bad.incarnation = 0;
    CHECK(check_join(bad) != nullptr);
}

TEST_CASE("parse_request takes inline bodies, descriptors, and nothing inconsistent") {
    parsed_request pr;
    SECTION("inline body") {
        message m(request(5, 10));
        m.add(10, std::byte{0x5a});
        REQUIRE(parse_request(m.bytes, pr) == violation::none);
        CHECK(pr.header.method == 5);
        CHECK(pr.inline_body.size() == 10);
        CHECK(pr.inline_body[9] == std::byte{0x5a});
        CHECK(!pr.external_body);
        CHECK(!pr.reply_buffer);
    }
    SECTION("the slot's epoch in the flags") {
        message m(request(1, 0, flag_epoch));
        REQUIRE(parse_request(m.bytes, pr) == violation::none);
        CHECK((pr.header.flags & flag_epoch) != 0);
        message keyless(request(1, 0, flag_rail_keys)); // rail keys, but no buffer to key
        CHECK(parse_request(keyless.bytes, pr) == violation::malformed);
    }
    SECTION("empty body") {
        message m(request(1, 0));
        REQUIRE(parse_request(m.bytes, pr) == violation::none);
        CHECK(pr.inline_body.empty());
    }
    SECTION("external body and reply buffer") {
        message m(request(2, 1 << 20, flag_external_body | flag_reply_buffer));
        m.add(buffer_descriptor{0x1000, 9, 1 << 20}).add(buffer_descriptor{0x900000, 10, 65536});
        REQUIRE(parse_request(m.bytes, pr) == violation::none);
        REQUIRE(pr.external_body);
        CHECK(pr.external_body->rkey == 9);
        REQUIRE(pr.reply_buffer);
        CHECK(pr.reply_buffer->length == 65536);
        CHECK(pr.inline_body.empty());
    }
    SECTION("every reply into the buffer: only with a reply buffer") {
        message m(request(2, 0, flag_reply_buffer | flag_reply_in_buffer));
        m.add(buffer_descriptor{0x900000, 10, 64});
        REQUIRE(parse_request(m.bytes, pr) == violation::none);
        CHECK((pr.header.flags & flag_reply_in_buffer) != 0);
        message alone(request(2, 0, flag_reply_in_buffer));
        CHECK(parse_request(alone.bytes, pr) == violation::malformed);
    }
    SECTION("rail keys: after the descriptors, whole, or the request is malformed") {
        const auto keyed = [](std::uint32_t rails, bool body, bool reply) {
            rail_keys k;
            k.rails = rails;
            for (std::uint32_t i = 0; i + 1 < rails && i + 1 < max_link_rails; ++i) {
                k.body[i] = body ? 100 + i : 0;
                k.reply[i] = reply ? 200 + i : 0;
            }
            return k;
        };
        const auto both =
            static_cast<std::uint8_t>(flag_external_body | flag_reply_buffer | flag_rail_keys);
        message m(request(2, 1 << 24, both));
        m.add(buffer_descriptor{0x1000, 9, 1 << 24})
            .add(buffer_descriptor{0x2000000, 10, 1 << 24})
            .add(keyed(2, true, true));
        CHECK(request_bytes(m.bytes.size() >= sizeof(message_header)
                                ? detail::load<message_header>(m.bytes.data())
                                : message_header{}) == m.bytes.size());
        REQUIRE(parse_request(m.bytes, pr) == violation::none);
        REQUIRE(pr.rails);
        CHECK(pr.rails->rails == 2);
        CHECK(pr.rails->body[0] == 100);
        CHECK(pr.rails->reply[0] == 200);
        // Only a reply buffer: the body's keys stay zero.
        message r(request(2, 0, flag_reply_buffer | flag_rail_keys));
        r.add(buffer_descriptor{0x2000000, 10, 1 << 24}).add(keyed(4, false, true));
        REQUIRE(parse_request(r.bytes, pr) == violation::none);
        CHECK(pr.rails->rails == 4);
        // Refused: one rail (nothing to key), more than the link has, a key
        // missing, a key past `rails`, a key for a buffer the call lacks,
        // the reserved word, the keys cut short.
        for (rail_keys bad : {keyed(1, true, true), keyed(5, true, true)}) {
            message b(request(2, 1 << 24, both));
            b.add(buffer_descriptor{0x1000, 9, 1 << 24})
                .add(buffer_descriptor{0x2000000, 10, 1 << 24})
                .add(bad);
            CHECK(parse_request(b.bytes, pr) == violation::malformed);
        }
        rail_keys missing = keyed(3, true, true);
        missing.body[1] = 0;
        rail_keys past = keyed(2, true, true);
        past.reply[2] = 7;
        rail_keys reserved = keyed(2, true, true);
        reserved.reserved = 1;
        for (const rail_keys& bad : {missing, past, reserved}) {
            message b(request(2, 1 << 24, both));
            b.add(buffer_descriptor{0x1000, 9, 1 << 24})
                .add(buffer_descriptor{0x2000000, 10, 1 << 24})
                .add(bad);
            CHECK(parse_request(b.bytes, pr) == violation::malformed);
        }
        message lacks(request(2, 0, flag_reply_buffer | flag_rail_keys));
        lacks.add(buffer_descriptor{0x2000000, 10, 1 << 24}).add(keyed(2, true, true));
        CHECK(parse_request(lacks.bytes, pr) == violation::malformed);
        message cut(request(2, 0, flag_reply_buffer | flag_rail_keys));
        cut.add(buffer_descriptor{0x2000000, 10, 1 << 24}).add(8, std::byte{0});
        CHECK(parse_request(cut.bytes, pr) == violation::malformed);
    }
    SECTION("a length that disagrees with the body") {
        message m(request(5, 11));
        m.add(10, std::byte{1});
        CHECK(parse_request(m.bytes, pr) == violation::malformed);
    }
    SECTION("method 0, unknown flags, a priority past 7, a status in a request") {
        message_header h = request(0, 0);
        CHECK(parse_request(message(h).bytes, pr) == violation::malformed);
        h = request(1, 0, flag_rail_keys); // keys for no buffer
        CHECK(parse_request(message(h).bytes, pr) == violation::malformed);
        h = request(1, 0);
        h.priority = 8;
        CHECK(parse_request(message(h).bytes, pr) == violation::malformed);
        h = request(1, 0);
        h.status = 1;
        CHECK(parse_request(message(h).bytes, pr) == violation::malformed);
    }
    SECTION("a descriptor cut short, or one that wraps, or with inline bytes beside it") {
        message cut(request(2, 100, flag_external_body));
        cut.add(8, std::byte{0});
        CHECK(parse_request(cut.bytes, pr) == violation::malformed);
        message wraps(request(2, 100, flag_external_body));
        wraps.add(buffer_descriptor{UINT64_MAX - 10, 1, 100});
        CHECK(parse_request(wraps.bytes, pr) == violation::malformed);
        message extra(request(2, 100, flag_external_body));
        extra.add(buffer_descriptor{0x1000, 1, 100}).add(4, std::byte{0});
        CHECK(parse_request(extra.bytes, pr) == violation::malformed);
        message mismatch(request(2, 100, flag_external_body));
        mismatch.add(buffer_descriptor{0x1000, 1, 99});
        CHECK(parse_request(mismatch.bytes, pr) == violation::malformed);
        message empty_reply(request(2, 0, flag_reply_buffer));
        empty_reply.add(buffer_descriptor{0x1000, 1, 0});
        CHECK(parse_request(empty_reply.bytes, pr) == violation::malformed);
    }
    SECTION("shorter than a header") {
        std::array<std::byte, 15> b{};
        CHECK(parse_request(b, pr) == violation::bad_length);
    }
}

TEST_CASE("parse_reply: inline, external within what was offered, server statuses only") {
    parsed_reply pr;
    message_header h;
    h.call_seq = 7;
    h.body_bytes = 4;
    message ok(h);
    ok.add(4, std::byte{9});
    REQUIRE(parse_reply(ok.bytes, 0, pr) == violation::none);
    CHECK(pr.inline_body.size() == 4);

    h.flags = flag_external_reply;
    h.body_bytes = 100000;
    CHECK(parse_reply(message(h).bytes, 100000, pr) == violation::none);
    CHECK(parse_reply(message(h).bytes, 99999, pr) == violation::malformed); // over the offer
    CHECK(parse_reply(message(h).bytes, 0, pr) == violation::malformed);     // nothing offered

    // A call that wanted every body in its buffer: an inline one is malformed,
    // an empty one or one in the buffer is not.
    CHECK(parse_reply(ok.bytes, 64, pr, true) == violation::malformed);
    CHECK(parse_reply(message(h).bytes, 100000, pr, true) == violation::none);
    message_header empty;
    CHECK(parse_reply(message(empty).bytes, 64, pr, true) == violation::none);

    h = {};
    h.status = static_cast<std::uint32_t>(call_status::timed_out); // the client's to say
    CHECK(parse_reply(message(h).bytes, 0, pr) == violation::malformed);
    h = {};
    h.method = 3; // replies carry no method
    CHECK(parse_reply(message(h).bytes, 0, pr) == violation::malformed);
}

TEST_CASE("random bytes never pass as a request with a body outside the slot") {
    std::mt19937 rng(7);
    std::vector<std::byte> slot(4096);
    parsed_request pr;
    int passed = 0;
    for (int i = 0; i < 20000; ++i) {
        constexpr std::size_t head = sizeof(message_header);
        const std::size_t n = head + rng() % (slot.size() - head);
        for (std::size_t j = 0; j < n; ++j)
            slot[j] = static_cast<std::byte>(rng());
        // Half the time a plausible header, so that the deeper checks run.
        if (i % 2 == 0) {
            const bool consistent = i % 4 == 0; // a body that matches the length
            message_header h =
                request(static_cast<std::uint16_t>(1 + rng() % 5),
                        consistent ? static_cast<std::uint32_t>(n - head)
                                   : static_cast<std::uint32_t>(rng() % 5000),
                        consistent ? std::uint8_t{0} : static_cast<std::uint8_t>(rng() % 4));
            std::memcpy(slot.data(), &h, sizeof h);
        }
        const std::span<const std::byte> in(slot.data(), n);
        if (parse_request(in, pr) != violation::none)
            continue;
        ++passed;
        CHECK(pr.inline_body.data() >= in.data());
        CHECK(pr.inline_body.data() + pr.inline_body.size() <= in.data() + in.size());
        if (!pr.external_body)
            CHECK(pr.inline_body.size() == pr.header.body_bytes);
    }
    CHECK(passed > 0);
}

TEST_CASE("options: defaults pass, out-of-range values are refused naming the field") {
    rpc_options o;
    CHECK_NOTHROW(o.check("test"));
    o.slot_bytes = 100;
    CHECK_THROWS_WITH(o.check("test"), Catch::Matchers::Contains("slot_bytes"));
    o = {};
    o.slots = 0;
    CHECK_THROWS_WITH(o.check("test"), Catch::Matchers::Contains("slots"));
    setenv("RDMAX_RPC_SLOTS", "9000", 1);
    CHECK_THROWS_WITH(rpc_options{}.with_env(), Catch::Matchers::Contains("RDMAX_RPC_SLOTS"));
    setenv("RDMAX_RPC_SLOTS", "16", 1);
    setenv("RDMAX_RPC_SLOT_BYTES", "1K", 1);
    const rpc_options e = rpc_options{}.with_env();
    CHECK(e.slots == 16);
    CHECK(e.slot_bytes == 1024);
    unsetenv("RDMAX_RPC_SLOTS");
    unsetenv("RDMAX_RPC_SLOT_BYTES");
}

TEST_CASE("counters print") {
    rpc_counters c;
    c.calls = 3;
    c.rejected_slot = 2;
    const std::string s = fmt::format("{}", c);
    CHECK(s.find("calls 3") != std::string::npos);
    CHECK(s.find("rejected 2") != std::string::npos);
    CHECK(s.find("link failures 0 (last: none) last link event none") != std::string::npos);
    // A link that ended: the first error completion and the connection event say why.
    c.count_link_end({IBV_WC_RETRY_EXC_ERR, RDMA_CM_EVENT_DISCONNECTED, 0});
    c.count_link_end({});                               // nothing said: nothing changes
    c.count_link_end({.failure = IBV_WC_WR_FLUSH_ERR}); // a flush is no cause
    const std::string e = fmt::format("{}", c);
    CHECK(e.find("link failures 1 (last: transport retry counter exceeded)") != std::string::npos);
    CHECK(e.find("last link event RDMA_CM_EVENT_DISCONNECTED (0)") != std::string::npos);
    CHECK(fmt::format("{}", call_status::timed_out) == "no reply before the deadline");
}

TEST_CASE("a refusal's reason is formatted in place, cut short when longer",
          "[bookkeeping][last-refusal]") {
    rpc_counters c;
    c.count_refusal_fmt(EBUSY, "node-local connection: {} handshakes of uid {}", 4, 1000);
    CHECK(c.refused == 1);
    CHECK(c.last_refusal.error == EBUSY);
    CHECK(c.last_refusal.what() == "node-local connection: 4 handshakes of uid 1000");
    const std::string longer(400, 'x');
    c.count_refusal_fmt(EPROTO, "{}: {}", std::string_view(longer), 7);
    CHECK(c.refused == 2);
    CHECK(c.last_refusal.what().size() == c.last_refusal.reason.size() - 1);
    CHECK(c.last_refusal.what() == std::string_view(longer).substr(0, 159));
}
