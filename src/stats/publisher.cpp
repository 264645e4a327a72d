// The process's stat segment and its stat thread (publisher.hpp).
//
// Everything mutable that the registry shares is behind pointers it never
// frees: a forked child drops them for fresh ones without touching the
// parent's (a mutex or a vector some other parent thread held at fork is
// unusable in the child), and objects destroyed after exit's cleanup still
// find a mutex to take and a mapping to write.

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <map>
#include <mutex>
#include <pthread.h>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/stats/proc_identity.hpp>
#include <rdmax/stats/publisher.hpp>
#include <rdmax/stats/stat_options.hpp>

#include "../notice.hpp"
#include "segment_lock.hpp"

namespace rdmax::stats {

namespace detail {
std::atomic<std::uint32_t> fork_generation{0};
} // namespace detail

stat_options stat_options::with_env() const {
    return config::apply_env(*this, stat_knobs, "stat_options::with_env");
}

namespace {

using rdmax::detail::notice;

void copy_text(char* to, std::size_t cap, std::string_view from) noexcept {
    const std::size_t n = std::min(from.size(), cap - 1);
    std::memcpy(to, from.data(), n);
    std::memset(to + n, 0, cap - n);
}

/// The seqlock's writer side: odd, values, even (segment_layout.hpp).
void write_values(record& r, std::span<const std::uint64_t> v) noexcept {
    const std::uint32_t s = r.seq.load(std::memory_order_relaxed);
    r.seq.store(s + 1, std::memory_order_relaxed);
    seqlock_fence(std::memory_order_release);
    const std::size_t n = std::min<std::size_t>(v.size(), r.fields);
    for (std::size_t i = 0; i < n; ++i)
        r.values[i].store(v[i], std::memory_order_relaxed);
    r.seq.store(s + 2, std::memory_order_release);
}

struct pull_entry {
    std::uint64_t id;
    record* rec;
    pulled::reader read;
};

class registry {
public:
    /// The process's registry; null when it could not be made (no memory):
    /// then nothing is published.
    static registry* get() noexcept {
        // Never destroyed: see the file's opening comment.
        static registry* const r = []() -> registry* {
            try {
                return new registry;
            } catch (...) {
                return nullptr;
            }
        }();
        return r;
    }

    record* open(std::string_view kind, std::string_view name,
                 std::span<const field_desc> fields) noexcept {
        std::lock_guard g(*mu_);
        return open_locked(kind, name, fields);
    }

    void close(record* r) noexcept {
        std::lock_guard g(*mu_);
        close_locked(r);
    }

    std::uint64_t add_pull(std::string_view kind, std::string_view name,
                           std::span<const field_desc> fields, pulled::reader read) noexcept {
        std::lock_guard g(*mu_);
        record* r = open_locked(kind, name, fields);
        if (r == nullptr)
            return 0;
        try {
            pulls_->push_back({++next_id_, r, std::move(read)});
            if (thread_ == nullptr)
                thread_ = new std::thread([this, gen = thread_gen_] { run(gen); });
        } catch (...) {
            if (!pulls_->empty() && pulls_->back().rec == r)
                pulls_->pop_back();
            close_locked(r);
            return 0;
        }
        return next_id_;
    }

    void remove_pull(std::uint64_t id) noexcept {
        std::thread* done = nullptr;
        {
            std::lock_guard g(*mu_);
            const auto it = std::find_if(pulls_->begin(), pulls_->end(),
                                         [id](const pull_entry& e) { return e.id == id; });
            if (it == pulls_->end())
                return; // dropped at fork
            close_locked(it->rec);
            pulls_->erase(it);
            // The last one gone: so is the thread. A process that used a cache
            // or an arena once is not left with a thread of rdmax's (a fork
            // from a multi-threaded process is what TSan, and careful
            // programs, refuse); the next pulled object starts another.
            if (pulls_->empty() && thread_ != nullptr) {
                ++thread_gen_;
                done = std::exchange(thread_, nullptr);
            }
        }
        if (done != nullptr) {
            cv_->notify_all();
            try {
                if (done->joinable() && done->get_id() != std::this_thread::get_id())
                    done->join();
                else if (done->joinable())
                    done->detach();
                delete done;
            } catch (...) { // kept, as at exit
            }
        }
    }

    void pull_now() noexcept {
        std::lock_guard g(*mu_);
        pull_locked();
    }

    [[nodiscard]] std::string_view path() const noexcept { return path_; }
    [[nodiscard]] std::chrono::milliseconds interval() const noexcept { return opts_.interval; }

private:
    registry() {
        try {
            opts_ = stat_options{}.with_env();
        } catch (const std::exception& e) {
            notice(fmt::format("live counters off: {}", e.what()));
            opts_.enable = false;
        }
        pthread_atfork(nullptr, nullptr, [] { get()->forked(); });
    }

