#pragma once
// What rdmax_write_lat and rdmax_write_bw share: perftest's flags, a cycle
// clock that needs no system call, the rdma_cm session that carries each
// side's buffer token in the connection's private data, a barrier between
// message sizes, and perftest's report formats plus --json lines.
//
// Every wait here has a deadline (--timeout, 30 s by default): a peer that
// dies or stalls ends the run with a message, never a hang.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <getopt.h>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

namespace rdmax::bench {

using namespace std::chrono_literals;

/// A failure that ends the run: main() prints it and exits 1.
class bench_failure : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

[[noreturn]] inline void fail(const std::string& what) {
    throw bench_failure(what);
}

// ---- time ---------------------------------------------------------------------------------

/// The CPU's time-stamp counter: one instruction, no system call. (On a guest
/// whose clocksource is the HPET, as under qemu TCG, clock_gettime is a real
/// system call that costs microseconds; perftest reads the TSC for the same
/// reason.) Elsewhere, steady_clock in nanoseconds.
[[nodiscard]] inline std::uint64_t cycles() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    return __rdtsc();
#else
    return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                          std::chrono::steady_clock::now().time_since_epoch())
                                          .count());
#endif
}

/// Measures the cycle counter's rate against steady_clock between start() and
/// stop(). Calibrating over the whole measured run makes the conversion as
/// exact as the run is long, whatever /proc/cpuinfo claims.
class cycle_rate {
public:
    void start() noexcept {
        wall_start_ = std::chrono::steady_clock::now();
        cycles_start_ = cycles();
    }
    void stop() noexcept {
        cycles_stop_ = cycles();
        wall_stop_ = std::chrono::steady_clock::now();
    }
    /// Cycles per microsecond; 0 when too little time passed to tell.
    [[nodiscard]] double per_us() const noexcept {
        const double us =
            std::chrono::duration<double, std::micro>(wall_stop_ - wall_start_).count();
        return us > 0 ? static_cast<double>(cycles_stop_ - cycles_start_) / us : 0.0;
    }

private:
    std::chrono::steady_clock::time_point wall_start_{}, wall_stop_{};
    std::uint64_t cycles_start_ = 0, cycles_stop_ = 0;
};

/// A first estimate of the cycle rate (20 ms of sleep), good enough to turn
/// deadlines into cycle counts before any run.
[[nodiscard]] inline double estimate_cycles_per_us() {
    cycle_rate rate;
    rate.start();
    std::this_thread::sleep_for(20ms);
    rate.stop();
    return std::max(rate.per_us(), 1.0);
}

/// Spins until ready() holds, reading the clock only every 1024 tries so that
/// the wait costs no more than the load it repeats. False when `limit` cycles
/// passed first.
template <class Ready>
[[nodiscard]] bool spin_until(Ready&& ready, std::uint64_t limit) {
    if (ready())
        return true;
    const std::uint64_t start = cycles();
    for (std::uint32_t tries = 1;; ++tries) {
        if (ready())
            return true;
        if ((tries & 1023u) == 0 && cycles() - start > limit)
            return false;
    }
}

// ---- options ------------------------------------------------------------------------------

enum class tool_kind : std::uint8_t { write_lat = 1, write_bw = 2 };

/// perftest's MAX_SIZE: -a runs 2, 4, ... up to this.
inline constexpr std::uint32_t largest_message = 8388608;
/// perftest's MIN_ITER.
inline constexpr std::uint32_t fewest_iterations = 5;

struct options {
    tool_kind tool = tool_kind::write_lat;
    std::string device;           ///< -d; empty: the first device with an ACTIVE port
    std::uint32_t size = 2;       ///< -s, bytes
    bool all_sizes = false;       ///< -a
    std::uint32_t iterations = 0; ///< -n
    std::uint32_t max_inline = 0; ///< -I
    std::uint32_t tx_depth = 0;   ///< -t
    std::uint32_t cq_mod = 100;   ///< -Q (bw)
    bool cq_mod_given = false;
    std::uint32_t post_list = 1;        ///< -l (bw)
    std::uint16_t port = 18515;         ///< -p, rdma_cm port
    std::string json_path;              ///< --json
    std::chrono::seconds timeout = 30s; ///< --timeout: the longest any one wait may last
    std::string server_address;         ///< last argument; empty: this is the server

