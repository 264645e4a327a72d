// group_echo: a server on many threads (rpc::server_group) and clients on
// many threads, one rpc::client per thread: the pattern for a service that
// calls from several threads. Every reply is checked; per-worker counters.
// Usage: group_echo [ADDRESS|auto [WORKERS [CLIENTS [CALLS]]]]  (auto: the first
// active device's address, 2 workers, 4 clients, 1000 calls each). Clients go
// through this node's memory unless RDMAX_RPC_LOCAL=0.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

#include "first_address.hpp"

using namespace rdmax;

int main(int argc, char** argv) try {
    const std::string addr =
        argc > 1 && std::string_view(argv[1]) != "auto" ? argv[1] : examples::first_active_ipv4();
    const std::size_t workers = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 2;
    const std::size_t clients = argc > 3 ? std::strtoul(argv[3], nullptr, 10) : 4;
    const int calls = argc > 4 ? std::atoi(argv[4]) : 1000;
    verbs::context ctx = verbs::context::open_by_address(addr);
    verbs::protection_domain pd(ctx);
    rpc::server_group group(pd, addr, 0, workers);
    // Each worker calls its own copy, on its thread: connections of
    // different workers run their handlers at once (share nothing unguarded).
    group.on(1, [](rpc::request_context& c) { c.reply(c.body()); });
    group.start();
    std::atomic<int> wrong{0};
    std::vector<std::thread> threads;
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t k = 0; k < clients; ++k)
        threads.emplace_back([&, k] {
            rpc::client cli(pd); // one client per thread: a client is not thread-safe
            const rpc::peer_id p = cli.connect(addr, group.port());
            for (int i = 0; i < calls; ++i) {
                const std::string body = fmt::format("client {} call {}", k, i);
                const rpc::call_result r = cli.call(p, 1, std::as_bytes(std::span(body)));
                if (r.status != rpc::call_status::ok || r.reply.size() != body.size() ||
                    std::memcmp(r.reply.data(), body.data(), body.size()) != 0)
                    ++wrong;
            }
        });
    for (std::thread& t : threads)
        t.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (std::size_t w = 0; w < workers; ++w)
        fmt::print("worker {}: {} connections, {} calls\n", w, group.counters(w).connected,
                   group.counters(w).calls);
    fmt::print("{} clients x {} calls on {} workers: {:.0f} calls/s, {} wrong\n", clients, calls,
               workers, static_cast<double>(clients) * calls / s, wrong.load());
    (void)group.drain(std::chrono::seconds(5));
    return wrong.load() == 0 ? 0 : 1;
} catch (const std::exception& e) {
    std::cerr << "group_echo: " << e.what() << '\n';
    return 1;
}
