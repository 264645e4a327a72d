// tcp_link: the RPC connection's operations as frames on one TCP socket
// (the format and its rules: tcp_link.hpp).

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <rdmax/detail/rpc/tcp_link.hpp>
#include <rdmax/error.hpp>

namespace rdmax::rpc::detail {

namespace {
/// The read buffer: slots' messages and frame headers come through it;
/// payloads of this much or more go straight to their destination.
constexpr std::size_t read_buffer_bytes = 64 * 1024;
constexpr std::uint32_t direct_bytes = 16 * 1024;
/// Bytes taken from the socket per poll at most (the endpoint's other links wait).
constexpr std::size_t poll_budget = 1024 * 1024;

constexpr std::uint32_t key_slot_bits = 11; // max_slots
static_assert((1U << key_slot_bits) == max_slots);

template <class T>
T load_at(const std::byte* p) noexcept {
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
} // namespace

tcp_link::tcp_link(int fd, bool server, std::uint16_t slots, std::uint32_t slot_bytes)
    : link(slots, slot_bytes, transport::tcp)
    , fd_(fd)
    , server_(server) {
    try {
        in_.resize(std::size_t{slots} * slot_bytes);
        out_.resize(std::size_t{slots} * slot_bytes);
        rbuf_.resize(read_buffer_bytes);
        spill_.resize(std::max<std::size_t>(chunk_bytes, slot_bytes));
        // Every frame either side can have queued at once: a message per
        // slot and controls, a body read and a reply write per block (3 x
        // slots + 8 blocks, as the server keeps), a read answer per granted
        // body, an abandon per slot.
        pool_.resize(std::size_t{slots} * 8 + 64);
        reads_.resize(std::size_t{slots} * 3 + 8);
        grants_.resize(slots);
        events_.reserve(pool_.size() + 256);
    } catch (...) {
        fd_ = -1; // still the caller's: it closes it
        throw;
    }
    for (std::size_t i = pool_.size(); i-- > 0;) {
        pool_[i].next = free_;
        free_ = static_cast<std::int32_t>(i);
    }
    q_head_.fill(-1);
    q_tail_.fill(-1);
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = fd_;
    if (epoll_fd_ < 0 || epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd_, &ev) != 0) {
        const int err = errno;
        if (epoll_fd_ >= 0)
            ::close(epoll_fd_);
        fd_ = -1; // still the caller's: it closes it
        throw_error("epoll_ctl(ADD)", err, "a TCP RPC connection");
    }
    lay_out(in_.data(), out_.data());
    set_hold_of(&tcp_link::hold_of);
    // The endpoint's epoll watches this link's own: readable when the socket
    // is (bytes, or its end), and writable when frames wait for room.
    set_fds(epoll_fd_, -1);
}

tcp_link::~tcp_link() {
    if (epoll_fd_ >= 0)
        ::close(epoll_fd_);
    if (fd_ >= 0)
        ::close(fd_);
}

// ---- sending ---------------------------------------------------------------------------------

std::int32_t tcp_link::take_entry(sched::priority p) noexcept {
    if (free_ < 0 || p.level >= sched::priority_levels)
        return -1;
    const std::int32_t i = free_;
    entry& e = pool_[static_cast<std::size_t>(i)];
    free_ = e.next;
    e = entry{};
    return i;
}

void tcp_link::link_entry(std::int32_t i, std::uint8_t level) noexcept {
    if (stall_.count() > 0 && !queued())
        sent_moved_ = sched::coarse_clock::now(); // the send stall counts from here
    pool_[static_cast<std::size_t>(i)].next = -1;
    if (q_tail_[level] < 0)
        q_head_[level] = i;
    else
        pool_[static_cast<std::size_t>(q_tail_[level])].next = i;
    q_tail_[level] = i;
}

status tcp_link::send_slot(message_kind k, std::uint32_t s, std::uint32_t bytes, sched::priority p,
                           bool epoch) noexcept {
    if (corrupt_ || closed_)
        return status::qp_failed;
    if (bytes != 0 && (s >= slots() || bytes > slot_bytes()))
        return status::out_of_range;
    const std::int32_t i = take_entry(p);
    if (i < 0)
        return status::queue_full;
    entry& e = pool_[static_cast<std::size_t>(i)];
    const head h{frame::slot, 0, 0, encode_imm(k, s, bytes, epoch)};
    std::memcpy(e.hdr.data(), &h, sizeof h);
    e.hdr_len = sizeof h;
    e.src = bytes != 0 ? staging(s) : nullptr;
    e.len = bytes;
    e.slot_msg = k == message_kind::request && bytes != 0;
    e.slot = static_cast<std::uint16_t>(s);
    link_entry(i, p.level);
    if (!held_)
        flush();
    return status::ok;
}

transfer tcp_link::move_body(body_way way, sched::priority p,
                             local_buffer<rights::local_write> local,
                             const buffer_descriptor& remote, std::uint64_t wr_id,
                             std::span<const std::uint32_t> /*rail_rkeys: one socket*/) noexcept {
    if (corrupt_ || closed_ || local.length > remote.length)
        return transfer::failed;
    pending_read* r = nullptr;
    if (way == body_way::read) {
        const auto it = std::find_if(reads_.begin(), reads_.end(),
                                     [](const pending_read& x) { return !x.used; });
        if (it == reads_.end())
            return transfer::failed;
        r = &*it;
    }
    const std::int32_t i = take_entry(p);
    if (i < 0)
        return transfer::failed;
    entry& e = pool_[static_cast<std::size_t>(i)];
    e.wr_id = wr_id;
    if (way == body_way::read) {
        const head h{frame::read_req, p.level, 0, local.length};
        const ext x{wr_id, remote.addr, remote.rkey, 0};
        std::memcpy(e.hdr.data(), &h, sizeof h);
        std::memcpy(e.hdr.data() + sizeof h, &x, sizeof x);
        e.hdr_len = full_head;
        *r = pending_read{wr_id, local.addr, local.length, 0, i, true};
    } else {
        e.stream = true;
        e.src = local.addr;
        e.len = local.length;
        e.addr = remote.addr;
        e.key = remote.rkey;
    }
    link_entry(i, p.level);
    if (!held_)
        flush();
    return transfer::started;
}

bool tcp_link::cancel(std::uint64_t wr_id) noexcept {
    for (std::uint8_t level = 0; level < sched::priority_levels; ++level) {
        for (std::int32_t i = q_head_[level]; i >= 0; i = pool_[static_cast<std::size_t>(i)].next) {
            entry& e = pool_[static_cast<std::size_t>(i)];
            if (e.dead || e.answer || e.wr_id != wr_id || (!e.stream && e.hdr_len != full_head))
                continue;
            if (i == partial_entry_ || (e.stream && e.done != 0))
                return false; // begun: it completes
            e.dead = true;
            if (pending_read* r = find_read(wr_id))
                r->used = false;
            return true;
        }
    }
    return false;
}

std::size_t tcp_link::current_chunk(const entry& e) const noexcept {
    if (!e.stream)
        return e.len;
    if (e.failing || (e.answer && e.done == e.len))
        return 0; // the answer's end
    return std::min<std::size_t>(chunk_bytes, e.len - e.done);
}

void tcp_link::build_frame(entry& e, std::size_t chunk) noexcept {
    if (!e.stream)
        return; // built when queued
    head h{};
    ext x{};
    if (e.answer && (e.failing || e.done == e.len)) {
        // The answer's last frame says how it went: a read completes on
        // it alone, so a chunk that could not be read all the same (its
        // memory faulted half-way) cannot pass for the body.
        h = {frame::read_end, 0, 0, 0};
        x = {e.wr_id, 0, 0, e.failing ? 0U : 1U};
    } else if (e.answer) {
        h = {frame::read_data, 0, 0, static_cast<std::uint32_t>(chunk)};
        x = {e.wr_id, e.done, 0, 0};
    } else {
        h = {frame::write_data, 0, 0, static_cast<std::uint32_t>(chunk)};
        x = {0, e.addr + e.done, e.key, 0};
    }
    std::memcpy(e.hdr.data(), &h, sizeof h);
    std::memcpy(e.hdr.data() + sizeof h, &x, sizeof x);
    e.hdr_len = full_head;
}

std::int32_t tcp_link::first_live(std::uint8_t level) noexcept {
    // Withdrawn frames at the front go back to the pool as they come up.
    while (q_head_[level] >= 0 && pool_[static_cast<std::size_t>(q_head_[level])].dead) {
        const std::int32_t i = q_head_[level];
        entry& e = pool_[static_cast<std::size_t>(i)];
        q_head_[level] = e.next;
        if (q_head_[level] < 0)
            q_tail_[level] = -1;
        e.next = free_;
        free_ = i;
    }
    return q_head_[level];
}

bool tcp_link::queued() const noexcept {
    return std::any_of(q_head_.begin(), q_head_.end(), [](std::int32_t h) { return h >= 0; });
}

std::size_t tcp_link::gather(batch& b) noexcept {
    // The frames that go next, in order: the one partly sent first, then by
    // level, FIFO within one; a body's chunk ends the batch (what follows it
    // at its level waits for the whole body, and a more urgent frame may
    // come before its next chunk).
    std::size_t total = 0;
    const auto add = [&](std::uint8_t level, std::int32_t i, bool partial) {
        entry& e = pool_[static_cast<std::size_t>(i)];
        // A frame partly sent keeps the size it started with.
        const std::size_t chunk = partial ? partial_chunk_ : current_chunk(e);
        if (!partial)
            build_frame(e, chunk);
        const std::size_t skip = partial ? partial_sent_ : 0;
        const std::byte* payload = partial && spilled_ ? spill_.data() : e.src + e.done;
        if (skip < e.hdr_len)
            b.iov[b.n++] = {e.hdr.data() + skip, e.hdr_len - skip};
        const std::size_t from = skip > e.hdr_len ? skip - e.hdr_len : 0;
        if (chunk > from)
            b.iov[b.n++] = {const_cast<std::byte*>(payload) + from, chunk - from};
        const std::size_t bytes = e.hdr_len + chunk - skip;
        b.frames[b.count++] = {level, i, bytes, chunk};
        total += bytes;
        return e.stream;
    };
    const std::int32_t skip_entry = partial_entry_;
    if (partial_entry_ >= 0 && add(partial_level_, partial_entry_, true))
        return total;
    for (std::uint8_t level = 0; level < sched::priority_levels; ++level) {
        for (std::int32_t i = first_live(level); i >= 0 && b.n + 2 <= b.iov.size();
             i = pool_[static_cast<std::size_t>(i)].next) {
            if (pool_[static_cast<std::size_t>(i)].dead || i == skip_entry)
                continue;
            if (add(level, i, false))
                return total;
        }
        if (b.n + 2 > b.iov.size())
            break;
    }
    return total;
}

void tcp_link::flush() noexcept {
    while (!closed_ && !corrupt_) {
        batch b;
        const std::size_t total = gather(b);
        if (b.count == 0) {
            want_out(false);
            return;
        }
        msghdr m{};
        m.msg_iov = b.iov.data();
        m.msg_iovlen = b.n;
        const ssize_t r = sendmsg(fd_, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EFAULT && answer_faulted(b))
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                want_out(true);
            else
                fail_io(errno);
            return;
        }
        after_send(b, static_cast<std::size_t>(r));
        if (static_cast<std::size_t>(r) < total) {
            want_out(true); // the socket is full: the rest when it has room
            return;
        }
    }
}

