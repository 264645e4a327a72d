// The process's userfaultfd, its reader thread, and the uffd_monitor
// subscriptions it feeds. See uffd_monitor.hpp for the contract.
#include <array>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <map>
#include <mutex>
#include <poll.h>
#include <pthread.h>
#include <string_view>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <thread>
#include <unistd.h>
#include <utility>

#include <boost/intrusive/list.hpp>
#include <fmt/format.h>

#include <rdmax/detail/mem/pending_invalidations.hpp>
#include <rdmax/error.hpp>
#include <rdmax/mem/fork_policy.hpp>
#include <rdmax/mem/uffd_monitor.hpp>

#include "../notice.hpp"

namespace rdmax {

namespace {
class uffd_service;

// The subscription's state word: bit 0 while its queue is not empty; the
// drains in progress above it. The reader's word: bit 0 while it is between
// poll and queueing, bit 1 once it died, above them the batches it queued
// (so that settle() waits for one batch, not for the reader to be idle).
constexpr std::uint32_t queued_bit = 1;
constexpr std::uint32_t one_drain = 2;
constexpr std::uint32_t reading_bit = 1;
constexpr std::uint32_t dead_bit = 2;
constexpr std::uint32_t one_batch = 4;
} // namespace

struct uffd_monitor::subscription : boost::intrusive::list_base_hook<> {
    uffd_service* service = nullptr;
    std::uint32_t fork_generation = rdmax::fork_generation();
    std::mutex mutex; ///< never held around anything that can unmap memory
    pending_invalidations<64> queue;
    std::atomic<std::uint32_t> state{0};
    std::atomic<std::uint64_t> events{0};

