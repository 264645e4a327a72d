// rdmax_allreduce_bench: ring allreduce (sum) of float vectors over RDMA writes,
// N ranks connected in a ring with rdma_cm, in three ways of getting memory
// registered, timed (examples/allreduce.cpp is the short version to copy).
//
//   rdmax_allreduce_bench -r RANK -n SIZE [-a ADDR | -H HOST0,HOST1,...] [--mode
//   per-call|cache|arena|all]
//             [-s MIN] [-S MAX] [-i ITERS] [-w ROUNDS] [-t SECONDS] [-p BASE_PORT]
//             [--json FILE] [--order interleaved|blocked] [--wait block|spin|hybrid|yield]
//             [--algo ring|doubling|auto] [--keys-baseline]   (-h says more)
//
// examples/allreduce-local starts N ranks on this machine. The rank and size
// can also come from mpirun or srun (OMPI_COMM_WORLD_*, PMI_*, SLURM_*).
//
// The algorithm is the bandwidth-optimal ring: the vector is cut into N
// chunks; in N-1 reduce-scatter steps each rank sends one chunk to its right
// neighbour and adds the chunk it got from its left one, so that each rank
// ends up owning one chunk summed over all ranks; in N-1 allgather steps the
// summed chunks travel once more around the ring. Every rank sends and
// receives 2 (N-1)/N of the vector, whatever N. On two ranks the ring is
// two steps, each a message's latency; recursive doubling (--algo doubling,
// and auto's choice on two ranks) is one: each rank writes its whole vector
// into the other's staging vector and adds the one it got, the same bytes in
// one round trip instead of two, at the price of adding all of the vector
// rather than half. With more ranks it would need links beyond the ring's
// (rank r and r XOR 2^k): not built, the ring serves them.
//
// Data movement. Each chunk is RDMA-written into the right neighbour's memory,
// the last piece of it with an immediate (write_imm): the immediate raises a
// receive completion at the neighbour only after all the chunk's bytes are in
// place (one RC queue pair executes writes in order), so the receiver learns
// of the arrival without polling memory and without a second message, and the
// immediate names the call, phase and step, which the receiver checks. In
// reduce-scatter the chunk lands in a staging vector at the chunk's own offset
// and the receiver adds it into its vector; in allgather it lands directly in
// the receiver's vector, where it belongs, so allgather copies nothing. A
// staging vector as large as the data means every offset is written once per
// call, so no step waits for the receiver to free a slot: the ring's own
// dependencies already order a call's writes after the previous call's reads
// (a rank's next-call writes into its right neighbour need that neighbour's
// previous allgather to have gone round, which needs its reductions done).
//
// Memory modes: what it costs to get the user's vectors registered.
//   per-call  memory_region on the vector and the staging vector at every
//             call, deregistered at its end, and the new tokens sent to the
//             left neighbour each call (it cannot write before it has them):
//             what code does that registers "just around" the operation.
//   cache     the registration cache at every call; the tokens are sent once
//             per buffer, because the registration they name is kept held
//             (an rkey given to a peer must stay valid while the peer may use
//             it). If a later call gets a different registration (the cache
//             merged neighbours), the held one still maps the same pages, so
//             the peer's writes through the old token still land right.
//   arena     the vectors are std::pmr::vectors in a registered_arena: the
//             keys are a lookup, nothing is registered per call, and the
//             tokens are sent once per buffer.
// The small control buffers (receive slots, token messages) are registered
// once at start-up in every mode: they are the library's, not the user's.
//
// Measuring. Rank 0 times each of its calls (registration and key exchange
// included where the mode does them per call; filling and checking the
// vectors are outside, and are a copy and a compare). By default the modes
// are interleaved: at each size every mode's vectors exist at once and each
// round runs every mode once, the order rotated round by round, so that a
// slow spell of a shared or emulated machine falls on all modes alike; the
// ratios are then taken call by call within a round, with a distribution-free
// 95 % interval of their median. Per-call's registration is also timed alone
// (the same four verbs on the same vectors, no ring around them, every rank
// at once) beside its time inside the call; --keys-baseline adds a mode that
// only exchanges keys per call, to split per-call's extra time in two.
#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <getopt.h>
#include <memory>
#include <memory_resource>
#include <optional>
#include <sched.h>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include <rdmax/mem/registered_arena.hpp>
#include <rdmax/mem/verbs_cache.hpp>
#include <rdmax/rdmax.hpp>

namespace {

using namespace rdmax;
using namespace std::chrono_literals;
using steady = std::chrono::steady_clock;

constexpr const char* usage_text = R"(usage:
  rdmax_allreduce_bench -r RANK -n SIZE [-a ADDR | -H HOST0,HOST1,... | --hostfile FILE]
            [--mode per-call|cache|arena|all] [-s MIN] [-S MAX] [-i ITERS]
            [-t SECONDS] [-p BASE_PORT] [--json FILE] [--order interleaved|blocked]
            [-w ROUNDS] [--wait block|spin|hybrid|yield] [--spin-us US]
            [--algo ring|doubling|auto] [--keys-baseline]

Ring allreduce (sum) of float vectors over RDMA writes. Rank r listens on
BASE_PORT + r and connects to rank (r + 1) % SIZE. Every rank must be given
the same options but -r. Rank 0 prints the medians of its calls per size and
mode, then per-call's ratios to cache and arena, call by call.
  -r RANK         this process's rank, 0 .. SIZE-1 (default: OMPI_COMM_WORLD_RANK,
                  PMI_RANK or SLURM_PROCID)
  -n SIZE         ranks in the ring, 2 to 64 (default: OMPI_COMM_WORLD_SIZE,
                  PMI_SIZE or SLURM_NTASKS)
  -a ADDR         the address of every rank (all on one machine); default: the
                  IPv4 address of the first device with an ACTIVE port
  -H HOSTS        the address of each rank, comma-separated, in rank order
  --hostfile FILE the same, one address per line (# starts a comment)
  --mode MODE     how the vectors get registered (default all: the three)
                    per-call  ibv_reg_mr/ibv_dereg_mr around every allreduce
                    cache     the registration cache at every allreduce
                    arena     vectors allocated in a registered arena
  -s MIN, -S MAX  vector sizes in bytes, powers of two from 64 to 1G (K, M, G
                  suffixes allowed; default 4K and 64M)
  -i ITERS        timed allreduces per size and mode up to 64 KiB (default 50);
                  above, fewer: ITERS * 64 KiB / size, at least 5 (or ITERS if
                  less). Every result is checked.
  -w ROUNDS       untimed warm-up allreduces per size and mode first (default 1)
  --order ORDER   interleaved (default): at each size every mode's vectors exist
                  at once and each round runs each mode once, in an order that
                  rotates round by round, so that a slow spell of the machine
                  falls on every mode alike; blocked: one mode's calls, then the
                  next mode's (what earlier versions did)
  -t SECONDS      deadline of every wait: connection, data, peer (default 60)
  -p BASE_PORT    rdma_cm port of rank 0 (default 18600)
  --keys-baseline one more mode, arena+keys: the arena, but the buffer tokens
                  sent at every call as per-call sends them, which splits
                  per-call's extra time into key exchange and registration
  --json FILE     rank 0 writes [{"bytes":..,"ranks":..,"mode":..,"seconds":..}]
                  (seconds: the median of rank 0's timed calls; per-call,
                  cache and arena only)
  --wait HOW      how a rank waits for an arrival: block (default) sleeps on a
                  completion channel; spin busy-polls (fastest while every rank
                  has a core of its own, ruinous when ranks outnumber cores);
                  hybrid polls for --spin-us, yields the CPU once, then sleeps;
                  yield polls and yields the CPU in turn for --spin-us, then
                  sleeps (no wakeup needed when ranks outnumber cores)
  --spin-us US    how long hybrid and yield poll before they sleep (default:
                  hybrid 50, yield 5000)
  --spin          --wait spin
  --algo ALGO     ring: the ring at every size; doubling: recursive doubling,
                  one exchange of the whole vector (2 ranks only); auto (the
                  default): doubling on 2 ranks, the ring on more
)";