void tcp_link::after_send(const batch& b, std::size_t sent) noexcept {
    for (std::size_t k = 0; k < b.count; ++k) {
        const batch::frame_sent& f = b.frames[k];
        if (sent < f.bytes) {
            if (partial_entry_ != f.entry)
                partial_sent_ = 0;
            partial_entry_ = f.entry;
            partial_level_ = f.level;
            partial_chunk_ = f.chunk;
            partial_sent_ += sent;
            return;
        }
        sent -= f.bytes;
        partial_entry_ = -1;
        partial_sent_ = 0;
        spilled_ = false;
        // Whole frames (a chunk at most 512 KiB) count as the peer taking
        // bytes: one that reads a segment at a time does not keep a reply alive.
        sent_moved_ = sched::coarse_clock::now();
        frame_done(f.level, f.entry, f.chunk);
    }
}

void tcp_link::frame_done(std::uint8_t level, std::int32_t i, std::size_t chunk) noexcept {
    entry& e = pool_[static_cast<std::size_t>(i)];
    const bool ending = e.answer && (e.failing || e.done == e.len);
    if (e.stream && !ending) {
        e.done += static_cast<std::uint32_t>(chunk);
        e.failing = e.failing || e.revoke_after; // revoked: its end says failed
        if (e.answer || e.done < e.len)
            return; // more to go (an answer's end at least): it stays at the front
        event(link_event{e.wr_id, 0, IBV_WC_SUCCESS, link_event::kind::transfer, false});
    } else if (!e.stream && e.hdr_len == full_head) {
        if (pending_read* r = find_read(e.wr_id)) {
            r->queued = -1; // on the wire: it cannot be withdrawn any more
            if (reads_out_++ == 0)
                read_moved_ = sched::coarse_clock::now();
        }
    }
    // It is the first live frame of its level.
    (void)first_live(level);
    q_head_[level] = e.next;
    if (q_head_[level] < 0)
        q_tail_[level] = -1;
    e.next = free_;
    free_ = i;
}

