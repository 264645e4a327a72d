#pragma once
// Waiting in a test for what another thread or the device does in its own
// time: polled with a deadline, so that a test fails rather than hangs.

#include <chrono>
#include <thread>

namespace rdmax::test {

/// Polls p() every millisecond until it holds (true) or `timeout` passes (false).
template <class Pred>
bool eventually(Pred p, std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!p()) {
        if (std::chrono::steady_clock::now() > deadline)
            return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
}

} // namespace rdmax::test
