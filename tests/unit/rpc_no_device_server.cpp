// The server half of test_rpc_no_device: an rpc::server built with no
// device on 127.0.0.1, in a process of its own (started with posix_spawn,
// not fork, so that ThreadSanitizer runs it too). It prints its port on
// stdout, then serves until killed, or for 60 s.
//   rpc_no_device_server [PORT [ADDRESS]]   (default 127.0.0.1)
// Methods: 1 echo; 2 a reply of as many pattern bytes as the request's first
// 4 say; 3 deferred, never answered.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <span>
#include <vector>

#include <rdmax/rpc/server.hpp>

using namespace rdmax;

int main(int argc, char** argv) try {
    rpc::rpc_options o;
    o.slots = 8;
    o.slot_bytes = 4096;
    o.housekeeping = std::chrono::microseconds(1000);
    const auto port = static_cast<std::uint16_t>(argc > 1 ? std::atoi(argv[1]) : 0);
    rpc::server s(argc > 2 ? argv[2] : "127.0.0.1", port, o);
    std::vector<rpc::deferred_call> never;
    std::vector<std::byte> reply;
    s.on(1, [](rpc::request_context& c) { c.reply(c.body()); });
    s.on(2, [&reply](rpc::request_context& c) {
        std::uint32_t n = 0;
        if (c.body().size() >= 4)
            std::memcpy(&n, c.body().data(), 4);
        reply.resize(n);
        for (std::size_t i = 0; i < n; ++i)
            reply[i] = static_cast<std::byte>((i * 7 + 9) % 251); // the test's pattern, seed 9
        c.reply(reply);
    });
    s.on(3, [&never](rpc::request_context& c) { never.push_back(c.defer()); });
    std::printf("%u\n", static_cast<unsigned>(s.port()));
    std::fflush(stdout);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < until)
        (void)s.wait(std::chrono::milliseconds(5));
    return 0;
} catch (const std::exception& e) {
    std::fprintf(stderr, "rpc_no_device_server: %s\n", e.what());
    return 1;
}
