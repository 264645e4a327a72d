// hello_client: calls hello_server's method 1 with a name and prints the reply.
// Usage: hello_client SERVER_ADDRESS [NAME]
#include <iostream>
#include <span>
#include <string_view>

#include <rdmax/rdmax.hpp>

using namespace rdmax;

int main(int argc, char** argv) try {
    if (argc < 2) {
        std::cerr << "usage: hello_client SERVER_ADDRESS [NAME]\n";
        return 2;
    }
    verbs::context ctx = verbs::context::open_first_active();
    verbs::protection_domain pd(ctx);
    rpc::client cli(pd);
    const rpc::peer_id server = cli.connect(argv[1], 7471);
    const std::string_view name = argc > 2 ? argv[2] : "world";
    const rpc::call_result r = cli.call(server, 1, std::as_bytes(std::span(name)));
    if (r.status != rpc::call_status::ok)
        throw std::runtime_error(std::string(rpc::to_string(r.status)));
    std::cout << std::string_view(reinterpret_cast<const char*>(r.reply.data()), r.reply.size())
              << (cli.is_local(server) ? " (through this node's memory)\n"
                                       : " (through the RDMA device)\n");
} catch (const std::exception& e) { // e.g. nobody serves there, or no reply in time
    std::cerr << "hello_client: " << e.what() << '\n';
    return 1;
}
