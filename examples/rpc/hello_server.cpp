// hello_server: the smallest RPC service; method 1 answers "hello, " + the request.
// Usage: hello_server [ADDRESS] (an RDMA device's; default: the first active one's,
// or 127.0.0.1 on a machine with no RDMA device: then it serves this node only)
#include <chrono>
#include <iostream>
#include <optional>
#include <string>

#include <rdmax/rdmax.hpp>

#include "first_address.hpp"

using namespace rdmax;

int main(int argc, char** argv) try {
    std::optional<verbs::context> dev = examples::active_device(); // none: no RDMA here
    const std::string addr = argc > 1 ? argv[1] : dev ? examples::first_active_ipv4() : "127.0.0.1";
    std::optional<verbs::protection_domain> pd;
    std::optional<rpc::server> srv;
    if (dev) // the device that carries addr; clients on this node still take shared memory
        srv.emplace(pd.emplace(dev.emplace(verbs::context::open_by_address(addr))), addr, 7471);
    else // no device: clients on this node only (shared memory, CMA)
        srv.emplace(addr, 7471);
    srv->on(1, [](rpc::request_context& c) { // runs in the thread that calls wait()
        std::string reply = "hello, ";
        for (const std::byte b : c.body())
            reply += static_cast<char>(b);
        c.reply(std::as_bytes(std::span(reply)));
    });
    std::cout << "hello_server: serving on " << addr << ':' << srv->port()
              << (dev ? "" : " (no RDMA device: this node's clients only)") << std::endl;
    for (;;)
        (void)srv->wait(std::chrono::milliseconds(100)); // serves until killed
} catch (const std::exception& e) {
    std::cerr << "hello_server: " << e.what() << '\n';
    return 1;
}
