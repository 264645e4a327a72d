#pragma once
// The clock of the scheduler's `hold`: CLOCK_MONOTONIC_COARSE, which the vDSO
// serves from memory on every clocksource (a few nanoseconds, never a system
// call). steady_clock reads the clocksource itself, and where that is not the
// TSC (the HPET under qemu TCG, some VMs) each read is a system call of
// microseconds: too dear for a data path. Resolution is one jiffy (1-10 ms),
// which a hold of milliseconds does not mind.

#include <chrono>
#include <ctime>

namespace rdmax::sched {

struct coarse_clock {
    using duration = std::chrono::nanoseconds;
    using rep = duration::rep;
    using period = duration::period;
    using time_point = std::chrono::time_point<coarse_clock>;
    static constexpr bool is_steady = true;

    [[nodiscard]] static time_point now() noexcept {
        timespec ts{};
        ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
        return time_point(std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec));
    }
    /// How far now() may lag the time (one jiffy): a deadline that must not
    /// pass early adds it.
    [[nodiscard]] static duration resolution() noexcept {
        static const duration res = [] {
            timespec ts{};
            ::clock_getres(CLOCK_MONOTONIC_COARSE, &ts);
            return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
        }();
        return res;
    }
};

} // namespace rdmax::sched
