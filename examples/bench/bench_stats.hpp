#pragma once
// What the benchmarks that are not perftest look-alikes share: medians with
// their range, --json FILE as one JSON list, sizes with K/M/G suffixes,
// touched anonymous mappings, the timing of ibv_reg_mr + ibv_dereg_mr, and
// --plot FILE.png through gnuplot.

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <sys/mman.h>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bench_common.hpp"

namespace rdmax::bench {

/// The median of the samples (sorts them).
inline double median(std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

struct summary {
    double median = 0, min = 0, max = 0;
};

inline summary summarize(std::vector<double> v) {
    summary s;
    s.median = median(v);
    s.min = v.front();
    s.max = v.back();
    return s;
}

/// --json FILE: a JSON list, rewritten whole after every record so that the
/// file is valid JSON even if a later measurement fails.
class json_list {
public:
    explicit json_list(std::string path)
        : path_(std::move(path)) {
        flush();
    }
    void add(std::string record) {
        records_.push_back(std::move(record));
        flush();
    }

private:
    void flush() const {
        if (path_.empty())
            return;
        std::FILE* f = std::fopen(path_.c_str(), "w");
        if (f == nullptr)
            fail(fmt::format("cannot write {}: {}", path_, std::strerror(errno)));
        fmt::print(f, "[");
        for (std::size_t i = 0; i < records_.size(); ++i)
            fmt::print(f, "{}\n  {}", i == 0 ? "" : ",", records_[i]);
        fmt::print(f, "{}]\n", records_.empty() ? "" : "\n");
        std::fclose(f);
    }

    std::string path_;
    std::vector<std::string> records_;
};

// ---- sizes and memory ---------------------------------------------------------------------

inline constexpr std::size_t kib = 1024;
inline constexpr std::size_t mib = 1024 * kib;

/// "4 KiB", "16 MiB", "100 B".
inline std::string human_bytes(std::size_t b) {
    if (b >= mib && b % mib == 0)
        return fmt::format("{} MiB", b / mib);
    if (b >= kib && b % kib == 0)
        return fmt::format("{} KiB", b / kib);
    return fmt::format("{} B", b);
}

/// A byte count with an optional binary K/M/G suffix, from 1 to `most`.
inline std::size_t parse_size(const char* text, std::string_view flag, std::size_t most) {
    std::string_view s(text);
    std::size_t unit = 1;
    if (!s.empty()) {
        switch (s.back()) {
        case 'k':
        case 'K': unit = kib; break;
        case 'm':
        case 'M': unit = mib; break;
        case 'g':
        case 'G': unit = 1024 * mib; break;
        default: break;
        }
        if (unit != 1)
            s.remove_suffix(1);
    }
    std::size_t value = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
    if (ec != std::errc{} || end != s.data() + s.size() || value == 0 || value > most / unit)
        fail(fmt::format("{} wants a size from 1 to {}, not '{}'", flag, human_bytes(most), text));
    return value * unit;
}

/// An anonymous private mapping, unmapped at the end.
class mapping {
public:
    /// `touch`: fault every page in now (so that registering it later pins
    /// pages that exist instead of faulting them in inside the timed call).
    mapping(std::size_t bytes, bool touch)
        : bytes_(bytes) {
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | (touch ? MAP_POPULATE : MAP_NORESERVE), -1, 0);
        if (p == MAP_FAILED)
            fail(fmt::format("cannot map {} bytes: {}", bytes, std::strerror(errno)));
        data_ = static_cast<std::byte*>(p);
        if (touch)
            std::memset(data_, 0x5a, bytes);
    }
    mapping(const mapping&) = delete;
    mapping& operator=(const mapping&) = delete;
    ~mapping() { munmap(data_, bytes_); }

    [[nodiscard]] std::byte* data() const noexcept { return data_; }

private:
    std::size_t bytes_;
    std::byte* data_ = nullptr;
};

// ---- ibv_reg_mr ---------------------------------------------------------------------------

/// Registrations per size: all of `n` up to 1 MiB, proportionally fewer above
/// (ibv_reg_mr's cost grows with the pages it pins), never below min(n, 9).
inline std::uint32_t reg_iterations(std::uint32_t n, std::size_t bytes) {
    if (bytes <= mib)
        return n;
    const auto scaled = static_cast<std::uint32_t>(std::uint64_t{n} * mib / bytes);
    return std::max(scaled, std::min(n, 9u));
}

/// Cycles of each ibv_reg_mr and each ibv_dereg_mr, one pair per iteration.
struct reg_cycles {
    std::vector<std::uint64_t> reg, dereg;
};

/// `iterations` times ibv_reg_mr then ibv_dereg_mr of [buffer, buffer + bytes)
/// (already touched), each timed apart, after one untimed round (the
/// provider's first call may set things up). A `nap` sleeps before each
/// iteration, untimed: registration then starts from a wakeup, as it does in a
/// program that communicates between registrations.
inline reg_cycles time_registration(const verbs::protection_domain& pd, std::byte* buffer,
                                    std::size_t bytes, rights granted, std::uint32_t iterations,
                                    std::chrono::microseconds nap = {}) {
    const auto fail_reg = [&](const char* verb) {
        fail(fmt::format("{} of {} bytes failed: {}", verb, bytes, std::strerror(errno)));
    };
    if (ibv_mr* mr = ibv_reg_mr(pd.get(), buffer, bytes, to_ibv(granted)); mr != nullptr)
        ibv_dereg_mr(mr);
    else
        fail_reg("ibv_reg_mr");
    reg_cycles out;
    out.reg.reserve(iterations);
    out.dereg.reserve(iterations);
    for (std::uint32_t i = 0; i < iterations; ++i) {
        if (nap.count() > 0)
            std::this_thread::sleep_for(nap);
        const std::uint64_t t0 = cycles();
        ibv_mr* mr = ibv_reg_mr(pd.get(), buffer, bytes, to_ibv(granted));
        const std::uint64_t t1 = cycles();
        if (mr == nullptr)
            fail_reg("ibv_reg_mr");
        if (ibv_dereg_mr(mr) != 0)
            fail_reg("ibv_dereg_mr");
        const std::uint64_t t2 = cycles();
        out.reg.push_back(t1 - t0);
        out.dereg.push_back(t2 - t1);
    }
    return out;
}

// ---- --plot -------------------------------------------------------------------------------

/// One line of a plot: its title and a y per x (NaN or <= 0: no point).
struct plot_series {
    std::string title;
    std::vector<double> y;
};

/// `s` inside a gnuplot double-quoted string.
inline std::string gnuplot_quoted(std::string_view s) {
    std::string q;
    for (const char c : s) {
        if (c == '"' || c == '\\')
            q += '\\';
        q += c;
    }
    return q;
}

/// A gnuplot set to write a 1000x650 PNG to `png`. Where gnuplot is not
/// installed, says so on stderr and returns nullptr: a missing plot is not a
/// failed run. Hand the pipe to close_gnuplot().
inline std::FILE* open_gnuplot(const std::string& png) {
    if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
        fmt::print(stderr,
                   "gnuplot is not installed: no plot written to {} (apt-get install "
                   "gnuplot-nox)\n",
                   png);
        return nullptr;
    }
    std::FILE* gp = popen("gnuplot", "w");
    if (gp == nullptr)
        fail(fmt::format("cannot run gnuplot: {}", std::strerror(errno)));
    fmt::print(gp, "set terminal pngcairo size 1000,650 noenhanced\nset output \"{}\"\n",
               gnuplot_quoted(png));
    return gp;
}

