#pragma once
// The registered arena's lock: allocate and deallocate hold it for a few
// dozen instructions, too short to be worth a sleep in the kernel.

#include <atomic>

namespace rdmax::detail {

/// A test-and-test-and-set lock that never sleeps in the kernel: the
/// sections it guards are a few dozen instructions long.
class spin_lock {
public:
    void lock() noexcept {
        while (flag_.exchange(true, std::memory_order_acquire))
            while (flag_.load(std::memory_order_relaxed))
                pause();
    }
    void unlock() noexcept { flag_.store(false, std::memory_order_release); }

private:
    static void pause() noexcept {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    std::atomic<bool> flag_{false};
};

} // namespace rdmax::detail
