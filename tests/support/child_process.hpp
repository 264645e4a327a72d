#pragma once
// Child processes in tests: started with a body, and waited for with a
// deadline, so that a child that hangs fails its test instead of hanging it.

#include <chrono>
#include <csignal>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

namespace rdmax::test {

/// Runs `body` in a child process; its return value is the exit status (an
/// exception: 100). The child never returns into the test runner.
template <class F>
pid_t spawn(F&& body) {
    const pid_t pid = fork();
    if (pid == 0) {
        int rc = 100;
        try {
            rc = body();
        } catch (...) {
        }
        _exit(rc);
    }
    return pid;
}

/// The child's exit status; -1 when killed past `limit`; -2 - N when a
/// signal N ended it.
inline int reap(pid_t pid, std::chrono::seconds limit = std::chrono::seconds(30)) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    int st = 0;
    while (waitpid(pid, &st, WNOHANG) == 0) {
        if (std::chrono::steady_clock::now() > deadline) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        usleep(1000);
    }
    if (WIFSIGNALED(st))
        return -2 - WTERMSIG(st);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

} // namespace rdmax::test
