// allreduce: a hierarchical allreduce (sum) of float vectors: the ranks of a
// node reduce through shared memory (local::node_team: no device), one rank
// per node (its leader) runs a ring over RDMA writes with the other nodes'
// leaders (rdma_cm), and each leader hands the result to its node. The one to
// copy; the measurement driver with every memory mode, timing and JSON output
// is examples/bench/rdmax_allreduce_bench (the ring alone).
//
//   allreduce -r RANK -n RANKS [--per-node K] [-a ADDR | -H HOST0,HOST1,...]
//             [-p BASE_PORT] [-c FLOATS] [-i ITERATIONS]
//
// Ranks are placed node by node: ranks [kK, (k+1)K) are node k (mpirun's
// default placement; checked against its local rank). Rank and size come
// from -r/-n or from mpirun (OMPI_COMM_WORLD_*, K from
// OMPI_COMM_WORLD_LOCAL_SIZE); node k's
// leader listens on HOSTk (-H; or every node on -a ADDR) at BASE_PORT + k.
// examples/allreduce-local starts the N ranks on this machine, e.g.
//   ALLREDUCE=build/examples/allreduce examples/allreduce-local -n 4 --per-node 2
// (two "nodes" of two ranks on one machine: two node teams, a ring of two).
//
// Between the leaders: the vector is cut into N chunks; in N-1 reduce-scatter steps
// each rank writes one chunk into its right neighbour's staging vector and adds
// the chunk its left neighbour wrote; in N-1 allgather steps the summed chunks
// go round once more, written straight into the neighbour's vector. Each write
// carries an immediate, which raises a receive completion at the neighbour only
// once all the chunk's bytes are there: the arrival costs no extra message.
// Two leaders skip the ring's two steps: recursive doubling on two is one
// exchange, each writing its whole vector into the other's staging vector
// and adding what came (the same bytes, one latency instead of two). With
// more leaders it needs links beyond the ring's (leader k and k XOR 2^j):
// the ring serves them. Every leader knows the leader count, so all agree.
// The vectors live in a registered arena, so nothing is registered per call.
// On a node: local::allreduce reduces by shares in the ranks' windows, then
// local::broadcast copies the leader's result out (docs/local.md).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <getopt.h>
#include <memory_resource>
#include <optional>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <rdmax/local/node_team.hpp>
#include <rdmax/local/team_allreduce.hpp>
#include <rdmax/local/team_broadcast.hpp>
#include <rdmax/rdmax.hpp>

using namespace rdmax;
using namespace std::chrono_literals;

namespace {

constexpr rights vec_rights = rights::local_write | rights::remote_write;
using token = remote_buffer<rights::remote_write>;
/// What a leader tells its left neighbour, which writes into it.
struct tokens {
    token vector;
    token staging;
};

struct options {
    int rank = -1, ranks = 0, per_node = 0, port = 7600, iterations = 3;
    std::string addr = "192.0.2.1";
    std::vector<std::string> hosts; ///< -H: node k's leader's address
    std::size_t count = 1024;       ///< floats per vector, a multiple of the nodes
    [[nodiscard]] int node() const { return rank / per_node; }
    [[nodiscard]] int nodes() const { return ranks / per_node; }
    [[nodiscard]] const std::string& host(int node) const {
        return hosts.empty() ? addr : hosts[static_cast<std::size_t>(node)];
    }
};

/// The immediate names the call, the phase and the step: the receiver checks it.
std::uint32_t tag(int iteration, int phase, int step) {
    return static_cast<std::uint32_t>(iteration) << 16 | static_cast<std::uint32_t>(phase) << 8 |
           static_cast<std::uint32_t>(step);
}

void expect(status s, const char* what) {
    if (s != status::ok)
        throw std::runtime_error(std::string(what) + ": " + std::string(to_string(s)));
}

/// Waits for one completion on the queue's side; throws on a failure or the deadline.
template <class Wait>
verbs::completion one(Wait wait, const char* what) {
    verbs::completion c[1];
    if (wait(std::span(c)) != 1)
        throw std::runtime_error(std::string(what) + ": no completion within 30 s");
    if (!c[0].ok())
        throw std::runtime_error(std::string(what) + ": " + std::string(c[0].status_name()));
    return c[0];
}

/// The ring between the nodes' leaders over RDMA: node k's leader is ring rank k.
class leader_ring {
public:
    explicit leader_ring(const options& o)
        : me_(o.node())
        , size_(o.nodes())
        , chunk_(o.count / static_cast<std::size_t>(o.nodes()))
        , ctx_(verbs::context::open_by_address(o.host(o.node())))
        , pd_(ctx_)
        , arena_(verbs_registrar(pd_), arena_options{}.with_env())
        , res_(arena_)
        , vec_(o.count, &res_)
        , staging_(size_ == 2 ? 2 * o.count : o.count, &res_) {
        connect(o);
    }
    /// The leader's vector: registered, so the neighbour writes straight into it.
    [[nodiscard]] std::span<float> data() { return vec_; }

