// Every RC operation moves the right bytes: checked at the destination, not
// only by its completion.
#include <chrono>
#include <cstring>
#include <vector>

#include "../support/loopback.hpp"

using namespace rdmax;
using namespace rdmax::test;

TEST_CASE("RDMA write lands at the remote offset, and only there") {
    loopback lp;
    registered src(lp.pd, 4096), dst(lp.pd, 8192, std::byte{0xee});
    fill_pattern(src.bytes, 7);
    REQUIRE(lp.a.write(src.mr.local(), dst.mr.remote(), 1000, 42) == status::ok);
    const auto c = wait_send(lp.a);
    CHECK(c.ok());
    CHECK(c.wr_id == 42);
    CHECK(has_pattern(std::span(dst.bytes).subspan(1000, 4096), 7));
    CHECK(dst.bytes[999] == std::byte{0xee});
    CHECK(dst.bytes[5096] == std::byte{0xee});
}

TEST_CASE("RDMA read brings the remote bytes") {
    loopback lp;
    registered remote(lp.pd, 65536), local(lp.pd, 65536);
    fill_pattern(remote.bytes, 3);
    REQUIRE(lp.a.read(local.mr.local(0, 32768), remote.mr.remote(), 32768, 7) == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(std::span(local.bytes).first(32768), 3 + 32768));
}

TEST_CASE("write with immediate: bytes and immediate arrive with a receive completion") {
    loopback lp;
    registered src(lp.pd, 256), dst(lp.pd, 256), rbuf(lp.pd, 64);
    fill_pattern(src.bytes, 11);
    REQUIRE(lp.b.post_recv(rbuf.mr.local(), 900) == status::ok);
    REQUIRE(lp.a.write_imm(src.mr.local(), dst.mr.remote(), 0, 0xdeadbeef, 1) == status::ok);
    CHECK(wait_send(lp.a).ok());
    const auto r = wait_recv(lp.b);
    CHECK(r.ok());
    CHECK(r.wr_id == 900);
    CHECK(r.has_imm);
    CHECK(r.imm == 0xdeadbeef);
    CHECK(r.opcode == IBV_WC_RECV_RDMA_WITH_IMM);
    CHECK(has_pattern(dst.bytes, 11));
}

TEST_CASE("a zero-length write with immediate is a notification") {
    loopback lp;
    registered src(lp.pd, 64), dst(lp.pd, 64), rbuf(lp.pd, 64);
    REQUIRE(lp.b.post_recv(rbuf.mr.local(), 1) == status::ok);
    REQUIRE(lp.a.write_imm(src.mr.local(0, 0), dst.mr.remote(), 0, 5, 2) == status::ok);
    CHECK(wait_send(lp.a).ok());
    const auto r = wait_recv(lp.b);
    CHECK(r.imm == 5);
    CHECK(r.byte_len == 0);
}

TEST_CASE("send and receive, with and without immediate") {
    loopback lp;
    registered src(lp.pd, 1024), rbuf(lp.pd, 4096);
    fill_pattern(src.bytes, 21);
    REQUIRE(lp.b.post_recv(rbuf.mr.local(), 10) == status::ok);
    REQUIRE(lp.b.post_recv(rbuf.mr.local(2048, 2048), 11) == status::ok);
    REQUIRE(lp.a.send(src.mr.local(0, 700), 1) == status::ok);
    REQUIRE(lp.a.send_imm(src.mr.local(), 77, 2) == status::ok);
    CHECK(wait_send(lp.a).wr_id == 1);
    CHECK(wait_send(lp.a).wr_id == 2);
    const auto r1 = wait_recv(lp.b);
    CHECK(r1.wr_id == 10);
    CHECK(r1.byte_len == 700);
    CHECK(!r1.has_imm);
    CHECK(has_pattern(std::span(rbuf.bytes).first(700), 21));
    const auto r2 = wait_recv(lp.b);
    CHECK(r2.wr_id == 11);
    CHECK(r2.byte_len == 1024);
    CHECK(r2.imm == 77);
    CHECK(has_pattern(std::span(rbuf.bytes).subspan(2048, 1024), 21));
}

