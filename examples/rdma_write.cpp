// rdma_write: one-sided RDMA write and read-back over one rdma_cm connection.
//
//   server:  rdma_write [-b ADDR] [-p PORT] [-s SIZE] [-t SECONDS]
//   client:  rdma_write [-d DEVICE] [-p PORT] [-s SIZE] [-t SECONDS] SERVER_ADDR
//
// The server registers a buffer for remote write and read and hands its
// token (address, length, rkey) to the client in the connection's private
// data. The client writes a pattern into it, reads it back into a second
// buffer and compares; the server's CPU takes no part in either. Then the
// client sends the server one message, and the server checks its buffer too.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <getopt.h>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

namespace {

using namespace rdmax;
using namespace std::chrono_literals;
using steady = std::chrono::steady_clock;

constexpr const char* usage_text = R"(usage:
  rdma_write [-b ADDR] [-p PORT] [-s SIZE] [-t SECONDS]                 (server)
  rdma_write [-d DEVICE] [-p PORT] [-s SIZE] [-t SECONDS] SERVER_ADDR   (client)

The client RDMA-writes SIZE bytes into the server's buffer, reads them back
and compares; the server checks them too.
  -b ADDR     server: IP address to listen on. rdma_cm needs an address that an
              RDMA device carries (with a wildcard address it could not tell on
              which device to register the buffer); default: the IPv4 address of
              the first device with an ACTIVE port (192.0.2.1 in the rdmax VM)
  -d DEVICE   client: device to connect from (default: the first ACTIVE one)
  -p PORT     rdma_cm port (default 18516)
  -s SIZE     server: its buffer's size; client: bytes to write, at most the
              server's buffer (default 1048576 on both; at most 1073741824)
  -t SECONDS  give up when a connection or a transfer takes longer (default 30)
)";

struct usage_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct options {
    std::string bind;   // server: address to listen on
    std::string device; // client: device to connect from
    std::string server; // client: the server's address; empty: be the server
    std::uint16_t port = 18516;
    std::uint32_t size = 1 << 20;
    std::chrono::seconds timeout{30};
};

/// What the server lets the client do with its buffer, and so the type of the
/// token on both ends: the client can write and read it, nothing else.
constexpr rdmax::rights client_rights = rights::remote_write | rights::remote_read;
using token = remote_buffer<client_rights>;

std::uint64_t number(const char* text, std::uint64_t lo, std::uint64_t hi, int flag) {
    std::uint64_t v = 0;
    const char* end = text + std::strlen(text);
    const auto [p, ec] = std::from_chars(text, end, v);
    if (ec != std::errc{} || p != end || v < lo || v > hi)
        throw usage_error(fmt::format("-{} {}: expected a number from {} to {}",
                                      static_cast<char>(flag), text, lo, hi));
    return v;
}

