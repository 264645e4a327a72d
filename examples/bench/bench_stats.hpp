#pragma once
// What the benchmarks that are not perftest look-alikes share: medians with
// their range, and --json FILE as one JSON list.

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
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

} // namespace rdmax::bench
