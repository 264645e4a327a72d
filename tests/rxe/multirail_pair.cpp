// Two rails between two hosts (issue 31; tests/multihost/run.sh, step
// multirail): each host has two soft-RoCE devices on two links, and this
// program runs on both.
//
//   multirail_pair --serve --rails A0,A1 --port P [--deadline S]
//       host 0: 64 MiB registered once per rail (make_rail_cache), a listener
//       on each rail's address; each connection accepted carries the buffer's
//       token (every rail's key). Two connections a rail (the client's bulk
//       queue pair and its urgent lane); accepts new ones on rail 1 (the
//       client's reconnect) until the client closes rail 0, then exits 0.
//   multirail_pair --rails B0,B1 --peer A,A' --port P --netdev DEV
//       host 1: a sched::rail_group over both rails, each dialed to the
//       peer's address on its subnet (rail_set::peer_for: --peer in any order). Striped 64 MiB
//       WRITEs and READs, every byte checked; rail 1's link (DEV) taken down mid-transfer (no
//       error, every byte right) and up again: the group dials rail 1 again once its port is ready
//       and attaches it, and it carries bytes again. The group has urgent lanes: 64-byte
//       urgent READs beside the striped transfers go by them, their bytes checked.
// Exit status 0 when every check held; 1 with the failed check on stderr.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <rdmax/rdmax.hpp>

using namespace rdmax;
using namespace std::chrono_literals;

namespace {

using clock_type = std::chrono::steady_clock;
using striper = sched::rail_group<>::striper_type;
constexpr rights rw = all_rights;
constexpr std::size_t big = std::size_t{64} << 20;
constexpr std::size_t note_bytes = 4096; ///< the urgent READs' buffer: 64 of 64 bytes

struct check_failed : std::runtime_error {
    using std::runtime_error::runtime_error;
};
void check(bool ok, const std::string& what) {
    if (!ok)
        throw check_failed(what);
}

std::vector<std::string> split(const std::string& s) {
    std::vector<std::string> out;
    for (std::size_t at = 0; at <= s.size();) {
        const std::size_t comma = std::min(s.find(',', at), s.size());
        out.push_back(s.substr(at, comma - at));
        at = comma + 1;
    }
    return out;
}

double ms_since(clock_type::time_point t) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t).count();
}

void fill_pattern(std::span<std::byte> out, unsigned seed) {
    for (std::size_t i = 0; i < out.size(); ++i)
        out[i] = static_cast<std::byte>((i + seed) % 251);
}
bool has_pattern(std::span<const std::byte> in, unsigned seed) {
    for (std::size_t i = 0; i < in.size(); ++i)
        if (in[i] != static_cast<std::byte>((i + seed) % 251))
            return false;
    return true;
}

struct options {
    bool serve = false;
    std::vector<std::string> rails, peer;
    std::uint16_t port = 0;
    std::string netdev;
    int deadline_s = 200;
};

// ---- host 0 ---------------------------------------------------------------------------------

int serve(const options& o) {
    const verbs::rail_set rails = verbs::rail_set::of(o.rails);
    check(rails.size() == 2, "two rails");
    rail_cache cache = make_rail_cache(rails);
    std::vector<std::byte> buf(big);
    auto h = cache.get<rw>(buf.data(), buf.size());
    const rail_remote<rw> token =
        rail_verbs_registrar::remote<rw>(h.registration(), buf.data(), big);
    check(token.rails == 2 && token.rkey[0] != 0 && token.rkey[1] != 0, "a key on each rail");
    std::array<verbs::listener, 2> l{verbs::listener(rails[0].address, o.port),
                                     verbs::listener(rails[1].address, o.port)};
    const auto deadline = clock_type::now() + std::chrono::seconds(o.deadline_s);
    fmt::print("multirail_pair: serving 64 MiB on {} and {} port {}\n", rails[0].address,
               rails[1].address, o.port);
    std::fflush(stdout);
    // Either rail's request, in whatever order they come; one that fails to
    // be accepted (a dial the client gave up on) is let go. Done when the
    // client closes rail 0's last connection (its lane: its last act).
    std::array<std::vector<verbs::connection>, 2> conn;
    std::array<int, 2> accepted{};
    while (conn[0].size() < 2 || !conn[0].back().wait_disconnected(20ms)) {
        check(clock_type::now() < deadline, "the client closed rail 0 before the deadline");
        bool any = false;
        for (std::size_t k = 0; k < 2; ++k) {
            std::optional<verbs::connection_request> r = l[k].poll_request();
            if (!r)
                continue;
            any = true;
            try {
                (void)r->create_qp(rails.pd(k));
                const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                    deadline - clock_type::now());
                verbs::connection c =
                    r->accept(verbs::payload_of(token),
                              std::clamp<std::chrono::milliseconds>(left, 1ms, 10s));
                conn[k].push_back(std::move(c)); // the old ones stay (their peers' ends failed)
                ++accepted[k];
            } catch (const rdmax::error& e) {
                fmt::print("multirail_pair: rail {}: a request not accepted: {}\n", k, e.what());
            }
        }
        // Every connection's events, so that the client's disconnects of
        // the others are answered (each would wait out its timeout).
        for (auto& per_rail : conn)
            for (verbs::connection& c : per_rail)
                (void)c.peer_disconnected();
        if (!any && conn[0].empty())
            std::this_thread::sleep_for(20ms);
    }
    fmt::print("multirail_pair: served {} + {} connections; the client closed rail 0\n",
               accepted[0], accepted[1]);
    // At least: a dial the client gave up on, or one whose lane failed, is
    // dialed again whole (the client checks its own dials).
    check(accepted[0] >= 2 && accepted[1] >= 4,
          "rail 0 twice (its queue pair and its lane), rail 1 four times (again after its link "
          "came back)");
    return 0;
}

