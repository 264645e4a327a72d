// Live counters (docs/stats.md): what a process publishes is what its objects
// count, read from outside by the reader and by rdmax-stat (JSON, and
// OpenMetrics checked by prometheus_client's parser); the segment is its
// user's alone; a stale one is told from a live one and removed; a hostile
// one is refused or clamped, never trusted.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <string>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/rpc/client.hpp>
#include <rdmax/rpc/server.hpp>
#include <rdmax/stats/counter_fields.hpp>
#include <rdmax/stats/publisher.hpp>
#include <rdmax/stats/reader.hpp>

#include "../support/catch.hpp"

using namespace rdmax;
using clock_type = std::chrono::steady_clock;

namespace {

/// Objects publish every 10 ms here (read once, at the first object).
const bool interval_set = [] { return ::setenv("RDMAX_STAT_INTERVAL_MS", "10", 1) == 0; }();

rpc::rpc_options options() {
    rpc::rpc_options o;
    o.slots = 8;
    o.call_timeout = std::chrono::seconds(10);
    o.housekeeping = std::chrono::microseconds(1000);
    o.transports = rpc::transport_set{} | rpc::transport::tcp;
    return o;
}

const stats::object_snapshot* find(const stats::process_snapshot& p, std::string_view kind,
                                   std::string_view name) {
    for (const auto& o : p.objects)
        if (o.kind == kind && o.name == name)
            return &o;
    return nullptr;
}

std::vector<std::uint64_t> expected_rpc(const rpc::rpc_counters& c, std::uint64_t in_flight,
                                        std::uint64_t peers) {
    std::vector<std::uint64_t> v(stats::rpc_fields().size());
    stats::rpc_values(c, in_flight, peers, v);
    return v;
}

std::vector<std::uint64_t> values_of(const stats::object_snapshot& o) {
    std::vector<std::uint64_t> v(o.fields.size());
    for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = o.fields[i].value;
    return v;
}

std::string run(const std::string& cmd) {
    std::string out;
    if (std::FILE* f = ::popen(cmd.c_str(), "r")) {
        char buf[4096];
        std::size_t n = 0;
        while ((n = std::fread(buf, 1, sizeof buf, f)) > 0)
            out.append(buf, n);
        ::pclose(f);
    }
    return out;
}

/// A server on a thread of its own and a client here, over TCP on loopback.
struct pair {
    rpc::server srv{"127.0.0.1", 0, options()};
    std::atomic<bool> stop{false};
    std::thread serving;
    rpc::client cli{options()};
    rpc::peer_id peer;

    pair() {
        srv.on(1, [](rpc::request_context& c) { c.reply(c.body()); });
        serving = std::thread([this] {
            while (!stop.load())
                srv.wait(std::chrono::milliseconds(1));
        });
        peer = cli.connect("127.0.0.1", srv.port());
    }
    ~pair() {
        stop = true;
        serving.join();
    }
    pair(const pair&) = delete;
    pair& operator=(const pair&) = delete;
};

} // namespace

