// The knob tables (config/knob.hpp): with_env() applies them and refuses a
// bad value whole, naming it; explicit options are used as given whatever the
// environment says; the README's knob table agrees with the tables; rdmax-info
// prints every knob.
#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <sys/wait.h>
#include <tuple>
#include <vector>

#include <rdmax/config/knobs.hpp>
#include <rdmax/local/mapping_options.hpp>
#include <rdmax/local/team_options.hpp>
#include <rdmax/mem/arena_options.hpp>
#include <rdmax/mem/handle_options.hpp>
#include <rdmax/mem/rcache_options.hpp>
#include <rdmax/rpc/rpc_options.hpp>
#include <rdmax/sched/scheduler_options.hpp>
#include <rdmax/sched/stripe_options.hpp>
#include <rdmax/verbs/rail_options.hpp>

#include "../support/catch.hpp"

using namespace rdmax;

namespace {

/// Sets a variable for the scope of a test, unsetting it after.
struct scoped_env {
    const char* name;
    scoped_env(const char* n, const char* value)
        : name(n) {
        setenv(n, value, 1);
    }
    scoped_env(const scoped_env&) = delete;
    scoped_env& operator=(const scoped_env&) = delete;
    ~scoped_env() { unsetenv(name); }
};

/// Every knob's default, printed and read back, gives the default again.
template <class... Knobs>
void check_round_trip(const std::tuple<Knobs...>& table) {
    std::apply(
        [](const Knobs&... k) {
            const auto one = [](const auto& kn) {
                using options = typename std::remove_cvref_t<decltype(kn)>::options_type;
                options o{};
                INFO(kn.name);
                kn.apply(o, kn.format(options{}), "test");
                CHECK(kn.format(o) == kn.format(options{}));
                CHECK(kn.doc.size() > 10);
                CHECK(std::string_view(kn.name).starts_with("RDMAX_"));
            };
            (one(k), ...);
        },
        table);
}

} // namespace

TEST_CASE("knobs: every default reads back as itself; names are unique") {
    check_round_trip(rcache_knobs);
    check_round_trip(arena_knobs);
    check_round_trip(handle_knobs);
    check_round_trip(sched::scheduler_knobs);
    check_round_trip(sched::stripe_knobs);
    check_round_trip(verbs::rail_knobs);
    check_round_trip(rpc::rpc_knobs);
    check_round_trip(local::mapping_knobs);
    check_round_trip(local::team_knobs);
    std::map<std::string, int> seen;
    for (const config::knob_row& r : config::knobs_from_env())
        CHECK(++seen[std::string(r.name)] == 1);
    CHECK(seen.size() == 48);
}

TEST_CASE("knobs: RDMAX_RAILS takes off, auto, or up to 4 addresses and device:port names") {
    using verbs::rail_list;
    const auto parse = [](std::string_view text) {
        return verbs::rail_list_parser::parse_rails("test", "RDMAX_RAILS", text);
    };
    CHECK(parse("off").how == rail_list::mode::off);
    CHECK(parse("auto").how == rail_list::mode::automatic);
    const rail_list named = parse("192.0.2.1,mlx5_1:1,fe80::1");
    CHECK(named.how == rail_list::mode::named);
    CHECK(named.names == std::vector<std::string>{"192.0.2.1", "mlx5_1:1", "fe80::1"});
    CHECK(verbs::rail_list_parser::format_rails(named) == "192.0.2.1,mlx5_1:1,fe80::1");
    CHECK(parse(verbs::rail_list_parser::format_rails(named)) == named);
    for (const char* bad : {"", "192.0.2.1,", ",192.0.2.1", "rxe0", "rxe0:0", "rxe0:256", ":1",
                            "192.0.2.1,192.0.2.1", "a:1,b:1,c:1,d:1,e:1", "on", "192.0.2.300"}) {
        INFO(bad);
        CHECK_THROWS_AS(parse(bad), rdmax::error);
    }
}

