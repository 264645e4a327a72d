// rdmax_team_bench: allreduce (sum of floats) between the ranks of one node
// through local::node_team (shared windows, no device), timed as
// examples/bench/mpi_allreduce_bench.c times MPI_Allreduce, so that
// examples/bench/allreduce-vs-mpi can put them side by side.
//
//   rdmax_team_bench [-r RANK -n RANKS] [--name TEAM] [-s MIN] [-S MAX] [-i ITERS]
//                    [--data staged|window] [--json FILE]
//
// Rank and team size come from -r/-n or from mpirun / srun (the node-local
// rank: OMPI_COMM_WORLD_LOCAL_*, SLURM_LOCALID with SLURM_NTASKS), the team's
// name from --name or the job's id (PMIX_NAMESPACE, OMPI_MCA_ess_base_jobid,
// SLURM_JOB_ID). Sizes double from MIN to MAX (bytes). Each call: a barrier,
// then the allreduce, timed on rank 0; every element of every result is
// checked on every rank (outside the timing). --data staged (the default)
// reduces a std::vector (copied into the window and out), window one that
// lives in the rank's window (node_team::window_as: no copy in). Prints one
// line per size: bytes, ranks, median and 10th/90th percentile in µs; --json
// writes {"bytes","ranks","impl","data","median_us"} per size.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <getopt.h>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/local/node_team.hpp>
#include <rdmax/local/team_allreduce.hpp>

