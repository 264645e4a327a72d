#pragma once
// Reading other processes' live counters (what rdmax-stat does): the
// segments of a user, and one segment's objects and values.
//
// A segment is another process's memory: nothing in it is trusted. It must
// be a regular file of the reader's user (0600), of exactly the layout's
// size, with the magic and version; names are read to their bound, counts
// clamped to the table, and a record whose seqlock never settles is left
// out rather than waited on. (Its owner could still truncate the file
// while it is mapped, which kills the reader with SIGBUS: only the owner,
// hurting only a reader of its own user or root.)

#include <cstdint>
#include <string>
#include <string_view>
#include <sys/types.h>
#include <vector>

#include <rdmax/stats/segment_layout.hpp>

namespace rdmax::stats {

struct field_value {
    std::string name;
    field_type type = field_type::counter;
    std::uint64_t value = 0;
};

struct object_snapshot {
    std::string kind;
    std::string name;
    std::vector<field_value> fields;
};

struct process_snapshot {
    pid_t pid = 0;
    std::string comm;
    std::uint64_t interval_ms = 0;
    std::uint64_t unpublished = 0; ///< objects left out: the table was full
    std::uint64_t unsettled = 0;   ///< records skipped: being written on every try
    std::vector<object_snapshot> objects;
};

struct segment_entry {
    pid_t pid = 0;
    std::string path;
    /// Nobody holds its lock: its process is gone (whatever its pid is now).
    bool stale = false;
};

/// The segments of user `uid` in `dir` (segment_dir), by pid.
[[nodiscard]] std::vector<segment_entry> list_segments(uid_t uid,
                                                       std::string_view dir = segment_dir);

/// Process `pid`'s segment of user `uid`, read now; throws rdmax::error
/// naming the file and the reason (none, not the user's, malformed).
[[nodiscard]] process_snapshot read_segment(pid_t pid, uid_t uid,
                                            std::string_view dir = segment_dir);

/// Removes a stale segment (of the caller's user), checked again under its
/// lock: true when it went.
bool remove_stale(const segment_entry& e) noexcept;

} // namespace rdmax::stats