TEST_CASE("knobs: sizes take suffixes, print with the largest that divides") {
    std::uint64_t n = 0;
    CHECK(config::parse_number("16M", n));
    CHECK(n == 16U << 20);
    CHECK(config::parse_number("4k", n));
    CHECK(n == 4096);
    CHECK_FALSE(config::parse_number("", n));
    CHECK_FALSE(config::parse_number("12Q", n));
    CHECK_FALSE(config::parse_number("1KB", n));
    CHECK_FALSE(config::parse_number("-1", n));
    CHECK_FALSE(config::parse_number("17000000T", n)); // over 64 bits
    CHECK(config::format_size(16U << 20) == "16M");
    CHECK(config::format_size(1536) == "1536");
    CHECK(config::format_size(0) == "0");
    CHECK(config::format_size(std::uint64_t{1} << 40) == "1T");
}

TEST_CASE("knobs: a refused value names the variable, the value and the range") {
    {
        const scoped_env e("RDMAX_RPC_SLOT_BYTES", "100");
        CHECK_THROWS_WITH(rpc::rpc_options{}.with_env(),
                          Catch::Matchers::Contains("RDMAX_RPC_SLOT_BYTES='100'") &&
                              Catch::Matchers::Contains("a multiple of 8 from 64 to 262144"));
    }
    {
        const scoped_env e("RDMAX_ARENA_AREA_BYTES", "3M");
        CHECK_THROWS_WITH(arena_options{}.with_env(),
                          Catch::Matchers::Contains("RDMAX_ARENA_AREA_BYTES='3M'") &&
                              Catch::Matchers::Contains("a power of two of at least 2M"));
    }
    {
        const scoped_env e("RDMAX_SCHED_BUDGET_BYTES", "0");
        CHECK_THROWS_WITH(sched::scheduler_options{}.with_env(),
                          Catch::Matchers::Contains("RDMAX_SCHED_BUDGET_BYTES='0'") &&
                              Catch::Matchers::Contains("or auto"));
    }
    {
        const scoped_env e("RDMAX_RPC_PTRACER", "all");
        CHECK_THROWS_WITH(rpc::rpc_options{}.with_env(),
                          Catch::Matchers::Contains("RDMAX_RPC_PTRACER='all'") &&
                              Catch::Matchers::Contains("off, peer or any"));
    }
    for (const char* bad : {"rdma,,shm", "ib", "shm,", "tcp,udp"}) {
        const scoped_env e("RDMAX_RPC_TRANSPORTS", bad);
        CHECK_THROWS_WITH(rpc::rpc_options{}.with_env(),
                          Catch::Matchers::Contains("a comma list of rdma, shm, tcp"));
    }
    {
        const scoped_env e("RDMAX_RPC_TIMEOUT_MS", "86400001");
        CHECK_THROWS_WITH(rpc::rpc_options{}.with_env(),
                          Catch::Matchers::Contains("from 1 to 86400000"));
    }
}

TEST_CASE("knobs: RDMAX_RPC_TRANSPORTS is a set, named in any order") {
    using rpc::transport;
    CHECK(rpc::rpc_options{}.transports == rpc::all_transports);
    CHECK(rpc::transport_list{}.format<rpc::transport_set>(rpc::all_transports) == "rdma,shm,tcp");
    const rpc::transport_set device_and_node =
        rpc::transport_set{} | transport::rdma | transport::shm;
    const std::pair<const char*, rpc::transport_set> cases[] = {
        {"shm", rpc::transport_set{} | transport::shm},
        {"rdma", rpc::transport_set{} | transport::rdma},
        {"tcp", rpc::transport_set{} | transport::tcp},
        {"shm,rdma", device_and_node},
        {"rdma,shm,rdma", device_and_node},
        {"tcp,shm,rdma", rpc::all_transports},
    };
    for (const auto& [text, want] : cases) {
        const scoped_env e("RDMAX_RPC_TRANSPORTS", text);
        INFO(text);
        const rpc::rpc_options o = rpc::rpc_options{}.with_env();
        CHECK(o.transports == want);
        CHECK(o.node_local() == want.has(transport::shm));
    }
    rpc::rpc_options none;
    none.transports = {};
    CHECK_THROWS_WITH(none.check("test"),
                      Catch::Matchers::Contains("one or more of rdma, shm, tcp"));
}