namespace {

using namespace rdmax;

struct settings {
    int rank = -1, ranks = -1;
    std::string name;
    std::size_t min = 4096, max = 256 * 1024;
    int iters = 200;
    bool in_window = false;
    std::string json;
};

const char* env(const char* n) {
    const char* v = std::getenv(n);
    return v != nullptr && *v != '\0' ? v : nullptr;
}

/// The node-local rank, team size and name mpirun or srun give, where -r/-n/--name did not.
void from_launcher(settings& s) {
    if (s.rank < 0) {
        if (const char* v = env("OMPI_COMM_WORLD_LOCAL_RANK"))
            s.rank = std::atoi(v);
        else if (const char* w = env("SLURM_LOCALID"))
            s.rank = std::atoi(w);
    }
    if (s.ranks < 0) {
        if (const char* v = env("OMPI_COMM_WORLD_LOCAL_SIZE"))
            s.ranks = std::atoi(v);
        else if (const char* w = env("SLURM_NTASKS"))
            s.ranks = std::atoi(w); // one node: every task is local
    }
    if (s.name.empty()) {
        if (const char* v = env("PMIX_NAMESPACE"))
            s.name = fmt::format("pmix-{}", v);
        else if (const char* w = env("OMPI_MCA_ess_base_jobid"))
            s.name = fmt::format("ompi-{}", w);
        else if (const char* j = env("SLURM_JOB_ID"))
            s.name =
                fmt::format("slurm-{}-{}", j, env("SLURM_STEP_ID") ? env("SLURM_STEP_ID") : "0");
    }
}

settings parse(int argc, char** argv) {
    settings s;
    const option longs[] = {{"name", required_argument, nullptr, 'N'},
                            {"data", required_argument, nullptr, 'D'},
                            {"json", required_argument, nullptr, 'J'},
                            {nullptr, 0, nullptr, 0}};
    for (int c; (c = getopt_long(argc, argv, "r:n:s:S:i:h", longs, nullptr)) != -1;) {
        switch (c) {
        case 'r': s.rank = std::atoi(optarg); break;
        case 'n': s.ranks = std::atoi(optarg); break;
        case 's': s.min = std::strtoull(optarg, nullptr, 0); break;
        case 'S': s.max = std::strtoull(optarg, nullptr, 0); break;
        case 'i': s.iters = std::atoi(optarg); break;
        case 'N': s.name = optarg; break;
        case 'D': s.in_window = std::string_view(optarg) == "window"; break;
        case 'J': s.json = optarg; break;
        default:
            std::fprintf(stderr,
                         "usage: rdmax_team_bench [-r RANK -n RANKS] [--name TEAM] [-s MIN] "
                         "[-S MAX] [-i ITERS] [--data staged|window] [--json FILE]\n");
            std::exit(2);
        }
    }
    from_launcher(s);
    if (s.rank < 0 || s.ranks < 1 || s.rank >= s.ranks || s.name.empty() || s.iters < 1 ||
        s.min < 4 || s.max < s.min) {
        std::fprintf(stderr, "rdmax_team_bench: need a rank, a size and a team name (-r -n "
                             "--name, or mpirun/srun), 1+ iterations, 4 <= MIN <= MAX\n");
        std::exit(2);
    }
    return s;
}

float value(int rank, std::size_t i, int iter) {
    return static_cast<float>(rank + 1) +
           static_cast<float>((i + static_cast<std::size_t>(iter)) % 1024);
}

/// One size: the median, 10th and 90th percentile of rank 0's calls, µs.
std::array<double, 3> run_size(local::node_team& t, const settings& s, std::size_t bytes) {
    const std::size_t n = bytes / sizeof(float);
    std::vector<float> own(s.in_window ? 0 : n);
    const std::span<float> v = s.in_window ? t.window_as<float>(n) : std::span<float>(own);
    std::vector<double> us;
    for (int it = -5; it < s.iters; ++it) { // 5 untimed first
        for (std::size_t i = 0; i < n; ++i)
            v[i] = value(t.rank(), i, it);
        t.barrier();
        const auto t0 = std::chrono::steady_clock::now();
        local::allreduce(t, v);
        const auto t1 = std::chrono::steady_clock::now();
        for (std::size_t i = 0; i < n; ++i) {
            float want = 0;
            for (int r = 0; r < t.size(); ++r)
                want += value(r, i, it);
            if (v[i] != want)
                throw std::runtime_error(fmt::format("{} B, call {}: element {} is {}, expected {}",
                                                     bytes, it, i, v[i], want));
        }
        if (it >= 0)
            us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    std::sort(us.begin(), us.end());
    const auto at = [&](double q) {
        return us[static_cast<std::size_t>(q * static_cast<double>(us.size() - 1))];
    };
    return {at(0.5), at(0.1), at(0.9)};
}

} // namespace

int main(int argc, char** argv) {
    const settings s = parse(argc, argv);
    try {
        local::team_options o = local::team_options{}.with_env();
        o.window_bytes = std::max(o.window_bytes, (s.max + 63) / 64 * 64);
        local::node_team t(s.name, s.rank, s.ranks, o);
        std::FILE* json =
            s.rank == 0 && !s.json.empty() ? std::fopen(s.json.c_str(), "w") : nullptr;
        if (s.rank == 0 && !s.json.empty() && json == nullptr)
            throw std::runtime_error(fmt::format("--json {}: {}", s.json, std::strerror(errno)));
        if (s.rank == 0)
            fmt::print("{:>9} {:>5} {:>12} {:>10} {:>10}  rdmax node_team ({})\n", "bytes", "ranks",
                       "median[us]", "p10[us]", "p90[us]", s.in_window ? "window" : "staged");
        for (std::size_t b = s.min; b <= s.max; b *= 2) {
            const auto [med, p10, p90] = run_size(t, s, b);
            if (s.rank != 0)
                continue;
            fmt::print("{:>9} {:>5} {:>12.2f} {:>10.2f} {:>10.2f}\n", b, s.ranks, med, p10, p90);
            std::fflush(stdout);
            if (json != nullptr)
                fmt::print(json,
                           "{{\"bytes\":{},\"ranks\":{},\"impl\":\"rdmax\",\"data\":\"{}\","
                           "\"median_us\":{:.3f}}}\n",
                           b, s.ranks, s.in_window ? "window" : "staged", med);
        }
        if (json != nullptr)
            std::fclose(json);
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "rdmax_team_bench: rank %d: %s\n", s.rank, e.what());
        return 1;
    }
}