TEST_CASE("receives from a shared receive queue") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    verbs::shared_receive_queue srq(pd, 64);
    verbs::completion_queue rcq(ctx, 64);
    verbs::qp_config with_srq;
    with_srq.srq = &srq;
    with_srq.recv_cq = &rcq;
    verbs::queue_pair<verbs::rc> sender(pd), receiver(pd, with_srq);
    verbs::connect_pair(sender, receiver);
    registered src(pd, 512), rbuf(pd, 2048);
    fill_pattern(src.bytes, 5);
    REQUIRE(srq.post_recv(rbuf.mr.local(0, 1024), 100) == status::ok);
    REQUIRE(srq.post_recv(rbuf.mr.local(1024, 1024), 101) == status::ok);
    CHECK(receiver.post_recv(rbuf.mr.local(), 1) == status::post_failed); // it has no receive queue
    REQUIRE(sender.send(src.mr.local(), 1) == status::ok);
    CHECK(wait_send(sender).ok());
    const auto r = wait_recv(receiver);
    CHECK(r.wr_id == 100);
    CHECK(r.byte_len == 512);
    CHECK(has_pattern(std::span(rbuf.bytes).first(512), 5));
}

TEST_CASE("atomics return the old value and change the remote word") {
    loopback lp;
    registered counter(lp.pd, 64), result(lp.pd, 64);
    std::uint64_t start = 40;
    std::memcpy(counter.bytes.data() + 8, &start, 8);
    const auto target = counter.mr.remote();
    const auto out = result.mr.local(0, 8);

    REQUIRE(lp.a.fetch_add(out, target, 8, 2, 1) == status::ok);
    CHECK(wait_send(lp.a).ok());
    std::uint64_t old = 0, now = 0;
    std::memcpy(&old, result.bytes.data(), 8);
    std::memcpy(&now, counter.bytes.data() + 8, 8);
    CHECK(old == 40);
    CHECK(now == 42);

    REQUIRE(lp.a.compare_swap(out, target, 8, 42, 1000, 2) == status::ok); // matches: swaps
    CHECK(wait_send(lp.a).ok());
    std::memcpy(&old, result.bytes.data(), 8);
    std::memcpy(&now, counter.bytes.data() + 8, 8);
    CHECK(old == 42);
    CHECK(now == 1000);

    REQUIRE(lp.a.compare_swap(out, target, 8, 1, 5, 3) == status::ok); // no match: unchanged
    CHECK(wait_send(lp.a).ok());
    std::memcpy(&old, result.bytes.data(), 8);
    std::memcpy(&now, counter.bytes.data() + 8, 8);
    CHECK(old == 1000);
    CHECK(now == 1000);
}

TEST_CASE("scatter/gather: three local pieces land contiguously, and read scatters back") {
    loopback lp;
    registered src(lp.pd, 3000), dst(lp.pd, 4096), back(lp.pd, 3000);
    fill_pattern(src.bytes, 9);
    const local_buffer<all_rights> pieces[] = {src.mr.local(0, 1000), src.mr.local(1000, 1000),
                                               src.mr.local(2000, 1000)};
    auto b = lp.a.batch();
    REQUIRE(b.write(std::span<const local_buffer<all_rights>>(pieces), dst.mr.remote(), 96, 1) ==
            status::ok);
    REQUIRE(b.post() == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(std::span(dst.bytes).subspan(96, 3000), 9));

    const local_buffer<all_rights> into[] = {back.mr.local(2000, 1000), back.mr.local(0, 2000)};
    auto r = lp.a.batch();
    REQUIRE(r.read(std::span<const local_buffer<all_rights>>(into), dst.mr.remote(), 96, 2) ==
            status::ok);
    REQUIRE(r.post() == status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(std::span(back.bytes).subspan(2000, 1000), 9));
    CHECK(has_pattern(std::span(back.bytes).first(2000), 9 + 1000));
}

TEST_CASE("a chain of writes goes out with one post; only the signaled ones complete") {
    loopback lp;
    registered src(lp.pd, 64 * 32), dst(lp.pd, 64 * 32);
    fill_pattern(src.bytes, 1);
    auto b = lp.a.batch();
    for (unsigned i = 0; i < 16; ++i) {
        verbs::send_flags f;
        f.signaled = (i == 15);
        REQUIRE(b.write(src.mr.local(i * 64, 64), dst.mr.remote(), i * 64, i, f) == status::ok);
    }
    CHECK(b.size() == 16);
    REQUIRE(b.post() == status::ok);
    const auto c = wait_send(lp.a);
    CHECK(c.wr_id == 15);
    verbs::completion more[4];
    CHECK(lp.a.poll_send(more) == 0);
    CHECK(has_pattern(std::span(dst.bytes).first(16 * 64), 1));
}