TEST_CASE("knobs: nothing is half-applied, the options given stay as they were") {
    rpc::rpc_options given;
    given.slots = 8;
    const scoped_env good("RDMAX_RPC_MAX_PEERS", "7");
    const scoped_env bad("RDMAX_RCACHE_MAX_COUNT", "many");
    CHECK_THROWS_WITH(given.with_env(), Catch::Matchers::Contains("RDMAX_RCACHE_MAX_COUNT='many'"));
    CHECK(given.slots == 8);
    CHECK(given.max_peers == 256);
    unsetenv("RDMAX_RCACHE_MAX_COUNT");
    const rpc::rpc_options e = given.with_env();
    CHECK(e.max_peers == 7);
    CHECK(e.slots == 8); // not set in the environment: the options stand
}

TEST_CASE("knobs: auto is 0, and 0 still means auto where it did") {
    const scoped_env a("RDMAX_RCACHE_MAX_COUNT", "auto");
    const scoped_env b("RDMAX_SCHED_BUDGET_BYTES", "auto");
    rcache_options r;
    r.max_count = 5;
    CHECK(r.with_env().max_count == 0);
    sched::scheduler_options s;
    s.budget_bytes = 5;
    CHECK(s.with_env().budget_bytes == 0);
    setenv("RDMAX_RCACHE_MAX_COUNT", "0", 1);
    CHECK(r.with_env().max_count == 0);
}

TEST_CASE("rpc_options: explicit arena and cache options are used, not the environment") {
    const scoped_env area("RDMAX_ARENA_AREA_BYTES", "64M");
    const scoped_env mon("RDMAX_RCACHE_MONITOR", "none");
    const scoped_env odp("RDMAX_RCACHE_ODP", "1");
    const scoped_env slice("RDMAX_SCHED_SMALL_SLICE", "4K");
    rpc::rpc_options o;
    o.arena.area_bytes = std::size_t{4} << 20;
    o.cache.monitor = monitor_kind::manual;
    // What the endpoint builds from explicit options: no environment read.
    CHECK(o.ring_arena().area_bytes == std::size_t{4} << 20);
    CHECK(o.ring_arena().area_rights == rights::local_write);
    CHECK(o.cache.monitor == monitor_kind::manual);
    CHECK_FALSE(o.cache.on_demand);
    CHECK(o.scheduler.small_slice == 16 * 1024);
    // Asking for the environment takes it, all the way down.
    const rpc::rpc_options e = o.with_env();
    CHECK(e.ring_arena().area_bytes == std::size_t{64} << 20);
    CHECK(e.cache.monitor == monitor_kind::none);
    CHECK(e.cache.on_demand);
    CHECK(e.scheduler.small_slice == 4096);
    // The compiled defaults, whatever the environment says.
    CHECK(rpc::rpc_options{}.ring_arena().area_bytes == std::size_t{16} << 20);
    CHECK(rpc::rpc_options{}.cache.monitor == monitor_kind::automatic);
}

TEST_CASE("knobs: rows say where a value came from, and a refused one why") {
    const scoped_env a("RDMAX_MAPCACHE_MAX_BYTES", "2G");
    const scoped_env b("RDMAX_HANDLE_REVOKE", "both");
    bool saw_a = false;
    bool saw_b = false;
    for (const config::knob_row& r : config::knobs_from_env()) {
        if (r.name == std::string_view("RDMAX_MAPCACHE_MAX_BYTES")) {
            saw_a = true;
            CHECK(r.value == "2G");
            CHECK(r.default_value == "1G");
            CHECK(r.from == config::source::environment);
            CHECK(r.problem.empty());
        } else if (r.name == std::string_view("RDMAX_HANDLE_REVOKE")) {
            saw_b = true;
            CHECK(r.value == "both");
            CHECK_THAT(r.problem, Catch::Matchers::Contains("auto, mw or mr"));
        } else if (r.name == std::string_view("RDMAX_RPC_SLOTS")) {
            CHECK(r.from == config::source::default_value);
            CHECK(r.value == "64");
        }
    }
    CHECK(saw_a);
    CHECK(saw_b);
}