    /// Sums data() over the leaders (each holding its node's sum).
    void allreduce(int it) {
        if (size_ == 2) {
            exchange(it);
            return;
        }
        for (int s = 0; s < size_ - 1; ++s) { // reduce-scatter
            send(mod(me_ - s), peer_.staging, tag(it, 0, s));
            arrived(tag(it, 0, s));
            const std::size_t c = mod(me_ - s - 1);
            for (std::size_t i = c * chunk_; i < (c + 1) * chunk_; ++i)
                vec_[i] += staging_[i];
        }
        for (int s = 0; s < size_ - 1; ++s) { // allgather
            send(mod(me_ + 1 - s), peer_.vector, tag(it, 1, s));
            arrived(tag(it, 1, s));
        }
    }
    void close() {
        right_->disconnect();
        left_->disconnect();
    }

private:
    /// Two leaders: each writes its whole vector into the half of the other's
    /// staging vector that the call's parity picks (the other may still be
    /// adding the last call's, but not the one before: it must have sent its
    /// own write of the last call first), then adds what the other wrote.
    void exchange(int it) {
        const std::size_t half = static_cast<std::size_t>(it & 1) * vec_.size();
        const std::uint32_t imm = tag(it, 2, 0);
        expect(right_->qp().write_imm(
                   arena_.local<vec_rights>(vec_.data(), vec_.size() * sizeof(float)),
                   peer_.staging, half * sizeof(float), imm, imm),
               "write_imm");
        one([&](std::span<verbs::completion> out) { return right_->wait_send(out, 30s); },
            "write_imm");
        arrived(imm);
        for (std::size_t i = 0; i < vec_.size(); ++i)
            vec_[i] += staging_[half + i];
    }
    void connect(const options& o);
    void send(std::size_t c, const token& dst, std::uint32_t imm) {
        expect(right_->qp().write_imm(arena_.local<vec_rights>(&vec_[c * chunk_], bytes()), dst,
                                      c * bytes(), imm, imm),
               "write_imm");
        one([&](std::span<verbs::completion> out) { return right_->wait_send(out, 30s); },
            "write_imm");
    }
    void arrived(std::uint32_t imm) {
        const verbs::completion c = one(
            [&](std::span<verbs::completion> out) { return left_->wait_recv(out, 30s); }, "recv");
        if (!c.has_imm || c.imm != imm)
            throw std::runtime_error("a write arrived out of order");
        expect(left_->qp().post_recv(arena_.local<vec_rights>(staging_.data(), 1), 0), "post_recv");
    }
    [[nodiscard]] std::size_t mod(int k) const {
        return static_cast<std::size_t>((k % size_ + size_) % size_);
    }
    [[nodiscard]] std::size_t bytes() const { return chunk_ * sizeof(float); }