    record* open_locked(std::string_view kind, std::string_view name,
                        std::span<const field_desc> fields) noexcept {
        if (!opts_.enable || in_child_ || !map_segment())
            return nullptr;
        std::size_t i = 0;
        while (i < max_records && taken_[i])
            ++i;
        if (i == max_records) {
            seg_->header.unpublished.fetch_add(1, std::memory_order_relaxed);
            return nullptr;
        }
        taken_[i] = true;
        record& r = seg_->records[i];
        // The names change under the seqlock too: a reader copying the
        // record's last object meanwhile retries rather than mixing them.
        const std::uint32_t s = r.seq.load(std::memory_order_relaxed);
        r.seq.store(s + 1, std::memory_order_relaxed);
        seqlock_fence(std::memory_order_release);
        r.live.store(0, std::memory_order_relaxed);
        copy_text(r.kind, kind_bytes, kind);
        std::string own;
        if (name.empty()) {
            try {
                own = fmt::format("#{}", ++numbered_[std::string(kind)]);
            } catch (...) {
                own = "#?";
            }
            name = own;
        }
        copy_text(r.name, object_name_bytes, name);
        const std::size_t n = std::min(fields.size(), max_fields);
        for (std::size_t f = 0; f < n; ++f) {
            copy_text(r.field_names[f], field_name_bytes, fields[f].name);
            r.types[f] = fields[f].type;
            r.values[f].store(0, std::memory_order_relaxed);
        }
        r.fields = static_cast<std::uint32_t>(n);
        r.live.store(1, std::memory_order_relaxed);
        r.seq.store(s + 2, std::memory_order_release);
        return &r;
    }

    void close_locked(record* r) noexcept {
        if (r == nullptr || seg_ == nullptr || in_child_)
            return;
        const auto i = static_cast<std::size_t>(r - seg_->records);
        if (i >= max_records)
            return;
        const std::uint32_t s = r->seq.load(std::memory_order_relaxed);
        r->seq.store(s + 1, std::memory_order_relaxed);
        seqlock_fence(std::memory_order_release);
        r->live.store(0, std::memory_order_relaxed);
        r->seq.store(s + 2, std::memory_order_release);
        taken_[i] = false;
    }

    /// Makes the segment the first time an object is published.
    bool map_segment() noexcept {
        if (seg_ != nullptr)
            return true;
        if (failed_)
            return false;
        failed_ = true; // said once
        try {
            return make_segment();
        } catch (...) { // no memory for a name or a notice: off
            return false;
        }
    }

