#pragma once
// importer: a peer's side of one-copy sharing on one node (the owner's is
// local/exporter.hpp). Over a unix_channel to the owner it maps the owner's
// export table read-only, once; then each export at its first use, kept in
// a mapping_cache: after that a copy from or into an export is a generation
// check and a memcpy, with no system call and no message.
//
// Failure, never a hang or a fault:
// - an export the owner revoked (or whose area its arena gave back) is
//   refused at the next use (map_status::revoked), its mapping dropped;
// - the owner gone: uses that need a new mapping fail (map_failed, failure()
//   says why) at once, since the channel is closed; mapped exports stay
//   readable (their pages live while mapped), and owner_alive() tells, with
//   one poll() and no waiting, that the owner is gone;
// - in a child forked after the importer was made, mapped exports work as
//   in the parent (the mappings are shared), but new mappings are refused:
//   the channel is the parent's, and two processes talking on it would mix
//   their messages. A child makes its own importer on its own channel.
//
// One thread at a time (as the mapping cache).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include <rdmax/local/descriptor_passing.hpp>
#include <rdmax/local/exporter.hpp>
#include <rdmax/local/mapping_cache.hpp>
#include <rdmax/local/shared_segment.hpp>

namespace rdmax::local {

class importer {
public:
    /// Asks the owner at the other end of `owner` for its export table,
    /// waiting up to `timeout` for each answer. Throws rdmax::error.
    explicit importer(unix_channel owner, mapping_options opts = mapping_options{}.with_env(),
                      std::chrono::milliseconds timeout = std::chrono::seconds(5));
    importer(const importer&) = delete;
    importer& operator=(const importer&) = delete;

    /// One copy out of the range, [offset, offset + out.size()) of it.
    map_status copy_out(const exported_range& r, std::uint64_t offset,
                        std::span<std::byte> out) noexcept {
        if (!inside(r, offset, out.size()))
            return map_status::out_of_range;
        return cache_->copy_out(r.notice, r.offset + offset, out);
    }
    /// One copy into the range (its export must be writable: a read-only
    /// export is mapped read-only, and this refuses it as read_only).
    map_status copy_in(const exported_range& r, std::uint64_t offset,
                       std::span<const std::byte> in) noexcept {
        if (!inside(r, offset, in.size()))
            return map_status::out_of_range;
        return cache_->copy_in(r.notice, r.offset + offset, in);
    }

    /// The owner still holds its end of the channel (a poll, no wait).
    [[nodiscard]] bool owner_alive() const noexcept;
    /// Why the last map_failed failed.
    [[nodiscard]] std::string_view failure() const noexcept { return cache_->failure(); }
    [[nodiscard]] mapping_cache& cache() noexcept { return *cache_; }
    [[nodiscard]] const mapping_counters& counters() const noexcept { return cache_->counters(); }

private:
    [[nodiscard]] static bool inside(const exported_range& r, std::uint64_t offset,
                                     std::size_t n) noexcept {
        return offset <= r.length && n <= r.length - offset;
    }
    shared_segment attach(const export_notice& e);

    unix_channel owner_;
    std::chrono::milliseconds timeout_;
    std::uint32_t fork_generation_;
    shared_segment control_;
    std::optional<mapping_cache> cache_;
};

} // namespace rdmax::local