options parse(int argc, char** argv) {
    static const option long_options[] = {{"help", no_argument, nullptr, 'h'}, {}};
    options o;
    for (int c; (c = getopt_long(argc, argv, "b:d:p:s:t:h", long_options, nullptr)) != -1;) {
        switch (c) {
        case 'b': o.bind = optarg; break;
        case 'd': o.device = optarg; break;
        case 'p': o.port = static_cast<std::uint16_t>(number(optarg, 1, 65535, c)); break;
        case 's': o.size = static_cast<std::uint32_t>(number(optarg, 1, 1 << 30, c)); break;
        case 't': o.timeout = std::chrono::seconds(number(optarg, 1, 86'400, c)); break;
        case 'h': std::fputs(usage_text, stdout); std::exit(0);
        default: throw usage_error("unknown option");
        }
    }
    if (argc - optind > 1)
        throw usage_error("more than one server address");
    if (optind < argc)
        o.server = argv[optind];
    if (!o.server.empty() && !o.bind.empty())
        throw usage_error("-b is for the server; the client takes the server's address");
    return o;
}

/// The IPv4 address of the first device with an ACTIVE port: its RoCE v2 GID
/// is the address mapped into IPv6 (::ffff:a.b.c.d).
std::string first_active_ipv4() {
    const verbs::context ctx = verbs::context::open_first_active();
    const auto g = ctx.preferred_gid(1);
    if (!g || !g->value.is_ipv4_mapped())
        throw std::runtime_error(
            fmt::format("{} has no IPv4 address to listen on: pass -b ADDR", ctx.name()));
    const auto& r = g->value.raw;
    return fmt::format("{}.{}.{}.{}", r[12], r[13], r[14], r[15]);
}

/// The bytes the client writes. Not periodic in any power of two, so that a
/// page or block that lands in the wrong place shows.
std::byte pattern(std::size_t i) {
    return static_cast<std::byte>((i * 131 + 7) % 251);
}

/// Throws unless bytes[i] == want(i) for every i, naming the first that differs.
template <class Want>
void compare(const char* what, std::span<const std::byte> bytes, Want want) {
    for (std::size_t i = 0; i < bytes.size(); ++i)
        if (bytes[i] != want(i))
            throw std::runtime_error(fmt::format("{}: byte {} is {:#04x}, expected {:#04x}", what,
                                                 i, std::to_integer<int>(bytes[i]),
                                                 std::to_integer<int>(want(i))));
}

void posted(status s, const char* what) {
    if (s != status::ok)
        throw std::runtime_error(fmt::format("{}: {}", what, to_string(s)));
}

/// Waits for the completion of the one request in flight; throws if it
/// failed, the server went away, or the deadline passed. It waits in 100 ms
/// slices to look at the connection in between: a queue pair whose peer has
/// vanished may otherwise go on retrying (on rxe: no error within 90 s).
void completed(verbs::connection& conn, const char* what, std::chrono::seconds timeout) {
    const auto deadline = steady::now() + timeout;
    verbs::completion c;
    for (;;) {
        const int n = conn.qp().wait_send(std::span(&c, 1), 100ms);
        if (n > 0)
            break;
        if (n < 0)
            throw std::runtime_error(fmt::format("{}: cannot poll the completion queue", what));
        if (conn.peer_disconnected())
            throw std::runtime_error(fmt::format("{}: the server disconnected", what));
        if (steady::now() >= deadline)
            throw std::runtime_error(
                fmt::format("{}: no completion within {} s", what, timeout.count()));
    }
    if (!c.ok())
        throw std::runtime_error(fmt::format("{} failed: {}", what, c.status_name()));
}

/// One work request moves at most the port's maximum message size (8 MiB on
/// rxe): a larger transfer goes in pieces, here one after the other.
/// post(offset, length) posts one piece. Returns the number of pieces.
template <class Post>
std::uint64_t in_pieces(verbs::connection& conn, std::uint64_t size, const char* what,
                        std::chrono::seconds timeout, const Post& post) {
    const std::uint64_t most = conn.qp().max_message();
    std::uint64_t pieces = 0;
    for (std::uint64_t offset = 0; offset < size; offset += most, ++pieces) {
        posted(post(offset, std::min(most, size - offset)), what);
        completed(conn, what, timeout);
    }
    return pieces;
}

int serve(options o) {
    if (o.bind.empty())
        o.bind = first_active_ipv4();
    verbs::listener lst(o.bind, o.port);
    const verbs::context ctx = lst.device();
    const verbs::protection_domain pd(ctx);

    std::vector<std::byte> target(o.size); // zeroed: the client's bytes must replace this
    const memory_region<rights::local_write | client_rights> target_mr(pd, target);
    std::uint64_t written = 0; // the client's message: how many bytes it wrote
    const memory_region<rights::local_write> note_mr(pd, &written, sizeof written);

    // The client's writes and reads raise nothing here: sleep until its
    // message comes (a receive queue on a completion channel), not spin.
    verbs::completion_channel events(ctx);
    verbs::completion_queue recv_cq(ctx, 4, &events);

    const token tok = target_mr.remote(); // fewer rights than the region: allowed
    fmt::print("[server] listening on {}:{} ({}); buffer of {} bytes, rkey {:#x}\n", o.bind, o.port,
               ctx.name(), tok.length, tok.rkey);
    verbs::connection conn =
        lst.accept(pd, verbs::payload_of(tok), {.recv_cq = &recv_cq}, o.timeout);
    posted(conn.qp().post_recv(note_mr.local(), 0), "post_recv");

    const auto deadline = steady::now() + o.timeout;
    verbs::completion c;
    for (;;) {
        const int n = conn.qp().wait_recv(std::span(&c, 1), 100ms);
        if (n > 0)
            break;
        if (n < 0)
            throw std::runtime_error("cannot poll the receive completion queue");
        if (conn.peer_disconnected()) {
            // Its message may have come just before the disconnect: look once more.
            if (conn.qp().poll_recv(std::span(&c, 1)) > 0 && c.ok())
                break;
            throw std::runtime_error("the client disconnected without saying it was done");
        }
        if (steady::now() >= deadline)
            throw std::runtime_error(
                fmt::format("no word from the client in {} s", o.timeout.count()));
    }
    if (!c.ok() || c.byte_len != sizeof written || written > target.size())
        throw std::runtime_error(fmt::format("bad message from the client: {}, {} bytes, says {}",
                                             c.status_name(), c.byte_len, written));

    const auto bytes = std::span<const std::byte>(target);
    compare("my buffer", bytes.first(written), pattern);
    compare("my buffer's tail", bytes.subspan(written), [](std::size_t) { return std::byte{0}; });
    fmt::print("[server] the client wrote {} bytes into my buffer: verified {} bytes{}\n", written,
               written,
               written < target.size()
                   ? fmt::format(", and the other {} untouched", target.size() - written)
                   : "");
    if (!conn.wait_disconnected(o.timeout))
        throw std::runtime_error("the client did not disconnect");
    return 0;
}

int client(const options& o) {
    const verbs::context ctx =
        o.device.empty() ? verbs::context::open_first_active() : verbs::context::open(o.device);
    const verbs::protection_domain pd(ctx);

    // Register before connecting: registration is slow, and never belongs on the data path.
    std::vector<std::byte> source(o.size);
    for (std::size_t i = 0; i < source.size(); ++i)
        source[i] = pattern(i);
    const memory_region<rights::local_read> source_mr(pd, source); // a write only reads it
    std::vector<std::byte> back(o.size);
    const memory_region<rights::local_write> back_mr(pd, back); // a read writes into it
    std::uint64_t written = o.size;
    const memory_region<rights::local_read> note_mr(pd, &written, sizeof written);

    verbs::connection conn = verbs::connection::connect(pd, o.server, o.port, {}, {}, o.timeout);
    const std::optional<token> tok = conn.peer_payload_as<token>();
    if (!tok)
        throw std::runtime_error(fmt::format(
            "the server sent {} bytes of private data, not a token", conn.peer_payload().size()));
    fmt::print(
        "[client] connected to {}:{} from {}; server buffer: {} bytes at {:#x}, rkey {:#x}\n",
        o.server, o.port, ctx.name(), tok->length, tok->addr, tok->rkey);
    if (!tok->contains(0, o.size))
        throw std::runtime_error(
            fmt::format("-s {}: the server's buffer holds only {} bytes", o.size, tok->length));

    auto& qp = conn.qp();
    const auto t0 = steady::now();
    const std::uint64_t pieces =
        in_pieces(conn, o.size, "RDMA write", o.timeout,
                  [&](auto at, auto n) { return qp.write(source_mr.local(at, n), *tok, at, at); });
    const auto t1 = steady::now();
    in_pieces(conn, o.size, "RDMA read", o.timeout,
              [&](auto at, auto n) { return qp.read(back_mr.local(at, n), *tok, at, at); });
    const auto t2 = steady::now();
    const auto ms = [](auto d) { return std::chrono::duration<double, std::milli>(d).count(); };
    fmt::print("[client] wrote {} bytes in {:.2f} ms, read them back in {:.2f} ms{}\n", o.size,
               ms(t1 - t0), ms(t2 - t1),
               pieces == 1 ? ""
                           : fmt::format(" ({} pieces of at most {} bytes each way)", pieces,
                                         qp.max_message()));

    compare("read back", back, [&](std::size_t i) { return source[i]; });
    fmt::print("[client] verified {} bytes\n", o.size);

    // Tell the server we are done; its buffer is complete by now: the read
    // that followed the write on this queue pair returned the written bytes.
    posted(qp.send(note_mr.local(), 0), "send");
    completed(conn, "send", o.timeout);
    conn.disconnect();
    return 0;
}

} // namespace

int main(int argc, char** argv) {
    // Line-buffered, so that a server's and a client's lines on one pipe come in order.
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    try {
        const options o = parse(argc, argv);
        return o.server.empty() ? serve(o) : client(o);
    } catch (const usage_error& e) {
        fmt::print(stderr, "rdma_write: {}\n{}", e.what(), usage_text);
        return 2;
    } catch (const std::exception& e) {
        fmt::print(stderr, "rdma_write: {}\n", e.what());
        return 1;
    }
}