// ---- host 1 ---------------------------------------------------------------------------------

/// `ip link set DEV up|down`, and up again when the program leaves early.
struct link_switch {
    std::string dev;
    bool is_down = false;
    explicit link_switch(std::string d)
        : dev(std::move(d)) {}
    void set(bool up) {
        const std::string cmd = fmt::format("ip link set dev {} {}", dev, up ? "up" : "down");
        check(std::system(cmd.c_str()) == 0, cmd);
        is_down = !up;
    }
    link_switch(const link_switch&) = delete;
    link_switch& operator=(const link_switch&) = delete;
    ~link_switch() {
        if (is_down)
            (void)std::system(fmt::format("ip link set dev {} up", dev).c_str());
    }
};

struct client {
    const options& o;
    verbs::rail_set rails = verbs::rail_set::of(o.rails);
    rail_cache cache = make_rail_cache(rails);
    std::vector<std::byte> buf = std::vector<std::byte>(big);
    rail_cache::handle h = cache.get<rw>(buf.data(), buf.size());
    rail_local<rw> here = rail_verbs_registrar::local<rw>(h.registration(), buf.data(), big);
    /// Where the urgent READs land.
    std::vector<std::byte> note = std::vector<std::byte>(note_bytes);
    rail_cache::handle nh = cache.get<rw>(note.data(), note.size());
    std::uint64_t urgent_sent = 0;
    /// Rail k's peer address; before the group, whose dials read it.
    std::vector<std::string> peer;
    std::optional<sched::rail_group<>> group;
    rail_remote<rw> there{};
    std::uint64_t next_id = 1;
    /// When the striper was first seen with a rail taken out.
    std::optional<clock_type::time_point> out_at;

    explicit client(const options& opts)
        : o(opts) {
        check(rails.size() == 2, "two rails");
        // The peer's rail on each rail's subnet, in whatever order --peer gave them.
        for (std::size_t k = 0; k < 2; ++k) {
            const std::optional<std::size_t> i = rails.peer_for(k, o.peer);
            check(i.has_value(), fmt::format("a peer address on rail {}'s subnet ({}/{})", k,
                                             rails[k].address, rails[k].prefix));
            peer.push_back(o.peer[*i]);
        }
        // Until the server listens (it may start later), then until both
        // rails are up (keep() dials again one that failed).
        const auto until = clock_type::now() + 120s;
        while (!group) {
            try {
                sched::rail_group_options go;
                go.urgent_lane = true;
                group.emplace(
                    rails,
                    [this](std::size_t k) {
                        return rails.connect(k, peer[k], o.port, {}, {}, 10s);
                    },
                    go);
            } catch (const rdmax::error& e) {
                check(clock_type::now() < until, fmt::format("connecting: {}", e.what()));
                std::this_thread::sleep_for(500ms);
            }
        }
        while (st().rails_up() < 2) {
            check(clock_type::now() < until, fmt::format("rail 1: {}", group->last_failure(1)));
            (void)group->keep();
            std::this_thread::sleep_for(10ms);
        }
        there = token_of(0);
        check(there.rails == 2, "the server's token, with two rails' keys");
        check(same_token(1), "one token on every rail");
    }
    [[nodiscard]] striper& st() noexcept { return group->striper(); }
    [[nodiscard]] rail_remote<rw> token_of(std::size_t k) {
        const verbs::connection* c = group->connection(k);
        if (c == nullptr)
            throw check_failed(fmt::format("rail {} has a connection", k));
        const auto t = c->peer_payload_as<rail_remote<rw>>();
        check(t.has_value(), fmt::format("a token in rail {}'s accept", k));
        return *t;
    }
    [[nodiscard]] bool same_token(std::size_t k) {
        const rail_remote<rw> t = token_of(k);
        return std::memcmp(&t, &there, sizeof t) == 0;
    }