    int me_, size_;
    std::size_t chunk_;
    verbs::context ctx_;
    verbs::protection_domain pd_;
    registered_arena arena_;
    registered_arena::resource res_;
    std::pmr::vector<float> vec_, staging_;
    std::optional<verbs::connection> left_, right_;
    tokens peer_{};
};

void leader_ring::connect(const options& o) {
    const tokens mine{
        arena_.remote<rights::remote_write>(vec_.data(), vec_.size() * sizeof(float)),
        arena_.remote<rights::remote_write>(staging_.data(), staging_.size() * sizeof(float))};
    // The left neighbour connects to us; we connect to the right one. Both at
    // once (a thread accepts), or every leader would wait in connect.
    verbs::listener listener(o.host(me_), static_cast<std::uint16_t>(o.port + me_));
    std::exception_ptr accept_failed;
    std::thread acceptor([&] {
        try {
            verbs::connection_request req = listener.next_request(30s);
            verbs::queue_pair<verbs::rc>& qp = req.create_qp(pd_);
            // Receives first: the neighbour may write as soon as it is connected.
            for (int i = 0; i < 2 * size_; ++i)
                expect(qp.post_recv(arena_.local<vec_rights>(staging_.data(), 1), 0), "post_recv");
            left_.emplace(req.accept(verbs::payload_of(mine)));
        } catch (...) {
            accept_failed = std::current_exception();
        }
    });
    const int right = (me_ + 1) % size_;
    for (auto until = std::chrono::steady_clock::now() + 30s; !right_;) {
        try { // the neighbour may not listen yet: try again until the deadline
            right_.emplace(verbs::connection::connect(pd_, o.host(right),
                                                      static_cast<std::uint16_t>(o.port + right)));
        } catch (const rdmax::error&) {
            if (std::chrono::steady_clock::now() > until)
                throw;
            std::this_thread::sleep_for(50ms);
        }
    }
    acceptor.join();
    if (accept_failed)
        std::rethrow_exception(accept_failed);
    const auto peer = right_->peer_payload_as<tokens>();
    if (!peer)
        throw std::runtime_error("the right neighbour sent no tokens");
    peer_ = *peer;
}

/// The node's team's name: one per job and node (the launcher's job id, else
/// the port), hashed where the job id is long (a team's name has 80 bytes).
std::string team_name(const options& o) {
    const char* job = std::getenv("PMIX_NAMESPACE");
    std::string id = job != nullptr ? job : std::to_string(o.port);
    if (id.size() > 48)
        id = std::to_string(std::hash<std::string>{}(id));
    return "allreduce-" + id + "-node" + std::to_string(o.node());
}

int run(const options& o) {
    std::optional<local::node_team> team;
    if (o.per_node > 1)
        team.emplace(team_name(o), o.rank % o.per_node, o.per_node);
    std::optional<leader_ring> ring;
    if (o.rank % o.per_node == 0 && o.nodes() > 1)
        ring.emplace(o);
    std::vector<float> plain(ring ? 0 : o.count);
    const std::span<float> vec = ring ? ring->data() : std::span<float>(plain);
    const int n = o.ranks;
    const int rank_sum = n * (n - 1) / 2; // 0 + 1 + ... + (n - 1)
    for (int it = 0; it < o.iterations; ++it) {
        for (std::size_t i = 0; i < o.count; ++i) // small integers: float sums are exact
            vec[i] = static_cast<float>(o.rank + static_cast<int>(i % 7) + it);
        if (team)
            local::allreduce(*team, vec); // the node's sum, on every rank of the node
        if (ring)
            ring->allreduce(it); // the leaders: every node's sum
        if (team)
            local::broadcast(*team, vec, 0); // from the leader to its node
        for (std::size_t i = 0; i < o.count; ++i) {
            const auto want = static_cast<float>(rank_sum + n * (static_cast<int>(i % 7) + it));
            if (vec[i] != want) {
                std::fprintf(stderr, "rank %d, call %d: element %zu is %g, expected %g\n", o.rank,
                             it, i, static_cast<double>(vec[i]), static_cast<double>(want));
                return 1;
            }
        }
    }
    std::printf("rank %d: %d allreduces of %zu floats over %d ranks (%d nodes of %d), every "
                "element checked\n",
                o.rank, o.iterations, o.count, o.ranks, o.nodes(), o.per_node);
    if (ring)
        ring->close();
    return 0;
}

/// -r, -n, --per-node from mpirun's environment where the command line did not say.
void from_launcher(options& o) {
    const auto env = [](const char* name, int& into) {
        if (const char* v = std::getenv(name); v != nullptr && into <= 0)
            into = std::atoi(v);
    };
    if (o.rank < 0)
        if (const char* v = std::getenv("OMPI_COMM_WORLD_RANK"))
            o.rank = std::atoi(v);
    env("OMPI_COMM_WORLD_SIZE", o.ranks);
    env("OMPI_COMM_WORLD_LOCAL_SIZE", o.per_node);
    if (o.per_node <= 0)
        o.per_node = 1;
}

/// Under mpirun, the ranks must be placed node by node (the team of node k
/// is ranks kK..): another placement would join ranks of different nodes.
bool placed_by_node(const options& o) {
    const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    return local == nullptr || std::atoi(local) == o.rank % o.per_node;
}

std::vector<std::string> split(const std::string& list) {
    std::vector<std::string> out;
    std::stringstream in(list);
    for (std::string item; std::getline(in, item, ',');)
        out.push_back(item);
    return out;
}

} // namespace

