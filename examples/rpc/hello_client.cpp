// hello_client: calls hello_server's method 1 with a name and prints the reply.
// Usage: hello_client SERVER_ADDRESS [NAME] (with no RDMA device here, the
// server must be on this node: the call goes through shared memory)
#include <iostream>
#include <optional>
#include <span>
#include <string_view>

#include <rdmax/rdmax.hpp>

#include "first_address.hpp"

using namespace rdmax;

int main(int argc, char** argv) try {
    if (argc < 2) {
        std::cerr << "usage: hello_client SERVER_ADDRESS [NAME]\n";
        return 2;
    }
    std::optional<verbs::context> dev = examples::active_device(); // none: no RDMA here
    std::optional<verbs::protection_domain> pd;
    std::optional<rpc::client> cli;
    if (dev)
        cli.emplace(pd.emplace(*dev));
    else
        cli.emplace(); // servers on this node only
    const rpc::peer_id server = cli->connect(argv[1], 7471);
    const std::string_view name = argc > 2 ? argv[2] : "world";
    const rpc::call_result r = cli->call(server, 1, std::as_bytes(std::span(name)));
    if (r.status != rpc::call_status::ok)
        throw std::runtime_error(std::string(rpc::to_string(r.status)));
    std::cout << std::string_view(reinterpret_cast<const char*>(r.reply.data()), r.reply.size())
              << (cli->is_local(server) ? " (through this node's memory)\n"
                                        : " (through the RDMA device)\n");
} catch (const std::exception& e) { // e.g. nobody serves there, or no reply in time
    std::cerr << "hello_client: " << e.what() << '\n';
    return 1;
}