struct usage_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

enum class mode : std::uint32_t { per_call = 1, cache = 2, arena = 4, arena_keys = 8 };
/// arena_keys (--keys-baseline) is not one of the modes the issue compares:
/// the arena, plus per-call's key exchange at every call, to split
/// per-call's cost into its key exchange and its registration.
constexpr mode all_modes[] = {mode::per_call, mode::cache, mode::arena, mode::arena_keys};

std::string_view name_of(mode m) {
    switch (m) {
    case mode::per_call: return "per-call";
    case mode::cache: return "cache";
    case mode::arena: return "arena";
    case mode::arena_keys: return "arena+keys";
    }
    return "?";
}

enum class wait_mode : std::uint8_t { block, spin, hybrid, yield };
enum class algorithm : std::uint8_t { ring, doubling, automatic };

struct options {
    int rank = -1;
    int ranks = -1;
    std::vector<std::string> hosts; ///< one per rank once resolved
    std::uint32_t modes = 7;        ///< bit set of mode
    std::uint64_t min_bytes = 4096;
    std::uint64_t max_bytes = std::uint64_t{64} << 20;
    std::uint32_t iters = 50;
    std::chrono::seconds timeout{60};
    std::uint16_t base_port = 18600;
    std::string json;
    bool interleave = true;   ///< --order interleaved
    std::uint32_t warmup = 1; ///< -w
    wait_mode wait = wait_mode::block;
    std::chrono::microseconds spin_budget{-1}; ///< --spin-us; -1: the wait mode's default
    algorithm algo = algorithm::automatic;

    /// Whether calls go by recursive doubling: on two ranks under --algo auto,
    /// at every size: across two guests it beat the ring from 8 KiB to 64 KiB
    /// and tied above (on one guest's loopback the ring's two halves were
    /// faster at 8 and 16 KiB; docs/bench-allreduce.md, "Two guests").
    /// Decided from the options every rank was given alike (checked at
    /// connection), so all agree.
    [[nodiscard]] bool doubling() const noexcept {
        return algo == algorithm::doubling || (algo == algorithm::automatic && ranks == 2);
    }
};

std::string describe(const options& o) {
    switch (o.wait) {
    case wait_mode::block: return "block on a completion channel";
    case wait_mode::spin: return "spin";
    case wait_mode::hybrid:
        return fmt::format("hybrid (poll {} us, yield, then block)", o.spin_budget.count());
    case wait_mode::yield:
        return fmt::format("yield (poll and yield the CPU in turn for {} us, then block)",
                           o.spin_budget.count());
    }
    return "?";
}

/// What a rank tells its neighbours in the connection's private data, so that
/// ranks started with different options fail at once, not at a deadline.
struct hello {
    std::uint32_t magic = 0x414c4c52; // "ALLR"
    std::uint32_t rank = 0;
    std::uint32_t ranks = 0;
    std::uint32_t modes = 0;
    std::uint64_t min_bytes = 0;
    std::uint64_t max_bytes = 0;
    std::uint32_t iters = 0;
    std::uint16_t warmup = 0;
    std::uint16_t interleave = 0;
    std::uint32_t doubling = 0;
};
static_assert(sizeof(hello) <= verbs::max_connect_payload);
static_assert(sizeof(hello) <= verbs::max_accept_payload);

/// The rights of the vectors: the peer writes into them, and remote write
/// needs local write.
constexpr rights vec_rights = rights::local_write | rights::remote_write;
using token = remote_buffer<rights::remote_write>;

/// Where the left neighbour may write into this rank: sent to it as a message.
struct tokens {
    token data;
    token staging;
    std::uint64_t seq = 0; ///< which exchange this is: both ends count alike
};

std::uint64_t number(std::string_view flag, const char* text, std::uint64_t lo, std::uint64_t hi,
                     bool suffixes = false) {
    std::uint64_t v = 0;
    const char* end = text + std::strlen(text);
    auto [p, ec] = std::from_chars(text, end, v);
    if (ec == std::errc{} && suffixes && p + 1 == end) {
        const unsigned shift = *p == 'K' || *p == 'k'   ? 10
                               : *p == 'M' || *p == 'm' ? 20
                               : *p == 'G' || *p == 'g' ? 30
                                                        : 64;
        if (shift < 64 && v <= (hi >> shift)) {
            v <<= shift;
            ++p;
        }
    }
    if (ec != std::errc{} || p != end || v < lo || v > hi)
        throw usage_error(
            fmt::format("{} {}: expected a number from {} to {}", flag, text, lo, hi));
    return v;
}

std::vector<std::string> split(std::string_view list, char sep) {
    std::vector<std::string> out;
    for (std::size_t at = 0; at <= list.size();) {
        const std::size_t next = std::min(list.find(sep, at), list.size());
        out.emplace_back(list.substr(at, next - at));
        at = next + 1;
    }
    return out;
}

std::vector<std::string> read_hostfile(const std::string& path) {
    std::ifstream in(path);
    if (!in)
        throw usage_error(fmt::format("--hostfile {}: cannot read it", path));
    std::vector<std::string> out;
    for (std::string line; std::getline(in, line);) {
        line = line.substr(0, line.find('#'));
        std::istringstream words(line);
        if (std::string host; words >> host)
            out.push_back(host);
    }
    return out;
}

/// The first of the launchers' variables that is set, as a number.
std::optional<int> from_launcher(std::initializer_list<const char*> names) {
    for (const char* name : names)
        if (const char* v = std::getenv(name); v != nullptr && *v != '\0')
            return static_cast<int>(number(name, v, 0, 1 << 20));
    return std::nullopt;
}

/// The IPv4 address of the first device with an ACTIVE port: its RoCE v2 GID
/// is the address mapped into IPv6 (::ffff:a.b.c.d).
std::string first_active_ipv4() {
    const verbs::context ctx = verbs::context::open_first_active();
    const auto g = ctx.preferred_gid(1);
    if (!g || !g->value.is_ipv4_mapped())
        throw std::runtime_error(
            fmt::format("{} has no IPv4 address to listen on: pass -a ADDR", ctx.name()));
    const auto& r = g->value.raw;
    return fmt::format("{}.{}.{}.{}", r[12], r[13], r[14], r[15]);
}

