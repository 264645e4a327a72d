// A connection's far end in another process, for the tests that need one to
// vanish: connects to ADDR:PORT, sends its buffer's token, says "connected"
// on stdout, then waits to be killed (for at most 60 s, so that it never
// outlives a broken test).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

int main(int argc, char** argv) {
    using namespace rdmax;
    if (argc != 3) {
        fmt::print(stderr, "usage: rxe_peer ADDR PORT\n");
        return 2;
    }
    try {
        verbs::context ctx = verbs::context::open_by_address(argv[1]);
        verbs::protection_domain pd(ctx);
        std::vector<std::byte> bytes(4096);
        memory_region<rights::local_write | rights::remote_write> mr(pd, bytes.data(),
                                                                     bytes.size());
        const auto token = mr.remote();
        verbs::connection c = verbs::connection::connect(
            pd, argv[1], static_cast<std::uint16_t>(std::atoi(argv[2])), verbs::payload_of(token));
        fmt::print("connected\n");
        std::fflush(stdout);
        std::this_thread::sleep_for(std::chrono::seconds(60));
        return 0;
    } catch (const std::exception& e) {
        fmt::print(stderr, "rxe_peer: {}\n", e.what());
        return 1;
    }
}