/// Ends the plot; a gnuplot that failed is a failure.
inline void close_gnuplot(std::FILE* gp, const std::string& png) {
    const int status = pclose(gp);
    if (status != 0)
        fail(fmt::format("gnuplot failed writing {} (status {})", png, status));
}

/// Writes a log-log PNG of the series against x with gnuplot; false where
/// gnuplot is not installed.
inline bool log_log_plot(const std::string& png, const std::string& title,
                         const std::string& xlabel, const std::string& ylabel,
                         const std::vector<double>& x, const std::vector<plot_series>& series) {
    std::FILE* gp = open_gnuplot(png);
    if (gp == nullptr)
        return false;
    // A margin either side, so that the first and last sizes keep their tics.
    const auto [least, most] = std::minmax_element(x.begin(), x.end());
    const double lo = x.empty() ? 1 : *least / 1.5, hi = x.empty() ? 2 : *most * 1.5;
    fmt::print(gp,
               "set title \"{}\"\n"
               "set xlabel \"{}\"\nset ylabel \"{}\"\n"
               "set logscale xy\nset grid xtics ytics mxtics mytics\n"
               "set key top left\nset xrange [{}:{}]\nset format y \"%g\"\n"
               "set xtics (\"64\" 64, \"1K\" 1024, \"4K\" 4096, \"16K\" 16384, \"64K\" 65536, "
               "\"256K\" 262144, \"1M\" 1048576, \"4M\" 4194304, \"16M\" 16777216, \"64M\" "
               "67108864, \"256M\" 268435456, \"1G\" 1073741824)\n",
               gnuplot_quoted(title), gnuplot_quoted(xlabel), gnuplot_quoted(ylabel), lo, hi);
    for (std::size_t s = 0; s < series.size(); ++s) {
        fmt::print(gp, "$d{} << EOD\n", s);
        for (std::size_t i = 0; i < x.size() && i < series[s].y.size(); ++i)
            if (series[s].y[i] > 0)
                fmt::print(gp, "{} {}\n", x[i], series[s].y[i]);
        fmt::print(gp, "EOD\n");
    }
    fmt::print(gp, "plot ");
    for (std::size_t s = 0; s < series.size(); ++s)
        fmt::print(gp, "{}$d{} using 1:2 with linespoints lw 2 pt 7 title \"{}\"",
                   s == 0 ? "" : ", ", s, gnuplot_quoted(series[s].title));
    fmt::print(gp, "\n");
    close_gnuplot(gp, png);
    return true;
}

} // namespace rdmax::bench
