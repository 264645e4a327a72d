#pragma once
// exporter: the owner's side of one-copy sharing on one node. It publishes
// memory (a shared_segment, or the area of a shareable registered_arena that
// holds a block) in its export_table, and answers peers over a unix_channel:
// a peer asks once for the table (its control segment, mapped read-only
// there) and then for each export's descriptor, which its mapping_cache maps
// once and keeps (local/importer.hpp).
//
// What a peer can reach: the exports it was told of, each whole (a memfd can
// be mapped anywhere in the file: an arena's export is its whole area, so a
// peer given one block of an area can read the area's other blocks). Give
// peers blocks of an arena that holds only what they may see. A read-only
// export is handed out as a descriptor opened read-only, so the peer cannot
// map it writable whatever it does.
//
// Revocation: revoke() (or the arena giving the area back to the system,
// which revokes it first) sets the export's generation to 0 in the table;
// the peer's next use is refused, and its mapping, still holding the pages,
// never faults.
//
// Thread-safe: an arena's trimming thread revokes through it.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include <rdmax/detail/local/export_table.hpp>
#include <rdmax/error.hpp>
#include <rdmax/local/descriptor_passing.hpp>
#include <rdmax/local/shared_segment.hpp>

namespace rdmax::local {

/// Bytes inside an export, as a peer is told of them.
struct exported_range {
    export_notice notice;
    std::uint64_t offset = 0; ///< in the export
    std::uint64_t length = 0;
};

/// The requests and replies of an exporter's conversation with a peer.
namespace export_wire {
inline constexpr std::uint32_t magic = 0x52584558; // "XEXR"
enum class kind : std::uint32_t { hello = 1, attach = 2 };
struct request {
    std::uint32_t magic = export_wire::magic;
    kind what = kind::hello;
    std::uint32_t id = 0;
    std::uint32_t reserved = 0;
    std::uint64_t generation = 0;
};
struct reply {
    std::uint32_t magic = export_wire::magic;
    std::int32_t error = 0;  ///< an errno: the request was refused, no descriptor comes
    std::uint32_t slots = 0; ///< hello: the table's slots
    std::uint32_t writable = 0;
    std::uint64_t bytes = 0; ///< hello: of the control segment; attach: of the export
};
} // namespace export_wire

class exporter {
public:
    /// Room for `slots` exports at once. Throws rdmax::error.
    explicit exporter(std::uint32_t slots = 1024);
    exporter(const exporter&) = delete;
    exporter& operator=(const exporter&) = delete;
    /// Stops listening to the arenas it shares from; the exports' generations
    /// stay in the table (a peer's mappings keep their pages).
    ~exporter();

    /// Publishes a whole segment (its descriptor is duplicated: the caller
    /// may drop the segment, the peer can still map it until revoke()).
    export_notice share(const shared_segment& seg, bool writable);

    /// The bytes [p, p + n) of a shareable arena (mem/registered_arena.hpp),
    /// as a range of the export of their area (published at its first share,
    /// then the same export for every block of it with the same access).
    /// When the arena gives the area back to the system, the export is
    /// revoked first. Throws rdmax::error if the arena is not shareable or
    /// the bytes are not inside one of its areas.
    template <class Arena>
    exported_range share(Arena& arena, const void* p, std::size_t n, bool writable) {
        const auto area = arena.area_for_sharing(p, n);
        bool hook = false;
        {
            std::lock_guard g(mutex_);
            hook = !knows(&arena);
            if (hook)
                unhooks_.push_back({&arena, [&arena] { arena.on_release({}); }});
        }
        // Outside our lock: the arena calls its listener under a lock of its
        // own, and the listener takes ours (the same order as here).
        if (hook)
            arena.on_release([this](const std::byte* base, std::size_t) { revoke_area(base); });
        std::lock_guard g(mutex_);
        exported_range r;
        r.notice = publish_locked(area.fd, area.base, area.bytes, writable);
        r.offset = static_cast<std::uint64_t>(static_cast<const std::byte*>(p) - area.base);
        r.length = n;
        return r;
    }

    /// Revokes an export: the peer's next use is refused. False if `n` is
    /// not live.
    bool revoke(const export_notice& n);

    /// Answers one request of the peer at the other end of `peer`, waiting
    /// for it up to `timeout` (nothing asked by then: true all the same).
    /// False when the peer closed the channel; throws rdmax::error on a
    /// malformed request (the caller should then drop the peer).
    bool answer(unix_channel& peer, std::chrono::milliseconds timeout);

    /// `n` is the live export of its id (not revoked, not replaced).
    [[nodiscard]] bool is_live(const export_notice& n) const;
    [[nodiscard]] std::size_t live() const;
    [[nodiscard]] std::uint32_t slots() const noexcept { return table_.slots(); }

private:
    struct published {
        int fd = -1; ///< our duplicate of the export's descriptor
        const std::byte* base = nullptr;
        export_notice notice;
        bool writable = false;
    };
    struct unhook {
        const void* arena;
        std::function<void()> call;
    };

    [[nodiscard]] bool knows(const void* arena) const noexcept;
    export_notice publish_locked(int fd, const std::byte* base, std::size_t bytes, bool writable);
    void revoke_locked(published& p) noexcept;
    void revoke_area(const std::byte* base) noexcept;
    /// Fills `r` for request `q`; the descriptor to send with it, or -1
    /// (`close_fd`: a duplicate made for this reply, closed once sent).
    int reply_to(const export_wire::request& q, export_wire::reply& r, bool& close_fd);

    mutable std::mutex mutex_;
    export_table table_;
    std::vector<published> by_id_; ///< by export id; fd < 0: free
    std::vector<unhook> unhooks_;
};

} // namespace rdmax::local