    /// False in a forked child: the service is the parent's.
    [[nodiscard]] bool ours() const noexcept { return fork_generation == rdmax::fork_generation(); }
};

bool detail::uffd_sees_everything(bool shared, unsigned long inode,
                                  std::string_view name) noexcept {
    if (shared)
        return false;
    // Private hugetlb memory (MAP_HUGETLB) is named "/anon_hugepage" by the
    // kernel, "(deleted)" after it; a file whose path merely starts so is a file.
    return inode == 0 || name == "/anon_hugepage" || name == "/anon_hugepage (deleted)";
}

detail::uffd_hooks& detail::uffd_test_hooks() noexcept {
    static uffd_hooks hooks;
    return hooks;
}

namespace {

using detail::notice_once;

#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif

constexpr std::uint64_t wanted_events =
    UFFD_FEATURE_EVENT_UNMAP | UFFD_FEATURE_EVENT_REMOVE | UFFD_FEATURE_EVENT_REMAP;

int open_uffd(std::string& why) noexcept {
    // User-mode-only faults need no privilege (vm.unprivileged_userfaultfd=0
    // is the default); kernels before 5.11 know only the plain form.
    int fd =
        static_cast<int>(syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY));
    if (fd < 0 && errno == EINVAL)
        fd = static_cast<int>(syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK));
    if (fd < 0) {
        why = fmt::format("userfaultfd: {}", std::strerror(errno));
        return -1;
    }
    uffdio_api api{};
    api.api = UFFD_API;
    api.features = wanted_events;
    if (ioctl(fd, UFFDIO_API, &api) != 0 || (api.features & wanted_events) != wanted_events) {
        why = fmt::format("UFFDIO_API: the kernel lacks unmap/remove/remap events ({})",
                          std::strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

// ---- Which mappings a range lies in, and whether userfaultfd sees all of
// ---- what can happen to them.

/// One mapping (VMA) as /proc/self/maps or PROCMAP_QUERY describes it.
struct vma_info {
    std::uintptr_t start = 0;
    std::uintptr_t end = 0;
    bool shared = false;
    unsigned long inode = 0;
    std::string_view name;
};

/// Whether every way this mapping can lose its pages reaches userfaultfd:
/// private anonymous memory (no file behind it that another mapping, another
/// process or ftruncate could change), and private anonymous hugetlb.
bool sees_everything(const vma_info& v) noexcept {
    return detail::uffd_sees_everything(v.shared, v.inode, v.name);
}

/// The mappings [start, end) lies in: [lo, hi), their union, when they cover
/// it without a hole and userfaultfd sees everything that can happen to each.
struct vma_span {
    std::uintptr_t lo = 0;
    std::uintptr_t hi = 0;
    bool cacheable = false;
    /// The mappings, in order (the first max_pieces; n counts them all).
    static constexpr std::size_t max_pieces = 32;
    std::array<std::pair<std::uintptr_t, std::uintptr_t>, max_pieces> pieces{};
    std::size_t n = 0;
};

/// Folds one mapping into a span being built over [start, end); false when
/// the walk is over (past end, a hole, or memory it cannot cache).
bool fold(vma_span& s, std::uintptr_t& at, std::uintptr_t end, const vma_info& v) noexcept {
    if (v.end <= at)
        return true; // before the range
    if (v.start > at || !sees_everything(v)) {
        s.cacheable = false; // a hole, or memory it cannot see
        return false;
    }
    if (s.hi == 0)
        s.lo = v.start;
    s.hi = v.end;
    if (s.n < vma_span::max_pieces)
        s.pieces[s.n] = {v.start, v.end};
    ++s.n;
    at = v.end;
    if (at >= end) {
        s.cacheable = true;
        return false;
    }
    return true;
}

// PROCMAP_QUERY (Linux 6.11): one mapping by address, no text to format.
struct procmap_query_arg {
    std::uint64_t size;
    std::uint64_t query_flags;
    std::uint64_t query_addr;
    std::uint64_t vma_start;
    std::uint64_t vma_end;
    std::uint64_t vma_flags;
    std::uint64_t vma_page_size;
    std::uint64_t vma_offset;
    std::uint64_t inode;
    std::uint32_t dev_major;
    std::uint32_t dev_minor;
    std::uint32_t vma_name_size;
    std::uint32_t build_id_size;
    std::uint64_t vma_name_addr;
    std::uint64_t build_id_addr;
};
constexpr unsigned long procmap_query = _IOWR('f', 17, procmap_query_arg);
constexpr std::uint64_t procmap_vma_shared = 0x08;

/// By PROCMAP_QUERY; false (and errno) when the kernel lacks it.
bool span_by_query(int maps_fd, std::uintptr_t start, std::uintptr_t end, vma_span& s) noexcept {
    std::uintptr_t at = start;
    for (;;) {
        char name[256];
        procmap_query_arg q{};
        q.size = sizeof q;
        q.query_addr = at;
        q.vma_name_size = sizeof name;
        q.vma_name_addr = reinterpret_cast<std::uintptr_t>(name);
        if (ioctl(maps_fd, procmap_query, &q) != 0) {
            if (errno != ENOENT && errno != ENAMETOOLONG)
                return false;
            s.cacheable = false; // a hole, or a long name: a file
            return true;
        }
        const vma_info v{
            static_cast<std::uintptr_t>(q.vma_start), static_cast<std::uintptr_t>(q.vma_end),
            (q.vma_flags & procmap_vma_shared) != 0, static_cast<unsigned long>(q.inode),
            q.vma_name_size != 0 ? std::string_view(name, q.vma_name_size - 1)
                                 : std::string_view{}};
        if (!fold(s, at, end, v))
            return true;
    }
}

/// Parses one line of /proc/self/maps: "lo-hi perm offset dev inode name".
bool parse_maps_line(std::string_view line, vma_info& v) noexcept {
    std::size_t i = 0;
    const auto hex = [&](std::uintptr_t& out) {
        out = 0;
        const std::size_t from = i;
        for (; i < line.size(); ++i) {
            const char c = line[i];
            const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
            if (d < 0)
                break;
            out = out * 16 + static_cast<std::uintptr_t>(d);
        }
        return i > from;
    };
    const auto skip = [&](char c) {
        if (i >= line.size() || line[i] != c)
            return false;
        ++i;
        return true;
    };
    const auto field = [&] { // skips one space-separated field and the spaces after it
        while (i < line.size() && line[i] != ' ')
            ++i;
        while (i < line.size() && line[i] == ' ')
            ++i;
    };
    if (!hex(v.start) || !skip('-') || !hex(v.end) || !skip(' ') || i + 4 > line.size())
        return false;
    v.shared = line[i + 3] == 's';
    field(); // perms
    field(); // offset
    field(); // device
    v.inode = 0;
    for (; i < line.size() && line[i] >= '0' && line[i] <= '9'; ++i)
        v.inode = v.inode * 10 + static_cast<unsigned long>(line[i] - '0');
    while (i < line.size() && line[i] == ' ')
        ++i;
    v.name = line.substr(i);
    return true;
}

/// By reading /proc/self/maps up to the end of the range. No allocation.
bool span_by_text(std::uintptr_t start, std::uintptr_t end, vma_span& s) noexcept {
    const int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    char buf[8192];
    std::size_t have = 0;
    std::uintptr_t at = start;
    bool going = true, ok = true;
    while (going) {
        const ssize_t n = read(fd, buf + have, sizeof buf - have);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            ok = n == 0;
            if (ok && have != 0) { // a last line without its newline
                vma_info v;
                if (parse_maps_line({buf, have}, v))
                    fold(s, at, end, v);
            }
            break;
        }
        have += static_cast<std::size_t>(n);
        std::size_t from = 0;
        for (std::size_t i = 0; i < have && going; ++i) {
            if (buf[i] != '\n')
                continue;
            vma_info v;
            if (parse_maps_line({buf + from, i - from}, v))
                going = fold(s, at, end, v);
            from = i + 1;
        }
        if (from == 0 && have == sizeof buf) { // a line longer than the buffer
            ok = false;
            break;
        }
        std::memmove(buf, buf + from, have - from);
        have -= from;
    }
    close(fd);
    return ok;
}

/// The span of [start, end); not cacheable when it cannot be told.
vma_span span_of(int maps_fd, std::uintptr_t start, std::uintptr_t end) noexcept {
    static std::atomic<bool> no_query{false};
    vma_span s;
    if (maps_fd >= 0 && !no_query.load(std::memory_order_relaxed) &&
        !detail::uffd_test_hooks().no_procmap_query) {
        if (span_by_query(maps_fd, start, end, s))
            return s;
        if (errno == ENOTTY || errno == EINVAL)
            no_query.store(true, std::memory_order_relaxed);
        s = {};
    }
    if (!span_by_text(start, end, s))
        s = {};
    return s;
}

/// The one userfaultfd of a process. Never destroyed: its reader thread may
/// be needed until the very end (a munmap in a static destructor waits for it).
class uffd_service {
public:
    /// The service of this process, created on first use; nullptr (and why)
    /// when userfaultfd is unavailable. A forked child gets a service of its own.
    static uffd_service* get(std::string& why) {
        // One mutex per process: in a forked child the parent's may have
        // been held at fork by a thread that is not there, so a child takes
        // a fresh one (the parent's is left, as the parent's service is).
        struct guard {
            std::uint32_t generation;
            std::mutex m;
        };
        static std::atomic<guard*> current{nullptr};
        guard* g = current.load(std::memory_order_acquire);
        while (g == nullptr || g->generation != fork_generation()) {
            auto* fresh = new guard{fork_generation(), {}};
            if (current.compare_exchange_strong(g, fresh, std::memory_order_acq_rel)) {
                g = fresh;
                break;
            }
            delete fresh; // another thread of this process won: g is its guard
        }
        static uffd_service* s = nullptr;
        std::lock_guard lock(g->m);
        if (s != nullptr && s->fork_generation_ != fork_generation())
            s = nullptr; // the parent's: its fd refers to the parent's memory, leave it be
        if (s == nullptr) {
            auto* fresh = new uffd_service;
            if (!fresh->start(why)) {
                delete fresh;
                return nullptr;
            }
            s = fresh;
        }
        return s;
    }

    [[nodiscard]] const std::atomic<std::uint32_t>& reading() const noexcept { return reading_; }
    [[nodiscard]] bool dead() const noexcept {
        return (reading_.load(std::memory_order_acquire) & dead_bit) != 0;
    }
    [[nodiscard]] std::string failure() const {
        std::lock_guard lock(failure_mutex_);
        return failure_text_;
    }

    void subscribe(uffd_monitor::subscription& sub) {
        std::lock_guard lock(subs_mutex_);
        subs_.push_back(sub);
    }
    void unsubscribe(uffd_monitor::subscription& sub) noexcept {
        std::lock_guard lock(subs_mutex_);
        subs_.erase(subs_.iterator_to(sub));
    }

    /// Registers the mappings [start, end) lies in, whole, and counts them
    /// watched once more; {0, 0} for memory it cannot watch (or see all that
    /// can happen to). Registering again a range already registered is
    /// harmless, and catches a new mapping placed where an old watched one was.
    /// The ioctl and the count are one step under pieces_mutex_, so that an
    /// unwatch that drops the count to zero (and unregisters) cannot fall
    /// between them.
    std::pair<std::uintptr_t, std::uintptr_t> watch(std::uintptr_t start, std::uintptr_t end) {
        if (dead())
            return {};
        const vma_span s = span_of(maps_fd_, start, end);
        if (!s.cacheable)
            return {};
        std::lock_guard lock(pieces_mutex_);
        if (dead())
            return {}; // fd_ is not the userfaultfd any more
        if (auto* hook = detail::uffd_test_hooks().before_register)
            hook();
        uffdio_register reg{};
        reg.range.start = s.lo;
        reg.range.len = s.hi - s.lo;
        reg.mode = UFFDIO_REGISTER_MODE_WP; // never armed: no fault waits on us
        if (ioctl(fd_, UFFDIO_REGISTER, &reg) != 0)
            return {}; // EINVAL: not anonymous/shmem/hugetlbfs; ENOMEM: a hole
        if (auto* hook = detail::uffd_test_hooks().after_register)
            hook();
        if (!add(s.lo, s.hi, +1))
            return {}; // no memory to count it: registered per use (the
                       // registration left behind only over-watches)
        // The mappings may have been replaced between the look and the
        // registration: what is registered now is what counts. (The kernel
        // may have merged them with watched neighbours: a wider span is fine.)
        // UFFDIO_REGISTER passes over holes, so a mapping unmapped before it
        // and replaced after it (same bounds) would look the same and not be
        // registered: ask the kernel whether each mapping now there is.
        const vma_span now = span_of(maps_fd_, start, end);
        if (!now.cacheable || now.lo > s.lo || now.hi < s.hi || !all_registered(now)) {
            (void)add(s.lo, s.hi, -1); // failing, it over-watches: never stale
            return {};
        }
        return {s.lo, s.hi};
    }

    /// Counts [start, end) watched once less; unregisters the pages that no
    /// one watches any more. Without memory for a split it leaves the count
    /// as it is: the pages stay watched (extra invalidations, never stale).
    void unwatch(std::uintptr_t start, std::uintptr_t end) noexcept {
        std::lock_guard lock(pieces_mutex_);
        (void)add(start, end, -1);
    }

    /// Waits until every event the reader took by now is queued: the batch
    /// it is reading, if any, is queued (or it went idle, or died). Not until
    /// it is idle: under unmaps that never pause, it may never be.
    void settle() const noexcept {
        const std::uint32_t seen = reading_.load(std::memory_order_acquire);
        if ((seen & reading_bit) == 0)
            return;
        while (reading_.load(std::memory_order_acquire) == seen)
            std::this_thread::yield();
    }

private:
    struct piece {
        std::uintptr_t end;
        long count;
    };
    using piece_map = std::map<std::uintptr_t, piece>;

    /// Whether every mapping of the span is registered with this
    /// userfaultfd now. Mappings are registered only here, under
    /// pieces_mutex_, so while it is held a mapping that is registered was
    /// there, registered, since UFFDIO_REGISTER: then every page the span
    /// saw was registered when it was seen, and replacing any of them later
    /// is an unmap that reaches the reader. UFFDIO_WRITEPROTECT (mode 0:
    /// resolve, a no-op here since nothing is ever protected) answers ENOENT
    /// for a mapping that is not, and for a hole; it is asked of one page
    /// of each mapping, or of one aligned 2 MiB block where the mapping
    /// holds one (so that a transparent huge page is not split). Any doubt
    /// (a mapping of 1 GiB pages, too many mappings) says no: per use.
    [[nodiscard]] bool all_registered(const vma_span& s) const noexcept {
        if (s.n > vma_span::max_pieces)
            return false;
        constexpr std::uintptr_t huge = std::uintptr_t{2} << 20;
        const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
        for (std::size_t i = 0; i < s.n; ++i) {
            const auto [lo, hi] = s.pieces[i];
            const std::uintptr_t block = (lo + huge - 1) & ~(huge - 1);
            uffdio_writeprotect wp{};
            wp.range.start = block >= lo && block + huge <= hi ? block : lo;
            wp.range.len = block >= lo && block + huge <= hi ? huge : page;
            wp.mode = 0;
            int tries = 0;
            while (ioctl(fd_, UFFDIO_WRITEPROTECT, &wp) != 0) {
                // EAGAIN: an event of this userfaultfd is being delivered.
                if (errno != EAGAIN || ++tries == 1000)
                    return false;
                std::this_thread::yield();
            }
        }
        return true;
    }

    bool start(std::string& why) {
        fd_ = open_uffd(why);
        if (fd_ < 0)
            return false;
        stop_fd_ = eventfd(0, EFD_CLOEXEC);
        maps_fd_ = open("/proc/self/maps", O_RDONLY | O_CLOEXEC); // -1: text each time
        // Signals go to the application's threads, never to the reader.
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        const int rc =
            stop_fd_ < 0 ? errno : pthread_create(&thread_, nullptr, &uffd_service::run, this);
        pthread_sigmask(SIG_SETMASK, &old, nullptr);
        if (stop_fd_ < 0 || rc != 0) {
            why = fmt::format("userfaultfd reader thread: {}", std::strerror(rc));
            close(fd_);
            if (stop_fd_ >= 0)
                close(stop_fd_);
            if (maps_fd_ >= 0)
                close(maps_fd_);
            return false;
        }
        pthread_detach(thread_);
        return true;
    }

    static void* run(void* self) {
        static_cast<uffd_service*>(self)->loop();
        return nullptr;
    }

    static int poll_fds(pollfd* fds, nfds_t n) noexcept {
        if (auto* hook = detail::uffd_test_hooks().poll)
            return hook(fds, n, -1);
        return ::poll(fds, n, -1);
    }

    void loop() noexcept {
        pollfd fds[2] = {{fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
        // poll() fails with ENOMEM or EAGAIN when the kernel is short of
        // memory for a moment: try again, a little later, for a while.
        constexpr int transient_tries = 1000;
        int failures = 0;
        for (;;) {
            if (poll_fds(fds, 2) < 0) {
                const int e = errno;
                if (e == EINTR)
                    continue;
                if ((e == ENOMEM || e == EAGAIN) && ++failures < transient_tries) {
                    retries_.fetch_add(1, std::memory_order_relaxed);
                    const timespec ms{0, 1000 * 1000};
                    nanosleep(&ms, nullptr);
                    continue;
                }
                die("poll", e, true);
                return;
            }
            failures = 0;
            if ((fds[1].revents & POLLIN) != 0)
                return;
            if ((fds[0].revents & POLLNVAL) != 0) {
                // The application closed our descriptor: the number is not
                // ours any more (it may be reused already).
                die("poll: the userfaultfd descriptor was closed (POLLNVAL)", EBADF, false);
                return;
            }
            // Set before read(): the munmap that produced the event returns
            // once read() took it, and from then on pending() must say so
            // until the range is in every queue (deliver() sets the queue's
            // bit before this one is cleared).
            reading_.fetch_or(reading_bit, std::memory_order_seq_cst);
            uffd_msg msgs[32];
            for (;;) {
                const ssize_t n = read(fd_, msgs, sizeof msgs);
                if (n < 0 && errno == EINTR)
                    continue;
                if (n < 0 && errno != EAGAIN) {
                    const int e = errno;
                    die("read", e, e != EBADF);
                    return;
                }
                if (n == 0) { // a userfaultfd never says end of file: the number was reused
                    die("read: the descriptor is not the userfaultfd any more", EBADF, false);
                    return;
                }
                if (n < 0)
                    break;
                for (std::size_t i = 0; i < static_cast<std::size_t>(n) / sizeof(uffd_msg); ++i)
                    deliver(msgs[i]);
                reading_.fetch_add(one_batch, std::memory_order_release); // settle() may go
            }
            reading_.fetch_and(~reading_bit, std::memory_order_release);
        }
    }

    /// The reader cannot go on: mark every monitor's pending() true for good
    /// (their drain() then reports everything), release the userfaultfd so
    /// that no munmap waits for an event nobody reads (the kernel wakes them
    /// when the file is released), and say so once. fd_ becomes a copy of the
    /// eventfd in one step, so a racing ioctl on fd_ fails harmlessly instead
    /// of reaching whatever file a closed number would be reused for; when
    /// the number is not ours any more (`ours` false: the application closed
    /// it, and may have reused it), it is left alone. Nothing here allocates
    /// or takes a lock before the release: an application thread may hold
    /// malloc's lock, or ours, while its munmap waits for this thread.
    void die(const char* what, int err, bool ours) noexcept {
        reading_.store(dead_bit, std::memory_order_seq_cst); // before any munmap is let go
        if (ours) {
            while (dup3(stop_fd_, fd_, O_CLOEXEC) < 0 && errno == EBUSY) {
            }
        }
        char why[sizeof failure_text_];
        const char* desc = strerrordesc_np(err); // no locale, no allocation
        std::snprintf(why, sizeof why, "%s: %s", what, desc != nullptr ? desc : "unknown error");
        {
            std::lock_guard lock(failure_mutex_);
            std::memcpy(failure_text_, why, sizeof why);
        }
        char line[sizeof why + 200];
        std::snprintf(line, sizeof line,
                      "the userfaultfd reader failed (%s): registration caches on userfaultfd "
                      "drop what they hold and register per use from now on",
                      why);
        static std::once_flag said;
        try {
            notice_once(said, line);
        } catch (...) {
        }
    }

    void deliver(const uffd_msg& m) noexcept {
        std::uintptr_t start = 0, end = 0;
        switch (m.event) {
        case UFFD_EVENT_UNMAP:
        case UFFD_EVENT_REMOVE:
            start = m.arg.remove.start;
            end = m.arg.remove.end;
            break;
        case UFFD_EVENT_REMAP:
            start = m.arg.remap.from;
            end = m.arg.remap.from + m.arg.remap.len;
            break;
        default: return; // no faults: write protection is never armed
        }
        std::lock_guard lock(subs_mutex_);
        for (auto& sub : subs_) {
            std::lock_guard q(sub.mutex);
            sub.queue.add(start, end);
            sub.events.fetch_add(1, std::memory_order_relaxed);
            sub.state.fetch_or(queued_bit, std::memory_order_release);
        }
    }

    /// Adds `delta` to the watch count of every page of [start, end), keeping
    /// the pieces disjoint; pieces whose count drops to zero are unregistered.
    /// Every map node the update needs is allocated first, so a failed
    /// allocation changes nothing (false); the update itself allocates nothing.
    [[nodiscard]] bool add(std::uintptr_t start, std::uintptr_t end, long delta) noexcept {
        piece_map spare;
        try {
            // A split where an end falls inside a piece and, counting up, a
            // piece per gap: at most one more gap than the pieces it meets.
            std::size_t need = std::size_t{splits(start)} + std::size_t{splits(end)};
            if (delta > 0) {
                ++need;
                auto it = pieces_.upper_bound(start);
                if (it != pieces_.begin() && std::prev(it)->second.end > start)
                    ++need;
                for (; it != pieces_.end() && it->first < end; ++it)
                    ++need;
            }
            for (std::size_t i = 0; i < need; ++i)
                spare.emplace(i, piece{});
        } catch (...) {
            return false;
        }
        split_at(start, spare);
        split_at(end, spare);
        std::uintptr_t at = start;
        auto it = pieces_.lower_bound(start);
        while (at < end) {
            if (it == pieces_.end() || it->first > at) { // a gap
                const std::uintptr_t gap_end =
                    it == pieces_.end() || it->first > end ? end : it->first;
                if (delta > 0)
                    insert_piece(it, at, piece{gap_end, delta}, spare);
                at = gap_end;
                continue;
            }
            it->second.count += delta;
            at = it->second.end;
            if (it->second.count <= 0) {
                uffdio_range r{it->first, it->second.end - it->first};
                if (!dead()) // else fd_ may be a number the application reused
                    ioctl(fd_, UFFDIO_UNREGISTER, &r); // unmapped already: nothing to undo
                it = pieces_.erase(it);
            } else {
                ++it;
            }
        }
        return true;
    }

    /// Puts a node of `spare` (never empty here: add() counted) into pieces_.
    // GCC cannot see that the node a non-empty map gives up holds one.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference"
    void insert_piece(piece_map::iterator hint, std::uintptr_t at, piece p,
                      piece_map& spare) noexcept {
        if (spare.empty())
            std::abort(); // add() counted wrong: never go on with a count missing
        auto node = spare.extract(spare.begin());
        node.key() = at;
        node.mapped() = p;
        pieces_.insert(hint, std::move(node));
    }
#pragma GCC diagnostic pop

    /// Whether `at` falls strictly inside a piece (which split_at then cuts).
    [[nodiscard]] bool splits(std::uintptr_t at) const noexcept {
        auto it = pieces_.upper_bound(at);
        return it != pieces_.begin() && std::prev(it)->first < at && at < std::prev(it)->second.end;
    }

    void split_at(std::uintptr_t at, piece_map& spare) noexcept {
        auto it = pieces_.upper_bound(at);
        if (it == pieces_.begin())
            return;
        --it;
        if (it->first < at && at < it->second.end) {
            const piece upper{it->second.end, it->second.count};
            it->second.end = at;
            insert_piece(std::next(it), at, upper, spare);
        }
    }

    int fd_ = -1;
    int stop_fd_ = -1;
    int maps_fd_ = -1;
    pthread_t thread_{};
    std::uint32_t fork_generation_ = fork_generation();
    std::atomic<std::uint32_t> reading_{0};
    std::atomic<std::uint64_t> retries_{0};
    mutable std::mutex failure_mutex_;
    char failure_text_[128] = {}; ///< why the reader died (empty while it works)
    std::mutex subs_mutex_;
    boost::intrusive::list<uffd_monitor::subscription> subs_;
    std::mutex pieces_mutex_;
    piece_map pieces_;
};

const std::atomic<std::uint32_t> never{0};

} // namespace

bool uffd_monitor::available() noexcept {
    static const bool yes = [] {
        try {
            std::string why;
            return uffd_service::get(why) != nullptr;
        } catch (...) {
            return false;
        }
    }();
    return yes;
}

uffd_monitor::uffd_monitor()
    : sub_(std::make_unique<subscription>()) {
    std::string why;
    sub_->service = uffd_service::get(why);
    if (sub_->service == nullptr)
        throw_error("uffd_monitor", ENOTSUP, why);
    sub_->service->subscribe(*sub_);
    state_flag_ = &sub_->state;
    reading_flag_ = &sub_->service->reading();
}

uffd_monitor::uffd_monitor(uffd_monitor&& o) noexcept
    : sub_(std::move(o.sub_))
    , state_flag_(std::exchange(o.state_flag_, &never))
    , reading_flag_(std::exchange(o.reading_flag_, &never)) {}

uffd_monitor& uffd_monitor::operator=(uffd_monitor&& o) noexcept {
    if (this != &o) {
        std::swap(sub_, o.sub_);
        std::swap(state_flag_, o.state_flag_);
        std::swap(reading_flag_, o.reading_flag_);
    }
    return *this;
}

uffd_monitor::~uffd_monitor() {
    if (!sub_)
        return;
    if (sub_->ours())
        sub_->service->unsubscribe(*sub_);
    else
        static_cast<void>(sub_.release()); // in the parent's list, which a child leaves alone
}

uffd_monitor::token uffd_monitor::watch(std::uintptr_t start, std::size_t len) {
    if (!sub_->ours())
        throw_error("uffd_monitor::watch", EPERM, "the monitor belongs to the parent process");
    const std::uintptr_t end = start + len;
    if (len == 0 || end < start)
        return {};
    const auto [lo, hi] = sub_->service->watch(start, end);
    return {lo, hi};
}

void uffd_monitor::unwatch(token t) noexcept {
    if (t.end != 0 && sub_ && sub_->ours())
        sub_->service->unwatch(t.start, t.end);
}

void uffd_monitor::drain(void (*sink)(void*, std::uintptr_t, std::uintptr_t), void* ctx) noexcept {
    if (!sub_ || !sub_->ours())
        return;
    uffd_service& service = *sub_->service;
    service.settle();
    pending_invalidations<64> taken;
    {
        // The queue's bit becomes a drain in progress in one step, and the
        // drain ends only after the sink returned: pending() stays true until
        // the cache has dropped the ranges.
        std::lock_guard lock(sub_->mutex);
        taken = sub_->queue;
        sub_->queue.clear();
        const std::uint32_t queued = sub_->state.load(std::memory_order_relaxed) & queued_bit;
        sub_->state.fetch_add(one_drain - queued, std::memory_order_acq_rel);
    }
    for (std::size_t i = 0; i < taken.size(); ++i)
        sink(ctx, taken[i].start, taken[i].end);
    if (service.dead()) // nothing is watched any more
        sink(ctx, 0, UINTPTR_MAX);
    sub_->state.fetch_sub(one_drain, std::memory_order_release);
}

std::string uffd_monitor::failed() const {
    return sub_ && sub_->ours() ? sub_->service->failure() : std::string{};
}

std::uint64_t uffd_monitor::events() const noexcept {
    return sub_ ? sub_->events.load(std::memory_order_relaxed) : 0;
}

std::uint64_t uffd_monitor::overflow_merges() const noexcept {
    if (!sub_ || !sub_->ours())
        return 0; // in a child, the reader may have held the mutex at fork
    std::lock_guard lock(sub_->mutex);
    return sub_->queue.overflow_merges();
}

std::size_t uffd_monitor::queued() const noexcept {
    if (!sub_ || !sub_->ours())
        return 0; // in a child, the reader may have held the mutex at fork
    std::lock_guard lock(sub_->mutex);
    return sub_->queue.size();
}

} // namespace rdmax