int main(int argc, char** argv) {
    options o;
    const option longs[] = {{"per-node", required_argument, nullptr, 'K'},
                            {nullptr, 0, nullptr, 0}};
    for (int c; (c = getopt_long(argc, argv, "r:n:a:H:p:c:i:h", longs, nullptr)) != -1;) {
        switch (c) {
        case 'r': o.rank = std::atoi(optarg); break;
        case 'n': o.ranks = std::atoi(optarg); break;
        case 'K': o.per_node = std::atoi(optarg); break;
        case 'a': o.addr = optarg; break;
        case 'H': o.hosts = split(optarg); break;
        case 'p': o.port = std::atoi(optarg); break;
        case 'c': o.count = std::strtoul(optarg, nullptr, 10); break;
        case 'i': o.iterations = std::atoi(optarg); break;
        default:
            std::fprintf(stderr, "usage: allreduce -r RANK -n RANKS [--per-node K] [-a ADDR | -H "
                                 "HOST0,...] [-p BASE_PORT] [-c FLOATS] [-i ITERATIONS]\n");
            return 2;
        }
    }
    from_launcher(o);
    if (o.ranks < 2 || o.rank < 0 || o.rank >= o.ranks || o.ranks % o.per_node != 0 ||
        o.count == 0 || o.count % static_cast<std::size_t>(o.nodes()) != 0 || o.iterations < 1 ||
        o.nodes() > 255 || o.iterations > 65535 ||
        (!o.hosts.empty() && o.hosts.size() != static_cast<std::size_t>(o.nodes()))) {
        std::fprintf(stderr, "allreduce: need 0 <= RANK < RANKS, RANKS >= 2 a multiple of K, "
                             "FLOATS a multiple of the nodes (RANKS / K, at most 255), 1 to 65535 "
                             "ITERATIONS, one -H host per node\n");
        return 2;
    }
    if (!placed_by_node(o)) {
        std::fprintf(stderr,
                     "allreduce: rank %d is not local rank %d of its node: place the "
                     "ranks node by node (mpirun --map-by slot, the default)\n",
                     o.rank, o.rank % o.per_node);
        return 2;
    }
    try {
        return run(o);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "allreduce rank %d: %s\n", o.rank, e.what());
        return 1;
    }
}