TEST_CASE("selective signaling never overflows the send queue") {
    verbs::qp_config cfg;
    cfg.send_depth = 16;
    cfg.max_batch = 8;
    loopback lp(cfg);
    registered src(lp.pd, 64), dst(lp.pd, 64 * 1000);
    fill_pattern(src.bytes, 2);
    verbs::send_flags quiet;
    quiet.signaled = false;
    unsigned posted = 0, full = 0;
    verbs::completion c[8];
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (posted < 1000 && std::chrono::steady_clock::now() < deadline) {
        const status s = lp.a.write(src.mr.local(), dst.mr.remote(), posted * 64, posted, quiet);
        if (s == status::ok) {
            ++posted;
        } else {
            REQUIRE(s == status::queue_full);
            ++full;
            REQUIRE(lp.a.poll_send(c) >= 0); // none are the caller's; this frees slots
        }
    }
    REQUIRE(posted == 1000);
    CHECK(full > 0); // the queue did fill, and was refused rather than overrun
    REQUIRE(lp.a.write(src.mr.local(), dst.mr.remote(), 0, 5000) == status::ok);
    CHECK(wait_send(lp.a).wr_id == 5000);
    for (unsigned i = 0; i < 1000; i += 97)
        CHECK(has_pattern(std::span(dst.bytes).subspan(i * 64, 64), 2));
}

TEST_CASE("wait_send_slots frees slots and keeps every completion for poll_send, once, in order") {
    verbs::qp_config cfg;
    cfg.send_depth = 16;
    cfg.max_batch = 8;
    loopback lp(cfg);
    const std::uint32_t depth = lp.a.send_depth();
    const std::uint32_t total = 4 * depth;
    registered src(lp.pd, 64 * std::size_t{total}), dst(lp.pd, 64 * std::size_t{total});
    fill_pattern(src.bytes, 9);
    std::uint32_t posted = 0;
    // Signaled writes, each to its own 64 bytes, wr_id = their order.
    auto post = [&] {
        return lp.a.write(src.mr.local(posted * 64, 64), dst.mr.remote(), posted * 64, posted);
    };

    CHECK(lp.a.wait_send_slots(depth + 1, 0us) == status::out_of_range);
    CHECK(lp.a.wait_send_slots(depth, 0us) == status::ok); // nothing in flight

    // Fill the queue until it refuses.
    status s = status::ok;
    while ((s = post()) == status::ok)
        ++posted;
    REQUIRE(s == status::queue_full);
    REQUIRE(posted == depth);
    CHECK(lp.a.send_slots_free() == 0);
    REQUIRE(lp.a.wait_send_slots(depth / 2, 5s) == status::ok);
    CHECK(lp.a.send_slots_free() >= depth / 2);

    // Go on posting into freed slots, waiting whenever the queue is full and
    // never polling, until the keep (a queue's worth) is full of completions
    // not yet taken: then the wait says so at once, and polling makes room.
    std::vector<std::uint64_t> seen;
    verbs::completion c[8];
    auto take = [&](int n) {
        for (int i = 0; i < n; ++i) {
            CHECK(c[i].ok());
            seen.push_back(c[i].wr_id);
        }
    };
    unsigned keep_full = 0;
    while (posted < total) {
        s = post();
        if (s == status::ok) {
            ++posted;
            continue;
        }
        REQUIRE(s == status::queue_full);
        const auto t0 = std::chrono::steady_clock::now();
        s = lp.a.wait_send_slots(1, 5s);
        if (s == status::ok)
            continue;
        REQUIRE(s == status::queue_full);
        CHECK(std::chrono::steady_clock::now() - t0 < 1s); // not the deadline: the keep
        ++keep_full;
        const int n = lp.a.poll_send(c);
        REQUIRE(n > 0);
        take(n);
    }
    CHECK(keep_full > 0);

    // The rest, waited for; then nothing more.
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (seen.size() < total && std::chrono::steady_clock::now() < deadline) {
        const int n = lp.a.wait_send(c, 1s);
        REQUIRE(n >= 0);
        take(n);
    }
    REQUIRE(seen.size() == total);
    for (std::uint32_t i = 0; i < total; ++i)
        CHECK(seen[i] == i);
    CHECK(lp.a.poll_send(c) == 0);
    CHECK(lp.a.send_slots_free() == depth);
    CHECK(has_pattern(dst.bytes, 9));
}