bool tcp_link::answer_faulted(const batch& b) noexcept {
    // Nothing went: the first frame's bytes fault (what came before went in
    // an earlier, shorter send). A read answer from memory the caller
    // unmapped under its call: the chunk ends in zeros, and the answer's end
    // says it failed. Anything else is this side's own memory: the link ends.
    entry& e = pool_[static_cast<std::size_t>(b.frames[0].entry)];
    if (!e.answer || e.failing || spilled_ || b.frames[0].chunk == 0)
        return false;
    const std::size_t sent = partial_entry_ >= 0 ? partial_sent_ : 0;
    const std::size_t from = sent > e.hdr_len ? sent - e.hdr_len : 0;
    std::memset(spill_.data() + from, 0, b.frames[0].chunk - from);
    if (partial_entry_ < 0) { // nothing of it went yet: partial from its first byte
        partial_entry_ = b.frames[0].entry;
        partial_level_ = b.frames[0].level;
        partial_chunk_ = b.frames[0].chunk;
        partial_sent_ = 0;
    }
    spilled_ = true;
    e.revoke_after = true;
    return true;
}

void tcp_link::spill_partial() noexcept {
    // The frame partly on the wire has a source that goes now: the rest of
    // its payload is copied (one chunk or slot at most), and goes from here.
    if (partial_entry_ < 0 || spilled_)
        return;
    const entry& e = pool_[static_cast<std::size_t>(partial_entry_)];
    const std::size_t chunk = partial_chunk_;
    const std::size_t from = partial_sent_ > e.hdr_len ? partial_sent_ - e.hdr_len : 0;
    if (chunk > from)
        std::memcpy(spill_.data() + from, e.src + e.done + from, chunk - from);
    spilled_ = true;
}