    [[nodiscard]] bool is_server() const noexcept { return server_address.empty(); }
    [[nodiscard]] std::vector<std::uint32_t> sizes() const {
        if (!all_sizes)
            return {size};
        std::vector<std::uint32_t> out;
        for (std::uint32_t s = 2; s <= largest_message; s *= 2)
            out.push_back(s);
        return out;
    }
    [[nodiscard]] std::uint32_t biggest_size() const noexcept {
        return all_sizes ? largest_message : size;
    }
};

[[nodiscard]] inline std::string_view tool_name(tool_kind t) noexcept {
    return t == tool_kind::write_lat ? "rdmax_write_lat" : "rdmax_write_bw";
}

namespace detail {

template <class Int>
Int parse_number(const char* text, std::string_view flag, Int least, Int most) {
    Int value{};
    const std::string_view s(text);
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
    if (ec != std::errc{} || end != s.data() + s.size() || value < least || value > most)
        fail(fmt::format("{} wants a number from {} to {}, not '{}'", flag, least, most, s));
    return value;
}

inline void print_usage(tool_kind tool, const options& d) {
    const bool bw = tool == tool_kind::write_bw;
    fmt::print("usage: {0} [options]              (server)\n"
               "       {0} [options] SERVER_ADDR  (client)\n"
               "RDMA write {1} over an rdma_cm connection, measured like perftest's {2}.\n"
               "Server and client must be given the same -s/-a/-n.\n\n"
               "  -d, --ib-dev DEV        device (default: the first with an ACTIVE port)\n"
               "  -s, --size BYTES        message size (default {3})\n"
               "  -a, --all               every size from 2 to {4} bytes in powers of 2\n"
               "  -n, --iters N           iterations per size (default {5}, at least {6})\n"
               "  -I, --inline_size B     most bytes sent inline (default {7}; the device's grant "
               "decides)\n"
               "  -t, --tx-depth N        send queue depth (default {8})\n"
               "{9}"
               "  -p, --port PORT         rdma_cm port (default {10})\n"
               "      --json FILE         one JSON object per size, a line each\n"
               "      --timeout SEC       the longest any single wait may last (default {11})\n"
               "  -h, --help              this text\n",
               tool_name(tool), bw ? "bandwidth" : "latency", bw ? "ib_write_bw" : "ib_write_lat",
               d.size, largest_message, d.iterations, fewest_iterations, d.max_inline, d.tx_depth,
               bw ? fmt::format("  -Q, --cq-mod N          signal every N-th write (default {})\n"
                                "  -l, --post_list N       writes chained per post (default 1)\n",
                                d.cq_mod)
                  : std::string(),
               d.port, d.timeout.count());
}

} // namespace detail

/// Parses perftest's flags. Exits (2) on a bad command line, (0) after --help.
[[nodiscard]] inline options parse_options(int argc, char** argv, options defaults) {
    using detail::parse_number;
    options o = defaults;
    const bool bw = o.tool == tool_kind::write_bw;
    enum : int { opt_json = 1000, opt_timeout };
    const option longs[] = {
        {"ib-dev", required_argument, nullptr, 'd'},
        {"size", required_argument, nullptr, 's'},
        {"all", no_argument, nullptr, 'a'},
        {"iters", required_argument, nullptr, 'n'},
        {"inline_size", required_argument, nullptr, 'I'},
        {"tx-depth", required_argument, nullptr, 't'},
        {"cq-mod", required_argument, nullptr, 'Q'},
        {"post_list", required_argument, nullptr, 'l'},
        {"port", required_argument, nullptr, 'p'},
        {"json", required_argument, nullptr, opt_json},
        {"timeout", required_argument, nullptr, opt_timeout},
        {"help", no_argument, nullptr, 'h'},
        {nullptr, 0, nullptr, 0},
    };
    const char* shorts = bw ? "d:s:an:I:t:Q:l:p:h" : "d:s:an:I:t:p:h";
    try {
        for (;;) {
            const int c = getopt_long(argc, argv, shorts, longs, nullptr);
            if (c == -1)
                break;
            switch (c) {
            case 'd': o.device = optarg; break;
            case 's': o.size = parse_number<std::uint32_t>(optarg, "-s", 1, largest_message); break;
            case 'a': o.all_sizes = true; break;
            case 'n':
                o.iterations =
                    parse_number<std::uint32_t>(optarg, "-n", fewest_iterations, 100'000'000);
                break;
            case 'I': o.max_inline = parse_number<std::uint32_t>(optarg, "-I", 0, 65536); break;
            case 't': o.tx_depth = parse_number<std::uint32_t>(optarg, "-t", 1, 65536); break;
            case 'Q':
                if (!bw)
                    fail("-Q is a bandwidth option");
                o.cq_mod = parse_number<std::uint32_t>(optarg, "-Q", 1, 65536);
                o.cq_mod_given = true;
                break;
            case 'l':
                if (!bw)
                    fail("-l is a bandwidth option");
                o.post_list = parse_number<std::uint32_t>(optarg, "-l", 1, 4096);
                break;
            case 'p': o.port = parse_number<std::uint16_t>(optarg, "-p", 1, 65535); break;
            case opt_json: o.json_path = optarg; break;
            case opt_timeout:
                o.timeout = std::chrono::seconds(parse_number<int>(optarg, "--timeout", 1, 86400));
                break;
            case 'h': detail::print_usage(o.tool, defaults); std::exit(0);
            default: fmt::print(stderr, "{}: try --help\n", tool_name(o.tool)); std::exit(2);
            }
        }
        if (optind < argc)
            o.server_address = argv[optind++];
        if (optind < argc)
            fail(fmt::format("unexpected argument '{}'", argv[optind]));
        if (o.post_list > o.tx_depth)
            fail(fmt::format("-l {} exceeds -t {}: a chain must fit in the send queue", o.post_list,
                             o.tx_depth));
    } catch (const bench_failure& e) {
        fmt::print(stderr, "{}: {}\n", tool_name(o.tool), e.what());
        std::exit(2);
    }
    return o;
}