TEST_CASE("wait_send_slots: only the caller's completions are kept; a failure ends the wait") {
    verbs::qp_config cfg;
    cfg.send_depth = 16;
    cfg.max_batch = 8;
    loopback lp(cfg);
    const std::uint32_t depth = lp.a.send_depth();
    registered src(lp.pd, 64 * std::size_t{depth}), dst(lp.pd, 64 * std::size_t{depth});
    fill_pattern(src.bytes, 12);
    verbs::send_flags quiet;
    quiet.signaled = false;
    // Mostly unsignaled: the library signals some for its own accounting,
    // and their completions are not the caller's. The last is signaled: an
    // unsignaled tail holds its slots until a later signaled request completes.
    auto signaled = [&](std::uint32_t i) { return i % 5 == 4 || i == depth - 1; };
    std::vector<std::uint64_t> asked;
    for (std::uint32_t i = 0; i < depth; ++i) {
        const verbs::send_flags f = signaled(i) ? verbs::send_flags{} : quiet;
        if (signaled(i))
            asked.push_back(i);
        REQUIRE(lp.a.write(src.mr.local(i * 64, 64), dst.mr.remote(), i * 64, i, f) == status::ok);
    }
    REQUIRE(lp.a.wait_send_slots(depth, 5s) == status::ok);
    CHECK(lp.a.send_slots_free() == depth);
    verbs::completion c[32];
    const int n = lp.a.poll_send(c);
    REQUIRE(n == static_cast<int>(asked.size()));
    for (std::size_t i = 0; i < asked.size(); ++i) {
        CHECK(c[i].ok());
        CHECK(c[i].wr_id == asked[i]);
    }
    CHECK(lp.a.poll_send(c) == 0);
    CHECK(has_pattern(dst.bytes, 12));

    // A write with a bad key fails; the wait keeps the failure and says so.
    remote_buffer<all_rights> bad = dst.mr.remote();
    bad.rkey ^= 0x5a5a00;
    REQUIRE(lp.a.write(src.mr.local(0, 64), bad, 0, 77, quiet) == status::ok);
    CHECK(lp.a.wait_send_slots(depth, 5s) == status::qp_failed);
    CHECK(lp.a.wait_send_slots(1, 0us) == status::qp_failed); // until the caller takes it
    REQUIRE(lp.a.poll_send(c) == 1);
    CHECK(c[0].wr_id == 77);
    CHECK(c[0].status == IBV_WC_REM_ACCESS_ERR);
}

TEST_CASE("small writes go inline; forcing inline past the limit is refused") {
    loopback lp;
    REQUIRE(lp.a.max_inline() > 0);
    registered src(lp.pd, 8192), dst(lp.pd, 8192);
    fill_pattern(src.bytes, 4);
    verbs::send_flags inl;
    inl.force_inline = true;
    REQUIRE(lp.a.write(src.mr.local(0, lp.a.max_inline()), dst.mr.remote(), 0, 1, inl) ==
            status::ok);
    CHECK(wait_send(lp.a).ok());
    CHECK(has_pattern(std::span(dst.bytes).first(lp.a.max_inline()), 4));
    CHECK(lp.a.write(src.mr.local(0, lp.a.max_inline() + 1), dst.mr.remote(), 0, 2, inl) ==
          status::inline_too_large);
}