    verbs::completion wait_one() {
        const auto deadline = clock_type::now() + 60s;
        std::array<verbs::completion, 4> done;
        while (clock_type::now() < deadline) {
            const int n = st().wait(done, 100ms);
            (void)group->keep();
            if (!out_at && st().counters().failovers > 0)
                out_at = clock_type::now();
            if (n == 1)
                return done[0];
            check(n == 0, "one completion per striped request");
        }
        throw check_failed("a striped request did not complete in 60 s");
    }
    /// A striped WRITE of a pattern, then a striped READ of it back into a
    /// cleared buffer; every byte checked.
    void write_and_read_checked(unsigned seed) {
        fill_pattern(buf, seed);
        check(st().write(sched::bulk, here, there, 0, next_id++) == status::ok, "WRITE submitted");
        const verbs::completion w = wait_one();
        check(w.ok(), fmt::format("striped WRITE: {}", w.status_name()));
        urgent_reads_checked(seed);
        read_back_checked(seed);
    }
    /// `count` urgent 64-byte READs of the server's buffer (at 4 KiB steps
    /// from `from`), submitted at once; completions are the caller's to take.
    void urgent_reads(int count, std::size_t from) {
        for (int i = 0; i < count; ++i) {
            const std::size_t at = static_cast<std::size_t>(i) * 64;
            const rail_local<rw> to =
                rail_verbs_registrar::local<rw>(nh.registration(), note.data() + at, 64);
            check(st().read(sched::urgent, to, there, from + static_cast<std::size_t>(i) * 4096,
                            next_id++) == status::ok,
                  "urgent READ submitted");
            ++urgent_sent;
        }
    }
    /// The urgent READs' bytes: each the pattern at its offset.
    [[nodiscard]] bool notes_hold(int count, std::size_t from, unsigned seed) const {
        for (int i = 0; i < count; ++i)
            for (std::size_t b = 0; b < 64; ++b) {
                const std::size_t at = from + static_cast<std::size_t>(i) * 4096 + b;
                if (note[static_cast<std::size_t>(i) * 64 + b] !=
                    static_cast<std::byte>((at + seed) % 251))
                    return false;
            }
        return true;
    }
    /// After a striped WRITE of `seed`: 16 urgent READs by the lanes, checked.
    void urgent_reads_checked(unsigned seed) {
        std::fill(note.begin(), note.end(), std::byte{0});
        urgent_reads(16, 4096);
        const auto deadline = clock_type::now() + 60s;
        std::array<verbs::completion, 16> done;
        for (int seen = 0; seen < 16;) {
            check(clock_type::now() < deadline, "16 urgent READs complete within 60 s");
            const int n = st().wait(done, 100ms);
            (void)group->keep();
            for (int i = 0; i < n; ++i) {
                const verbs::completion& c = done[static_cast<std::size_t>(i)];
                check(c.ok(), fmt::format("urgent READ: {}", c.status_name()));
            }
            seen += n;
        }
        check(notes_hold(16, 4096, seed), "every urgent READ's bytes");
    }
    void read_back_checked(unsigned seed) {
        std::memset(buf.data(), 0, buf.size());
        check(st().read(sched::bulk, here, there, 0, next_id++) == status::ok, "READ submitted");
        const verbs::completion r = wait_one();
        check(r.ok(), fmt::format("striped READ: {}", r.status_name()));
        check(has_pattern(buf, seed), "every byte read back is the pattern written");
    }
};

