// kv_service: a key-value service over rdmax::rpc, its values in registered
// memory (a std::pmr map on a registered_arena), and a client that checks it.
//
//   server:  kv_service --server [--addr ADDR] [--port PORT] [--clients N] [--timeout SECONDS]
//   client:  kv_service --connect ADDR [--port PORT] [--ops N] [--clients C] [--verify]
//
// Methods: 1 put (key, value), 2 get (key) -> value, 3 erase (key). The
// first reply byte says found (0) or not (1). Values of up to 1 MiB: those
// over a slot travel by RDMA READ from the caller's buffer (put) or are
// written into the buffer the caller offers (get).
//
// The client opens C connections (one rpc::client each, all in one thread)
// and runs N rounds of put, get and check over keys and value sizes from
// 16 B to 200 KiB, then erases every key and checks that it is gone. Exit
// status 0 when every answer was right; the server's once N clients came and
// went with no protocol violation.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <getopt.h>
#include <map>
#include <memory_resource>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

#include "first_address.hpp"

namespace {

using namespace rdmax;
using steady = std::chrono::steady_clock;
constexpr std::uint16_t m_put = 1, m_get = 2, m_erase = 3;
constexpr std::size_t max_value = 1U << 20;

struct options {
    bool server = false;
    std::string addr;
    std::uint16_t port = 7472;
    int clients = 0; // server: clients to serve before exiting; client: connections
    int timeout_s = 600;
    long ops = 1000;
    bool verify = false;
};

[[noreturn]] void usage() {
    std::fputs("usage:\n"
               "  kv_service --server [--addr ADDR] [--port PORT] [--clients N] [--timeout S]\n"
               "  kv_service --connect ADDR [--port PORT] [--ops N] [--clients C] [--verify]\n",
               stderr);
    std::exit(2);
}

options parse(int argc, char** argv) {
    static const option longs[] = {
        {"server", no_argument, nullptr, 'S'},        {"connect", required_argument, nullptr, 'c'},
        {"addr", required_argument, nullptr, 'a'},    {"port", required_argument, nullptr, 'p'},
        {"clients", required_argument, nullptr, 'N'}, {"timeout", required_argument, nullptr, 't'},
        {"ops", required_argument, nullptr, 'n'},     {"verify", no_argument, nullptr, 'v'},
        {"help", no_argument, nullptr, 'h'},          {nullptr, 0, nullptr, 0}};
    options o;
    for (int c; (c = getopt_long(argc, argv, "", longs, nullptr)) != -1;) {
        switch (c) {
        case 'S': o.server = true; break;
        case 'c':
        case 'a': o.addr = optarg; break;
        case 'p': o.port = static_cast<std::uint16_t>(std::atoi(optarg)); break;
        case 'N': o.clients = std::atoi(optarg); break;
        case 't': o.timeout_s = std::atoi(optarg); break;
        case 'n': o.ops = std::atol(optarg); break;
        case 'v': o.verify = true; break;
        default: usage();
        }
    }
    if (optind != argc || (!o.server && o.addr.empty()))
        usage();
    return o;
}

/// put's body: a 2-byte key length, the key, the value.
std::vector<std::byte> put_body(const std::string& key, std::span<const std::byte> value) {
    std::vector<std::byte> b(2 + key.size() + value.size());
    const auto n = static_cast<std::uint16_t>(key.size());
    std::memcpy(b.data(), &n, 2);
    std::memcpy(b.data() + 2, key.data(), key.size());
    std::copy(value.begin(), value.end(), b.begin() + 2 + static_cast<std::ptrdiff_t>(key.size()));
    return b;
}

/// The store: keys and values in the arena's registered memory.
class store {
public:
    explicit store(registered_arena& arena)
        : mem_(arena)
        , map_(&mem_) {}