void tcp_link::want_out(bool on) noexcept {
    if (on == out_armed_ || epoll_fd_ < 0)
        return;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP | (on ? EPOLLOUT : 0U);
    ev.data.fd = fd_;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, fd_, &ev) == 0)
        out_armed_ = on;
}

void tcp_link::fail_io(int err) noexcept {
    closed_ = true;
    io_error_ = err;
}

void tcp_link::event(link_event e) noexcept {
    if (events_.size() < events_.capacity()) {
        events_.push_back(e); // room made with the link: never reallocates
        return;
    }
    // More completions waiting than the link made room for (a caller that
    // posts and never polls): like a completion queue that overruns, the link
    // fails rather than lose one silently.
    fail_io(ENOBUFS);
}

// ---- receiving -------------------------------------------------------------------------------

tcp_link::pending_read* tcp_link::find_read(std::uint64_t wr_id) noexcept {
    for (pending_read& r : reads_)
        if (r.used && r.wr_id == wr_id)
            return &r;
    return nullptr;
}

bool tcp_link::read_in() noexcept {
    for (;;) {
        ssize_t r = 0;
        if (pay_kind_ != pay::none && pay_dst_ != nullptr && pay_left_ >= direct_bytes &&
            rpos_ == rend_) {
            // A body's bytes straight where they go: no copy but the socket's.
            r = recv(fd_, pay_dst_, pay_left_, MSG_DONTWAIT);
            if (r > 0) {
                pay_dst_ += r;
                pay_left_ -= static_cast<std::uint32_t>(r);
            }
        } else {
            if (rpos_ != 0) {
                std::memmove(rbuf_.data(), rbuf_.data() + rpos_, rend_ - rpos_);
                rend_ -= rpos_;
                rpos_ = 0;
            }
            r = recv(fd_, rbuf_.data() + rend_, rbuf_.size() - rend_, MSG_DONTWAIT);
            if (r > 0)
                rend_ += static_cast<std::size_t>(r);
        }
        if (r > 0) {
            taken_ += static_cast<std::size_t>(r);
            return true;
        }
        if (r == 0) {
            closed_ = true; // the peer closed its end
            return false;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            fail_io(errno);
        return false;
    }
}

bool tcp_link::parse() noexcept {
    // Stops with room left for every write's completion (event() never drops one).
    const std::size_t room = events_.capacity() - pool_.size();
    full_ = false;
    while (!(full_ = events_.size() >= room)) {
        if (pay_kind_ != pay::none) {
            const std::size_t take = std::min<std::size_t>(rend_ - rpos_, pay_left_);
            if (pay_dst_ != nullptr && take != 0) {
                std::memcpy(pay_dst_, rbuf_.data() + rpos_, take);
                pay_dst_ += take;
            }
            rpos_ += take;
            pay_left_ -= static_cast<std::uint32_t>(take);
            if (pay_left_ != 0)
                return true; // the rest when it comes
            finish_payload();
            continue;
        }
        const std::size_t avail = rend_ - rpos_;
        if (avail < sizeof(head))
            return true;
        const auto h = load_at<head>(rbuf_.data() + rpos_);
        const bool short_frame = h.type == frame::slot || h.type == frame::abandon;
        if (h.type < frame::slot || h.type > frame::abandon || h.reserved != 0)
            return false;
        const std::size_t need = short_frame ? sizeof(head) : full_head;
        if (avail < need)
            return true;
        const ext x = short_frame ? ext{} : load_at<ext>(rbuf_.data() + rpos_ + sizeof(head));
        rpos_ += need;
        if (!start_payload(h, x))
            return false;
    }
    return true;
}

bool tcp_link::start_payload(const head& h, const ext& x) noexcept {
    pay_left_ = 0;
    pay_dst_ = nullptr;
    switch (h.type) {
    case frame::slot: return start_slot(h);
    case frame::read_req: return !server_ && answer_read(h, x);
    case frame::read_data: return start_read_data(h, x);
    case frame::read_end: return end_read(x);
    case frame::write_data: return start_write(h, x);
    case frame::abandon:
        if (!server_ || h.value >= slots())
            return false;
        // The caller gave the call in this slot up: its request's epoch
        // flips where it lies, which the server checks before it reads the
        // body or writes the reply (server::abandoned).
        in_[std::size_t{h.value} * slot_bytes() + offsetof(message_header, flags)] ^=
            std::byte{flag_epoch};
        return true;
    }
    return false;
}

bool tcp_link::start_slot(const head& h) noexcept {
    const imm_fields f = decode_imm(h.value);
    // Requests come to the server, replies to the client.
    if ((f.kind == message_kind::request) != server_)
        return false;
    if (is_control(f)) {
        event(link_event::of_imm(h.value));
        return true;
    }
    if (f.slot >= slots() || f.bytes > slot_bytes())
        return false;
    pay_kind_ = pay::slot;
    pay_imm_ = h.value;
    pay_dst_ = in_.data() + std::size_t{f.slot} * slot_bytes();
    pay_left_ = f.bytes;
    return true;
}

bool tcp_link::start_read_data(const head& h, const ext& x) noexcept {
    pending_read* r = server_ ? find_read(x.wr_id) : nullptr;
    // Chunks of exactly the size a sender cuts (a whole chunk, or the rest):
    // a peer cannot keep a read alive, and the server's block held, with a
    // trickle of empty or one-byte frames.
    if (r == nullptr || r->queued >= 0 || x.addr != r->got || r->got == r->len ||
        h.value != std::min<std::uint32_t>(chunk_bytes, r->len - r->got) || x.last != 0)
        return false;
    pay_kind_ = pay::read;
    pay_dst_ = r->dst + r->got;
    pay_left_ = h.value;
    r->got += h.value;
    read_moved_ = sched::coarse_clock::now();
    return true;
}

bool tcp_link::end_read(const ext& x) noexcept {
    pending_read* r = server_ ? find_read(x.wr_id) : nullptr;
    if (r == nullptr || r->queued >= 0 || x.last > 1 || (x.last == 1 && r->got != r->len))
        return false;
    r->used = false;
    --reads_out_;
    read_moved_ = sched::coarse_clock::now();
    // A refused read fails its call alone: the stream is whole.
    event(link_event{x.wr_id, 0, x.last == 1 ? IBV_WC_SUCCESS : IBV_WC_REM_ACCESS_ERR,
                     link_event::kind::transfer, x.last != 1});
    return true;
}

bool tcp_link::start_write(const head& h, const ext& x) noexcept {
    if (server_ || h.value > chunk_bytes)
        return false;
    pay_kind_ = pay::write;
    pay_left_ = h.value;
    pay_slot_ = UINT32_MAX;
    // Into the call's reply buffer while the call lasts; a late chunk (the
    // call ended) is read and dropped.
    const std::uint32_t s = x.key & (max_slots - 1);
    if (x.key != 0 && s < grants_.size() && grants_[s].reply_key == x.key) {
        const grant& g = grants_[s];
        const auto base = reinterpret_cast<std::uintptr_t>(g.reply);
        if (x.addr >= base && h.value <= g.reply_len && x.addr - base <= g.reply_len - h.value) {
            pay_dst_ = g.reply + (x.addr - base);
            pay_slot_ = s;
        }
    }
    return true;
}

void tcp_link::finish_payload() noexcept {
    const pay kind = pay_kind_;
    pay_kind_ = pay::none;
    if (kind == pay::slot) {
        event(link_event::of_imm(pay_imm_));
    }
}

bool tcp_link::answer_read(const head& h, const ext& x) noexcept {
    if (h.prio >= sched::priority_levels)
        return false;
    const std::int32_t i = take_entry(sched::priority{h.prio});
    if (i < 0)
        return false; // more reads than a client's calls can have: not a server's
    entry& e = pool_[static_cast<std::size_t>(i)];
    e.stream = true;
    e.answer = true;
    e.wr_id = x.wr_id;
    const std::uint32_t s = x.key & (max_slots - 1);
    e.slot = static_cast<std::uint16_t>(s);
    // The call's body while the call lasts, nothing else: else a failed end.
    e.failing = true;
    if (x.key != 0 && s < grants_.size() && grants_[s].body_key == x.key) {
        const grant& g = grants_[s];
        const auto base = reinterpret_cast<std::uintptr_t>(g.body);
        if (x.addr >= base && h.value <= g.body_len && x.addr - base <= g.body_len - h.value) {
            e.failing = false;
            e.src = g.body + (x.addr - base);
            e.len = h.value;
        }
    }
    link_entry(i, h.prio);
    return true;
}

int tcp_link::poll(std::span<link_event> out, bool) noexcept {
    if (corrupt_)
        return -1;
    if (!held_ && queued())
        flush();
    std::size_t n = 0;
    const auto hand_out = [&] {
        const std::size_t k = std::min(out.size() - n, events_.size());
        std::copy_n(events_.begin(), k, out.begin() + static_cast<std::ptrdiff_t>(n));
        n += k;
        // Only what is left to hand out keeps its room (erase never reallocates).
        events_.erase(events_.begin(), events_.begin() + static_cast<std::ptrdiff_t>(k));
    };
    hand_out();
    taken_ = 0;
    bool ok = true;
    bool drained = false; // everything the socket had is parsed
    while (n < out.size() && !closed_) {
        ok = parse();
        hand_out();
        if (!ok || n == out.size() || taken_ >= poll_budget)
            break;
        if (!read_in()) {
            drained = true;
            break;
        }
    }
    if (ok && stalled(drained))
        fail_io(ETIMEDOUT); // the peer holds this side's blocks and moves nothing
    if (!ok) {
        // The peer broke the stream's rules: what came before is handed
        // out, the next poll says so.
        corrupt_ = true;
        return n > 0 ? static_cast<int>(n) : -1;
    }
    // Answers to reads queued while parsing go now.
    if (!held_ && queued())
        flush();
    return static_cast<int>(n);
}

bool tcp_link::stalled(bool drained) const noexcept {
    if (stall_.count() <= 0 || closed_)
        return false; // (a peer that closed its end is an event, not a stall)
    const auto now = sched::coarse_clock::now();
    // A read is judged with the socket drained: a chunk may wait unread
    // behind a poll that stopped at its budget, or a server that was busy.
    // Not drained, at twice the limit: a peer flooding other frames must not
    // keep its reads from being judged at all.
    if (reads_out_ != 0 && now - read_moved_ > (drained ? stall_ : 2 * stall_))
        return true;
    // Frames waiting and not one byte taken by the peer: it stopped reading.
    return queued() && now - sent_moved_ > stall_;
}

// ---- the rest of the ten ---------------------------------------------------------------------

std::optional<link_end> tcp_link::ended(look what) noexcept {
    // A failure is this side's (a broken rule, a socket error); the peer
    // closing its end is an event, as a disconnection is on the device.
    if (what == look::cause || corrupt_ || io_error_ != 0 || (what == look::events && closed_))
        return link_end{};
    return std::nullopt;
}

bool tcp_link::sleep(bool going) noexcept {
    if (!going)
        return true;
    if (queued())
        want_out(true); // woken when the socket has room
    // Not with events to hand out, nor with whole frames read and left for
    // want of room: nothing on the socket would wake it for those.
    return events_.empty() && !full_ && !closed_ && !corrupt_;
}

void tcp_link::close() noexcept {
    if (fd_ >= 0)
        shutdown(fd_, SHUT_RDWR);
}

bool tcp_link::hold_of(link* self, bool on) noexcept {
    auto* t = static_cast<tcp_link*>(self);
    t->held_ = on;
    if (!on && t->queued())
        t->flush(); // what the hold kept back goes in one system call
    return true;
}

access tcp_link::grant_access(std::uint32_t slot, const call_ranges& r, buffer_descriptor& body,
                              buffer_descriptor& reply) noexcept {
    if (slot >= grants_.size())
        return access::no_room;
    // The socket carries host memory the CPU copies; a dma-buf it cannot.
    if (const access a = describe_host(r, body, reply); a != access::ok)
        return a;
    // Keys name the slot in their low bits and a count above, never 0: a
    // key of an earlier call in the slot is not this one's.
    const auto next_key = [&] {
        key_gen_ = (key_gen_ + 1) & ((1U << (32 - key_slot_bits)) - 1);
        if (key_gen_ == 0)
            key_gen_ = 1;
        return (key_gen_ << key_slot_bits) | slot;
    };
    grant& g = grants_[slot];
    g = grant{};
    if (body.length != 0) {
        g.body = r.body.data();
        g.body_len = body.length;
        g.body_key = body.rkey = next_key();
    }
    if (reply.length != 0) {
        g.reply = r.reply.data();
        g.reply_len = reply.length;
        g.reply_key = reply.rkey = next_key();
    }
    return access::ok;
}

bool tcp_link::end_access(std::uint32_t slot, access_end how) noexcept {
    if (how == access_end::fence)
        return false; // nothing to fence: the caller ends it `now`
    if (slot >= grants_.size())
        return true;
    const bool had_body = grants_[slot].body_key != 0;
    grants_[slot] = grant{};
    const std::int32_t partial_i = partial_entry_;
    bool withdrawn = false;
    // A reply chunk arriving into the call's buffer: its rest is dropped.
    if (pay_kind_ == pay::write && pay_slot_ == slot)
        pay_dst_ = nullptr;
    // Answers still queued from the call's body end at once (failed);
    // one partly sent finishes its chunk from a copy.
    for (std::uint8_t level = 0; level < sched::priority_levels; ++level) {
        for (std::int32_t i = q_head_[level]; i >= 0; i = pool_[static_cast<std::size_t>(i)].next) {
            entry& e = pool_[static_cast<std::size_t>(i)];
            const bool partial = i == partial_i;
            if (e.dead || e.slot != slot)
                continue;
            if (had_body && e.answer && !e.failing) {
                if (partial) {
                    spill_partial();
                    e.revoke_after = true;
                } else {
                    e.failing = true;
                }
            } else if (how == access_end::abandon && e.slot_msg) {
                if (!partial) {
                    e.dead = true; // the request never went
                    withdrawn = true;
                    continue; // answers to the call's body may be queued at other levels
                }
                spill_partial(); // it went in part: the rest from a copy
            }
        }
    }
    if (how != access_end::abandon || withdrawn)
        return true;
    // The request is on its way or there: the server drops it unread.
    const std::int32_t i = take_entry(sched::urgent);
    if (i < 0) {
        corrupt_ = true; // no room for the frame that fences the call: the link ends
        return true;
    }
    entry& e = pool_[static_cast<std::size_t>(i)];
    const head h{frame::abandon, 0, 0, slot};
    std::memcpy(e.hdr.data(), &h, sizeof h);
    e.hdr_len = sizeof h;
    link_entry(i, sched::urgent.level);
    if (!held_)
        flush();
    return true;
}

} // namespace rdmax::rpc::detail
