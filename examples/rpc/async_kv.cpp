// async_kv: a key-value service written with coroutines. The server is an
// rpc::server_group whose workers run coroutine handlers on Asio (each on its
// own thread and io_context); the clients are coroutines on an rpc::async_client,
// one client and one io_context per thread, with a timeout and a cancellation.
// Every value read back is checked; the program fails on any mismatch.
// Usage: async_kv [ADDRESS|auto [WORKERS [CLIENTS [KEYS]]]]  (auto: the first
// active device's address, 2 workers, 2 clients, 200 keys each). Clients go
// through this node's memory unless RDMAX_RPC_LOCAL=0.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

// First: they set up Asio for the compiler (see there).
#include <rdmax/asio/client.hpp>
#include <rdmax/asio/server.hpp>
#include <rdmax/rdmax.hpp>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference" // in Asio's own code (see client.hpp)
#include <asio/bind_cancellation_slot.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/experimental/awaitable_operators.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>
#pragma GCC diagnostic pop

#include "first_address.hpp"

using namespace rdmax;
using namespace std::chrono_literals;
using namespace asio::experimental::awaitable_operators;

namespace {

constexpr std::uint16_t put = 1;      ///< body: key '\0' value; reply: nothing
constexpr std::uint16_t get = 2;      ///< body: key; reply: the value, or fails
constexpr std::uint16_t slow_get = 3; ///< get, after 200 ms of "disk"

std::span<const std::byte> bytes(std::string_view s) {
    return std::as_bytes(std::span(s.data(), s.size()));
}
std::string_view text(std::span<const std::byte> b) {
    return {reinterpret_cast<const char*>(b.data()), b.size()};
}

/// The service's state, shared by the workers (its own lock: the library
/// takes none on the call path, the service decides what it shares).
struct store {
    std::mutex lock;
    std::unordered_map<std::string, std::string> map;
};

/// One worker's handlers: coroutines on its own io_context's thread.
void serve(rpc::async_server& a, store& s) {
    a.on(put, [&s](rpc::async_request r) -> asio::awaitable<void> {
        const std::string_view b = text(r.body());
        const auto nul = b.find('\0');
        if (nul == std::string_view::npos) {
            r.fail(rpc::call_status::handler_failed);
            co_return;
        }
        {
            const std::lock_guard hold(s.lock);
            s.map.insert_or_assign(std::string(b.substr(0, nul)), std::string(b.substr(nul + 1)));
        }
        r.reply({});
    });
    auto lookup = [&s](rpc::async_request& r) {
        const std::lock_guard hold(s.lock);
        const auto it = s.map.find(std::string(text(r.body())));
        return it == s.map.end() ? r.fail(rpc::call_status::handler_failed)
                                 : r.reply(bytes(it->second));
    };
    a.on(get, [lookup](rpc::async_request r) -> asio::awaitable<void> {
        lookup(r);
        co_return;
    });
    a.on(slow_get, [lookup](rpc::async_request r) -> asio::awaitable<void> {
        asio::steady_timer disk(co_await asio::this_coro::executor, 200ms);
        co_await disk.async_wait(asio::use_awaitable); // other calls run meanwhile
        lookup(r);
    });
}

struct tally {
    std::atomic<int> ok{0}, wrong{0}, timed_out{0}, cancelled{0};
};

/// One client thread's work: puts and gets of its keys, 8 coroutines at once.
asio::awaitable<void> worker(rpc::async_client& c, rpc::peer_id p, int client, int from, int to,
                             tally& t) {
    constexpr auto tuple = asio::experimental::as_tuple(asio::use_awaitable);
    for (int k = from; k < to; k += 8) {
        const std::string key = fmt::format("c{}-k{}", client, k);
        const std::string value = fmt::format("value of {} ({})", key, std::string(k % 64, '*'));
        std::string body = key;
        body += '\0';
        body += value;
        (void)co_await c.async_call(p, put, bytes(body), {}, asio::use_awaitable);
        auto [ec, r] = co_await c.async_call(p, get, bytes(key), {}, tuple);
        if (!ec && text(r.reply) == value) // the reply: valid until this coroutine's next co_await
            ++t.ok;
        else
            ++t.wrong;
    }
}

/// A timeout (the call against a timer) and a cancellation by hand.
asio::awaitable<void> impatient(rpc::async_client& c, rpc::peer_id p, int client, tally& t) {
    const std::string key = fmt::format("c{}-k0", client);
    asio::steady_timer limit(co_await asio::this_coro::executor, 20ms);
    auto raced = co_await (c.async_call(p, slow_get, bytes(key), {}, asio::use_awaitable) ||
                           limit.async_wait(asio::use_awaitable));
    if (raced.index() == 1)
        ++t.timed_out; // the timer won: the call was cancelled, its buffers fenced
    asio::cancellation_signal stop;
    asio::steady_timer soon(co_await asio::this_coro::executor, 10ms);
    soon.async_wait([&](std::error_code ec) {
        if (!ec) // not when the call ended first and soon went with this frame
            stop.emit(asio::cancellation_type::terminal);
    });
    auto [ec, r] =
        co_await c.async_call(p, slow_get, bytes(key), {},
                              asio::bind_cancellation_slot(
                                  stop.slot(), asio::experimental::as_tuple(asio::use_awaitable)));
    if (r.status == rpc::call_status::cancelled)
        ++t.cancelled;
}

} // namespace

int main(int argc, char** argv) try {
    const std::string addr =
        argc > 1 && std::string_view(argv[1]) != "auto" ? argv[1] : examples::first_active_ipv4();
    const std::size_t workers = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 2;
    const int clients = argc > 3 ? std::atoi(argv[3]) : 2;
    const int keys = argc > 4 ? std::atoi(argv[4]) : 200;
    verbs::context ctx = verbs::context::open_by_address(addr);
    verbs::protection_domain pd(ctx);
    store s;
    rpc::server_group group(pd, addr, 0, workers);
    rpc::serve_with_asio(group, [&s](rpc::async_server& a, std::size_t) { serve(a, s); });
    group.start();

    tally t;
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(clients));
    const auto t0 = std::chrono::steady_clock::now();
    for (int n = 0; n < clients; ++n)
        threads.emplace_back([&, n] {
            asio::io_context io(1);
            rpc::client cli(pd); // one client, one io_context, one thread
            const rpc::peer_id p = cli.connect(addr, group.port());
            rpc::async_client c(io, cli);
            for (int lane = 0; lane < 8; ++lane)
                asio::co_spawn(io, worker(c, p, n, lane, keys, t), asio::detached);
            asio::co_spawn(io, impatient(c, p, n, t), asio::detached);
            io.run_for(120s); // returns when every coroutine ended
        });
    for (std::thread& th : threads)
        th.join();
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (std::size_t w = 0; w < workers; ++w)
        fmt::print("worker {}: {} connections, {} calls\n", w, group.counters(w).connected,
                   group.counters(w).calls);
    fmt::print("{} clients x {} keys (put, then get) on {} workers in {:.2f} s: {} ok, {} wrong; "
               "timeouts {} of {}, cancellations {} of {}\n",
               clients, keys, workers, secs, t.ok.load(), t.wrong.load(), t.timed_out.load(),
               clients, t.cancelled.load(), clients);
    const bool good =
        t.wrong == 0 && t.ok == clients * keys && t.timed_out == clients && t.cancelled == clients;
    return good ? 0 : 1;
} catch (const std::exception& e) {
    fmt::print(stderr, "async_kv: {}\n", e.what());
    return 1;
}
