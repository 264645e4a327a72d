// A connection torn down while its soft-RoCE port is down must not break
// rdma_cm for the port: the teardown's DREQ would move rxe's QP1 to the
// error state for good (include/rdmax/detail/verbs/parked_ids.hpp). The test
// makes its own netdev and rxe device (root, rdma_rxe), so that taking the
// link down disturbs no other test, and has them removed once it exits.
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <optional>
#include <string>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/detail/verbs/parked_ids.hpp>
#include <rdmax/rdmax.hpp>

#include "../support/catch.hpp"
#include "../support/eventually.hpp"
#include "../support/skip_reason.hpp"
#include "../support/test_device.hpp"

using namespace rdmax;
using namespace std::chrono_literals;

namespace {

// A benchmarking range (RFC 2544), never a private one; its own /24.
constexpr const char* netdev = "rdmaxld0";
constexpr const char* device = "rxeld0";
constexpr const char* address = "198.18.0.1";
constexpr const char* mapped_gid = "0000:0000:0000:0000:0000:ffff:c612:0001";

bool run(const std::string& cmd) {
    return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0; // NOLINT(cert-env33-c): test setup
}

std::string port_file(const char* what) {
    return fmt::format("/sys/class/infiniband/{}/ports/1/{}", device, what);
}

bool port_is(const char* state) {
    std::ifstream f(port_file("state"));
    std::string line;
    return std::getline(f, line) && line.find(state) != std::string::npos;
}

bool has_gid() {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(port_file("gids"), ec)) {
        std::ifstream f(e.path());
        std::string gid;
        if (std::getline(f, gid) && gid == mapped_gid)
            return true;
    }
    return false;
}

/// The private netdev and its rxe device, removed when the test ends.
struct private_device {
    private_device() {
        remove();
        REQUIRE(run(fmt::format("ip link add {} type dummy", netdev)));
        REQUIRE(run(fmt::format("ip addr add {}/24 dev {}", address, netdev)));
        REQUIRE(run(fmt::format("ip link set {} up", netdev)));
        REQUIRE(run(fmt::format("rdma link add {} type rxe netdev {}", device, netdev)));
        up();
    }
    // Removed once this process is gone: librdmacm keeps every device open
    // until exit, and deleting a device waits for its users to close it.
    ~private_device() {
        (void)run(fmt::format("(while kill -0 {} 2>/dev/null; do sleep 0.1; done; rdma link "
                              "delete {}; ip link del {}) </dev/null >/dev/null 2>&1 &",
                              getpid(), device, netdev));
    }
    private_device(const private_device&) = delete;
    private_device& operator=(const private_device&) = delete;
    static void remove() {
        (void)run(fmt::format("rdma link delete {}", device));
        (void)run(fmt::format("ip link del {}", netdev));
    }
    static void up() {
        REQUIRE(run(fmt::format("ip link set {} up", netdev)));
        REQUIRE(rdmax::test::eventually([] { return port_is("ACTIVE") && has_gid(); }, 20s));
    }
    static void down() {
        REQUIRE(run(fmt::format("ip link set {} down", netdev)));
        REQUIRE(rdmax::test::eventually([] { return !port_is("ACTIVE"); }, 20s));
    }
};

struct connected_pair {
    verbs::listener l{address, 0};
    verbs::context ctx = l.device();
    verbs::protection_domain pd{ctx};
    std::optional<verbs::connection> server;
    std::optional<verbs::connection> client;
    connected_pair() {
        auto accepted = std::async(std::launch::async, [&] { return l.accept(pd, {}, {}, 15s); });
        client.emplace(verbs::connection::connect(pd, address, l.port(), {}, {}, 15s));
        server.emplace(accepted.get());
    }
};

} // namespace

std::optional<std::string> rdmax::test::skip_reason() {
    if (geteuid() != 0)
        return "makes its own netdev and soft-RoCE device: needs root";
    if (!run("rdma -V") || !run("ip -V"))
        return "needs the ip and rdma tools (iproute2)";
    if (!std::filesystem::exists("/sys/module/rdma_rxe") && !run("modprobe rdma_rxe"))
        return "needs the rdma_rxe module (soft-RoCE)";
    return std::nullopt;
}

TEST_CASE("connections torn down while the link is down leave rdma_cm working") {
    private_device dev;
    {
        connected_pair first;
        private_device::down();
        // Both ends go while no MAD can leave: their ids are parked, not
        // destroyed (which would send DREQs and break QP1).
        first.client.reset();
        first.server.reset();
        CHECK(verbs::detail::parked_ids() == 2);
        // A connect through the down port is refused at once, not sent.
        CHECK_THROWS_AS(verbs::connection::connect(first.pd, address, first.l.port(), {}, {}, 5s),
                        rdmax::error);
        private_device::up();
    }
    // The port is back: the parked ids go before the next connection, and
    // the handshake (REQ, REP, RTU through QP1) works again.
    connected_pair second;
    CHECK(verbs::detail::parked_ids() == 0);
    CHECK(second.client->established());
}