TEST_CASE("a wrong rkey and an access outside the remote region fail with the status name") {
    loopback lp;
    registered src(lp.pd, 4096), dst(lp.pd, 4096);

    remote_buffer<all_rights> bad_key = dst.mr.remote();
    bad_key.rkey ^= 0x5a5a00;
    REQUIRE(lp.a.write(src.mr.local(0, 64), bad_key, 0, 1) == status::ok);
    const auto c = wait_send(lp.a);
    CHECK(!c.ok());
    CHECK(c.wr_id == 1);
    CHECK(c.status == IBV_WC_REM_ACCESS_ERR);
    CHECK(c.status_name() == "remote access error");

    loopback lp2;
    registered src2(lp2.pd, 4096), dst2(lp2.pd, 4096);
    // A token that claims more than was registered: the check here passes, the
    // responder refuses.
    remote_buffer<all_rights> too_long = dst2.mr.remote();
    too_long.length = 1 << 20;
    REQUIRE(lp2.a.write(src2.mr.local(), too_long, 8192, 2) == status::ok);
    const auto c2 = wait_send(lp2.a);
    CHECK(c2.status == IBV_WC_REM_ACCESS_ERR);
    CHECK(std::string(c2.status_name()).find("remote access") != std::string::npos);
}

TEST_CASE("after an error completion the queue pair refuses every post: qp_failed, nothing "
          "posted") {
    loopback lp;
    registered src(lp.pd, 4096), dst(lp.pd, 4096), res(lp.pd, 64);
    remote_buffer<all_rights> bad_key = dst.mr.remote();
    bad_key.rkey ^= 0x5a5a00;
    REQUIRE(lp.a.write(src.mr.local(0, 64), bad_key, 0, 1) == status::ok);
    const auto c = wait_send(lp.a);
    REQUIRE(c.status == IBV_WC_REM_ACCESS_ERR);
    CHECK(lp.a.failed());
    const std::uint32_t free_before = lp.a.send_slots_free();
    // Every kind of post, and a chain: refused up front, not taken and flushed.
    CHECK(lp.a.write(src.mr.local(0, 64), dst.mr.remote(), 0, 2) == status::qp_failed);
    CHECK(lp.a.read(src.mr.local(0, 64), dst.mr.remote(), 0, 3) == status::qp_failed);
    CHECK(lp.a.send(src.mr.local(0, 64), 4) == status::qp_failed);
    CHECK(lp.a.write_imm(src.mr.local(0, 64), dst.mr.remote(), 0, 9, 5) == status::qp_failed);
    CHECK(lp.a.fetch_add(res.mr.local(0, 8), dst.mr.remote(), 0, 1, 6) == status::qp_failed);
    CHECK(lp.a.local_invalidate(0x1234, 7) == status::qp_failed);
    {
        verbs::send_batch b = lp.a.batch();
        CHECK(b.write(src.mr.local(0, 64), dst.mr.remote(), 0, 8) == status::qp_failed);
        CHECK(b.size() == 0);
    }
    CHECK(lp.a.send_slots_free() == free_before);
    verbs::completion more[4];
    CHECK(lp.a.wait_send(more, std::chrono::milliseconds(200)) == 0); // nothing was posted
    CHECK(to_string(status::qp_failed).find("error state") != std::string_view::npos);
}