    bool make_segment() {
        const pid_t pid = ::getpid();
        path_ = fmt::format("{}/{}{}.{}", segment_dir, segment_prefix, ::getuid(), pid);
        int fd = -1;
        for (int attempt = 0; attempt < 2 && fd < 0; ++attempt) {
            fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
            // One left by an earlier process of this pid (killed) is stale:
            // nobody holds its lock. One whose lock is held is a live
            // process's (of another pid namespace sharing /dev/shm, or a
            // second copy of rdmax in this process): left alone.
            if (fd < 0 && errno == EEXIST && !detail::unlink_if_unused(path_))
                break;
        }
        // Held (shared) while this process lives: what tells readers it does.
        if (fd >= 0 && ::flock(fd, LOCK_SH) != 0) {
            const int err = errno;
            ::close(fd);
            ::unlink(path_.c_str());
            fd = -1;
            errno = err;
        }
        if (fd < 0) {
            notice(fmt::format("live counters off: open {}: {}", path_, std::strerror(errno)));
            path_.clear();
            return false;
        }
        void* p = MAP_FAILED;
        if (::fchmod(fd, 0600) == 0 && ::ftruncate(fd, sizeof(segment)) == 0)
            p = ::mmap(nullptr, sizeof(segment), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        const int err = errno;
        if (p == MAP_FAILED) {
            ::unlink(path_.c_str());
            ::close(fd);
            notice(fmt::format("live counters off: {}: {}", path_, std::strerror(err)));
            path_.clear();
            return false;
        }
        fd_ = fd; // kept open: its lock says this process lives
        seg_ = new (p) segment;
        segment_header& h = seg_->header;
        h.version = segment_version;
        h.records = max_records;
        h.bytes = sizeof(segment);
        h.pid = static_cast<std::uint64_t>(pid);
        h.start_ticks = start_ticks_of(pid);
        h.interval_ms = static_cast<std::uint64_t>(opts_.interval.count());
        copy_text(h.comm, sizeof h.comm, comm_of(pid));
        seqlock_fence(std::memory_order_release);
        std::memcpy(h.magic, segment_magic, sizeof h.magic);
        owner_ = pid;
        failed_ = false;
        std::atexit([] { get()->at_exit(); });
        return true;
    }

    void pull_locked() noexcept {
        std::array<std::uint64_t, max_fields> v{};
        for (pull_entry& e : *pulls_) {
            v.fill(0);
            try {
                e.read(std::span(v.data(), e.rec->fields));
            } catch (...) {
                continue;
            }
            write_values(*e.rec, std::span(v.data(), e.rec->fields));
        }
    }

    /// The stat thread of generation `gen`: it ends at exit, or once the
    /// generation moved on (its last object went).
    void run(std::uint64_t gen) noexcept {
        std::unique_lock lock(*mu_);
        while (!stop_ && gen == thread_gen_) {
            cv_->wait_for(lock, opts_.interval);
            if (!stop_ && gen == thread_gen_ && !in_child_)
                pull_locked();
        }
    }

    /// At exit (the process that made the segment only): the stat thread
    /// stops and the segment's name goes; the mapping stays for objects
    /// destroyed later.
    void at_exit() noexcept {
        if (owner_ != ::getpid())
            return;
        std::thread* t = nullptr;
        {
            std::lock_guard g(*mu_);
            stop_ = true;
            t = std::exchange(thread_, nullptr);
        }
        cv_->notify_all();
        try {
            if (t != nullptr && t->joinable())
                t->join();
            delete t;
        } catch (...) { // EDEADLK: at exit, from the stat thread itself (kept)
        }
        // Only the file this process made: its name may be another's by now.
        struct stat mine {
        }, now{};
        if (fd_ >= 0 && ::fstat(fd_, &mine) == 0 && ::lstat(path_.c_str(), &now) == 0 &&
            mine.st_dev == now.st_dev && mine.st_ino == now.st_ino)
            ::unlink(path_.c_str());
    }

    /// In a forked child: publish nothing; drop what the parent's threads
    /// may have held (see the file's opening comment).
    void forked() noexcept {
        detail::fork_generation.fetch_add(1, std::memory_order_relaxed);
        in_child_ = true;
        mu_ = new (std::nothrow) std::mutex;
        cv_ = new (std::nothrow) std::condition_variable;
        pulls_ = new (std::nothrow) std::vector<pull_entry>;
        thread_ = nullptr;
        if (mu_ == nullptr || cv_ == nullptr || pulls_ == nullptr)
            std::abort(); // no memory in a fresh child
    }

    std::mutex* mu_ = new std::mutex;
    std::condition_variable* cv_ = new std::condition_variable;
    std::vector<pull_entry>* pulls_ = new std::vector<pull_entry>;
    std::thread* thread_ = nullptr;
    std::uint64_t thread_gen_ = 0; ///< bumped when the thread is told to end
    stat_options opts_;
    segment* seg_ = nullptr;
    std::string path_;
    std::array<bool, max_records> taken_{};
    std::map<std::string, std::uint64_t> numbered_;
    std::uint64_t next_id_ = 0;
    pid_t owner_ = 0;
    int fd_ = -1; ///< the segment's file, its shared lock held
    bool failed_ = false;
    bool stop_ = false;
    bool in_child_ = false;
};

} // namespace

slot::slot(std::string_view kind, std::string_view name,
           std::span<const field_desc> fields) noexcept
    : generation_(detail::fork_generation.load(std::memory_order_relaxed)) {
    if (registry* r = registry::get()) {
        rec_ = r->open(kind, name, fields);
        interval_ = r->interval();
    }
}

slot::slot(slot&& o) noexcept
    : rec_(std::exchange(o.rec_, nullptr))
    , next_(o.next_)
    , interval_(o.interval_)
    , generation_(o.generation_) {}

slot& slot::operator=(slot&& o) noexcept {
    if (this != &o) {
        close();
        rec_ = std::exchange(o.rec_, nullptr);
        next_ = o.next_;
        interval_ = o.interval_;
        generation_ = o.generation_;
    }
    return *this;
}

slot::~slot() {
    close();
}

void slot::close() noexcept {
    record* rec = std::exchange(rec_, nullptr);
    // A slot inherited by a forked child is the parent's: left alone.
    if (rec != nullptr && generation_ == detail::fork_generation.load(std::memory_order_relaxed))
        registry::get()->close(rec); // a record was had: so was the registry
}

void slot::publish(std::span<const std::uint64_t> values) noexcept {
    if (rec_ != nullptr && generation_ == detail::fork_generation.load(std::memory_order_relaxed))
        write_values(*rec_, values);
}

pulled::pulled(std::string_view kind, std::string_view name, std::span<const field_desc> fields,
               reader read) noexcept {
    if (registry* r = registry::get())
        id_ = r->add_pull(kind, name, fields, std::move(read));
}

pulled& pulled::operator=(pulled&& o) noexcept {
    if (this != &o) {
        if (id_ != 0)
            registry::get()->remove_pull(id_);
        id_ = std::exchange(o.id_, 0);
    }
    return *this;
}

pulled::~pulled() {
    if (id_ != 0)
        registry::get()->remove_pull(id_);
}

std::string_view segment_path() noexcept {
    const registry* r = registry::get();
    return r != nullptr ? r->path() : std::string_view{};
}

void publish_pulled_now() noexcept {
    if (registry* r = registry::get())
        r->pull_now();
}

} // namespace rdmax::stats
