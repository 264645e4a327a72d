#pragma once
// The live-counter segment's layout: what a process publishes (publisher.hpp)
// and rdmax-stat reads (reader.hpp), in /dev/shm/rdmax-stat.<uid>.<pid>.
//
// One header, then a fixed table of records, one per published object (an
// RPC client or server, a registration cache, an arena, a scheduler sum).
// Each record is written by one writer only and guarded by a seqlock: the
// writer makes its sequence odd, stores the values, makes it even again; a
// reader copies the values between two equal even reads of the sequence.
// So no lock is taken and no read-modify-write is done on any data path:
// objects copy their own plain counters in (at their housekeeping), and a
// reader retries the rare copy it raced with. Values are std::atomic words
// written and read relaxed, so a torn or racing copy is never undefined
// behaviour, only a retry.
//
// A reader trusts nothing in it: the file is checked to be its user's, of
// the size the header says, and every count is clamped to the table.

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace rdmax::stats {

inline constexpr char segment_magic[8] = {'R', 'D', 'M', 'A', 'X', 'S', 'T', '1'};
inline constexpr std::uint32_t segment_version = 1;
inline constexpr std::size_t max_records = 128;
inline constexpr std::size_t max_fields = 64;
inline constexpr std::size_t field_name_bytes = 32;
inline constexpr std::size_t kind_bytes = 16;
inline constexpr std::size_t object_name_bytes = 48;
/// Where segments live, and their names' prefix (then "<uid>.<pid>").
inline constexpr const char* segment_dir = "/dev/shm";
inline constexpr const char* segment_prefix = "rdmax-stat.";

/// How a field is to be read: a count that only grows, or a level now.
enum class field_type : std::uint8_t { counter = 0, gauge = 1 };

struct field_desc {
    const char* name;
    field_type type;
};

struct record {
    /// Odd while the writer is copying values in; bumped twice per copy.
    std::atomic<std::uint32_t> seq{0};
    /// 0: free; 1: in use. Set last when a record is taken, first when freed.
    std::atomic<std::uint32_t> live{0};
    /// Fields in use (names below, written once before live is set).
    std::uint32_t fields = 0;
    std::uint32_t reserved = 0;
    char kind[kind_bytes] = {};
    char name[object_name_bytes] = {};
    char field_names[max_fields][field_name_bytes] = {};
    field_type types[max_fields] = {};
    std::atomic<std::uint64_t> values[max_fields] = {};
};

struct segment_header {
    char magic[8] = {};
    std::uint32_t version = 0;
    std::uint32_t records = 0; ///< the table's length (max_records)
    std::uint64_t bytes = 0;   ///< the whole segment's size
    std::uint64_t pid = 0;
    /// The process's start time (/proc/PID/stat field 22, clock ticks since
    /// boot), for readers to tell a reused pid. Whether it lives is told by
    /// the file's lock, which its writer holds (src/stats/segment_lock.hpp).
    std::uint64_t start_ticks = 0;
    std::uint64_t interval_ms = 0; ///< how often objects publish
    /// Objects not published because the table was full.
    std::atomic<std::uint64_t> unpublished{0};
    char comm[32] = {}; ///< the process's name
};

struct segment {
    segment_header header;
    record records[max_records];
};

/// A seqlock's fence (writer: release after the odd sequence; reader:
/// acquire before the second read of it). ThreadSanitizer does not model
/// fences and GCC refuses them under it (as mapping_cache.hpp's): there the
/// release and acquire accesses around stand alone. (It could not see a race
/// here anyway: writer and reader map the segment at different addresses.)
inline void seqlock_fence(std::memory_order order) noexcept {
#if !defined(__SANITIZE_THREAD__)
    std::atomic_thread_fence(order);
#else
    (void)order;
#endif
}

static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "values are read across processes: they must not need a lock");
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);

} // namespace rdmax::stats