namespace {

std::string trim(std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '`'))
        s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '`'))
        s.remove_suffix(1);
    return std::string(s);
}

std::vector<std::string> split(std::string_view s, std::string_view sep) {
    std::vector<std::string> out;
    for (std::size_t at = s.find(sep); at != std::string_view::npos; at = s.find(sep)) {
        out.push_back(trim(s.substr(0, at)));
        s.remove_prefix(at + sep.size());
    }
    out.push_back(trim(s));
    return out;
}

/// Harness knobs the README lists beside the library's (tests/run, tests/vm).
bool harness_knob(std::string_view name) {
    return name.starts_with("RDMAX_FUZZ_") || name.starts_with("RDMAX_TEST_") ||
           name.starts_with("RDMAX_VM_");
}

/// README.md's "## Knobs" table as name -> default; `A` / `_B` rows give two
/// names (the second with A's RDMAX_GROUP prefix) and two defaults.
std::map<std::string, std::string> readme_knobs(const std::string& path) {
    std::ifstream in(path);
    REQUIRE(in.good());
    std::map<std::string, std::string> out;
    std::string line;
    bool inside = false;
    while (std::getline(in, line)) {
        if (line.starts_with("## "))
            inside = line == "## Knobs";
        if (!inside || !line.starts_with("| `RDMAX_"))
            continue;
        const std::vector<std::string> cells = split(std::string_view(line).substr(1), "|");
        REQUIRE(cells.size() >= 3);
        const std::vector<std::string> names = split(cells[0], "` / `");
        const std::vector<std::string> defaults = split(cells[1], "` / `");
        const std::string group = names[0].substr(0, names[0].find('_', 6));
        for (std::size_t i = 0; i < names.size(); ++i) {
            const std::string name = names[i].starts_with("_") ? group + names[i] : names[i];
            if (harness_knob(name))
                continue;
            INFO(line);
            REQUIRE(names.size() == defaults.size());
            CHECK(out.emplace(name, defaults[i]).second);
        }
    }
    return out;
}

} // namespace

TEST_CASE("README: the knob table lists every knob once, with the tables' defaults") {
    const char* root = std::getenv("RDMAX_SOURCE_ROOT");
    REQUIRE(root != nullptr);
    std::map<std::string, std::string> readme = readme_knobs(std::string(root) + "/README.md");
    for (const config::knob_row& r : config::knobs_from_env()) {
        INFO(r.name);
        const auto it = readme.find(std::string(r.name));
        CHECK(it != readme.end()); // missing from the README
        if (it == readme.end())
            continue;
        CHECK(it->second == r.default_value);
        readme.erase(it);
    }
    for (const auto& [name, value] : readme) {
        INFO("in the README, in no table: " << name);
        CHECK(false);
    }
}

TEST_CASE("rdmax-info: prints every knob with its value and source, devices, module, monitor") {
    const char* tool = std::getenv("RDMAX_INFO");
    REQUIRE(tool != nullptr);
    const scoped_env e("RDMAX_RPC_SLOTS", "32");
    std::FILE* p = popen(tool, "r");
    REQUIRE(p != nullptr);
    std::string out;
    std::array<char, 4096> buf{};
    for (std::size_t n; (n = std::fread(buf.data(), 1, buf.size(), p)) > 0;)
        out.append(buf.data(), n);
    const int status = pclose(p);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
    for (const config::knob_row& r : config::knobs_from_env())
        CHECK_THAT(out, Catch::Matchers::Contains(std::string(r.name)));
    std::istringstream lines(out);
    bool slots_line = false;
    for (std::string line; std::getline(lines, line);)
        if (line.starts_with("RDMAX_RPC_SLOTS "))
            slots_line = line.find("= 32") != std::string::npos &&
                         line.find("environment") != std::string::npos;
    CHECK(slots_line);
    CHECK_THAT(out, Catch::Matchers::Contains("# RDMA devices"));
    CHECK_THAT(out, Catch::Matchers::Contains("# Kernel module"));
    CHECK_THAT(out, Catch::Matchers::Contains("auto would pick: "));
}
