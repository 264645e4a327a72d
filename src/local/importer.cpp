#include <cerrno>
#include <poll.h>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/local/importer.hpp>
#include <rdmax/mem/fork_policy.hpp>

namespace rdmax::local {

namespace {

/// Sends `q` and takes the owner's answer, with its descriptor if one came.
export_wire::reply ask(unix_channel& owner, const export_wire::request& q, int& fd,
                       std::chrono::milliseconds timeout) {
    owner.send(std::as_bytes(std::span(&q, 1)));
    export_wire::reply r;
    std::vector<int> fds;
    const std::size_t got = owner.receive(std::as_writable_bytes(std::span(&r, 1)), fds, timeout);
    fd = -1;
    if (got != sizeof r || r.magic != export_wire::magic || fds.size() > 1 ||
        (r.error == 0) != (fds.size() == 1)) {
        for (const int f : fds)
            close(f);
        throw_error("importer", EPROTO,
                    fmt::format("the owner's answer: {} bytes, {} descriptors", got, fds.size()));
    }
    if (!fds.empty())
        fd = fds[0];
    return r;
}

} // namespace

importer::importer(unix_channel owner, mapping_options opts, std::chrono::milliseconds timeout)
    : owner_(std::move(owner))
    , timeout_(timeout)
    , fork_generation_(fork_generation()) {
    int fd = -1;
    const export_wire::reply r = ask(owner_, export_wire::request{}, fd, timeout_);
    if (r.error != 0)
        throw_error("importer", r.error, "the owner refused its export table");
    try {
        control_ = shared_segment::attach(fd, r.bytes, false, /*require_sealed=*/true);
    } catch (...) {
        close(fd);
        throw;
    }
    close(fd);
    const auto table = export_table::view(control_.bytes(), r.slots);
    if (table.empty())
        throw_error("importer", EPROTO,
                    fmt::format("a table of {} slots in {} bytes", r.slots, control_.size()));
    cache_.emplace(
        table, [this](const export_notice& e) { return attach(e); }, opts);
}

shared_segment importer::attach(const export_notice& e) {
    if (fork_generation() != fork_generation_)
        throw_error("importer", EPERM,
                    "a forked child cannot map new exports through its parent's channel: "
                    "make an importer of its own");
    // Said plainly, rather than as the send's EPIPE.
    if (!owner_alive())
        throw_error("importer", ECONNRESET, "the owner is gone: its channel is closed");
    export_wire::request q;
    q.what = export_wire::kind::attach;
    q.id = e.id;
    q.generation = e.generation;
    int fd = -1;
    const export_wire::reply r = ask(owner_, q, fd, timeout_);
    if (r.error != 0)
        throw_error("importer", r.error,
                    fmt::format("the owner refused export {} generation {}", e.id, e.generation));
    try {
        shared_segment s = shared_segment::attach(fd, e.bytes, r.writable != 0);
        close(fd);
        return s;
    } catch (...) {
        close(fd);
        throw;
    }
}

bool importer::owner_alive() const noexcept {
    pollfd p{owner_.fd(), POLLRDHUP, 0};
    const int n = poll(&p, 1, 0);
    return n == 0 || (n == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) == 0);
}

} // namespace rdmax::local