options parse(int argc, char** argv) {
    enum {
        opt_mode = 256,
        opt_json,
        opt_spin,
        opt_hostfile,
        opt_order,
        opt_wait,
        opt_spin_us,
        opt_keys,
        opt_algo
    };
    static const option long_options[] = {{"mode", required_argument, nullptr, opt_mode},
                                          {"json", required_argument, nullptr, opt_json},
                                          {"spin", no_argument, nullptr, opt_spin},
                                          {"order", required_argument, nullptr, opt_order},
                                          {"wait", required_argument, nullptr, opt_wait},
                                          {"spin-us", required_argument, nullptr, opt_spin_us},
                                          {"keys-baseline", no_argument, nullptr, opt_keys},
                                          {"algo", required_argument, nullptr, opt_algo},
                                          {"hostfile", required_argument, nullptr, opt_hostfile},
                                          {"help", no_argument, nullptr, 'h'},
                                          {}};
    options o;
    std::string addr;
    bool min_given = false, keys = false;
    for (int c;
         (c = getopt_long(argc, argv, "r:n:a:H:s:S:i:w:t:p:h", long_options, nullptr)) != -1;) {
        switch (c) {
        case 'r': o.rank = static_cast<int>(number("-r", optarg, 0, 63)); break;
        case 'n': o.ranks = static_cast<int>(number("-n", optarg, 2, 64)); break;
        case 'a': addr = optarg; break;
        case 'H': o.hosts = split(optarg, ','); break;
        case opt_hostfile: o.hosts = read_hostfile(optarg); break;
        case 's':
            o.min_bytes = number("-s", optarg, 64, 1 << 30, true);
            min_given = true;
            break;
        case 'S': o.max_bytes = number("-S", optarg, 64, 1 << 30, true); break;
        case 'i': o.iters = static_cast<std::uint32_t>(number("-i", optarg, 1, 1'000'000)); break;
        case 'w': o.warmup = static_cast<std::uint32_t>(number("-w", optarg, 0, 1000)); break;
        case 't': o.timeout = std::chrono::seconds(number("-t", optarg, 1, 86'400)); break;
        case 'p': o.base_port = static_cast<std::uint16_t>(number("-p", optarg, 1, 65535)); break;
        case opt_mode: {
            const std::string_view m = optarg;
            o.modes = m == "per-call" ? 1
                      : m == "cache"  ? 2
                      : m == "arena"  ? 4
                      : m == "all"    ? 7
                                      : 0;
            if (o.modes == 0)
                throw usage_error(fmt::format("--mode {}: per-call, cache, arena or all", m));
            break;
        }
        case opt_json: o.json = optarg; break;
        case opt_spin: o.wait = wait_mode::spin; break;
        case opt_keys: keys = true; break;
        case opt_order: {
            const std::string_view v = optarg;
            if (v != "interleaved" && v != "blocked")
                throw usage_error(fmt::format("--order {}: interleaved or blocked", v));
            o.interleave = v == "interleaved";
            break;
        }
        case opt_wait: {
            const std::string_view v = optarg;
            if (v == "block")
                o.wait = wait_mode::block;
            else if (v == "spin")
                o.wait = wait_mode::spin;
            else if (v == "hybrid")
                o.wait = wait_mode::hybrid;
            else if (v == "yield")
                o.wait = wait_mode::yield;
            else
                throw usage_error(fmt::format("--wait {}: block, spin, hybrid or yield", v));
            break;
        }
        case opt_algo: {
            const std::string_view v = optarg;
            o.algo = v == "ring"       ? algorithm::ring
                     : v == "doubling" ? algorithm::doubling
                     : v == "auto"
                         ? algorithm::automatic
                         : throw usage_error(fmt::format("--algo {}: ring, doubling or auto", v));
            break;
        }
        case opt_spin_us:
            o.spin_budget = std::chrono::microseconds(number("--spin-us", optarg, 0, 1'000'000));
            break;
        case 'h': std::fputs(usage_text, stdout); std::exit(0);
        default: throw usage_error("unknown option");
        }
    }
    if (optind < argc)
        throw usage_error(fmt::format("unexpected argument '{}'", argv[optind]));
    if (keys)
        o.modes |= static_cast<std::uint32_t>(mode::arena_keys);
    if (o.spin_budget.count() < 0)
        o.spin_budget = std::chrono::microseconds(o.wait == wait_mode::yield ? 5000 : 50);
    if (o.rank < 0)
        o.rank = from_launcher({"OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}).value_or(-1);
    if (o.ranks < 0)
        o.ranks = from_launcher({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}).value_or(-1);
    if (o.rank < 0 || o.ranks < 0)
        throw usage_error("no rank or size: pass -r RANK -n SIZE, or start under mpirun or srun");
    if (o.ranks < 2 || o.ranks > 64)
        throw usage_error(fmt::format("{} ranks: a ring needs 2 to 64", o.ranks));
    if (o.rank >= o.ranks)
        throw usage_error(fmt::format("rank {} of {}: ranks count from 0", o.rank, o.ranks));
    if (o.algo == algorithm::doubling && o.ranks != 2)
        throw usage_error(fmt::format("--algo doubling on {} ranks: only 2 here (the ring's "
                                      "links); --algo ring or auto",
                                      o.ranks));
    if (!min_given && o.max_bytes < o.min_bytes)
        o.min_bytes = o.max_bytes;
    for (const auto b : {o.min_bytes, o.max_bytes})
        if ((b & (b - 1)) != 0)
            throw usage_error(fmt::format("-s/-S {}: sizes are powers of two", b));
    if (o.min_bytes > o.max_bytes)
        throw usage_error("-s MIN is above -S MAX");
    if (o.min_bytes / sizeof(float) < static_cast<std::uint64_t>(o.ranks))
        throw usage_error(fmt::format("-s {}: fewer floats than ranks", o.min_bytes));
    if (o.base_port + o.ranks - 1 > 65535)
        throw usage_error(
            fmt::format("-p {}: the ports of {} ranks run past 65535", o.base_port, o.ranks));
    if (!addr.empty() && !o.hosts.empty())
        throw usage_error("-a gives every rank one address; -H and --hostfile one each: not both");
    if (!o.hosts.empty() && o.hosts.size() != static_cast<std::size_t>(o.ranks))
        throw usage_error(fmt::format("{} hosts for {} ranks: give one address per rank",
                                      o.hosts.size(), o.ranks));
    if (std::any_of(o.hosts.begin(), o.hosts.end(), [](const auto& h) { return h.empty(); }))
        throw usage_error("an empty host name in -H or --hostfile");
    if (o.hosts.empty())
        o.hosts.assign(static_cast<std::size_t>(o.ranks),
                       addr.empty() ? first_active_ipv4() : addr);
    return o;
}

void posted(status s, std::string_view what) {
    if (s != status::ok)
        throw std::runtime_error(fmt::format("{}: refused: {}", what, to_string(s)));
}

/// The ring: a listener, a connection to each neighbour, and the control
/// memory both connections receive into.
class ring {
public:
    static constexpr std::uint32_t slots_per_link = 32;
    static constexpr std::size_t slot_bytes = 64;
    static_assert(sizeof(tokens) <= slot_bytes);

    explicit ring(const options& o)
        : o_(o)
        , rank_(o.rank)
        , ranks_(o.ranks)
        , left_((o.rank + o.ranks - 1) % o.ranks)
        , right_((o.rank + 1) % o.ranks)
        , listener_(o.hosts[static_cast<std::size_t>(o.rank)],
                    static_cast<std::uint16_t>(o.base_port + o.rank))
        , ctx_(listener_.device())
        , pd_(ctx_)
        , right_channel_(ctx_)
        , left_channel_(ctx_)
        , right_cq_(ctx_, 2 * slots_per_link, o.wait == wait_mode::spin ? nullptr : &right_channel_)
        , left_cq_(ctx_, 2 * slots_per_link, o.wait == wait_mode::spin ? nullptr : &left_channel_)
        , ctl_(2 * slots_per_link * slot_bytes + 2 * slot_bytes)
        , ctl_mr_(pd_, ctl_.data(), ctl_.size()) {
        const hello me{.rank = static_cast<std::uint32_t>(o.rank),
                       .ranks = static_cast<std::uint32_t>(o.ranks),
                       .modes = o.modes,
                       .min_bytes = o.min_bytes,
                       .max_bytes = o.max_bytes,
                       .iters = o.iters,
                       .warmup = static_cast<std::uint16_t>(o.warmup),
                       .interleave = o.interleave ? std::uint16_t{1} : std::uint16_t{0},
                       .doubling = o.doubling() ? 1U : 0U};
        // Connect and accept in an order that cannot deadlock: rank 0
        // connects first, the others accept first, so the connects ripple
        // round the ring 0 -> 1 -> ... -> N-1 -> 0.
        // Each link's receives are posted as soon as it is up: the neighbour
        // may send its tokens before this rank has made its other link.
        const auto open_left = [&] {
            from_left_.emplace(accept_left(me));
            for (std::uint32_t i = 0; i < slots_per_link; ++i)
                repost_left(i);
        };
        const auto open_right = [&] {
            to_right_.emplace(connect_right(me));
            for (std::uint32_t i = 0; i < slots_per_link; ++i)
                repost_right(slots_per_link + i);
        };
        if (rank_ == 0) {
            open_right();
            open_left();
        } else {
            open_left();
            open_right();
        }
    }

    [[nodiscard]] int rank() const noexcept { return rank_; }
    [[nodiscard]] int ranks() const noexcept { return ranks_; }
    [[nodiscard]] const verbs::protection_domain& pd() const noexcept { return pd_; }
    [[nodiscard]] std::uint32_t max_message() { return to_right_->qp().max_message(); }
    [[nodiscard]] bool doubling() const noexcept { return o_.doubling(); }
    /// The staging vector's floats for a vector of `bytes`: recursive doubling
    /// lands whole vectors in it, in two halves used call by call in turn.
    [[nodiscard]] std::size_t staging_floats(std::uint64_t bytes) const noexcept {
        return (doubling() ? 2 : 1) * (bytes / sizeof(float));
    }

    /// Sends this rank's tokens to its left neighbour, which writes into it.
    void send_tokens(const tokens& t) {
        std::memcpy(send_slot(0), &t, sizeof t);
        posted(from_left_->qp().send(ctl_mr_.local(send_offset(0), sizeof t), 0),
               fmt::format("send of the tokens to rank {}", left_));
        ++left_unacked_;
    }

    /// The right neighbour's tokens of exchange `seq`.
    tokens receive_tokens(std::uint64_t seq) {
        const verbs::completion c = next_recv(*to_right_, right_, "its buffer tokens");
        tokens t;
        if (c.opcode != IBV_WC_RECV || c.byte_len != sizeof t)
            throw std::runtime_error(fmt::format("rank {} sent {} bytes ({}), not its tokens",
                                                 right_, c.byte_len,
                                                 c.has_imm ? "with an immediate" : "a message"));
        std::memcpy(&t, slot(c.wr_id), sizeof t);
        repost_right(static_cast<std::uint32_t>(c.wr_id));
        if (t.seq != seq)
            throw std::runtime_error(
                fmt::format("rank {} sent tokens of exchange {}, expected {}", right_, t.seq, seq));
        return t;
    }

    /// The send batch for writes to the right neighbour.
    [[nodiscard]] verbs::queue_pair<verbs::rc>& right_qp() { return to_right_->qp(); }
    void count_right_signaled() noexcept { ++right_unacked_; }

    /// Waits for the write_imm from the left neighbour that carries `imm`.
    void expect_write(std::uint32_t imm, std::string_view what) {
        const verbs::completion c = next_recv(*from_left_, left_, what);
        repost_left(static_cast<std::uint32_t>(c.wr_id));
        if (c.opcode != IBV_WC_RECV_RDMA_WITH_IMM || c.imm != imm)
            throw std::runtime_error(fmt::format(
                "rank {} out of step: expected {} (immediate {:#x}), got {} immediate {:#x}", left_,
                what, imm, c.opcode == IBV_WC_RECV_RDMA_WITH_IMM ? "a write with" : "a message, no",
                c.imm));
    }

    /// Waits until every signaled send on both links has completed: the
    /// memory they read may then be deregistered or changed.
    void drain_sends() {
        drain(*to_right_, right_, right_unacked_);
        drain(*from_left_, left_, left_unacked_);
    }

    /// The end: tell the right neighbour that nothing more will come, and
    /// wait until the left one says the same, so that no rank tears down a
    /// connection its neighbour still has work on.
    void goodbye() {
        drain_sends();
        std::memset(send_slot(1), 0, sizeof(std::uint64_t));
        posted(to_right_->qp().send(ctl_mr_.local(send_offset(1), sizeof(std::uint64_t)), 1),
               fmt::format("goodbye to rank {}", right_));
        ++right_unacked_;
        drain_sends();
        // The right neighbour may have its goodbye from me and be gone by now:
        // only the left one matters here.
        const verbs::completion c = next_recv(*from_left_, left_, "its goodbye", false);
        if (c.opcode != IBV_WC_RECV || c.byte_len != sizeof(std::uint64_t))
            throw std::runtime_error(
                fmt::format("rank {}: expected its goodbye, got something else", left_));
        to_right_->disconnect(2s);
        from_left_->disconnect(2s);
    }

private:
    [[nodiscard]] std::string address_of(int r) const {
        return o_.hosts[static_cast<std::size_t>(r)];
    }
    [[nodiscard]] verbs::qp_config config(verbs::completion_queue& cq) const {
        verbs::qp_config cfg;
        cfg.recv_depth = slots_per_link + 1;
        cfg.recv_cq = &cq;
        return cfg;
    }

    static void check_hello(const verbs::connection& c, const hello& me, int peer, bool left) {
        const auto h = c.peer_payload_as<hello>();
        if (!h || h->magic != me.magic)
            throw std::runtime_error(
                fmt::format("rank {} is not an allreduce of this version", peer));
        if (h->rank != static_cast<std::uint32_t>(peer))
            throw std::runtime_error(fmt::format("expected rank {} on my {}, rank {} came", peer,
                                                 left ? "left" : "right", h->rank));
        if (h->ranks != me.ranks || h->modes != me.modes || h->min_bytes != me.min_bytes ||
            h->max_bytes != me.max_bytes || h->iters != me.iters || h->warmup != me.warmup ||
            h->interleave != me.interleave || h->doubling != me.doubling)
            throw std::runtime_error(fmt::format(
                "rank {} runs other options (-n {} -s {} -S {} -i {} -w {} modes {:#x} "
                "interleaved {} doubling {}; mine: -n {} -s {} -S {} -i {} -w {} modes {:#x} "
                "interleaved {} doubling {})",
                peer, h->ranks, h->min_bytes, h->max_bytes, h->iters, h->warmup, h->modes,
                h->interleave, h->doubling, me.ranks, me.min_bytes, me.max_bytes, me.iters,
                me.warmup, me.modes, me.interleave, me.doubling));
    }

    /// Connects to the right neighbour, retrying while its listener is not
    /// up yet (the ranks start in any order), until the deadline.
    verbs::connection connect_right(const hello& me) {
        const auto deadline = steady::now() + o_.timeout;
        const auto port = static_cast<std::uint16_t>(o_.base_port + right_);
        for (;;) {
            try {
                const auto left =
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - steady::now());
                verbs::connection c =
                    verbs::connection::connect(pd_, address_of(right_), port, verbs::payload_of(me),
                                               config(right_cq_), std::clamp(left, 100ms, 5000ms));
                check_hello(c, me, right_, false);
                return c;
            } catch (const rdmax::error& e) {
                if (steady::now() >= deadline)
                    throw std::runtime_error(
                        fmt::format("cannot connect to rank {} at {}:{} within {} s: {}", right_,
                                    address_of(right_), port, o_.timeout.count(), e.what()));
                std::this_thread::sleep_for(100ms);
            }
        }
    }

    verbs::connection accept_left(const hello& me) {
        verbs::connection c = listener_.accept(pd_, verbs::payload_of(me), config(left_cq_),
                                               std::chrono::milliseconds(o_.timeout));
        check_hello(c, me, left_, true);
        return c;
    }

    /// One receive completion on `link`; throws if it failed, the peer (or
    /// the other neighbour) went away, or the deadline passed.
    verbs::completion next_recv(verbs::connection& link, int peer, std::string_view what,
                                bool watch_other = true) {
        verbs::connection& other = &link == &*to_right_ ? *from_left_ : *to_right_;
        const int other_peer = &link == &*to_right_ ? left_ : right_;
        const auto deadline = steady::now() + o_.timeout;
        verbs::completion c;
        for (bool polled = o_.wait != wait_mode::hybrid && o_.wait != wait_mode::yield;;) {
            if (!polled) {
                polled = true;
                if (poll_a_while(link, c))
                    break;
            }
            const int n = link.wait_recv(std::span(&c, 1), 100ms);
            if (n < 0)
                throw std::runtime_error(fmt::format(
                    "waiting for {} from rank {}: cannot poll the completion queue", what, peer));
            if (n > 0)
                break;
            if (link.peer_disconnected())
                throw std::runtime_error(
                    fmt::format("rank {} went away while I waited for {}", peer, what));
            if (watch_other && other.peer_disconnected())
                throw std::runtime_error(
                    fmt::format("rank {} went away while I waited for {} from rank {}", other_peer,
                                what, peer));
            if (steady::now() >= deadline)
                throw std::runtime_error(
                    fmt::format("no {} from rank {} within {} s", what, peer, o_.timeout.count()));
        }
        if (!c.ok())
            throw std::runtime_error(
                fmt::format("receive from rank {} ({}) failed: {}{}", peer, what, c.status_name(),
                            c.status == IBV_WC_WR_FLUSH_ERR ? " (the connection is gone)" : ""));
        return c;
    }

    /// --wait hybrid: polls `link`'s receive queue for up to the spin budget,
    /// yields the CPU once and polls again; true with a completion in `c`.
    /// (A failed poll returns false: the blocking wait then reports it.)
    /// --wait yield: the same, yielding after every empty poll.
    bool poll_a_while(verbs::connection& link, verbs::completion& c) {
        const auto until = steady::now() + o_.spin_budget;
        const bool yield = o_.wait == wait_mode::yield;
        for (unsigned i = 1;; ++i) {
            if (const int n = link.qp().poll_recv(std::span(&c, 1)); n != 0)
                return n > 0;
            if (yield)
                sched_yield();
            // The clock may cost a microsecond in a VM: read it now and then.
            if ((yield || i % 32 == 0) && steady::now() >= until)
                break;
        }
        sched_yield();
        return link.qp().poll_recv(std::span(&c, 1)) > 0;
    }

    /// Waits for `unacked` signaled sends on `link` to complete. The send
    /// queue has no completion channel, so this polls and yields the CPU in
    /// between: ranks may outnumber cores, and soft-RoCE needs CPU to ack.
    void drain(verbs::connection& link, int peer, std::uint32_t& unacked) {
        const auto deadline = steady::now() + o_.timeout;
        verbs::completion done[16];
        for (unsigned spins = 0; unacked > 0; ++spins) {
            const int n = link.qp().poll_send(done);
            if (n < 0)
                throw std::runtime_error(
                    fmt::format("cannot poll the send queue to rank {}", peer));
            for (int i = 0; i < n; ++i) {
                const auto& c = done[i];
                if (!c.ok())
                    throw std::runtime_error(fmt::format(
                        "a write or send to rank {} failed: {}{}", peer, c.status_name(),
                        c.status == IBV_WC_WR_FLUSH_ERR ? " (the connection is gone)" : ""));
                --unacked;
            }
            if (n > 0 || unacked == 0)
                continue;
            if (spins % 256 == 255) {
                if (link.peer_disconnected())
                    throw std::runtime_error(fmt::format(
                        "rank {} went away before it acknowledged my last writes", peer));
                if (steady::now() >= deadline)
                    throw std::runtime_error(fmt::format(
                        "rank {} acknowledged no write within {} s", peer, o_.timeout.count()));
            }
            sched_yield();
        }
    }

    [[nodiscard]] std::byte* slot(std::uint64_t i) { return ctl_.data() + i * slot_bytes; }
    [[nodiscard]] static std::size_t send_offset(std::size_t k) {
        return (2 * slots_per_link + k) * slot_bytes;
    }
    [[nodiscard]] std::byte* send_slot(std::size_t k) { return ctl_.data() + send_offset(k); }
    void repost_left(std::uint32_t i) {
        posted(from_left_->qp().post_recv(ctl_mr_.local(i * slot_bytes, slot_bytes), i),
               "post_recv");
    }
    void repost_right(std::uint32_t i) {
        posted(to_right_->qp().post_recv(ctl_mr_.local(i * slot_bytes, slot_bytes), i),
               "post_recv");
    }

    const options& o_;
    int rank_, ranks_, left_, right_;
    verbs::listener listener_; // first: the context is the listener's device
    verbs::context ctx_;
    verbs::protection_domain pd_;
    verbs::completion_channel right_channel_, left_channel_;
    verbs::completion_queue right_cq_, left_cq_;
    std::vector<std::byte> ctl_;
    memory_region<rights::local_write> ctl_mr_;
    std::optional<verbs::connection> to_right_, from_left_; // last: they go first
    std::uint32_t right_unacked_ = 0, left_unacked_ = 0;
};

/// Chunk k of a vector of `count` floats cut into `n` near-equal chunks.
struct chunks {
    std::size_t count, n;
    [[nodiscard]] std::size_t begin(std::size_t k) const noexcept { return k * count / n; }
    [[nodiscard]] std::size_t size(std::size_t k) const noexcept { return begin(k + 1) - begin(k); }
};

/// The immediate of a chunk: call (low 16 bits), phase, step. The receiver
/// compares it with what it expects next, so a lost or misordered write shows.
std::uint32_t imm_of(std::uint64_t call, int phase, int step) {
    return static_cast<std::uint32_t>((call & 0xffff) << 16) |
           static_cast<std::uint32_t>(phase << 8) | static_cast<std::uint32_t>(step);
}

/// Writes chunk k of `data` to the same offset of `dst` at the right
/// neighbour (`dst_base` bytes further on), in pieces of at most the port's
/// maximum message, the last with the immediate. Only the last is signaled:
/// one completion per chunk.
void write_chunk(ring& R, std::span<const float> data, std::uint32_t lkey, const chunks& ch,
                 std::size_t k, const token& dst, std::uint32_t imm, std::uint64_t dst_base = 0) {
    const std::uint64_t most = R.max_message();
    const std::uint64_t first = ch.begin(k) * sizeof(float);
    const std::uint64_t end = first + ch.size(k) * sizeof(float);
    auto* base = reinterpret_cast<std::byte*>(const_cast<float*>(data.data()));
    auto b = R.right_qp().batch();
    for (std::uint64_t at = first; at < end; at += most) {
        const auto n = static_cast<std::uint32_t>(std::min(most, end - at));
        const local_buffer<rights::local_read> src{base + at, n, lkey};
        const bool last = at + n == end;
        posted(last ? b.write_imm(src, dst, dst_base + at, imm, k)
                    : b.write(src, dst, dst_base + at, k, {.signaled = false}),
               "RDMA write");
    }
    posted(b.post(), "RDMA write");
    R.count_right_signaled();
}

/// One allreduce of `data` in place, `staging` receiving the reduce-scatter
/// chunks; `lkey` covers data, `right` says where the right neighbour wants
/// them. Returns when the result is complete and every write acknowledged.
void ring_allreduce(ring& R, std::span<float> data, std::span<const float> staging,
                    std::uint32_t lkey, const tokens& right, std::uint64_t call) {
    const int r = R.rank(), n = R.ranks();
    const chunks ch{data.size(), static_cast<std::size_t>(n)};
    const auto mod = [n](int k) { return static_cast<std::size_t>(((k % n) + n) % n); };
    for (int s = 0; s < n - 1; ++s) { // reduce-scatter
        write_chunk(R, data, lkey, ch, mod(r - s), right.staging, imm_of(call, 0, s));
        const std::size_t k = mod(r - s - 1);
        R.expect_write(imm_of(call, 0, s), "a reduce-scatter chunk");
        float* out = data.data() + ch.begin(k);
        const float* in = staging.data() + ch.begin(k);
        for (std::size_t i = 0, m = ch.size(k); i < m; ++i)
            out[i] += in[i];
    }
    for (int s = 0; s < n - 1; ++s) { // allgather: straight into the neighbour's vector
        write_chunk(R, data, lkey, ch, mod(r + 1 - s), right.data, imm_of(call, 1, s));
        R.expect_write(imm_of(call, 1, s), "an allgather chunk");
    }
    R.drain_sends();
}

/// Recursive doubling on two ranks: one exchange. Each rank writes its whole
/// vector into the other's staging vector, in the half of it that this call's
/// parity picks, and adds the vector the other wrote. Two halves, because
/// the other rank may still be adding this call's copy when this rank, done,
/// starts the next call; it cannot start the one after that before the
/// other's next write has come, which the other sends once done adding.
/// The add waits for this rank's own write to complete: the other's write
/// arriving says nothing of how much of this one the device has read yet
/// (a 256 KiB write is 256 packets, paced by acknowledgements), and adding
/// into the vector under it would send partial sums.
void doubling_allreduce(ring& R, std::span<float> data, std::span<const float> staging,
                        std::uint32_t lkey, const tokens& right, std::uint64_t call) {
    const chunks whole{data.size(), 1};
    const std::size_t half = (call & 1) * data.size();
    write_chunk(R, data, lkey, whole, 0, right.staging, imm_of(call, 2, 0), half * sizeof(float));
    R.expect_write(imm_of(call, 2, 0), "the other rank's vector");
    R.drain_sends();
    const float* in = staging.data() + half;
    for (std::size_t i = 0, m = data.size(); i < m; ++i)
        data[i] += in[i];
}

/// One allreduce by the algorithm the options chose (ring.doubling()).
void allreduce(ring& R, std::span<float> data, std::span<const float> staging, std::uint32_t lkey,
               const tokens& right, std::uint64_t call) {
    if (R.doubling())
        doubling_allreduce(R, data, staging, lkey, right, call);
    else
        ring_allreduce(R, data, staging, lkey, right, call);
}

/// Rank r's element i is i % 1000 + r: an integer, so every partial sum is
/// exact in a float.
/// A rank's input at one size and the sum every rank must end with, made
/// once per size: filling and checking are then a copy and a compare, quick
/// beside the allreduce even under emulation, so that ranks reach the next
/// call together (a slow fill on one rank is waiting time on its neighbours,
/// charged to whichever mode runs next).
struct reference {
    std::vector<float> input, expected;

    reference(std::size_t count, int rank, int ranks)
        : input(count)
        , expected(count) {
        const auto base = static_cast<std::size_t>(ranks * (ranks - 1) / 2);
        for (std::size_t i = 0; i < count; ++i) {
            input[i] = static_cast<float>(i % 1000 + static_cast<std::size_t>(rank));
            expected[i] = static_cast<float>(static_cast<std::size_t>(ranks) * (i % 1000) + base);
        }
    }

    void fill(std::span<float> v) const { std::memcpy(v.data(), input.data(), v.size_bytes()); }

    void check(std::span<const float> v, std::string_view what) const {
        if (std::memcmp(v.data(), expected.data(), v.size_bytes()) == 0)
            return;
        for (std::size_t i = 0; i < v.size(); ++i)
            if (v[i] != expected[i])
                throw std::runtime_error(
                    fmt::format("{}: element {} is {}, expected {}", what, i, v[i], expected[i]));
    }
};

std::uint32_t iterations(const options& o, std::uint64_t bytes) {
    constexpr std::uint64_t full = 64 << 10;
    if (bytes <= full)
        return o.iters;
    return static_cast<std::uint32_t>(
        std::max<std::uint64_t>(std::min<std::uint64_t>(o.iters, 5), o.iters * full / bytes));
}

/// One mode's vectors at one size, and one allreduce of them.
class mode_at_size {
public:
    mode_at_size() = default;
    mode_at_size(const mode_at_size&) = delete;
    mode_at_size& operator=(const mode_at_size&) = delete;
    virtual ~mode_at_size() = default;
    [[nodiscard]] virtual std::span<float> data() = 0;
    /// One allreduce, call number `seq` (counted alike by every rank).
    virtual void call(std::uint64_t seq) = 0;
};

/// What naive code does: register both vectors, hand the keys to the left
/// neighbour (it cannot write before it has them), use, deregister. The
/// three parts that are not the allreduce are timed apart.
class per_call_vectors final : public mode_at_size {
public:
    per_call_vectors(ring& R, std::uint64_t bytes)
        : R_(R)
        , data_(bytes / sizeof(float))
        , staging_(R.staging_floats(bytes)) {}
    std::span<float> data() override { return data_; }
    void call(std::uint64_t seq) override {
        const std::size_t bytes = data_.size() * sizeof(float);
        const auto t0 = steady::now();
        std::optional<memory_region<vec_rights>> dmr, smr;
        dmr.emplace(R_.pd(), data_.data(), bytes);
        smr.emplace(R_.pd(), staging_.data(), staging_.size() * sizeof(float));
        const auto t1 = steady::now();
        R_.send_tokens({dmr->remote(), smr->remote(), seq});
        const tokens right = R_.receive_tokens(seq);
        const auto t2 = steady::now();
        allreduce(R_, data_, staging_, dmr->lkey(), right, seq);
        const auto t3 = steady::now();
        dmr.reset();
        smr.reset();
        const auto t4 = steady::now();
        using sec = std::chrono::duration<double>;
        reg.push_back(sec(t1 - t0).count());
        exchange.push_back(sec(t2 - t1).count());
        dereg.push_back(sec(t4 - t3).count());
    }
    /// The same registrations and deregistrations as call() makes, `n`
    /// times with nothing between them: no ring, no wakeups (every rank
    /// does this at the same time). Seconds of each reg + reg + dereg + dereg.
    std::vector<double> registration_alone(std::uint32_t n) {
        const std::size_t bytes = data_.size() * sizeof(float);
        std::vector<double> out;
        for (std::uint32_t i = 0; i < n; ++i) {
            const auto t0 = steady::now();
            {
                const memory_region<vec_rights> dmr(R_.pd(), data_.data(), bytes);
                const memory_region<vec_rights> smr(R_.pd(), staging_.data(),
                                                    staging_.size() * sizeof(float));
            }
            out.push_back(std::chrono::duration<double>(steady::now() - t0).count());
        }
        return out;
    }
    std::vector<double> reg, exchange, dereg; ///< seconds, one per call

private:
    ring& R_;
    std::vector<float> data_, staging_;
};

/// The registration cache asked at every call, as a library does with the
/// user's pointers. The registrations whose tokens the left neighbour holds
/// are kept for as long as it may write through them (see the top of the file).
class cached_vectors final : public mode_at_size {
public:
    cached_vectors(ring& R, verbs_cache& cache, std::uint64_t bytes,
                   const std::function<tokens(const token&, const token&)>& exchange)
        : R_(R)
        , cache_(cache)
        , data_(bytes / sizeof(float))
        , staging_(R.staging_floats(bytes))
        , pub_d_(cache.get<vec_rights>(data_.data(), bytes))
        , pub_s_(cache.get<vec_rights>(staging_.data(), staging_bytes()))
        , right_(exchange(pub_d_.remote<rights::remote_write>(data_.data(), bytes),
                          pub_s_.remote<rights::remote_write>(staging_.data(), staging_bytes()))) {}
    std::span<float> data() override { return data_; }
    void call(std::uint64_t seq) override {
        const std::size_t bytes = data_.size() * sizeof(float);
        const auto d = cache_.get<vec_rights>(data_.data(), bytes);
        const auto s = cache_.get<vec_rights>(staging_.data(), staging_bytes());
        allreduce(R_, data_, staging_, d.lkey(), right_, seq);
    }

private:
    [[nodiscard]] std::size_t staging_bytes() const { return staging_.size() * sizeof(float); }

    ring& R_;
    verbs_cache& cache_;
    std::vector<float> data_, staging_;
    verbs_cache::handle pub_d_, pub_s_;
    tokens right_;
};

/// The vectors are std::pmr::vectors in a registered_arena: the keys are a
/// lookup, nothing is registered per call, the tokens are sent once.
/// With `keys_each_call` (mode arena_keys), the tokens also go left at every
/// call and the call waits for the right neighbour's, as per-call's do.
class arena_vectors final : public mode_at_size {
public:
    arena_vectors(ring& R, registered_arena& arena, std::uint64_t bytes,
                  const std::function<tokens(const token&, const token&)>& exchange,
                  bool keys_each_call)
        : R_(R)
        , arena_(arena)
        , res_(arena)
        , data_(bytes / sizeof(float), &res_)
        , staging_(R.staging_floats(bytes), &res_)
        , mine_{arena.remote<rights::remote_write>(data_.data(), bytes),
                arena.remote<rights::remote_write>(staging_.data(),
                                                   staging_.size() * sizeof(float))}
        , right_(exchange(mine_.data, mine_.staging))
        , keys_each_call_(keys_each_call) {}
    std::span<float> data() override { return data_; }
    void call(std::uint64_t seq) override {
        const std::size_t bytes = data_.size() * sizeof(float);
        const auto d = arena_.local<vec_rights>(data_.data(), bytes); // O(1): the area's key
        if (keys_each_call_) {
            R_.send_tokens({mine_.data, mine_.staging, seq});
            right_ = R_.receive_tokens(seq);
        }
        allreduce(R_, data_, staging_, d.lkey, right_, seq);
    }

private:
    ring& R_;
    registered_arena& arena_;
    registered_arena::resource res_;
    std::pmr::vector<float> data_, staging_;
    tokens mine_, right_;
    bool keys_each_call_;
};

double median(std::vector<double> v) {
    if (v.empty())
        return 0;
    std::sort(v.begin(), v.end());
    const std::size_t m = v.size() / 2;
    return v.size() % 2 == 1 ? v[m] : (v[m - 1] + v[m]) / 2;
}

/// One mode at one size: rank 0's time of each timed call.
struct result {
    std::uint64_t bytes;
    int ranks;
    mode m;
    std::vector<double> t;                    ///< seconds, call i of the size's rotation i
    std::vector<double> reg, exchange, dereg; ///< per-call only: its parts, seconds
    std::vector<double> reg_alone;            ///< per-call only: registration_alone(), seconds
    [[nodiscard]] double seconds() const { return median(t); }
    [[nodiscard]] double min_seconds() const { return *std::min_element(t.begin(), t.end()); }
};

/// Everything one run keeps across sizes: the ring, the exchange counter,
/// and the cache and the arena (one each, so that no mode helps another).
struct run {
    static constexpr std::uint32_t reg_probes = 21;
    const options& o;
    ring& R;
    /// A verbs_cache in place (it does not move): optional's emplace takes the pd.
    struct cache_holder {
        verbs_cache c;
        explicit cache_holder(const verbs::protection_domain& pd)
            : c(make_verbs_cache(pd)) {}
    };
    std::optional<cache_holder> cache;     ///< made only if a mode uses it
    std::optional<registered_arena> arena; ///< made only if a mode uses it
    std::uint64_t seq = 0; ///< token exchanges and calls, counted alike by all ranks

    run(const options& opts, ring& r)
        : o(opts)
        , R(r) {
        const auto uses = [&](mode m) { return (o.modes & static_cast<std::uint32_t>(m)) != 0; };
        if (uses(mode::cache))
            cache.emplace(r.pd());
        if (uses(mode::arena) || uses(mode::arena_keys))
            arena.emplace(verbs_registrar(r.pd()), arena_options{}.with_env());
    }

    /// Sends my tokens left and returns my right neighbour's.
    tokens exchange(const token& data, const token& staging) {
        ++seq;
        R.send_tokens({data, staging, seq});
        return R.receive_tokens(seq);
    }

    std::unique_ptr<mode_at_size> make(mode m, std::uint64_t bytes) {
        const std::function<tokens(const token&, const token&)> ex =
            [this](const token& d, const token& s) { return exchange(d, s); };
        switch (m) {
        case mode::per_call: return std::make_unique<per_call_vectors>(R, bytes);
        case mode::cache: return std::make_unique<cached_vectors>(R, cache->c, bytes, ex);
        case mode::arena: return std::make_unique<arena_vectors>(R, *arena, bytes, ex, false);
        case mode::arena_keys: return std::make_unique<arena_vectors>(R, *arena, bytes, ex, true);
        }
        throw std::logic_error("no such mode");
    }

    /// One checked allreduce; its time, registration included where the
    /// mode registers per call.
    double once(const reference& ref, mode_at_size& v, mode m, std::uint64_t it) {
        const std::span<float> data = v.data();
        ref.fill(data);
        ++seq;
        const auto t0 = steady::now();
        v.call(seq);
        const double t = std::chrono::duration<double>(steady::now() - t0).count();
        ref.check(data, fmt::format("{} bytes, {}, call {}", data.size_bytes(), name_of(m), it));
        return t;
    }

    /// The modes asked for at one size. Interleaved: every mode's vectors
    /// exist at once and each round runs every mode once, the order rotated
    /// round by round (no mode always first after the check and fill of
    /// another), so slow phases of the machine fall on all modes alike.
    /// Blocked: all of one mode's calls, then the next mode's.
    std::vector<result> one_size(std::uint64_t bytes, std::uint32_t iters) {
        std::vector<mode> ms;
        for (const mode m : all_modes)
            if ((o.modes & static_cast<std::uint32_t>(m)) != 0)
                ms.push_back(m);
        std::vector<result> out;
        std::vector<std::unique_ptr<mode_at_size>> vs;
        for (const mode m : ms) {
            out.push_back({bytes, R.ranks(), m, {}, {}, {}, {}, {}});
            vs.push_back(o.interleave ? make(m, bytes) : nullptr);
        }
        const std::size_t n = ms.size();
        const reference ref(bytes / sizeof(float), R.rank(), R.ranks());
        // Per-call's registrations without the ring around them, before the
        // rounds (its vectors touched first, as a call finds them).
        for (std::size_t k = 0; k < n; ++k)
            if (ms[k] == mode::per_call) {
                std::optional<per_call_vectors> own;
                auto* pc = dynamic_cast<per_call_vectors*>(vs[k].get());
                if (pc == nullptr)
                    pc = &own.emplace(R, bytes);
                ref.fill(pc->data());
                out[k].reg_alone = pc->registration_alone(reg_probes);
            }
        const auto timed = [&](std::size_t k, std::uint64_t it, bool keep) {
            const double t = once(ref, *vs[k], ms[k], it);
            if (!keep)
                return;
            out[k].t.push_back(t);
            if (auto* pc = dynamic_cast<per_call_vectors*>(vs[k].get())) {
                out[k].reg.push_back(pc->reg.back());
                out[k].exchange.push_back(pc->exchange.back());
                out[k].dereg.push_back(pc->dereg.back());
            }
        };
        if (o.interleave) {
            for (std::uint64_t round = 0; round < o.warmup + iters; ++round)
                for (std::size_t j = 0; j < n; ++j)
                    timed((round + j) % n, round, round >= o.warmup);
        } else {
            for (std::size_t k = 0; k < n; ++k) {
                vs[k] = make(ms[k], bytes);
                for (std::uint64_t it = 0; it < o.warmup + iters; ++it)
                    timed(k, it, it >= o.warmup);
                vs[k].reset();
            }
        }
        return out;
    }
};

void print_table(std::span<const result> rs) {
    if (rs.empty())
        return;
    fmt::print("\n{:>10} {:>5} {:>9} {:>6} {:>11} {:>11} {:>9} {:>9} {:>9} {:>9}\n", "bytes",
               "ranks", "mode", "iters", "median us", "min us", "MB/s", "reg us", "keys us",
               "dereg us");
    for (const auto& x : rs) {
        const bool pc = x.m == mode::per_call;
        const auto us = [&](const std::vector<double>& v) {
            return pc ? fmt::format("{:.1f}", median(v) * 1e6) : std::string("-");
        };
        fmt::print("{:>10} {:>5} {:>9} {:>6} {:>11.1f} {:>11.1f} {:>9.2f} {:>9} {:>9} {:>9}\n",
                   x.bytes, x.ranks, name_of(x.m), x.t.size(), x.seconds() * 1e6,
                   x.min_seconds() * 1e6, static_cast<double>(x.bytes) / x.seconds() / 1e6,
                   us(x.reg), us(x.exchange), us(x.dereg));
    }
}

/// A median and its 95 % confidence interval, distribution-free: the order
/// statistics k and n+1-k of n samples, k = (n - 1.96 sqrt(n)) / 2 (the
/// binomial's normal approximation). With fewer than 6 samples the interval
/// is the whole range.
struct estimate {
    double median = 0, lo = 0, hi = 0;
};

estimate estimate_of(std::vector<double> v) {
    if (v.empty())
        return {};
    std::sort(v.begin(), v.end());
    const auto n = static_cast<double>(v.size());
    const auto k =
        static_cast<std::size_t>(std::max(1.0, std::floor((n - 1.96 * std::sqrt(n)) / 2)));
    return {median(v), v[k - 1], v[v.size() - k]};
}

/// a[i] op b[i] for every i: calls i of two modes ran in the same round.
template <class Op>
estimate paired(const std::vector<double>& a, const std::vector<double>& b, Op op) {
    std::vector<double> v;
    for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
        v.push_back(op(a[i], b[i]));
    return estimate_of(std::move(v));
}

void print_ratios(std::span<const result> rs, bool interleaved) {
    const auto find = [&](std::uint64_t bytes, mode m) -> const result* {
        for (const auto& x : rs)
            if (x.bytes == bytes && x.m == m)
                return &x;
        return nullptr;
    };
    const auto ratio = [](double a, double b) { return a / b; };
    const auto cell = [](const estimate& e, double scale, int digits) {
        return fmt::format("{:.{}f} [{:.{}f}, {:.{}f}]", e.median * scale, digits, e.lo * scale,
                           digits, e.hi * scale, digits);
    };
    fmt::print(
        "\nper-call against cache and arena, call by call ({}): median [95 % interval] of the\n"
        "ratios (> 1: per-call is slower) and of the differences; the ratio of the medians.\n"
        "Then medians of what per-call spends beside the allreduce: its 2 ibv_reg_mr + 2\n"
        "ibv_dereg_mr in the call, that plus the key exchange, and the same 4 verbs with\n"
        "nothing between them, {} times per size before the rounds, every rank at once\n",
        interleaved ? "calls of one round" : "calls of one index, blocked order", run::reg_probes);
    fmt::print("{:>10} {:>21} {:>21} {:>7} {:>7} {:>26} {:>9} {:>9} {:>9}\n", "bytes",
               "per-call/cache", "per-call/arena", "med/med", "med/med", "per-call - arena us",
               "(de)reg", "+ keys", "(de)reg");
    fmt::print("{:>10} {:>21} {:>21} {:>7} {:>7} {:>26} {:>9} {:>9} {:>9}\n", "", "", "", "cache",
               "arena", "", "in call", "us", "alone us");
    for (const auto& x : rs) {
        if (x.m != mode::per_call)
            continue;
        const result* c = find(x.bytes, mode::cache);
        const result* a = find(x.bytes, mode::arena);
        if (c == nullptr || a == nullptr)
            continue;
        std::vector<double> regdereg;
        for (std::size_t i = 0; i < x.reg.size(); ++i)
            regdereg.push_back(x.reg[i] + x.dereg[i]);
        const double rd = median(regdereg);
        fmt::print("{:>10} {:>21} {:>21} {:>7.2f} {:>7.2f} {:>26} {:>9.1f} {:>9.1f} {:>9.1f}\n",
                   x.bytes, cell(paired(x.t, c->t, ratio), 1, 2),
                   cell(paired(x.t, a->t, ratio), 1, 2), x.seconds() / c->seconds(),
                   x.seconds() / a->seconds(), cell(paired(x.t, a->t, std::minus<>()), 1e6, 0),
                   rd * 1e6, (rd + median(x.exchange)) * 1e6, median(x.reg_alone) * 1e6);
    }
}

/// With --keys-baseline: per-call's extra time split into its key exchange
/// and its registration, both measured as differences of whole calls.
void print_split(std::span<const result> rs) {
    const auto find = [&](std::uint64_t bytes, mode m) -> const result* {
        for (const auto& x : rs)
            if (x.bytes == bytes && x.m == m)
                return &x;
        return nullptr;
    };
    const auto cell = [](const estimate& e) {
        return fmt::format("{:.0f} [{:.0f}, {:.0f}]", e.median * 1e6, e.lo * 1e6, e.hi * 1e6);
    };
    fmt::print("\nper-call's extra time, split, call by call: median [95 % interval], us.\n"
               "keys: arena+keys - arena (the key exchange); registration: per-call - "
               "arena+keys;\nbeside it the 2 reg + 2 dereg timed in the call and alone\n");
    fmt::print("{:>10} {:>26} {:>26} {:>26} {:>9} {:>9}\n", "bytes", "per-call - arena", "keys",
               "registration", "in call", "alone");
    for (const auto& x : rs) {
        if (x.m != mode::per_call)
            continue;
        const result* a = find(x.bytes, mode::arena);
        const result* k = find(x.bytes, mode::arena_keys);
        if (a == nullptr || k == nullptr)
            continue;
        std::vector<double> regdereg;
        for (std::size_t i = 0; i < x.reg.size(); ++i)
            regdereg.push_back(x.reg[i] + x.dereg[i]);
        fmt::print("{:>10} {:>26} {:>26} {:>26} {:>9.1f} {:>9.1f}\n", x.bytes,
                   cell(paired(x.t, a->t, std::minus<>())),
                   cell(paired(k->t, a->t, std::minus<>())),
                   cell(paired(x.t, k->t, std::minus<>())), median(regdereg) * 1e6,
                   median(x.reg_alone) * 1e6);
    }
}

void write_json(const std::string& path, std::span<const result> rs_all) {
    std::vector<result> rs; // the issue's three modes only
    for (const auto& x : rs_all)
        if (x.m != mode::arena_keys)
            rs.push_back(x);
    std::string out = "[\n";
    for (std::size_t i = 0; i < rs.size(); ++i)
        out += fmt::format("  {{\"bytes\":{},\"ranks\":{},\"mode\":\"{}\",\"seconds\":{:.9g}}}{}\n",
                           rs[i].bytes, rs[i].ranks, name_of(rs[i].m), rs[i].seconds(),
                           i + 1 < rs.size() ? "," : "");
    out += "]\n";
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr)
        throw std::runtime_error(fmt::format("--json {}: {}", path, std::strerror(errno)));
    const bool ok = std::fwrite(out.data(), 1, out.size(), f) == out.size();
    if (std::fclose(f) != 0 || !ok)
        throw std::runtime_error(fmt::format("--json {}: cannot write it", path));
}

int main_rank(const options& o) {
    ring R(o);
    run x(o, R);
    const bool lead = o.rank == 0;
    if (lead)
        fmt::print("allreduce: {} ranks in a ring on {}, {}, sizes {} to {} bytes; modes {}, "
                   "{} warm-up rounds; waiting: {}\n",
                   o.ranks, o.hosts[0], o.doubling() ? "recursive doubling" : "ring algorithm",
                   o.min_bytes, o.max_bytes,
                   o.interleave ? "interleaved (rotated every round)" : "one after another",
                   o.warmup, describe(o));
    std::vector<result> all;
    for (std::uint64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 2) {
        const std::uint32_t iters = iterations(o, bytes);
        if (lead)
            fmt::print(stderr, "[{}] {} bytes x {}\n", o.interleave ? "interleaved" : "blocked",
                       bytes, iters);
        for (auto& r : x.one_size(bytes, iters))
            all.push_back(std::move(r));
    }
    R.goodbye();
    if (lead) {
        std::vector<result> by_mode;
        for (const mode m : all_modes)
            for (const auto& r : all)
                if (r.m == m)
                    by_mode.push_back(r);
        print_table(by_mode);
        if (x.cache)
            fmt::print("cache: {}\n", x.cache->c.counters());
        if (x.arena)
            fmt::print("arena: {}\n", x.arena->counters());
        if (std::popcount(o.modes) > 1)
            print_ratios(all, o.interleave);
        if ((o.modes & static_cast<std::uint32_t>(mode::arena_keys)) != 0)
            print_split(all);
        if (!o.json.empty())
            write_json(o.json, by_mode);
        fmt::print("all results checked: every element of every call was the exact sum\n");
    }
    return 0;
}

} // namespace

int main(int argc, char** argv) {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    std::string who = "allreduce";
    try {
        const options o = parse(argc, argv);
        who = fmt::format("allreduce rank {}", o.rank);
        return main_rank(o);
    } catch (const usage_error& e) {
        fmt::print(stderr, "{}: {}\n{}", who, e.what(), usage_text);
        return 2;
    } catch (const std::exception& e) {
        fmt::print(stderr, "{}: {}\n", who, e.what());
        return 1;
    }
}
