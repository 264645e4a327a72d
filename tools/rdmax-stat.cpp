// rdmax-stat: the live counters of running rdmax processes of this user
// (their stat segments, include/rdmax/stats/reader.hpp).
//
//   rdmax-stat                      the processes, and stale segments removed
//   rdmax-stat PID                  a table of its objects' counters
//   rdmax-stat PID --watch 1s       refreshed, with rates
//   rdmax-stat [PID] --json         as JSON (every process without PID)
//   rdmax-stat [PID] --openmetrics  Prometheus / OpenMetrics text
//
// Nothing read from a segment is trusted (reader.hpp); names are escaped
// wherever they are printed.

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/stats/reader.hpp>

namespace {

using rdmax::stats::field_type;
using rdmax::stats::process_snapshot;

struct options {
    pid_t pid = 0;
    bool json = false;
    bool openmetrics = false;
    bool all = false;
    std::chrono::milliseconds watch{0};
    long count = 0; ///< refreshes under --watch (0: until interrupted)
    std::string dir = rdmax::stats::segment_dir;
};

volatile std::sig_atomic_t interrupted = 0;

[[noreturn]] void usage(const char* why) {
    if (why != nullptr)
        fmt::print(stderr, "rdmax-stat: {}\n", why);
    fmt::print(stderr, "usage: rdmax-stat [PID] [--json | --openmetrics] [--all] "
                       "[--watch INTERVAL (1s, 500ms) [--count N]] [--dir DIR]\n");
    std::exit(2);
}

std::chrono::milliseconds parse_interval(std::string_view s) {
    long n = 0;
    std::size_t i = 0;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9' && n < 86'400'000)
        n = n * 10 + (s[i++] - '0');
    const std::string_view unit = s.substr(i);
    if (i == 0 || n == 0)
        usage("--watch wants a positive interval, as 1s or 500ms");
    if (unit == "ms")
        return std::chrono::milliseconds(n);
    if (unit.empty() || unit == "s")
        return std::chrono::seconds(n);
    usage("--watch: the interval's unit is s or ms");
}

options parse(int argc, char** argv) {
    options o;
    for (int i = 1; i < argc; ++i) {
        const std::string_view a = argv[i];
        const auto value = [&]() -> std::string_view {
            if (i + 1 >= argc)
                usage(fmt::format("{} wants a value", a).c_str());
            return argv[++i];
        };
        if (a == "--json") {
            o.json = true;
        } else if (a == "--openmetrics") {
            o.openmetrics = true;
        } else if (a == "--all") {
            o.all = true;
        } else if (a == "--watch") {
            o.watch = parse_interval(value());
        } else if (a == "--count") {
            o.count = std::strtol(std::string(value()).c_str(), nullptr, 10);
            if (o.count <= 0)
                usage("--count wants a positive number");
        } else if (a == "--dir") {
            o.dir = value();
        } else if (a == "-h" || a == "--help") {
            usage(nullptr);
        } else if (!a.empty() && a.find_first_not_of("0123456789") == std::string_view::npos &&
                   o.pid == 0 && a.size() < 10) {
            o.pid = static_cast<pid_t>(std::strtol(argv[i], nullptr, 10));
        } else {
            usage(fmt::format("unknown argument '{}'", a).c_str());
        }
    }
    if (o.json && o.openmetrics)
        usage("--json or --openmetrics, not both");
    if (o.watch.count() > 0 && o.pid == 0)
        usage("--watch wants a PID");
    return o;
}

/// JSON's string escapes (names come from another process).
std::string json_string(std::string_view s) {
    std::string out = "\"";
    for (const char c : s) {
        const auto u = static_cast<unsigned char>(c);
        if (c == '"' || c == '\\')
            out += fmt::format("\\{}", c);
        else if (u < 0x20 || u >= 0x7f)
            out += fmt::format("\\u{:04x}", u);
        else
            out += c;
    }
    return out + "\"";
}

/// An OpenMetrics label value's escapes.
std::string label_value(std::string_view s) {
    std::string out;
    for (const char c : s) {
        if (c == '\\' || c == '"')
            out += fmt::format("\\{}", c);
        else if (c == '\n')
            out += "\\n";
        else if (static_cast<unsigned char>(c) >= 0x20 && static_cast<unsigned char>(c) < 0x7f)
            out += c;
        else
            out += '_';
    }
    return out;
}

/// A metric name part: [a-z0-9_] only.
std::string name_part(std::string_view s) {
    std::string out;
    for (const char c : s)
        out += (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'
                   ? c
                   : ((c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : '_');
    return out.empty() ? "_" : out;
}

std::string to_json(const process_snapshot& p) {
    std::string out =
        fmt::format("{{\"pid\": {}, \"comm\": {}, \"interval_ms\": {}, "
                    "\"unpublished\": {}, \"unsettled\": {}, \"objects\": [",
                    p.pid, json_string(p.comm), p.interval_ms, p.unpublished, p.unsettled);
    for (std::size_t i = 0; i < p.objects.size(); ++i) {
        const auto& o = p.objects[i];
        out += fmt::format(R"({}{{"kind": {}, "name": {}, "values": {{)", i == 0 ? "" : ", ",
                           json_string(o.kind), json_string(o.name));
        for (std::size_t f = 0; f < o.fields.size(); ++f)
            out += fmt::format("{}{}: {}", f == 0 ? "" : ", ", json_string(o.fields[f].name),
                               o.fields[f].value);
        out += "}}";
    }
    return out + "]}";
}

void print_openmetrics(const std::vector<process_snapshot>& procs) {
    // A family's samples together, whichever process and object they are of.
    struct family {
        field_type type = field_type::counter;
        std::vector<std::string> samples;
    };
    std::map<std::string, family> families;
    for (const auto& p : procs)
        for (const auto& o : p.objects)
            for (const auto& f : o.fields) {
                const std::string name =
                    fmt::format("rdmax_{}_{}", name_part(o.kind), name_part(f.name));
                auto [it, fresh] = families.try_emplace(name, family{f.type, {}});
                if (!fresh && it->second.type != f.type)
                    continue; // a hostile segment's clash: the first type stands
                it->second.samples.push_back(
                    fmt::format(R"({}{}{{kind="{}",name="{}",pid="{}",comm="{}"}} {})", name,
                                f.type == field_type::counter ? "_total" : "", label_value(o.kind),
                                label_value(o.name), p.pid, label_value(p.comm), f.value));
            }
    std::string out;
    for (const auto& [name, fam] : families) {
        out += fmt::format("# TYPE {} {}\n", name,
                           fam.type == field_type::counter ? "counter" : "gauge");
        for (const auto& s : fam.samples)
            out += s + '\n';
    }
    out += "# EOF\n";
    std::fputs(out.c_str(), stdout);
}

using previous = std::map<std::string, std::uint64_t>;

void print_table(const process_snapshot& p, bool all, previous* prev, double dt) {
    fmt::print("pid {} ({}), published every {} ms{}\n", p.pid, label_value(p.comm), p.interval_ms,
               p.unpublished != 0 ? fmt::format(", {} objects left out", p.unpublished) : "");
    previous now;
    for (const auto& o : p.objects) {
        fmt::print("  {} {}\n", label_value(o.kind), label_value(o.name));
        for (const auto& f : o.fields) {
            const std::string key = o.kind + '\0' + o.name + '\0' + f.name;
            now[key] = f.value;
            if (f.value == 0 && !all)
                continue;
            std::string rate;
            if (prev != nullptr && f.type == field_type::counter && dt > 0) {
                if (const auto it = prev->find(key); it != prev->end() && f.value >= it->second)
                    rate =
                        fmt::format("  {:.1f}/s", static_cast<double>(f.value - it->second) / dt);
            }
            fmt::print("    {:<22} {:>14}{}{}\n", label_value(f.name), f.value,
                       f.type == field_type::gauge ? " (now)" : "", rate);
        }
    }
    if (prev != nullptr)
        *prev = std::move(now);
}

/// Every live process's snapshot (stale segments removed, said on stderr).
std::vector<process_snapshot> all_processes(const options& o, bool say_stale) {
    std::vector<process_snapshot> out;
    for (const auto& e : rdmax::stats::list_segments(::getuid(), o.dir)) {
        if (e.stale) {
            if (rdmax::stats::remove_stale(e) && say_stale)
                fmt::print(stderr, "rdmax-stat: removed {}: its process {} is gone\n", e.path,
                           e.pid);
            continue;
        }
        try {
            out.push_back(rdmax::stats::read_segment(e.pid, ::getuid(), o.dir));
        } catch (const rdmax::error& err) {
            fmt::print(stderr, "rdmax-stat: pid {}: {}\n", e.pid, err.what());
        }
    }
    return out;
}

int run(const options& o) {
    if (o.pid == 0) {
        const auto procs = all_processes(o, true);
        if (o.openmetrics) {
            print_openmetrics(procs);
        } else if (o.json) {
            std::string out = "[";
            for (std::size_t i = 0; i < procs.size(); ++i)
                out += (i == 0 ? "" : ", ") + to_json(procs[i]);
            fmt::print("{}]\n", out);
        } else if (procs.empty()) {
            fmt::print("no rdmax process of uid {} publishes counters (in {})\n", ::getuid(),
                       o.dir);
        } else {
            fmt::print("{:>8}  {:<16} {}\n", "PID", "NAME", "OBJECTS");
            for (const auto& p : procs) {
                std::map<std::string, int> kinds;
                for (const auto& ob : p.objects)
                    ++kinds[ob.kind];
                std::string what;
                for (const auto& [k, n] : kinds)
                    what += fmt::format("{}{} {}", what.empty() ? "" : ", ", n, label_value(k));
                fmt::print("{:>8}  {:<16} {}\n", p.pid, label_value(p.comm), what);
            }
        }
        return 0;
    }
    if (o.watch.count() == 0) {
        const auto p = rdmax::stats::read_segment(o.pid, ::getuid(), o.dir);
        if (o.openmetrics)
            print_openmetrics({p});
        else if (o.json)
            fmt::print("{}\n", to_json(p));
        else
            print_table(p, o.all, nullptr, 0);
        return 0;
    }
    std::signal(SIGINT, [](int) { interrupted = 1; });
    previous prev;
    auto last = std::chrono::steady_clock::now();
    for (long n = 0; interrupted == 0 && (o.count == 0 || n < o.count); ++n) {
        if (n != 0)
            std::this_thread::sleep_for(o.watch);
        const auto p = rdmax::stats::read_segment(o.pid, ::getuid(), o.dir);
        const auto t = std::chrono::steady_clock::now();
        const double dt = std::chrono::duration<double>(t - last).count();
        last = t;
        if (o.json) {
            fmt::print("{}\n", to_json(p));
        } else {
            if (::isatty(STDOUT_FILENO) != 0)
                fmt::print("\x1b[H\x1b[2J");
            print_table(p, o.all, &prev, n == 0 ? 0 : dt);
        }
        std::fflush(stdout);
    }
    return 0;
}

} // namespace

int main(int argc, char** argv) {
    try {
        return run(parse(argc, argv));
    } catch (const std::exception& e) {
        fmt::print(stderr, "rdmax-stat: {}\n", e.what());
        return 1;
    }
}