TEST_CASE("stat: a client's counters read from outside match its own, after a known workload") {
    REQUIRE(interval_set);
    pair p;
    std::vector<std::byte> body(100, std::byte{7});
    for (int i = 0; i < 25; ++i)
        REQUIRE(p.cli.call(p.peer, 1, body).status == rpc::call_status::ok);
    REQUIRE(p.cli.call(p.peer, 99, body).status == rpc::call_status::unknown_method);
    p.cli.release();
    const std::string path(stats::segment_path());
    REQUIRE(!path.empty());
    const std::string name =
        std::string(path).substr(path.rfind('.') + 1) == std::to_string(::getpid()) ? "" : "?";
    REQUIRE(name.empty()); // the segment is named by this process's pid

    // The client publishes at its housekeeping (driven here by wait()).
    const auto deadline = clock_type::now() + std::chrono::seconds(5);
    bool same = false;
    std::string client_name;
    while (!same && clock_type::now() < deadline) {
        rpc::call_result out[4];
        (void)p.cli.wait(out, std::chrono::milliseconds(5));
        const stats::process_snapshot s = stats::read_segment(::getpid(), ::getuid());
        for (const auto& o : s.objects) {
            if (o.kind != "rpc_client")
                continue;
            if (values_of(o) == expected_rpc(p.cli.counters(), p.cli.in_flight(), 1)) {
                same = true;
                client_name = o.name;
            }
        }
    }
    REQUIRE(same);
    CHECK(p.cli.counters().calls == 26);
    CHECK(p.cli.counters().completed == 25);

    // The server's too (its thread publishes; its counters are read here
    // only once it has stopped).
    p.stop = true;
    p.serving.join();
    p.serving = std::thread([] {});
    const auto srv_name = fmt::format("127.0.0.1:{}", p.srv.port());
    // Its housekeeping, driven here, publishes within an interval.
    const auto srv_deadline = clock_type::now() + std::chrono::seconds(5);
    stats::process_snapshot s;
    const stats::object_snapshot* srv = nullptr;
    do {
        p.srv.wait(std::chrono::milliseconds(5));
        s = stats::read_segment(::getpid(), ::getuid());
        srv = find(s, "rpc_server", srv_name);
    } while ((srv == nullptr || values_of(*srv) != expected_rpc(p.srv.counters(), 0, 1)) &&
             clock_type::now() < srv_deadline);
    REQUIRE(srv != nullptr);
    CHECK(values_of(*srv) == expected_rpc(p.srv.counters(), 0, 1));
    CHECK(p.srv.counters().calls == 26);
    CHECK(p.srv.counters().unknown_method == 1);
    // Its connection's scheduler sum and the arenas are there too.
    CHECK(find(s, "scheduler", "rpc_server " + srv_name) != nullptr);
    bool arena = false;
    for (const auto& o : s.objects)
        arena = arena || o.kind == "arena";
    CHECK(arena);

    SECTION("rdmax-stat --json and --openmetrics say the same") {
        const char* tool = std::getenv("RDMAX_STAT_TOOL");
        REQUIRE(tool != nullptr);
        const std::string json = run(fmt::format("{} {} --json", tool, ::getpid()));
        INFO(json);
        std::string want =
            fmt::format(R"("kind": "rpc_server", "name": "{}", "values": {{)", srv_name);
        const auto v = expected_rpc(p.srv.counters(), 0, 1);
        for (std::size_t i = 0; i < v.size(); ++i)
            want +=
                fmt::format("{}\"{}\": {}", i == 0 ? "" : ", ", stats::rpc_fields()[i].name, v[i]);
        CHECK(json.find(want) != std::string::npos);

        // prometheus_client's OpenMetrics parser takes it whole, and finds
        // the server's calls.
        const char* root = std::getenv("RDMAX_SOURCE_ROOT");
        REQUIRE(root != nullptr);
        const char* python = std::getenv("RDMAX_PYTHON");
        const std::string parsed = run(
            fmt::format("{} {} --openmetrics | {} {}/tests/lib/parse_openmetrics.py "
                        "rdmax_rpc_server_calls name={} 2>&1",
                        tool, ::getpid(), python != nullptr ? python : "python3", root, srv_name));
        INFO(parsed);
        CHECK(parsed == "26\n");

        // The list names this process.
        const std::string list = run(fmt::format("{}", tool));
        INFO(list);
        CHECK(list.find(fmt::format("{:>8}", ::getpid())) != std::string::npos);
    }
}

TEST_CASE("stat: the segment is the user's alone (0600), and another user cannot open it") {
    pair p; // makes sure the segment exists
    const std::string path(stats::segment_path());
    REQUIRE(!path.empty());
    struct stat st {};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0600);
    CHECK(st.st_uid == ::getuid());
    if (::getuid() == 0) {
        // As root: a child that becomes nobody (65534) is refused.
        const pid_t child = ::fork();
        REQUIRE(child >= 0);
        if (child == 0) {
            if (::setgid(65534) != 0 || ::setuid(65534) != 0)
                ::_exit(3);
            const int fd = ::open(path.c_str(), O_RDONLY);
            ::_exit(fd < 0 && errno == EACCES ? 0 : 1);
        }
        int status = 0;
        REQUIRE(::waitpid(child, &status, 0) == child);
        CHECK(WIFEXITED(status));
        CHECK(WEXITSTATUS(status) == 0);
    }
}

TEST_CASE("stat: a segment nobody holds locked is stale and removed; a locked one never") {
    pair p;
    const auto dir =
        std::filesystem::temp_directory_path() / fmt::format("rdmax-stat-test.{}", ::getpid());
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    // A process that is gone: a child that exited, reaped.
    const pid_t gone = ::fork();
    REQUIRE(gone >= 0);
    if (gone == 0)
        ::_exit(0);
    REQUIRE(::waitpid(gone, nullptr, 0) == gone);
    const auto mine = dir / fmt::format("{}{}.{}", stats::segment_prefix, ::getuid(), ::getpid());
    const auto dead = dir / fmt::format("{}{}.{}", stats::segment_prefix, ::getuid(), gone);
    for (const auto& to : {mine, dead}) {
        std::filesystem::copy_file(std::string(stats::segment_path()), to);
        std::filesystem::permissions(to, std::filesystem::perms::owner_read |
                                             std::filesystem::perms::owner_write);
    }
    // The first stands for a live writer: its lock held, as a publisher holds it.
    const int held = ::open(mine.c_str(), O_RDONLY | O_CLOEXEC);
    REQUIRE(held >= 0);
    REQUIRE(::flock(held, LOCK_SH) == 0);
    const auto list = stats::list_segments(::getuid(), dir.string());
    REQUIRE(list.size() == 2);
    for (const auto& e : list) {
        INFO(e.path);
        CHECK(e.stale == (e.pid == gone));
        if (e.stale)
            CHECK(stats::remove_stale(e));
    }
    CHECK(!std::filesystem::exists(dead));
    CHECK(std::filesystem::exists(mine));
    // Once its writer is gone, it is stale too.
    ::close(held);
    const auto after = stats::list_segments(::getuid(), dir.string());
    REQUIRE(after.size() == 1);
    CHECK(after[0].stale);
    CHECK(stats::remove_stale(after[0]));
    CHECK(!std::filesystem::exists(mine));
    std::filesystem::remove_all(dir);
}