// ---- the session --------------------------------------------------------------------------

/// Rights of the memory each side exposes: the peer writes into it.
inline constexpr rights region_rights = rights::local_write | rights::remote_write;

/// What each side puts in the rdma_cm private data (40 of the 55 bytes a
/// connect request carries): its buffer token, and the parameters both sides
/// must agree on, so that a mismatch is reported instead of a hang.
struct hello {
    remote_buffer<region_rights> token; ///< the receive area, then the inbox
    std::uint32_t magic = 0;
    std::uint8_t tool = 0;
    std::uint8_t all_sizes = 0;
    std::uint16_t reserved = 0;
    std::uint32_t size = 0;
    std::uint32_t iterations = 0;
};
static_assert(sizeof(hello) <= verbs::max_connect_payload);
inline constexpr std::uint32_t hello_magic = 0x72646d62; // "rdmb"

/// One side of a benchmark connection, and its registered memory:
///
///   [ send area | receive area | inbox | outbox ]
///     slot        slot           64      64
///
/// Writes go from the send area into the peer's receive area. The inbox takes
/// the peer's barrier counter; the outbox is the source of ours. The token
/// handed to the peer covers the receive area and the inbox.
class session {
public:
    session(const options& opt, const verbs::qp_config& cfg)
        : opt_(opt)
        , ctx_(opt.device.empty() ? verbs::context::open_first_active()
                                  : verbs::context::open(opt.device))
        , pd_(ctx_)
        , slot_(round_up(opt.biggest_size(), control_bytes))
        , memory_(allocate(2 * slot_ + 2 * control_bytes))
        , region_(pd_, memory_.get(), 2 * slot_ + 2 * control_bytes) {
        const auto mine = my_hello();
        if (opt.is_server()) {
            listener_.emplace("0.0.0.0", opt.port);
            fmt::print("\n************************************\n"
                       "* Waiting for client to connect... *\n"
                       "************************************\n");
            std::fflush(stdout);
            conn_.emplace(listener_->accept(pd_, verbs::payload_of(mine), cfg, opt.timeout));
        } else {
            conn_.emplace(connect_with_retry(verbs::payload_of(mine), cfg));
        }
        peer_ = check_peer(mine);
    }
    session(const session&) = delete;
    session& operator=(const session&) = delete;

    [[nodiscard]] verbs::queue_pair<verbs::rc>& qp() noexcept { return conn_->qp(); }
    [[nodiscard]] verbs::connection& connection() noexcept { return *conn_; }
    [[nodiscard]] const verbs::context& device() const noexcept { return ctx_; }

    /// The first `size` bytes of the send area, as the source of writes.
    [[nodiscard]] local_buffer<region_rights> send_area(std::uint32_t size) const {
        return region_.local(0, size);
    }
    [[nodiscard]] std::byte* send_bytes() const noexcept { return region_.data(); }
    [[nodiscard]] std::byte* receive_bytes() const noexcept { return region_.data() + slot_; }
    /// The peer's receive area: where writes go.
    [[nodiscard]] remote_buffer<region_rights> peer_receive_area() const noexcept {
        return *peer_.sub(0, slot_);
    }

