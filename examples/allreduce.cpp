// allreduce: a ring allreduce (sum) of float vectors over RDMA writes, N
// processes connected in a ring with rdma_cm. The one to copy; the
// measurement driver with every memory mode, timing and JSON output is
// examples/bench/rdmax_allreduce_bench.
//
//   allreduce -r RANK -n RANKS [-a ADDR] [-p BASE_PORT] [-c FLOATS] [-i ITERATIONS]
//
// examples/allreduce-local starts the N ranks on this machine, e.g.
//   ALLREDUCE=build/examples/allreduce examples/allreduce-local -n 4 -c 4096
//
// The algorithm: the vector is cut into N chunks; in N-1 reduce-scatter steps
// each rank writes one chunk into its right neighbour's staging vector and adds
// the chunk its left neighbour wrote; in N-1 allgather steps the summed chunks
// go round once more, written straight into the neighbour's vector. Each write
// carries an immediate, which raises a receive completion at the neighbour only
// once all the chunk's bytes are there: the arrival costs no extra message.
// The vectors live in a registered arena, so nothing is registered per call.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory_resource>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <rdmax/rdmax.hpp>

using namespace rdmax;
using namespace std::chrono_literals;

namespace {

constexpr rights vec_rights = rights::local_write | rights::remote_write;
using token = remote_buffer<rights::remote_write>;
/// What a rank tells its left neighbour, which writes into it.
struct tokens {
    token vector;
    token staging;
};

struct options {
    int rank = -1, ranks = 0, port = 7600, iterations = 3;
    std::string addr = "192.0.2.1";
    std::size_t count = 1024; ///< floats per vector, a multiple of ranks
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

int run(const options& o) {
    verbs::context ctx = verbs::context::open_by_address(o.addr);
    verbs::protection_domain pd(ctx);
    registered_arena arena(verbs_registrar(pd), arena_options{}.with_env());
    registered_arena::resource res(arena);
    std::pmr::vector<float> vec(o.count, &res), staging(o.count, &res);
    const std::size_t chunk = o.count / static_cast<std::size_t>(o.ranks);
    const std::size_t chunk_bytes = chunk * sizeof(float);
    const tokens mine{
        arena.remote<rights::remote_write>(vec.data(), vec.size() * sizeof(float)),
        arena.remote<rights::remote_write>(staging.data(), staging.size() * sizeof(float))};

    // The left neighbour connects to us; we connect to the right one. Both at
    // once (a thread accepts), or every rank would wait in connect.
    verbs::listener listener(o.addr, static_cast<std::uint16_t>(o.port + o.rank));
    std::optional<verbs::connection> left;
    std::exception_ptr accept_failed;
    std::thread acceptor([&] {
        try {
            verbs::connection_request req = listener.next_request(30s);
            verbs::queue_pair<verbs::rc>& qp = req.create_qp(pd);
            // Receives first: the neighbour may write as soon as it is connected.
            for (int i = 0; i < 2 * o.ranks; ++i)
                expect(qp.post_recv(arena.local<vec_rights>(staging.data(), 1), 0), "post_recv");
            left.emplace(req.accept(verbs::payload_of(mine)));
        } catch (...) {
            accept_failed = std::current_exception();
        }
    });
    const int right_rank = (o.rank + 1) % o.ranks;
    std::optional<verbs::connection> right;
    for (auto until = std::chrono::steady_clock::now() + 30s; !right;) {
        try { // the neighbour may not listen yet: try again until the deadline
            right.emplace(verbs::connection::connect(
                pd, o.addr, static_cast<std::uint16_t>(o.port + right_rank)));
        } catch (const rdmax::error&) {
            if (std::chrono::steady_clock::now() > until)
                throw;
            std::this_thread::sleep_for(50ms);
        }
    }
    acceptor.join();
    if (accept_failed)
        std::rethrow_exception(accept_failed);
    const auto peer = right->peer_payload_as<tokens>();
    if (!peer)
        throw std::runtime_error("the right neighbour sent no tokens");

    const auto send = [&](std::size_t c, const token& dst, std::uint32_t imm) {
        expect(right->qp().write_imm(arena.local<vec_rights>(&vec[c * chunk], chunk_bytes), dst,
                                     c * chunk_bytes, imm, imm),
               "write_imm");
        one([&](std::span<verbs::completion> out) { return right->wait_send(out, 30s); },
            "write_imm");
    };
    const auto arrived = [&](std::uint32_t imm) {
        const verbs::completion c = one(
            [&](std::span<verbs::completion> out) { return left->wait_recv(out, 30s); }, "recv");
        if (!c.has_imm || c.imm != imm)
            throw std::runtime_error("a write arrived out of order");
        expect(left->qp().post_recv(arena.local<vec_rights>(staging.data(), 1), 0), "post_recv");
    };
    const auto mod = [&](int k) {
        return static_cast<std::size_t>((k % o.ranks + o.ranks) % o.ranks);
    };

    for (int it = 0; it < o.iterations; ++it) {
        for (std::size_t i = 0; i < o.count; ++i) // small integers: float sums are exact
            vec[i] = static_cast<float>(o.rank + static_cast<int>(i % 7) + it);
        for (int s = 0; s < o.ranks - 1; ++s) { // reduce-scatter
            send(mod(o.rank - s), peer->staging, tag(it, 0, s));
            arrived(tag(it, 0, s));
            const std::size_t c = mod(o.rank - s - 1);
            for (std::size_t i = c * chunk; i < (c + 1) * chunk; ++i)
                vec[i] += staging[i];
        }
        for (int s = 0; s < o.ranks - 1; ++s) { // allgather
            send(mod(o.rank + 1 - s), peer->vector, tag(it, 1, s));
            arrived(tag(it, 1, s));
        }
        const int n = o.ranks;
        const int rank_sum = n * (n - 1) / 2; // 0 + 1 + ... + (n - 1)
        for (std::size_t i = 0; i < o.count; ++i) {
            const auto want = static_cast<float>(rank_sum + n * (static_cast<int>(i % 7) + it));
            if (vec[i] != want) {
                std::fprintf(stderr, "rank %d, call %d: element %zu is %g, expected %g\n", o.rank,
                             it, i, static_cast<double>(vec[i]), static_cast<double>(want));
                return 1;
            }
        }
    }
    std::printf("rank %d: %d allreduces of %zu floats over %d ranks, every element checked\n",
                o.rank, o.iterations, o.count, o.ranks);
    right->disconnect();
    left->disconnect();
    return 0;
}

} // namespace

int main(int argc, char** argv) {
    options o;
    for (int c; (c = getopt(argc, argv, "r:n:a:p:c:i:h")) != -1;) {
        switch (c) {
        case 'r': o.rank = std::atoi(optarg); break;
        case 'n': o.ranks = std::atoi(optarg); break;
        case 'a': o.addr = optarg; break;
        case 'p': o.port = std::atoi(optarg); break;
        case 'c': o.count = std::strtoul(optarg, nullptr, 10); break;
        case 'i': o.iterations = std::atoi(optarg); break;
        default:
            std::fprintf(stderr, "usage: allreduce -r RANK -n RANKS [-a ADDR] [-p BASE_PORT] "
                                 "[-c FLOATS] [-i ITERATIONS]\n");
            return 2;
        }
    }
    if (o.ranks < 2 || o.rank < 0 || o.rank >= o.ranks || o.count == 0 ||
        o.count % static_cast<std::size_t>(o.ranks) != 0 || o.iterations < 1) {
        std::fprintf(stderr, "allreduce: need 0 <= RANK < RANKS, RANKS >= 2, FLOATS a multiple "
                             "of RANKS, ITERATIONS >= 1\n");
        return 2;
    }
    try {
        return run(o);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "allreduce rank %d: %s\n", o.rank, e.what());
        return 1;
    }
}
