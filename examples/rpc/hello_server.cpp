// hello_server: the smallest RPC service; method 1 answers "hello, " + the request.
// Usage: hello_server [ADDRESS] (an RDMA device's; default: the first active one's)
#include <chrono>
#include <iostream>
#include <string>

#include <rdmax/rdmax.hpp>

#include "first_address.hpp"

using namespace rdmax;

int main(int argc, char** argv) try {
    const std::string addr = argc > 1 ? argv[1] : examples::first_active_ipv4();
    verbs::context ctx = verbs::context::open_by_address(addr);
    verbs::protection_domain pd(ctx);
    rpc::server srv(pd, addr, 7471);
    srv.on(1, [](rpc::request_context& c) { // runs in the thread that calls wait()
        std::string reply = "hello, ";
        for (const std::byte b : c.body())
            reply += static_cast<char>(b);
        c.reply(std::as_bytes(std::span(reply)));
    });
    std::cout << "hello_server: serving on " << addr << ':' << srv.port() << std::endl;
    for (;;)
        (void)srv.wait(std::chrono::milliseconds(100)); // serves until killed
} catch (const std::exception& e) {
    std::cerr << "hello_server: " << e.what() << '\n';
    return 1;
}