TEST_CASE("stat: a hostile segment is refused or clamped, never trusted") {
    pair p;
    const auto dir =
        std::filesystem::temp_directory_path() / fmt::format("rdmax-stat-hostile.{}", ::getpid());
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    const auto file = dir / fmt::format("{}{}.{}", stats::segment_prefix, ::getuid(), ::getpid());
    const auto write = [&](const std::vector<char>& bytes, mode_t mode) {
        std::filesystem::remove(file);
        const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL, mode);
        REQUIRE(fd >= 0);
        REQUIRE(::fchmod(fd, mode) == 0);
        REQUIRE(::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
        ::close(fd);
    };
    std::vector<char> seg(sizeof(stats::segment));
    {
        std::ifstream in(std::string(stats::segment_path()), std::ios::binary);
        REQUIRE(in.read(seg.data(), static_cast<std::streamsize>(seg.size())));
    }
    const auto refused = [&](std::string_view why) {
        try {
            (void)stats::read_segment(::getpid(), ::getuid(), dir.string());
            FAIL("read");
        } catch (const rdmax::error& e) {
            CHECK_THAT(e.what(), Catch::Matchers::Contains(std::string(why)));
        }
    };
    SECTION("the wrong size") {
        write(std::vector<char>(seg.begin(), seg.begin() + 4096), 0600);
        refused("bytes, where a segment");
    }
    SECTION("readable by others") {
        write(seg, 0644);
        refused("others may read");
    }
    SECTION("no magic") {
        std::vector<char> bad = seg;
        bad[0] = 'X';
        write(bad, 0600);
        refused("no rdmax stat magic");
    }
    SECTION("counts and names out of bounds: clamped") {
        std::vector<char> bad = seg;
        auto* s = reinterpret_cast<stats::segment*>(bad.data());
        for (auto& r : s->records) {
            r.fields = 0xffffffff;
            std::memset(r.kind, 'k', sizeof r.kind);
            std::memset(r.name, 'n', sizeof r.name);
            std::memset(r.field_names, 'f', sizeof r.field_names);
            std::memset(static_cast<void*>(r.types), 0x7f, sizeof r.types);
        }
        write(bad, 0600);
        const stats::process_snapshot snap =
            stats::read_segment(::getpid(), ::getuid(), dir.string());
        REQUIRE(!snap.objects.empty());
        for (const auto& o : snap.objects) {
            CHECK(o.fields.size() == stats::max_fields);
            CHECK(o.kind.size() == stats::kind_bytes);
            CHECK(o.name.size() == stats::object_name_bytes);
            for (const auto& f : o.fields)
                CHECK(f.name.size() == stats::field_name_bytes);
        }
    }
    std::filesystem::remove_all(dir);
}

TEST_CASE("stat: a forked child publishes nothing and leaves the parent's records alone") {
    pair p;
    const std::string path(stats::segment_path());
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
        // An object made in the child gets no record, and no segment of its
        // own. (A slot, not an rpc::client: that starts threads, which TSan
        // refuses after a multi-threaded fork.)
        const stats::field_desc f[] = {{"x", stats::field_type::counter}};
        const stats::slot c("child", "", f);
        const bool none =
            !c && stats::segment_path() == path &&
            !std::filesystem::exists(fmt::format("{}/{}{}.{}", stats::segment_dir,
                                                 stats::segment_prefix, ::getuid(), ::getpid()));
        ::_exit(none ? 0 : 1);
    }
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
    // The parent's records are still there.
    const stats::process_snapshot s = stats::read_segment(::getpid(), ::getuid());
    CHECK(find(s, "rpc_server", fmt::format("127.0.0.1:{}", p.srv.port())) != nullptr);
}

// Run by the next case as a process of its own: publishes, says where, exits.
TEST_CASE("stat: (child) publish and exit", "[.stat_child]") {
    rpc::client c(options());
    rpc::call_result out[1];
    (void)c.wait(out, std::chrono::milliseconds(20));
    fmt::print("segment {}\n", stats::segment_path());
    std::fflush(stdout);
}

TEST_CASE("stat: a process that exits leaves no segment behind") {
    const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
    const std::string out = run(fmt::format("'{}' '[.stat_child]' 2>&1", self));
    INFO(out);
    const auto at = out.find("segment /");
    REQUIRE(at != std::string::npos);
    const std::string path = out.substr(at + 8, out.find('\n', at) - at - 8);
    CHECK(path.find(stats::segment_prefix) != std::string::npos);
    CHECK(!std::filesystem::exists(path)); // popen waited for its exit
}