    void serve(rpc::server& srv) {
        srv.on(m_put, [this](rpc::request_context& c) {
            const auto b = c.body();
            std::uint16_t n = 0;
            if (b.size() < 2 || (std::memcpy(&n, b.data(), 2), b.size() < 2U + n) ||
                b.size() - 2 - n > max_value)
                return c.fail(rpc::call_status::handler_failed);
            std::pmr::string key(reinterpret_cast<const char*>(b.data() + 2), n, &mem_);
            const auto value = b.subspan(2U + n);
            auto& v = map_[std::move(key)];
            v.assign(value.begin(), value.end());
            const std::byte found{0};
            c.reply({&found, 1});
        });
        srv.on(m_get, [this](rpc::request_context& c) {
            const std::string key(reinterpret_cast<const char*>(c.body().data()), c.body().size());
            const auto it = map_.find(std::pmr::string(key, &mem_));
            if (it == map_.end()) {
                const std::byte missing{1};
                return c.reply({&missing, 1});
            }
            // The answer: a found byte, then the value (over the slot it goes
            // into the caller's buffer).
            reply_.resize(1 + it->second.size());
            reply_[0] = std::byte{0};
            std::copy(it->second.begin(), it->second.end(), reply_.begin() + 1);
            c.reply(reply_);
        });
        srv.on(m_erase, [this](rpc::request_context& c) {
            const std::string key(reinterpret_cast<const char*>(c.body().data()), c.body().size());
            const std::byte found{map_.erase(std::pmr::string(key, &mem_)) == 1 ? std::byte{0}
                                                                                : std::byte{1}};
            c.reply({&found, 1});
        });
    }
    [[nodiscard]] std::size_t size() const noexcept { return map_.size(); }

private:
    registered_arena::resource mem_;
    std::pmr::map<std::pmr::string, std::pmr::vector<std::byte>> map_;
    std::vector<std::byte> reply_;
};

int serve(const options& o) {
    // The device that carries the address (a wildcard names none).
    const std::string addr = o.addr.empty() ? examples::first_active_ipv4() : o.addr;
    verbs::context ctx = verbs::context::open_by_address(addr);
    verbs::protection_domain pd(ctx);
    registered_arena arena(verbs_registrar(pd), arena_options{.area_rights = rights::local_write});
    store kv(arena);
    rpc::server srv(pd, addr, o.port);
    kv.serve(srv);
    fmt::print("kv_service: serving on {}:{} ({})\n", addr, srv.port(), ctx.name());
    std::fflush(stdout);
    const auto deadline = steady::now() + std::chrono::seconds(o.timeout_s);
    while (steady::now() < deadline) {
        (void)srv.wait(std::chrono::milliseconds(50));
        if (o.clients > 0 && srv.counters().connected >= static_cast<std::uint64_t>(o.clients) &&
            srv.peers() == 0)
            break;
    }
    fmt::print("kv_service: {} keys; server {}\n", kv.size(), srv.counters());
    // Served: N clients came and all of them left. A deadline that cuts a
    // client off mid-run is a failure, not a pass.
    const bool served =
        o.clients == 0 ||
        (srv.counters().connected >= static_cast<std::uint64_t>(o.clients) && srv.peers() == 0);
    if (o.clients > 0 && srv.peers() != 0)
        fmt::print(stderr,
                   "kv_service: the deadline ({} s) passed with {} client(s) still connected\n",
                   o.timeout_s, srv.peers());
    return served && srv.counters().rejected() == 0 ? 0 : 1;
}

int run_client(const options& o) {
    verbs::context ctx = verbs::context::open_first_active();
    verbs::protection_domain pd(ctx);
    const int conns = std::max(1, o.clients);
    std::vector<std::unique_ptr<rpc::client>> cs;
    std::vector<rpc::peer_id> peers;
    for (int i = 0; i < conns; ++i) {
        cs.push_back(std::make_unique<rpc::client>(pd));
        for (int attempt = 0;; ++attempt) {
            try {
                peers.push_back(cs.back()->connect(o.addr, o.port));
                break;
            } catch (const std::exception&) {
                if (attempt >= 20)
                    throw;
                std::this_thread::sleep_for(std::chrono::milliseconds(500));
            }
        }
    }
    constexpr std::size_t sizes[] = {16, 1000, 4000, 20'000, 200'000};
    constexpr long keys = 64;
    std::vector<std::byte> value, reply_buf(max_value + 1);
    long bad = 0, done = 0;
    const auto expect = [&](bool ok, const std::string& what) {
        if (!ok) {
            ++bad;
            fmt::print(stderr, "kv_service: {}\n", what);
        }
    };
    const auto t0 = steady::now();
    for (long i = 0; i < o.ops; ++i) {
        const auto c = static_cast<std::size_t>(i % conns);
        const std::string key = fmt::format("key-{}", i % keys);
        value.resize(sizes[static_cast<std::size_t>(i) % std::size(sizes)]);
        for (std::size_t j = 0; j < value.size(); ++j)
            value[j] = static_cast<std::byte>((static_cast<std::size_t>(i) * 7 + j) % 251);
        const auto body = put_body(key, value);
        const rpc::call_result p = cs[c]->call(peers[c], m_put, body);
        expect(p.status == rpc::call_status::ok && p.reply.size() == 1,
               fmt::format("put {}: {}", key, p.status));
        // Read it back through another connection: the store is shared.
        const auto g = static_cast<std::size_t>((i + 1) % conns);
        const rpc::call_result r =
            cs[g]->call(peers[g], m_get, std::as_bytes(std::span(key.data(), key.size())),
                        {.reply_into = reply_buf});
        const bool same = r.status == rpc::call_status::ok && r.reply.size() == 1 + value.size() &&
                          r.reply[0] == std::byte{0} &&
                          (!o.verify || std::equal(r.reply.begin() + 1, r.reply.end(),
                                                   value.begin(), value.end()));
        expect(same,
               fmt::format("get {} ({} B): {}, {} B", key, value.size(), r.status, r.reply.size()));
        done += 2;
    }
    for (long k = 0; k < std::min(keys, o.ops); ++k) {
        const std::string key = fmt::format("key-{}", k);
        const auto kb = std::as_bytes(std::span(key.data(), key.size()));
        const rpc::call_result e = cs[0]->call(peers[0], m_erase, kb);
        expect(e.status == rpc::call_status::ok && e.reply.size() == 1 &&
                   e.reply[0] == std::byte{0},
               fmt::format("erase {}", key));
        const rpc::call_result g = cs[0]->call(peers[0], m_get, kb, {.reply_into = reply_buf});
        expect(g.status == rpc::call_status::ok && g.reply.size() == 1 &&
                   g.reply[0] == std::byte{1},
               fmt::format("get {} after erase", key));
        done += 2;
    }
    const double secs = std::chrono::duration<double>(steady::now() - t0).count();
    fmt::print("kv_service: {} operations over {} connections ({}) in {:.2f} s, {} wrong{}\n", done,
               conns,
               cs[0]->is_local(peers[0]) ? "through this node's memory" : "through the RDMA device",
               secs, bad, o.verify ? " (every value checked)" : "");
    fmt::print("kv_service: client 0 {}\n", cs[0]->counters());
    if (const auto sc = cs[0]->scheduler_counters(peers[0]))
        fmt::print("kv_service: client 0 scheduler: {}\n", *sc);
    return bad == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
    try {
        const options o = parse(argc, argv);
        return o.server ? serve(o) : run_client(o);
    } catch (const std::exception& e) {
        fmt::print(stderr, "kv_service: {}\n", e.what());
        return 1;
    }
}