TEST_CASE("bad requests are refused before anything is posted") {
    loopback lp;
    registered src(lp.pd, 4096), dst(lp.pd, 4096), res(lp.pd, 64);
    const auto remote = dst.mr.remote();
    const auto slots = lp.a.send_slots_free();

    CHECK(lp.a.write(src.mr.local(0, 0), remote, 0, 1) == status::zero_length);
    CHECK(lp.a.read(src.mr.local(0, 0), remote, 0, 1) == status::zero_length);
    CHECK(lp.a.send(src.mr.local(0, 0), 1) == status::zero_length);
    CHECK(lp.a.write(src.mr.local(0, 100), remote, 4000, 1) == status::out_of_range);
    CHECK(lp.a.write(src.mr.local(0, 1), remote, 4096, 1) == status::out_of_range);
    CHECK(lp.a.read(src.mr.local(0, 64), remote, ~0ull - 10, 1) == status::out_of_range);
    CHECK(lp.a.fetch_add(res.mr.local(0, 8), remote, 4, 1, 1) == status::misaligned_atomic);
    CHECK(lp.a.fetch_add(res.mr.local(0, 4), remote, 8, 1, 1) == status::misaligned_atomic);
    CHECK(lp.a.compare_swap(res.mr.local(0, 8), remote, 4096, 0, 1, 1) == status::out_of_range);

    std::vector<local_buffer<all_rights>> many(lp.a.max_send_sge() + 1, src.mr.local(0, 8));
    CHECK(lp.a.batch().write(std::span<const local_buffer<all_rights>>(many), remote, 0, 1) ==
          status::too_many_sge);
    verbs::send_flags inl;
    inl.force_inline = true;
    CHECK(lp.a.write(src.mr.local(0, lp.a.max_inline() + 1), remote, 0, 1, inl) ==
          status::inline_too_large);

    verbs::queue_pair<verbs::rc> lonely(lp.pd);
    CHECK(lonely.write(src.mr.local(0, 8), remote, 0, 1) == status::not_connected);
    CHECK(lonely.post_recv(src.mr.local(), 1) == status::not_connected);

    // Longer than the port's largest message: refused before anything is read.
    if (lp.a.max_message() < UINT32_MAX) {
        const local_buffer<all_rights> huge{src.bytes.data(), lp.a.max_message() + 1,
                                            src.mr.lkey()};
        remote_buffer<all_rights> wide = remote;
        wide.length = ~0ull;
        CHECK(lp.a.write(huge, wide, 0, 1) == status::too_long);
        CHECK(lp.a.send(huge, 1) == status::too_long);
    }

    CHECK(lp.a.send_slots_free() == slots); // nothing refused took a slot
    verbs::completion c[4];
    CHECK(lp.a.poll_send(c) == 0); // and nothing was posted
    CHECK(to_string(status::out_of_range) == "range outside the buffer");
}

TEST_CASE("queue sizes beyond the device's limits are refused with the limit named") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    verbs::qp_config cfg;
    cfg.send_depth = ctx.limits().max_qp_wr + 1;
    CHECK_THROWS_WITH(verbs::queue_pair<verbs::rc>(pd, cfg),
                      Catch::Matchers::Contains("send_depth") &&
                          Catch::Matchers::Contains("allows"));
    verbs::qp_config sge;
    sge.max_send_sge = ctx.limits().max_sge + 1;
    CHECK_THROWS_WITH(verbs::queue_pair<verbs::rc>(pd, sge),
                      Catch::Matchers::Contains("max_send_sge"));
}

TEST_CASE("UD: a datagram arrives behind its 40-byte global route header") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    verbs::queue_pair<verbs::ud> a(pd), b(pd);
    registered src(pd, 512), rbuf(pd, verbs::ud_grh_bytes + 1024);
    fill_pattern(src.bytes, 13);
    REQUIRE(b.post_recv(rbuf.mr.local(), 1) == status::ok);
    const verbs::qp_endpoint eb = b.endpoint();
    verbs::address_handle to_b(pd, eb, 1, a.endpoint().gid_index);
    REQUIRE(a.send_to(src.mr.local(), to_b, 3) == status::ok);
    CHECK(wait_send(a).ok());
    const auto r = wait_recv(b);
    CHECK(r.ok());
    CHECK(r.byte_len == verbs::ud_grh_bytes + 512);
    CHECK(r.src_qp == a.qp_num());
    CHECK(has_pattern(std::span(rbuf.bytes).subspan(verbs::ud_grh_bytes, 512), 13));
}

TEST_CASE("completion queue in event mode: wait sleeps until the completion, or the deadline") {
    verbs::context ctx = open_test_device();
    verbs::protection_domain pd(ctx);
    verbs::completion_channel ch(ctx);
    verbs::completion_queue rcq(ctx, 16, &ch);
    verbs::qp_config cfg;
    cfg.recv_cq = &rcq;
    verbs::queue_pair<verbs::rc> a(pd), b(pd, cfg);
    verbs::connect_pair(a, b);
    registered src(pd, 64), rbuf(pd, 64);
    REQUIRE(b.post_recv(rbuf.mr.local(), 9) == status::ok);
    ibv_wc wc[2];
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(rcq.wait(wc, 200ms) == 0); // nothing sent: the deadline passes
    CHECK(std::chrono::steady_clock::now() - t0 >= 150ms);
    REQUIRE(a.send(src.mr.local(), 1) == status::ok);
    REQUIRE(rcq.wait(wc, 5s) == 1);
    CHECK(wc[0].wr_id == 9);
    CHECK(wc[0].status == IBV_WC_SUCCESS);
}
