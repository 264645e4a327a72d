// allreduce: ring allreduce (sum) of float vectors over RDMA writes, N ranks
// connected in a ring with rdma_cm, in three ways of getting memory registered.
//
//   allreduce -r RANK -n SIZE [-a ADDR | -H HOST0,HOST1,...] [--mode per-call|cache|arena|all]
//             [-s MIN] [-S MAX] [-i ITERS] [-t SECONDS] [-p BASE_PORT] [--json FILE]
//
// examples/allreduce-local starts N ranks on this machine. The rank and size
// can also come from mpirun or srun (OMPI_COMM_WORLD_*, PMI_*, SLURM_*).
//
// The algorithm is the bandwidth-optimal ring: the vector is cut into N
// chunks; in N-1 reduce-scatter steps each rank sends one chunk to its right
// neighbour and adds the chunk it got from its left one, so that each rank
// ends up owning one chunk summed over all ranks; in N-1 allgather steps the
// summed chunks travel once more around the ring. Every rank sends and
// receives 2 (N-1)/N of the vector, whatever N.
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
#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <getopt.h>
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
  allreduce -r RANK -n SIZE [-a ADDR | -H HOST0,HOST1,... | --hostfile FILE]
            [--mode per-call|cache|arena|all] [-s MIN] [-S MAX] [-i ITERS]
            [-t SECONDS] [-p BASE_PORT] [--json FILE] [--spin]

Ring allreduce (sum) of float vectors over RDMA writes. Rank r listens on
BASE_PORT + r and connects to rank (r + 1) % SIZE. Every rank must be given
the same options but -r. Rank 0 prints a table per mode.
  -r RANK         this process's rank, 0 .. SIZE-1 (default: OMPI_COMM_WORLD_RANK,
                  PMI_RANK or SLURM_PROCID)
  -n SIZE         ranks in the ring, 2 to 64 (default: OMPI_COMM_WORLD_SIZE,
                  PMI_SIZE or SLURM_NTASKS)
  -a ADDR         the address of every rank (all on one machine); default: the
                  IPv4 address of the first device with an ACTIVE port
  -H HOSTS        the address of each rank, comma-separated, in rank order
  --hostfile FILE the same, one address per line (# starts a comment)
  --mode MODE     how the vectors get registered (default all: the three in turn)
                    per-call  ibv_reg_mr/ibv_dereg_mr around every allreduce
                    cache     the registration cache at every allreduce
                    arena     vectors allocated in a registered arena
  -s MIN, -S MAX  vector sizes in bytes, powers of two from 64 to 1G (K, M, G
                  suffixes allowed; default 4K and 64M)
  -i ITERS        allreduces per size up to 1 MiB (default 20); above, fewer:
                  ITERS * 1 MiB / size, at least 1. Every result is checked.
  -t SECONDS      deadline of every wait: connection, data, peer (default 60)
  -p BASE_PORT    rdma_cm port of rank 0 (default 18600)
  --json FILE     rank 0 writes [{"bytes":..,"ranks":..,"mode":..,"seconds":..}]
  --spin          busy-poll for arrivals instead of sleeping on a completion
                  channel (sleeping is kinder when ranks outnumber cores)
)";

struct usage_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

enum class mode : std::uint32_t { per_call = 1, cache = 2, arena = 4 };
constexpr mode all_modes[] = {mode::per_call, mode::cache, mode::arena};

std::string_view name_of(mode m) {
    switch (m) {
    case mode::per_call: return "per-call";
    case mode::cache: return "cache";
    case mode::arena: return "arena";
    }
    return "?";
}

struct options {
    int rank = -1;
    int ranks = -1;
    std::vector<std::string> hosts; ///< one per rank once resolved
    std::uint32_t modes = 7;        ///< bit set of mode
    std::uint64_t min_bytes = 4096;
    std::uint64_t max_bytes = std::uint64_t{64} << 20;
    std::uint32_t iters = 20;
    std::chrono::seconds timeout{60};
    std::uint16_t base_port = 18600;
    std::string json;
    bool spin = false;
};

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
    std::uint32_t reserved = 0;
};
static_assert(sizeof(hello) <= verbs::max_connect_payload);
static_assert(sizeof(hello) <= verbs::max_accept_payload);