    /// Writes `generation` into the peer's inbox and waits for that write to
    /// complete (so the outbox may change again).
    void signal(std::uint64_t generation) {
        std::memcpy(outbox(), &generation, sizeof generation);
        auto& q = qp();
        reclaim_slots(1);
        const auto source = region_.local(2 * slot_ + control_bytes, sizeof generation);
        if (const status s = q.write(source, peer_, slot_, control_wr_id); s != status::ok)
            fail(fmt::format("posting the barrier write: {} (errno {})", to_string(s),
                             q.last_errno()));
        const auto deadline = std::chrono::steady_clock::now() + opt_.timeout;
        verbs::completion done[16];
        for (;;) {
            // In slices, so that a peer that went away ends the wait at once
            // rather than after the transport's retries.
            const int n = q.wait_send(done, 50ms);
            if (n < 0)
                fail("polling the send completion queue failed");
            for (int i = 0; i < n; ++i) {
                const verbs::completion& c = done[static_cast<std::size_t>(i)];
                if (!c.ok())
                    fail(fmt::format("a write failed: {}", c.status_name()));
                if (c.wr_id == control_wr_id)
                    return;
            }
            if (n == 0 && conn_->peer_disconnected())
                fail("the peer disconnected");
            if (n == 0 && std::chrono::steady_clock::now() > deadline)
                fail(fmt::format("the barrier write did not complete within {} s",
                                 opt_.timeout.count()));
        }
    }

    /// Waits until the peer's counter reaches `generation`. Spinning answers
    /// fastest; a side with nothing else to do sleeps instead, so as not to
    /// take a CPU from the peer (qemu guests often have two).
    void wait_for(std::uint64_t generation, std::chrono::seconds timeout, bool sleep) {
        std::atomic_ref<std::uint64_t> counter(*inbox());
        const auto reached = [&] { return counter.load(std::memory_order_acquire) >= generation; };
        if (!sleep) {
            if (!spin_until(reached, to_cycles(timeout)))
                fail(fmt::format("the peer did not reach step {} within {} s", generation,
                                 timeout.count()));
            return;
        }
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        while (!reached()) {
            // Sleeps in poll() on the connection's event channel: a
            // disconnect (the peer quit or died) ends the wait at once.
            if (conn_->wait_disconnected(20ms) && !reached())
                fail("the peer disconnected before it finished");
            if (std::chrono::steady_clock::now() > deadline)
                fail(fmt::format("the peer did not reach step {} within {} s", generation,
                                 timeout.count()));
        }
    }

    /// Both sides: signal, then wait.
    void barrier(std::uint64_t generation, bool sleep = false) {
        signal(generation);
        wait_for(generation, opt_.timeout, sleep);
    }

    /// Polls send completions until `wanted` send-queue slots are free. A
    /// selectively signaled queue frees slots only when a signaled request
    /// completes, and the library signals at least every send_depth / 2
    /// requests, so up to that many always come back. Cheap enough for timed
    /// loops: no clock but the cycle counter.
    void reclaim_slots(std::uint32_t wanted) {
        auto& q = qp();
        verbs::completion done[16];
        const auto freed = [&] {
            const int n = q.poll_send(done);
            if (n < 0)
                fail("polling the send completion queue failed");
            for (int i = 0; i < n; ++i)
                if (const verbs::completion& c = done[static_cast<std::size_t>(i)]; !c.ok())
                    fail(fmt::format("a write failed: {}", c.status_name()));
            return q.send_slots_free() >= wanted;
        };
        if (!spin_until(freed, to_cycles(opt_.timeout)))
            fail(fmt::format("send completions missing after {} s", opt_.timeout.count()));
    }

    /// The cycle-counter equivalent of a duration (from the estimated rate).
    [[nodiscard]] std::uint64_t to_cycles(std::chrono::duration<double> d) const noexcept {
        return static_cast<std::uint64_t>(d.count() * 1e6 * cycles_per_us_);
    }

private:
    static constexpr std::uint32_t control_bytes = 64;
    static constexpr std::uint64_t control_wr_id = ~std::uint64_t{0};

    struct free_deleter {
        void operator()(std::byte* p) const noexcept { std::free(p); }
    };
    using memory_ptr = std::unique_ptr<std::byte, free_deleter>;

    static std::uint64_t round_up(std::uint64_t n, std::uint64_t to) noexcept {
        return (n + to - 1) / to * to;
    }
    /// Page-aligned, zeroed (which also faults every page in before the run).
    static memory_ptr allocate(std::uint64_t bytes) {
        const std::uint64_t page = 4096;
        void* p = std::aligned_alloc(page, round_up(bytes, page));
        if (p == nullptr)
            fail(fmt::format("cannot allocate {} bytes", bytes));
        std::memset(p, 0, round_up(bytes, page));
        return memory_ptr(static_cast<std::byte*>(p));
    }

