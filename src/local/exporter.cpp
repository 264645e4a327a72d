#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <optional>
#include <string>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/local/exporter.hpp>

namespace rdmax::local {

exporter::exporter(std::uint32_t slots)
    : table_(slots)
    , by_id_(slots) {}

exporter::~exporter() {
    std::vector<unhook> going;
    {
        std::lock_guard g(mutex_);
        going.swap(unhooks_);
    }
    // Outside our lock: an arena calls its listener under its own lock, and
    // the listener takes ours.
    for (unhook& u : going)
        u.call();
    std::lock_guard g(mutex_);
    for (published& p : by_id_)
        if (p.fd >= 0)
            close(p.fd);
}

bool exporter::knows(const void* arena) const noexcept {
    return std::any_of(unhooks_.begin(), unhooks_.end(),
                       [arena](const unhook& u) { return u.arena == arena; });
}

export_notice exporter::share(const shared_segment& seg, bool writable) {
    if (!seg)
        throw_error("exporter::share", EINVAL, "an empty segment");
    std::lock_guard g(mutex_);
    return publish_locked(seg.fd(), seg.data(), seg.size(), writable);
}

export_notice exporter::publish_locked(int fd, const std::byte* base, std::size_t bytes,
                                       bool writable) {
    // One export per memory and access: a second block of an area shares
    // the export of the first.
    for (const published& p : by_id_)
        if (p.fd >= 0 && p.base == base && p.writable == writable && p.notice.bytes == bytes)
            return p.notice;
    const int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (mine < 0)
        throw_error("fcntl(F_DUPFD_CLOEXEC)", errno, "an export's descriptor");
    export_notice n;
    try {
        n = table_.publish_bytes(bytes);
    } catch (...) {
        close(mine);
        throw;
    }
    published& p = by_id_[n.id];
    p.fd = mine;
    p.base = base;
    p.notice = n;
    p.writable = writable;
    return n;
}

bool exporter::revoke(const export_notice& n) {
    std::lock_guard g(mutex_);
    if (n.id >= by_id_.size() || by_id_[n.id].fd < 0 ||
        by_id_[n.id].notice.generation != n.generation)
        return false;
    revoke_locked(by_id_[n.id]);
    return true;
}

void exporter::revoke_locked(published& p) noexcept {
    table_.revoke(p.notice);
    close(p.fd);
    p = published{};
}

void exporter::revoke_area(const std::byte* base) noexcept {
    std::lock_guard g(mutex_);
    for (published& p : by_id_)
        if (p.fd >= 0 && p.base == base)
            revoke_locked(p);
}

bool exporter::is_live(const export_notice& n) const {
    std::lock_guard g(mutex_);
    return n.id < by_id_.size() && by_id_[n.id].fd >= 0 &&
           by_id_[n.id].notice.generation == n.generation;
}

std::size_t exporter::live() const {
    std::lock_guard g(mutex_);
    return table_.live();
}

namespace {

/// One request of the peer, or none: nothing asked in time (`gone` false),
/// or the peer closed the channel (`gone` true). Throws on a malformed one.
std::optional<export_wire::request> read_request(unix_channel& peer,
                                                 std::chrono::milliseconds timeout, bool& gone) {
    export_wire::request q;
    std::vector<int> fds;
    std::size_t got = 0;
    try {
        got = peer.receive(std::as_writable_bytes(std::span(&q, 1)), fds, timeout);
    } catch (const error& e) {
        if (e.code().value() != ETIMEDOUT && e.code().value() != ECONNRESET)
            throw;
        gone = e.code().value() == ECONNRESET;
        return std::nullopt;
    }
    for (const int fd : fds) // a peer sends none: close what came anyway
        close(fd);
    if (got != sizeof q || q.magic != export_wire::magic)
        throw_error("exporter::answer", EPROTO,
                    fmt::format("a request of {} bytes, magic {:#x}", got, q.magic));
    return q;
}

} // namespace

bool exporter::answer(unix_channel& peer, std::chrono::milliseconds timeout) {
    bool gone = false;
    const std::optional<export_wire::request> q = read_request(peer, timeout, gone);
    if (!q)
        return !gone; // nothing asked: the peer is still there
    export_wire::reply r;
    bool close_fd = false;
    const int fd = reply_to(*q, r, close_fd);
    bool sent = true;
    try {
        peer.send(std::as_bytes(std::span(&r, 1)),
                  fd >= 0 ? std::span<const int>(&fd, 1) : std::span<const int>{});
    } catch (const error& e) {
        if (e.code().value() != EPIPE && e.code().value() != ECONNRESET) {
            if (close_fd)
                close(fd);
            throw;
        }
        sent = false; // the peer went away meanwhile
    }
    if (close_fd)
        close(fd);
    return sent;
}

int exporter::reply_to(const export_wire::request& q, export_wire::reply& r, bool& close_fd) {
    std::lock_guard g(mutex_);
    switch (q.what) {
    case export_wire::kind::hello:
        r.slots = table_.slots();
        r.bytes = table_.control().size();
        return table_.control().fd();
    case export_wire::kind::attach: {
        const published* p = q.id < by_id_.size() ? &by_id_[q.id] : nullptr;
        if (p == nullptr || p->fd < 0 || p->notice.generation != q.generation) {
            r.error = ENOENT; // revoked, replaced, or never published
            return -1;
        }
        r.bytes = p->notice.bytes;
        r.writable = p->writable ? 1 : 0;
        // A duplicate made under the lock, either way: once it is released a
        // revoke may close p->fd, and its number may name another file by
        // the time the reply goes.
        const int fd = p->writable ? fcntl(p->fd, F_DUPFD_CLOEXEC, 0)
                                   : shared_segment::reopen_read_only(p->fd);
        if (fd < 0) {
            r = export_wire::reply{};
            r.error = errno;
            return -1;
        }
        close_fd = true;
        return fd;
    }
    default:
        throw_error("exporter::answer", EPROTO,
                    fmt::format("request kind {}", static_cast<std::uint32_t>(q.what)));
    }
}

} // namespace rdmax::local
