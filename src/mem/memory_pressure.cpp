// The process's PSI watcher: one trigger on /proc/pressure/memory, one thread.
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <mutex>
#include <poll.h>
#include <pthread.h>
#include <string_view>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <rdmax/detail/mem/memory_pressure.hpp>

namespace rdmax {

struct memory_pressure_subscription::entry {
    std::function<void()> call;
};

namespace {

/// 150 ms of "some" stall within any 2 s window: a system that is swapping
/// or reclaiming hard, not one that is merely busy. (Without CAP_SYS_RESOURCE
/// the kernel takes only windows that are multiples of 2 s.)
constexpr std::string_view trigger = "some 150000 2000000";

class watcher {
public:
    static watcher& get() {
        static auto* w = new watcher; // never destroyed: its thread may outlive main
        return *w;
    }

    [[nodiscard]] bool ok() const noexcept { return fd_ >= 0; }
    [[nodiscard]] const std::string& why() const noexcept { return why_; }

    void add(memory_pressure_subscription::entry* e) {
        std::lock_guard g(mutex_);
        subs_.push_back(e);
    }
    void remove(memory_pressure_subscription::entry* e) noexcept {
        std::lock_guard g(mutex_); // waits for a call in progress
        std::erase(subs_, e);
    }
    void notify_all() {
        std::lock_guard g(mutex_);
        for (auto* e : subs_)
            e->call();
    }

private:
    watcher() {
        fd_ = open("/proc/pressure/memory", O_RDWR | O_NONBLOCK | O_CLOEXEC);
        if (fd_ < 0) {
            why_ = fmt::format("/proc/pressure/memory: {}", std::strerror(errno));
            return;
        }
        if (write(fd_, trigger.data(), trigger.size() + 1) < 0) {
            why_ = fmt::format("a PSI trigger on /proc/pressure/memory: {}", std::strerror(errno));
            close(fd_);
            fd_ = -1;
            return;
        }
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        pthread_t t{};
        const int rc = pthread_create(&t, nullptr, &watcher::run, this);
        pthread_sigmask(SIG_SETMASK, &old, nullptr);
        if (rc != 0) {
            why_ = fmt::format("the PSI watcher thread: {}", std::strerror(rc));
            close(fd_);
            fd_ = -1;
            return;
        }
        pthread_detach(t);
    }

    static void* run(void* self) {
        auto* w = static_cast<watcher*>(self);
        pollfd p{w->fd_, POLLPRI, 0};
        for (;;) {
            if (poll(&p, 1, -1) < 0) {
                if (errno == EINTR)
                    continue;
                return nullptr;
            }
            if ((p.revents & POLLERR) != 0)
                return nullptr; // the trigger is gone
            if ((p.revents & POLLPRI) != 0)
                w->notify_all();
        }
    }

    int fd_ = -1;
    std::string why_;
    std::mutex mutex_;
    std::vector<memory_pressure_subscription::entry*> subs_;
};

} // namespace

memory_pressure_subscription::memory_pressure_subscription(std::function<void()> on_pressure)
    : entry_(std::make_unique<entry>(entry{std::move(on_pressure)})) {
    watcher::get().add(entry_.get()); // subscribed even without PSI: simulate() still reaches it
}

memory_pressure_subscription::~memory_pressure_subscription() {
    watcher::get().remove(entry_.get());
}

bool memory_pressure_subscription::available(std::string* why) {
    const watcher& w = watcher::get();
    if (why != nullptr)
        *why = w.why();
    return w.ok();
}

namespace detail {
void simulate_memory_pressure() {
    watcher::get().notify_all();
}
} // namespace detail

} // namespace rdmax