    [[nodiscard]] std::uint64_t* inbox() const noexcept {
        return reinterpret_cast<std::uint64_t*>(region_.data() + 2 * slot_);
    }
    [[nodiscard]] std::byte* outbox() const noexcept {
        return region_.data() + 2 * slot_ + control_bytes;
    }

    [[nodiscard]] hello my_hello() const {
        hello h;
        // Zero the padding too (remote_buffer ends in four bytes of it):
        // the whole struct crosses the wire.
        std::memset(static_cast<void*>(&h), 0, sizeof h);
        h.token = *region_.remote().sub(slot_, slot_ + control_bytes);
        h.magic = hello_magic;
        h.tool = static_cast<std::uint8_t>(opt_.tool);
        h.all_sizes = opt_.all_sizes ? 1 : 0;
        h.size = opt_.all_sizes ? 0 : opt_.size;
        h.iterations = opt_.iterations;
        return h;
    }

    /// The client may start before the server listens (scripts start both at
    /// once): a refused connection is retried until the deadline.
    verbs::connection connect_with_retry(std::span<const std::byte> payload,
                                         const verbs::qp_config& cfg) {
        const auto deadline = std::chrono::steady_clock::now() + opt_.timeout;
        for (;;) {
            try {
                return verbs::connection::connect(pd_, opt_.server_address, opt_.port, payload, cfg,
                                                  std::chrono::milliseconds(opt_.timeout));
            } catch (const rdmax::error& e) {
                if (e.code().value() != ECONNREFUSED ||
                    std::chrono::steady_clock::now() + 200ms > deadline)
                    throw;
            }
            std::this_thread::sleep_for(200ms);
        }
    }

    [[nodiscard]] remote_buffer<region_rights> check_peer(const hello& mine) const {
        const auto peer = conn_->peer_payload_as<hello>();
        if (!peer || peer->magic != hello_magic)
            fail("the peer is not an rdmax benchmark tool");
        const auto describe = [](const hello& h) {
            return fmt::format("{} {} -n {}", tool_name(static_cast<tool_kind>(h.tool)),
                               h.all_sizes != 0 ? std::string("-a") : fmt::format("-s {}", h.size),
                               h.iterations);
        };
        if (peer->tool != mine.tool || peer->all_sizes != mine.all_sizes ||
            peer->size != mine.size || peer->iterations != mine.iterations)
            fail(fmt::format("the peer runs '{}', this side '{}': give both the same tool, "
                             "-s/-a and -n",
                             describe(*peer), describe(mine)));
        if (peer->token.length != slot_ + control_bytes)
            fail("the peer's buffer does not match this side's");
        return peer->token;
    }

    options opt_;
    verbs::context ctx_;
    verbs::protection_domain pd_;
    std::uint64_t slot_;
    memory_ptr memory_;
    memory_region<region_rights> region_;
    std::optional<verbs::listener> listener_;
    std::optional<verbs::connection> conn_;
    remote_buffer<region_rights> peer_;
    double cycles_per_us_ = estimate_cycles_per_us();
};

// ---- output -------------------------------------------------------------------------------

inline constexpr std::string_view result_line =
    "---------------------------------------------------------------------------------------\n";

/// --json FILE: one object a line, flushed as each size finishes.
class json_lines {
public:
    explicit json_lines(const std::string& path) {
        if (path.empty())
            return;
        file_ = std::fopen(path.c_str(), "w");
        if (file_ == nullptr)
            fail(fmt::format("cannot write {}: {}", path, std::strerror(errno)));
    }
    json_lines(const json_lines&) = delete;
    json_lines& operator=(const json_lines&) = delete;
    ~json_lines() {
        if (file_ != nullptr)
            std::fclose(file_);
    }
    void write(const std::string& object) {
        if (file_ == nullptr)
            return;
        fmt::print(file_, "{}\n", object);
        std::fflush(file_);
    }

private:
    std::FILE* file_ = nullptr;
};

/// main() of both tools: failures end in one line on stderr and exit 1.
template <class Run>
int run_tool(tool_kind tool, Run&& run) {
    try {
        run();
        return 0;
    } catch (const std::exception& e) {
        std::fflush(stdout);
        fmt::print(stderr, "{}: {}\n", tool_name(tool), e.what());
        return 1;
    }
}

} // namespace rdmax::bench