/// The rights of the vectors: the peer writes into them, and remote write
/// needs local write (rdmax::access in full: <unistd.h>'s access() hides it).
constexpr rdmax::access vec_rights = access::local_write | access::remote_write;
using token = remote_buffer<access::remote_write>;

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
    enum { opt_mode = 256, opt_json, opt_spin, opt_hostfile };
    static const option long_options[] = {{"mode", required_argument, nullptr, opt_mode},
                                          {"json", required_argument, nullptr, opt_json},
                                          {"spin", no_argument, nullptr, opt_spin},
                                          {"hostfile", required_argument, nullptr, opt_hostfile},
                                          {"help", no_argument, nullptr, 'h'},
                                          {}};
    options o;
    std::string addr;
    bool min_given = false;
    for (int c;
         (c = getopt_long(argc, argv, "r:n:a:H:s:S:i:t:p:h", long_options, nullptr)) != -1;) {
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
        case opt_spin: o.spin = true; break;
        case 'h': std::fputs(usage_text, stdout); std::exit(0);
        default: throw usage_error("unknown option");
        }
    }
    if (optind < argc)
        throw usage_error(fmt::format("unexpected argument '{}'", argv[optind]));
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
        , right_cq_(ctx_, 2 * slots_per_link, o.spin ? nullptr : &right_channel_)
        , left_cq_(ctx_, 2 * slots_per_link, o.spin ? nullptr : &left_channel_)
        , ctl_(2 * slots_per_link * slot_bytes + 2 * slot_bytes)
        , ctl_mr_(pd_, ctl_.data(), ctl_.size()) {
        const hello me{.rank = static_cast<std::uint32_t>(o.rank),
                       .ranks = static_cast<std::uint32_t>(o.ranks),
                       .modes = o.modes,
                       .min_bytes = o.min_bytes,
                       .max_bytes = o.max_bytes,
                       .iters = o.iters};
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
            h->max_bytes != me.max_bytes || h->iters != me.iters)
            throw std::runtime_error(fmt::format(
                "rank {} runs other options (-n {} -s {} -S {} -i {} modes {:#x}; mine: -n {} -s "
                "{} -S {} -i {} modes {:#x})",
                peer, h->ranks, h->min_bytes, h->max_bytes, h->iters, h->modes, me.ranks,
                me.min_bytes, me.max_bytes, me.iters, me.modes));
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
        for (;;) {
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
    memory_region<access::local_write> ctl_mr_;
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
/// neighbour, in pieces of at most the port's maximum message, the last
/// with the immediate. Only the last is signaled: one completion per chunk.
void write_chunk(ring& R, std::span<const float> data, std::uint32_t lkey, const chunks& ch,
                 std::size_t k, const token& dst, std::uint32_t imm) {
    const std::uint64_t most = R.max_message();
    const std::uint64_t first = ch.begin(k) * sizeof(float);
    const std::uint64_t end = first + ch.size(k) * sizeof(float);
    auto* base = reinterpret_cast<std::byte*>(const_cast<float*>(data.data()));
    auto b = R.right_qp().batch();
    for (std::uint64_t at = first; at < end; at += most) {
        const auto n = static_cast<std::uint32_t>(std::min(most, end - at));
        const local_buffer<access::local_read> src{base + at, n, lkey};
        const bool last = at + n == end;
        posted(last ? b.write_imm(src, dst, at, imm, k)
                    : b.write(src, dst, at, k, {.signaled = false}),
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

/// Rank r's element i: an integer, so every partial sum is exact in a float.
float input(int r, std::size_t i) {
    return static_cast<float>(i % 1000 + static_cast<std::size_t>(r));
}

void fill(std::span<float> v, int r) {
    for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = input(r, i);
}

void check(std::span<const float> v, int ranks, std::string_view what) {
    const auto base = static_cast<std::size_t>(ranks * (ranks - 1) / 2);
    for (std::size_t i = 0; i < v.size(); ++i) {
        const auto want = static_cast<float>(static_cast<std::size_t>(ranks) * (i % 1000) + base);
        if (v[i] != want)
            throw std::runtime_error(
                fmt::format("{}: element {} is {}, expected {}", what, i, v[i], want));
    }
}

std::uint32_t iterations(const options& o, std::uint64_t bytes) {
    constexpr std::uint64_t mib = 1 << 20;
    if (bytes <= mib)
        return o.iters;
    return static_cast<std::uint32_t>(std::max<std::uint64_t>(1, o.iters * mib / bytes));
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const std::size_t m = v.size() / 2;
    return v.size() % 2 == 1 ? v[m] : (v[m - 1] + v[m]) / 2;
}

struct result {
    std::uint64_t bytes;
    int ranks;
    mode m;
    std::uint32_t iters;
    double seconds; ///< median per allreduce
    double min_seconds;
    double registration_seconds = 0; ///< per-call: median ibv_reg_mr + dereg time per call
};

/// Everything one run keeps across sizes: the ring and the exchange counter.
struct run {
    ring& R;
    std::uint64_t seq = 0;            ///< token exchanges and calls, counted alike by all ranks
    std::vector<double> registration; ///< per-call: time in (de)registration, each call

    /// Sends my tokens left and returns my right neighbour's.
    tokens exchange(const token& data, const token& staging) {
        ++seq;
        R.send_tokens({data, staging, seq});
        return R.receive_tokens(seq);
    }

    /// `iters` checked allreduces of `data`; `once` runs one and returns its
    /// time, registration included where the mode registers per call.
    template <class Once>
    std::vector<double> repeat(std::span<float> data, std::uint32_t iters, mode m, Once once) {
        std::vector<double> t;
        for (std::uint32_t it = 0; it < iters; ++it) {
            fill(data, R.rank());
            ++seq;
            const auto t0 = steady::now();
            once(seq);
            t.push_back(std::chrono::duration<double>(steady::now() - t0).count());
            check(data, R.ranks(),
                  fmt::format("{} bytes, {}, call {}", data.size_bytes(), name_of(m), it));
        }
        return t;
    }

    std::vector<double> per_call(std::uint64_t bytes, std::uint32_t iters) {
        std::vector<float> data(bytes / sizeof(float)), staging(data.size());
        registration.clear();
        return repeat(data, iters, mode::per_call, [&](std::uint64_t call) {
            // What naive code does: register, hand out the keys, use, deregister.
            // The (de)registration time is kept apart, to set it beside
            // rdmax_reg_bench's measure of the same calls.
            const auto r0 = steady::now();
            std::optional<memory_region<vec_rights>> dmr, smr;
            dmr.emplace(R.pd(), data.data(), bytes);
            smr.emplace(R.pd(), staging.data(), bytes);
            const auto r1 = steady::now();
            R.send_tokens({dmr->remote(), smr->remote(), call});
            const tokens right = R.receive_tokens(call);
            ring_allreduce(R, data, staging, dmr->lkey(), right, call);
            const auto r2 = steady::now();
            dmr.reset();
            smr.reset();
            registration.push_back(
                std::chrono::duration<double>((r1 - r0) + (steady::now() - r2)).count());
        });
    }

    std::vector<double> cached(verbs_cache& cache, std::uint64_t bytes, std::uint32_t iters) {
        std::vector<float> data(bytes / sizeof(float)), staging(data.size());
        // The registrations whose tokens the left neighbour holds: kept for
        // as long as it may write through them (see the top of the file).
        auto pub_d = cache.get<vec_rights>(data.data(), bytes);
        auto pub_s = cache.get<vec_rights>(staging.data(), bytes);
        const tokens right = exchange(pub_d.remote<access::remote_write>(data.data(), bytes),
                                      pub_s.remote<access::remote_write>(staging.data(), bytes));
        return repeat(data, iters, mode::cache, [&](std::uint64_t call) {
            // What a library does with the user's pointers at every call.
            const auto d = cache.get<vec_rights>(data.data(), bytes);
            const auto s = cache.get<vec_rights>(staging.data(), bytes);
            ring_allreduce(R, data, staging, d.lkey(), right, call);
        });
    }

    std::vector<double> in_arena(registered_arena& arena, std::uint64_t bytes,
                                 std::uint32_t iters) {
        registered_arena::resource res(arena);
        std::pmr::vector<float> data(bytes / sizeof(float), &res), staging(data.size(), &res);
        const tokens right = exchange(arena.remote<access::remote_write>(data.data(), bytes),
                                      arena.remote<access::remote_write>(staging.data(), bytes));
        return repeat(data, iters, mode::arena, [&](std::uint64_t call) {
            const auto d = arena.local<vec_rights>(data.data(), bytes); // O(1): the area's key
            ring_allreduce(R, data, staging, d.lkey, right, call);
        });
    }
};

void print_table(std::span<const result> rs) {
    if (rs.empty())
        return;
    fmt::print("\n{:>10} {:>5} {:>9} {:>6} {:>13} {:>13} {:>10} {:>12}\n", "bytes", "ranks", "mode",
               "iters", "median us", "min us", "MB/s", "(de)reg us");
    for (const auto& x : rs)
        fmt::print("{:>10} {:>5} {:>9} {:>6} {:>13.1f} {:>13.1f} {:>10.2f} {:>12}\n", x.bytes,
                   x.ranks, name_of(x.m), x.iters, x.seconds * 1e6, x.min_seconds * 1e6,
                   static_cast<double>(x.bytes) / x.seconds / 1e6,
                   x.m == mode::per_call ? fmt::format("{:.1f}", x.registration_seconds * 1e6)
                                         : std::string("-"));
}

void print_ratios(std::span<const result> rs) {
    const auto find = [&](std::uint64_t bytes, mode m) -> const result* {
        for (const auto& x : rs)
            if (x.bytes == bytes && x.m == m)
                return &x;
        return nullptr;
    };
    fmt::print("\nratios of median times (> 1: the first is slower)\n");
    fmt::print("{:>10} {:>16} {:>16} {:>16}\n", "bytes", "per-call/arena", "cache/arena",
               "per-call/cache");
    for (const auto& x : rs) {
        if (x.m != mode::per_call)
            continue;
        const result* c = find(x.bytes, mode::cache);
        const result* a = find(x.bytes, mode::arena);
        if (c == nullptr || a == nullptr)
            continue;
        fmt::print("{:>10} {:>16.2f} {:>16.2f} {:>16.2f}\n", x.bytes, x.seconds / a->seconds,
                   c->seconds / a->seconds, x.seconds / c->seconds);
    }
}

void write_json(const std::string& path, std::span<const result> rs) {
    std::string out = "[\n";
    for (std::size_t i = 0; i < rs.size(); ++i)
        out += fmt::format("  {{\"bytes\":{},\"ranks\":{},\"mode\":\"{}\",\"seconds\":{:.9g}}}{}\n",
                           rs[i].bytes, rs[i].ranks, name_of(rs[i].m), rs[i].seconds,
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
    run x{R, 0, {}};
    const bool lead = o.rank == 0;
    if (lead)
        fmt::print("allreduce: {} ranks in a ring on {}, sizes {} to {} bytes\n", o.ranks,
                   o.hosts[0], o.min_bytes, o.max_bytes);
    std::vector<result> all;
    for (const mode m : all_modes) {
        if ((o.modes & static_cast<std::uint32_t>(m)) == 0)
            continue;
        const std::size_t first = all.size();
        // one_size(bytes, iters) runs one size of this mode and returns its times.
        const auto sweep = [&](auto one_size) {
            for (std::uint64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 2) {
                const std::uint32_t iters = iterations(o, bytes);
                if (lead)
                    fmt::print(stderr, "[{}] {} bytes x {}\n", name_of(m), bytes, iters);
                const std::vector<double> t = one_size(bytes, iters);
                all.push_back(
                    {bytes, o.ranks, m, iters, median(t), *std::min_element(t.begin(), t.end())});
                if (m == mode::per_call)
                    all.back().registration_seconds = median(x.registration);
            }
            if (lead)
                print_table(std::span(all).subspan(first));
        };
        // The cache and the arena are made per mode, so that one mode's
        // registrations cannot help another.
        if (m == mode::per_call) {
            sweep([&](std::uint64_t b, std::uint32_t n) { return x.per_call(b, n); });
        } else if (m == mode::cache) {
            verbs_cache cache = make_verbs_cache(R.pd());
            sweep([&](std::uint64_t b, std::uint32_t n) { return x.cached(cache, b, n); });
            if (lead)
                fmt::print("cache: {}\n", cache.counters());
        } else {
            registered_arena arena(verbs_registrar(R.pd()), arena_options{}.with_env());
            sweep([&](std::uint64_t b, std::uint32_t n) { return x.in_arena(arena, b, n); });
            if (lead)
                fmt::print("arena: {}\n", arena.counters());
        }
    }
    R.goodbye();
    if (lead) {
        if (std::popcount(o.modes) > 1)
            print_ratios(all);
        if (!o.json.empty())
            write_json(o.json, all);
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