int run_client(const options& o) {
    link_switch link{o.netdev};
    client c(o);
    const auto& n = c.st().counters();
    const auto& g = c.group->counters();
    const std::uint64_t dials0 = g.dials; // a rail that joined late was dialed by keep()
    const std::uint64_t failures0 = g.dial_failures;

    // 1. Striped over both links.
    const auto t0 = clock_type::now();
    c.write_and_read_checked(11);
    const double both_ms = ms_since(t0);
    check(n.rail_bytes[0] > 0 && n.rail_bytes[1] > 0, "both rails carried bytes");
    fmt::print("multirail_pair: 64 MiB WRITE + READ over both rails in {:.0f} ms ({} + {} bytes)\n",
               both_ms, n.rail_bytes[0], n.rail_bytes[1]);

    // 2. Rail 1's link down while a WRITE is under way on both: it ends ok,
    // and later ones go on rail 0 alone, every byte right.
    fill_pattern(c.buf, 21);
    check(c.st().write(sched::bulk, c.here, c.there, 0, c.next_id++) == status::ok, "WRITE");
    const std::uint64_t before = n.rail_bytes[1];
    std::array<verbs::completion, 4> done;
    int finished = 0;
    const auto deadline = clock_type::now() + 120s;
    while (n.rail_bytes[1] == before && finished == 0) {
        check(clock_type::now() < deadline, "rail 1 took part in the WRITE");
        finished = c.st().poll(done);
    }
    const auto t_down = clock_type::now();
    std::atomic<bool> down{false};
    auto taker = std::async(std::launch::async, [&] {
        link.set(false);
        down = true;
    });
    const verbs::completion first = finished != 0 ? done[0] : c.wait_one();
    check(first.ok(),
          fmt::format("the WRITE under way as the link went down: {}", first.status_name()));
    c.read_back_checked(21);
    // Two more once the striper took rail 1 out (its port event, through
    // keep(), or its work failing, whichever came first).
    unsigned seed = 23;
    for (int after = 0; after < 2; seed += 2) {
        check(clock_type::now() < deadline, "the striper took rail 1 out within 120 s");
        c.write_and_read_checked(seed);
        if (down && n.failovers > 0)
            ++after;
    }
    taker.get();
    const double out_ms =
        c.out_at ? std::chrono::duration<double, std::milli>(*c.out_at - t_down).count() : -1;
    check(!c.st().rail_up(1) && c.st().rail_up(0), "rail 1 out, rail 0 in");
    check(n.failed == 0, "no request failed");
    fmt::print("multirail_pair: rail 1 down mid-transfer: {} requests, none failed; {} pieces "
               "sent again\n",
               n.completed, n.reposts);

    // 3. Up again: the group dials rail 1 once its port is ready (PORT_ACTIVE,
    // its GID back) and attaches it; it carries bytes again.
    const auto t_up = clock_type::now();
    link.set(true);
    while (!c.st().rail_up(1)) {
        check(clock_type::now() < t_up + 60s,
              fmt::format("rail 1 back within 60 s of `ip link set up` (last dial: {})",
                          c.group->last_failure(1)));
        (void)c.group->keep();
        std::this_thread::sleep_for(5ms);
    }
    const double back_ms = ms_since(t_up);
    check(c.same_token(1), "the same token on the new connection");
    const std::uint64_t rail1_before = n.rail_bytes[1];
    c.write_and_read_checked(seed);
    check(n.rail_bytes[1] > rail1_before, "rail 1 carries bytes again");
    check(n.rejoins == 1 && n.failed == 0 && g.rejoins == 1, "one rejoin, no failure");
    check(c.group->lane_connection(1) != nullptr, "rail 1 back with its lane");
    check(n.lane_pieces >= c.urgent_sent, "every urgent READ by a lane");
    check(g.dials - dials0 == g.dial_failures - failures0 + 1, "one dial that succeeded");
    fmt::print("multirail_pair: rail 1 out {:.0f} ms after `ip link set down` began, back {:.0f} "
               "ms after `up`; {}; group: port downs {}, dials {} ({} failed), rejoins {}\n",
               out_ms, back_ms, n, g.port_downs, g.dials, g.dial_failures, g.rejoins);
    // Rail 1 first, rail 0's lane last: the server's sign that the client is done.
    for (const std::size_t k : {1, 0})
        for (verbs::connection* conn : {c.group->connection(k), c.group->lane_connection(k)})
            if (conn != nullptr)
                conn->disconnect();
    return 0;
}

options parse(int argc, char** argv) {
    options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        const auto value = [&]() -> std::string {
            if (i + 1 >= argc)
                throw std::invalid_argument(a + ": a value is missing");
            return argv[++i];
        };
        if (a == "--serve")
            o.serve = true;
        else if (a == "--rails")
            o.rails = split(value());
        else if (a == "--peer")
            o.peer = split(value());
        else if (a == "--port")
            o.port = static_cast<std::uint16_t>(std::stoul(value()));
        else if (a == "--netdev")
            o.netdev = value();
        else if (a == "--deadline")
            o.deadline_s = std::stoi(value());
        else
            throw std::invalid_argument(a + ": unknown");
    }
    if (o.rails.size() != 2 || o.port == 0 ||
        (!o.serve && (o.peer.size() != 2 || o.netdev.empty())))
        throw std::invalid_argument("--rails A,B and --port P; a client also --peer A,B and "
                                    "--netdev DEV");
    return o;
}

} // namespace

int main(int argc, char** argv) {
    try {
        const options o = parse(argc, argv);
        return o.serve ? serve(o) : run_client(o);
    } catch (const check_failed& e) {
        fmt::print(stderr, "multirail_pair: FAILED: {}\n", e.what());
    } catch (const std::exception& e) {
        fmt::print(stderr, "multirail_pair: {}\n", e.what());
    }
    return 1;
}
